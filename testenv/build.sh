#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver and kube-controller-manager from
# k8s.io/kubernetes, etcd from
# go.etcd.io/etcd/server/v3) and helmrender (Helm's chart renderer, from
# helm.sh/helm/v3; its own module in helmrender/) with the machine's Go, into a cache
# directory keyed by the modules' inputs (lib.sh: the cache and the lock, shared with
# gpu-operator/build.sh). A second run with unchanged inputs costs a hash and a stat.
# Builds of the same inputs take a lock: one started while another runs waits for it,
# then uses its binaries.
# Prints the directory holding the binaries on stdout; timings go to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"
name=testenv kind=testenv
key=$( {
  go version
  cat "$here/go.mod" "$here/go.sum" "$here/build.sh" "$here/lib.sh"
  find "$here/cmd" -name '*.go' -print0 | sort -z | xargs -0 cat
  find "$here/helmrender" \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 | sort -z | xargs -0 cat
} | sha256sum | cut -c1-16)
k8s_version=$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' "$here/go.mod")
helm_version=$(awk '$1=="require" && $2=="helm.sh/helm/v3"{print $3; exit} $1=="helm.sh/helm/v3"{print $2; exit}' "$here/helmrender/go.mod")
what="kube-apiserver $k8s_version, helm $helm_version"
complete() {
  [[ -x "$1/kube-apiserver" && -x "$1/kube-controller-manager" && -x "$1/etcd" && -x "$1/helmrender" ]]
}
cached_or_locked
cd "$here"
ver_flags="-X k8s.io/component-base/version.gitVersion=${k8s_version} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$k8s_version" | cut -d. -f2)"
echo "testenv: building kube-apiserver and kube-controller-manager ${k8s_version}, etcd and helmrender (helm ${helm_version}) (first build takes a while)..." >&2
go build -mod=readonly -trimpath -ldflags "-s -w ${ver_flags}" -o "$tmp/kube-apiserver" ./cmd/kube-apiserver
# The garbage collector and EndpointSlice controllers (tests of owner references and endpoints).
go build -mod=readonly -trimpath -ldflags "-s -w ${ver_flags}" -o "$tmp/kube-controller-manager" ./cmd/kube-controller-manager
go build -mod=readonly -trimpath -ldflags "-s -w" -o "$tmp/etcd" ./cmd/etcd
# As helm's Makefile does: the default Kubernetes version of rendering follows client-go's.
client_go_minor=$(awk '$1=="k8s.io/client-go"{print $2; exit}' "$here/helmrender/go.mod" | cut -d. -f2)
helm_flags="-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${client_go_minor}"
(cd "$here/helmrender" && go build -mod=readonly -trimpath -ldflags "-s -w ${helm_flags}" -o "$tmp/helmrender" .)
publish
