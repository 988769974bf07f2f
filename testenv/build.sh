#!/usr/bin/env bash
# Builds the test control plane of one Kubernetes version: kube-apiserver and
# kube-controller-manager from k8s.io/kubernetes, and the etcd that version is tested with
# (go.etcd.io/etcd/server/v3), with `go build -modfile=kube/<minor>.mod` (that version's
# requirements, made by gen-gomod.sh from its own go.mod; cmd/ is shared), into a cache
# directory keyed by the inputs (lib.sh: the cache and the lock, shared with the other
# build scripts). A second run with unchanged inputs costs a hash and a stat. Builds of the
# same inputs take a lock: one started while another runs waits for it, then uses its
# binaries. Helm's renderer is a build of its own (helmrender/build.sh), once for every
# version.
#
#   build.sh MINOR      # 1.33, 1.34, 1.35, 1.36, 1.37: one kube/<MINOR>.mod each
#
# Every version builds with the machine's Go (Go >= 1.26.0: v1.37.2's go.mod asks for
# go 1.26.0).
# Prints the directory holding the binaries on stdout; timings go to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
minor=${1:-}
mod="$here/kube/$minor.mod"
if [[ -z $minor || ! -f $mod ]]; then
  known=$(cd "$here/kube" && ls -- *.mod | sed 's/\.mod$//' | sort -V | paste -sd' ')
  echo "testenv: usage: build.sh MINOR (a Kubernetes version with a kube/<MINOR>.mod: $known)" >&2
  exit 2
fi
source "$here/lib.sh"
name=testenv kind=testenv
key=$( {
  go version
  cat "$here/go.mod" "$mod" "${mod%.mod}.sum" "$here/build.sh" "$here/lib.sh"
  find "$here/cmd" -name '*.go' -print0 | sort -z | xargs -0 cat
} | sha256sum | cut -c1-16)
k8s_version=$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' "$mod")
etcd_version=$(awk '$1=="go.etcd.io/etcd/server/v3"{print $2; exit}' "$mod")
what="kube-apiserver $k8s_version, etcd $etcd_version"
complete() {
  [[ -x "$1/kube-apiserver" && -x "$1/kube-controller-manager" && -x "$1/etcd" ]]
}
cached_or_locked
cd "$here"
ver_flags="-X k8s.io/component-base/version.gitVersion=${k8s_version} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$k8s_version" | cut -d. -f2)"
echo "testenv: building kube-apiserver and kube-controller-manager ${k8s_version}, etcd ${etcd_version} (first build takes a while)..." >&2
build() { go build -modfile="$mod" -mod=readonly -trimpath "$@"; }
build -ldflags "-s -w ${ver_flags}" -o "$tmp/kube-apiserver" ./cmd/kube-apiserver
# The garbage collector and EndpointSlice controllers (tests of owner references and endpoints).
build -ldflags "-s -w ${ver_flags}" -o "$tmp/kube-controller-manager" ./cmd/kube-controller-manager
build -ldflags "-s -w" -o "$tmp/etcd" ./cmd/etcd
publish
