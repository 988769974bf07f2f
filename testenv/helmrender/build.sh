#!/usr/bin/env bash
# Builds helmrender (Helm's chart renderer and linter, from helm.sh/helm/v3; the module
# beside this file) with the machine's Go, into a cache directory keyed by its inputs
# (../lib.sh: the cache and the lock). One build serves every Kubernetes version of the
# test control plane (../build.sh). A second run with unchanged inputs costs a hash and a
# stat. Prints the directory holding the binary on stdout; timings go to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../lib.sh"
name=helmrender kind=helmrender
key=$( {
  go version
  cat "$here/build.sh" "$here/../lib.sh"
  find "$here" \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 | sort -z | xargs -0 cat
} | sha256sum | cut -c1-16)
helm_version=$(awk '$1=="require" && $2=="helm.sh/helm/v3"{print $3; exit} $1=="helm.sh/helm/v3"{print $2; exit}' "$here/go.mod")
what="helm $helm_version"
complete() {
  [[ -x "$1/helmrender" ]]
}
cached_or_locked
cd "$here"
echo "helmrender: building helmrender (helm ${helm_version})..." >&2
# As helm's Makefile does: the default Kubernetes version of rendering follows client-go's.
client_go_minor=$(awk '$1=="k8s.io/client-go"{print $2; exit}' go.mod | cut -d. -f2)
helm_flags="-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${client_go_minor}"
go build -mod=readonly -trimpath -ldflags "-s -w ${helm_flags}" -o "$tmp/helmrender" .
publish
