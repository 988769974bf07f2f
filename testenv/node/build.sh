#!/usr/bin/env bash
# Builds the real node's programs with the machine's Go, into a cache directory keyed by
# their inputs (../lib.sh: the cache and the lock of every build script here):
#   bin/  kubelet, kube-scheduler, kube-proxy, kubectl of one Kubernetes version, from
#         k8s.io/kubernetes with `go build -modfile=kube/<minor>.mod` (made by
#         gen-gomod.sh from that version's own go.mod);
#         containerd, containerd-shim-runc-v2, ctr (github.com/containerd/containerd/v2);
#         helm (helm.sh/helm/v3/cmd/helm, the version helmrender renders with);
#   cni/  the CNI plugins bridge, host-local, loopback, portmap
#         (github.com/containernetworking/plugins);
#   pause the sandbox's process: Kubernetes' own build/pause/linux/pause.c, static.
# containerd, the plugins and helm are `go install <pkg>@<version>` (their own go.mod and
# go.sum, no replace directives; the checksum database verifies the modules). A second run
# with unchanged inputs costs a hash and a stat; builds of the same inputs take a lock.
#
#   build.sh [MINOR]   # the Kubernetes minor (1.36); default $SHARED_SVC_KUBE_VERSION, else 1.36
#
# Prints the directory on stdout; timings go to stderr. Run it under `nice -n 10`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
minor=${1:-${SHARED_SVC_KUBE_VERSION:-1.36}}
mod="$here/kube/$minor.mod"
if [[ ! -f $mod ]]; then
  known=$(cd "$here/kube" && ls -- *.mod | sed 's/\.mod$//' | sort -V | paste -sd' ')
  echo "node: no module file for Kubernetes $minor (kube/$minor.mod; there are: $known; make one with gen-gomod.sh)" >&2
  exit 2
fi
toolchain=$(awk '$1=="toolchain"{print $2; exit}' "$mod")
if [[ -n $toolchain ]]; then export GOTOOLCHAIN=$toolchain; fi
source "$here/../lib.sh"
CONTAINERD_VERSION=v2.4.2
CNI_PLUGINS_VERSION=v1.9.1
HELM_VERSION=v3.22.0
name=node kind=node
key=$( {
  go version
  cat "$here/go.mod" "$mod" "${mod%.mod}.sum" "$here/build.sh" "$here/../lib.sh"
} | sha256sum | cut -c1-16)
k8s_version=$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' "$mod")
what="kubelet $k8s_version, containerd $CONTAINERD_VERSION, CNI plugins $CNI_PLUGINS_VERSION, helm $HELM_VERSION"
bins=(kubelet kube-scheduler kube-proxy kubectl containerd containerd-shim-runc-v2 ctr helm)
plugins=(bridge host-local loopback portmap)
complete() {
  local b
  for b in "${bins[@]}"; do [[ -x "$1/bin/$b" ]] || return 1; done
  for b in "${plugins[@]}"; do [[ -x "$1/cni/$b" ]] || return 1; done
  [[ -x "$1/pause" ]]
}
cached_or_locked
mkdir -p "$tmp/bin" "$tmp/cni"
echo "node: building $what (first build takes 10-15 minutes)..." >&2
cd "$here"
ver_flags="-X k8s.io/component-base/version.gitVersion=${k8s_version} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$k8s_version" | cut -d. -f2)"
go build -modfile="$mod" -mod=readonly -trimpath -ldflags "-s -w ${ver_flags}" -o "$tmp/bin/" \
  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl
cd "$tmp"  # outside any module: `go install pkg@version` uses that module's own go.mod
ctrd=github.com/containerd/containerd/v2
GOWORK=off GOBIN="$tmp/bin" go install -trimpath -tags "no_btrfs urfave_cli_no_docs" \
  -ldflags "-s -w -X $ctrd/version.Version=$CONTAINERD_VERSION" \
  "$ctrd/cmd/containerd@$CONTAINERD_VERSION" "$ctrd/cmd/ctr@$CONTAINERD_VERSION"
# The shim is static, as containerd's Makefile builds it.
CGO_ENABLED=0 GOWORK=off GOBIN="$tmp/bin" go install -trimpath \
  -ldflags "-s -w -X $ctrd/version.Version=$CONTAINERD_VERSION" \
  "$ctrd/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION"
cni=github.com/containernetworking/plugins/plugins
CGO_ENABLED=0 GOWORK=off GOBIN="$tmp/cni" go install -trimpath -ldflags "-s -w" \
  "$cni/main/bridge@$CNI_PLUGINS_VERSION" "$cni/ipam/host-local@$CNI_PLUGINS_VERSION" \
  "$cni/main/loopback@$CNI_PLUGINS_VERSION" "$cni/meta/portmap@$CNI_PLUGINS_VERSION"
GOWORK=off GOBIN="$tmp/bin" go install -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
  "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
k8s_src=$(GOWORK=off go mod download -json "k8s.io/kubernetes@$k8s_version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
gcc -Os -static -DVERSION="$k8s_version" -o "$tmp/pause" "$k8s_src/build/pause/linux/pause.c"
publish
