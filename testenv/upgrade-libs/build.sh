#!/usr/bin/env bash
# Builds the driver of k8s-operator-libs' upgrade state machine (main.go: the libs at the
# pseudo-version gpu-operator v26.7.0 vendors, configured as gpu-operator configures them,
# with gpu-operator's restart-only rule) for the tests marked upgrade_libs. Its own module
# beside this file, whose go.sum pins every dependency: the build is -mod=readonly and the
# same on any machine. A separate step from ../build.sh (its own cache key and lock,
# ../lib.sh), so tests that do not need it never wait for it.
#
# A second run with unchanged inputs costs a hash and a stat. Prints the directory holding
# the binary on stdout; timings go to stderr. Run it under `nice -n 10` on a busy machine.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../lib.sh"
name=upgrade-libs kind=upgrade-libs
module=github.com/NVIDIA/k8s-operator-libs
what="$module $(awk -v m="$module" '$1=="require" && $2==m {print $3; exit} $1==m {print $2; exit}' "$here/go.mod")"
key=$( {
  go version
  cat "$here/go.mod" "$here/go.sum" "$here/main.go" "$here/build.sh" "$here/../lib.sh"
} | sha256sum | cut -c1-16)
complete() {
  [[ -x "$1/upgrade-libs" ]]
}
cached_or_locked
cd "$here"
echo "upgrade-libs: building the driver of $what (first build takes a few minutes)..." >&2
GOWORK=off go build -mod=readonly -trimpath -ldflags "-s -w" -o "$tmp/upgrade-libs" .
publish
