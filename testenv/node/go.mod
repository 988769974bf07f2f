// The module root of the node's components (build.sh). Their requirements are per
// Kubernetes version, in kube/<minor>.mod and kube/<minor>.sum (made by gen-gomod.sh from
// that version's own go.mod); build.sh builds with `go build -modfile=kube/<minor>.mod`.
// Go reads this file only to find the module's root.
module github.com/shared-svc/testenv/node

go 1.24.0
