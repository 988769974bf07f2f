#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver from k8s.io/kubernetes, etcd from
# go.etcd.io/etcd/server/v3) with the machine's Go, into a cache directory keyed by
# the module's inputs. A second run with unchanged inputs costs a hash and a stat.
# Prints the directory holding the binaries on stdout; timings go to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache_root="${SHARED_SVC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shared-svc}"
start=$(date +%s%N)
key=$( { go version; cat "$here/go.mod" "$here/go.sum" "$here/build.sh"; find "$here/cmd" -name '*.go' -print0 | sort -z | xargs -0 cat; } | sha256sum | cut -c1-16)
out="$cache_root/testenv/$key"
k8s_version=$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' "$here/go.mod")
if [[ -x "$out/kube-apiserver" && -x "$out/etcd" ]]; then
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  printf 'testenv: cached build %s (kube-apiserver %s) in %d.%03ds\n' "$key" "$k8s_version" $((ms / 1000)) $((ms % 1000)) >&2
  echo "$out"
  exit 0
fi
mkdir -p "$out.tmp"
cd "$here"
ver_flags="-X k8s.io/component-base/version.gitVersion=${k8s_version} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$k8s_version" | cut -d. -f2)"
echo "testenv: building kube-apiserver ${k8s_version} and etcd (first build takes a while)..." >&2
go build -mod=readonly -trimpath -ldflags "-s -w ${ver_flags}" -o "$out.tmp/kube-apiserver" ./cmd/kube-apiserver
go build -mod=readonly -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" ./cmd/etcd
rm -rf "$out" && mv "$out.tmp" "$out"
ms=$(( ($(date +%s%N) - start) / 1000000 ))
printf 'testenv: built %s (kube-apiserver %s) in %d.%03ds\n' "$key" "$k8s_version" $((ms / 1000)) $((ms % 1000)) >&2
echo "$out"
