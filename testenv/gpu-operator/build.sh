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
# take a lock (flock on a file in the cache directory). Prints the directory holding the
# binary on stdout; timings go to stderr. Run it under `nice -n 10` on a busy machine.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache_root="${SHARED_SVC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shared-svc}"
start=$(date +%s%N)
version=$(tr -d '[:space:]' <"$here/version")
module=github.com/NVIDIA/gpu-operator
key=$( {
  go version
  cat "$here/version" "$here/build.sh"
} | sha256sum | cut -c1-16)
out="$cache_root/gpu-operator/$key"
complete() {
  [[ -x "$1/gpu-operator" && -d "$1/opt/gpu-operator/state-dcgm" && -d "$1/opt/gpu-operator/manifests" && -d "$1/crds" && -d "$1/rbac" ]]
}
cached() {
  complete "$out" || return 1
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  printf 'gpu-operator: cached build %s (%s) in %d.%03ds\n' "$key" "$version" $((ms / 1000)) $((ms % 1000)) >&2
  echo "$out"
}
if cached; then exit 0; fi
mkdir -p "$cache_root/gpu-operator"
if command -v flock >/dev/null; then
  exec 9>"$cache_root/gpu-operator/$key.lock"
  if ! flock -n 9; then
    echo "gpu-operator: another build of $key is running; waiting for it..." >&2
    flock 9
  fi
  if cached; then exit 0; fi  # (also when the other build ended just before the lock)
else
  echo "gpu-operator: flock not found: builds started at once are not serialized" >&2
fi
tmp="$out.tmp.$$"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
cd "$tmp"  # outside any module or workspace: `go install pkg@version` uses the module's go.mod
commit=${version##*-}
echo "gpu-operator: building $module $version (first build takes 5-10 minutes)..." >&2
GOWORK=off GOBIN="$tmp/bin" go install -trimpath \
  -ldflags "-s -w -X $module/internal/info.version=$version -X $module/internal/info.gitCommit=$commit" \
  "$module/cmd/gpu-operator@$version"
mv "$tmp/bin/gpu-operator" "$tmp/gpu-operator" && rmdir "$tmp/bin"
src=$(GOWORK=off go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -d "$src/assets" ]] || { echo "gpu-operator: module source not found ($src)" >&2; exit 1; }
mkdir -p "$tmp/opt/gpu-operator" "$tmp/crds" "$tmp/rbac"
cp -R "$src/assets/." "$tmp/opt/gpu-operator/"  # as its Dockerfile: COPY assets /opt/gpu-operator/
cp -R "$src/manifests" "$tmp/opt/gpu-operator/manifests"
cp "$src"/deployments/gpu-operator/crds/*.yaml "$tmp/crds/"
cp "$src"/deployments/gpu-operator/templates/{clusterrole,role}.yaml "$tmp/rbac/"
chmod -R u+w "$tmp"  # the module cache is read-only
if complete "$out"; then
  rm -rf "$tmp"  # another build of the same inputs finished first: keep its files in place
else
  rm -rf "$out" && mv "$tmp" "$out"
fi
ms=$(( ($(date +%s%N) - start) / 1000000 ))
printf 'gpu-operator: built %s (%s) in %d.%03ds\n' "$key" "$version" $((ms / 1000)) $((ms % 1000)) >&2
echo "$out"
