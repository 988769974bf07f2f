#!/usr/bin/env bash
# Builds the real Prometheus (3.5.0: its Go module github.com/prometheus/prometheus v0.305.0,
# whose cmd/prometheus has the Kubernetes service discovery that Debian's package lacks) and
# its promtool (the same module's cmd/promtool: `promtool test rules` proves the chart's
# alerts) for the tests marked prometheus. `go install pkg@version` refuses the module (its
# go.mod has a replace directive), so both are tools of the small wrapper module beside this
# file, whose go.mod repeats that replace line and whose go.sum pins every dependency: the
# build is -mod=readonly and the same on any machine. A separate step from ../build.sh (its
# own cache key and lock, ../lib.sh), so tests that do not need it never wait for it.
#
# A second run with unchanged inputs costs a hash and a stat. Prints the directory holding
# the binaries on stdout; timings go to stderr. Run it under `nice -n 10` on a busy machine.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../lib.sh"
name=prometheus kind=prometheus
module=github.com/prometheus/prometheus
module_version=$(awk -v m="$module" '$1=="require" && $2==m {print $3; exit} $1==m {print $2; exit}' "$here/go.mod")
# Prometheus 3.x is tagged v0.3MM.P in Go: v0.305.0 is 3.5.0.
minor=${module_version#v0.3}; minor=${minor%%.*}; minor=$((10#$minor))
version="3.$minor.${module_version##*.}"
what="Prometheus $version, $module $module_version"
key=$( {
  go version
  cat "$here/go.mod" "$here/go.sum" "$here/build.sh" "$here/../lib.sh"
} | sha256sum | cut -c1-16)
complete() {
  [[ -x "$1/prometheus" && -x "$1/promtool" ]]
}
cached_or_locked
cd "$here"
echo "prometheus: building $module $module_version (first build takes several minutes)..." >&2
for cmd in prometheus promtool; do
  GOWORK=off go build -mod=readonly -trimpath \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$version -X github.com/prometheus/common/version.Branch=$module_version" \
    -o "$tmp/$cmd" "$module/cmd/$cmd"
done
publish
