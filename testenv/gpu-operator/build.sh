#!/usr/bin/env bash
# Builds the real gpu-operator (its ClusterPolicy/NVIDIADriver controllers) from its Go
# module, at the version pinned in ./version, with `go install <pkg>@<version>`: the
# module's own go.mod and go.sum fix every dependency (it has no replace directives) and
# the Go checksum database verifies the module itself, so the build is the same on any
# machine. A separate step from ../build.sh (its own cache key and lock), so the ordinary
# test control plane is never rebuilt for it and tests that do not need it never wait.
#
# Also lays out its states next to the binary as its image does (opt/gpu-operator/ holds
# the contents of the module's assets/ and, in manifests/, its manifests/: it reads them
# from the hard-coded /opt/gpu-operator/), with its CRDs and its chart's RBAC templates:
# at run time nothing is read from the module cache and nothing is downloaded.
#
# A second run with unchanged inputs costs a hash and a stat. Builds of the same inputs
# take a lock (../lib.sh: the cache and the lock, shared with ../build.sh). Prints the
# directory holding the binary on stdout; timings go to stderr. Run it under `nice -n 10`
# on a busy machine.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../lib.sh"
name=gpu-operator kind=gpu-operator
version=$(tr -d '[:space:]' <"$here/version")
what=$version
module=github.com/NVIDIA/gpu-operator
wrapper="$here/no-upgrade"  # gpu-operator without its upgrade controller (its main.go says why)
key=$( {
  go version
  cat "$here/version" "$here/build.sh" "$here/../lib.sh"
  cat "$wrapper/main.go" "$wrapper/go.mod" "$wrapper/go.sum"
} | sha256sum | cut -c1-16)
complete() {
  [[ -x "$1/gpu-operator" && -x "$1/gpu-operator-no-upgrade" && -d "$1/opt/gpu-operator/state-dcgm" && -d "$1/opt/gpu-operator/manifests" && -d "$1/crds" && -d "$1/rbac" ]]
}
grep -q "github.com/NVIDIA/gpu-operator $version\$" "$wrapper/go.mod" || {
  echo "gpu-operator: $wrapper/go.mod requires another gpu-operator than $here/version ($version): run 'go get github.com/NVIDIA/gpu-operator@$version && go mod tidy' there" >&2
  exit 1
}
cached_or_locked
mkdir -p "$tmp/bin"
cd "$tmp"  # outside any module or workspace: `go install pkg@version` uses the module's go.mod
commit=${version##*-}
echo "gpu-operator: building $module $version (first build takes 5-10 minutes)..." >&2
GOWORK=off GOBIN="$tmp/bin" go install -trimpath \
  -ldflags "-s -w -X $module/internal/info.version=$version -X $module/internal/info.gitCommit=$commit" \
  "$module/cmd/gpu-operator@$version"
mv "$tmp/bin/gpu-operator" "$tmp/gpu-operator" && rmdir "$tmp/bin"
(cd "$wrapper" && GOWORK=off go build -trimpath -ldflags "-s -w" -o "$tmp/gpu-operator-no-upgrade" .)
src=$(GOWORK=off go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -d "$src/assets" ]] || { echo "gpu-operator: module source not found ($src)" >&2; exit 1; }
mkdir -p "$tmp/opt/gpu-operator" "$tmp/crds" "$tmp/rbac"
cp -R "$src/assets/." "$tmp/opt/gpu-operator/"  # as its Dockerfile: COPY assets /opt/gpu-operator/
cp -R "$src/manifests" "$tmp/opt/gpu-operator/manifests"
cp "$src"/deployments/gpu-operator/crds/*.yaml "$tmp/crds/"
cp "$src"/deployments/gpu-operator/templates/{clusterrole,role}.yaml "$tmp/rbac/"
chmod -R u+w "$tmp"  # the module cache is read-only
publish
