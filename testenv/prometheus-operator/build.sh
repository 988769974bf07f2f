#!/usr/bin/env bash
# Builds the real prometheus-operator (v0.85.0: its Go module
# github.com/prometheus-operator/prometheus-operator) for the tests marked prometheus, and copies
# its CRDs (the module's example/prometheus-operator-crd/) beside the binary. A tool of the small
# wrapper module beside this file, whose go.sum pins every dependency: the build is
# -mod=readonly and the same on any machine. Its own module, not Prometheus' (../prometheus/):
# prometheus-operator lifts client-go past what Prometheus' Kubernetes discovery compiles
# against. Its own cache key and lock (../lib.sh), like ../prometheus/build.sh.
#
# A second run with unchanged inputs costs a hash and a stat. Prints the directory holding
# `operator` and `crds/` on stdout; timings go to stderr. Run it under `nice -n 10` on a busy
# machine.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../lib.sh"
name=prometheus-operator kind=prometheus-operator
module=github.com/prometheus-operator/prometheus-operator
module_version=$(awk -v m="$module" '$1=="require" && $2==m {print $3; exit} $1==m {print $2; exit}' "$here/go.mod")
what="prometheus-operator $module_version"
key=$( {
  go version
  cat "$here/go.mod" "$here/go.sum" "$here/build.sh" "$here/../lib.sh"
} | sha256sum | cut -c1-16)
complete() {
  [[ -x "$1/operator" && -f "$1/crds/monitoring.coreos.com_prometheuses.yaml" ]]
}
cached_or_locked
cd "$here"
echo "prometheus-operator: building $module $module_version (first build takes several minutes)..." >&2
src=$(GOWORK=off go mod download -json "$module@$module_version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -d "$src/example/prometheus-operator-crd" ]] || { echo "prometheus-operator: module source not found ($src)" >&2; exit 1; }
GOWORK=off go build -mod=readonly -trimpath \
  -ldflags "-s -w -X github.com/prometheus/common/version.Version=${module_version#v}" \
  -o "$tmp/operator" "$module/cmd/operator"
mkdir -p "$tmp/crds"
cp "$src"/example/prometheus-operator-crd/*.yaml "$tmp/crds/"
chmod -R u+w "$tmp/crds"
publish
