#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver and kube-controller-manager from
# k8s.io/kubernetes, etcd from
# go.etcd.io/etcd/server/v3) and helmrender (Helm's chart renderer, from
# helm.sh/helm/v3; its own module in helmrender/) with the machine's Go, into a cache
# directory keyed by the modules' inputs. A second run with unchanged inputs costs a
# hash and a stat. Builds of the same inputs take a lock (flock on a file in the cache
# directory): one started while another runs waits for it, then uses its binaries.
# Prints the directory holding the binaries on stdout; timings go to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache_root="${SHARED_SVC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shared-svc}"
start=$(date +%s%N)
key=$( {
  go version
  cat "$here/go.mod" "$here/go.sum" "$here/build.sh"
  find "$here/cmd" -name '*.go' -print0 | sort -z | xargs -0 cat
  find "$here/helmrender" \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 | sort -z | xargs -0 cat
} | sha256sum | cut -c1-16)
out="$cache_root/testenv/$key"
k8s_version=$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' "$here/go.mod")
helm_version=$(awk '$1=="require" && $2=="helm.sh/helm/v3"{print $3; exit} $1=="helm.sh/helm/v3"{print $2; exit}' "$here/helmrender/go.mod")
cached() {
  [[ -x "$out/kube-apiserver" && -x "$out/kube-controller-manager" && -x "$out/etcd" && -x "$out/helmrender" ]] || return 1
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  printf 'testenv: cached build %s (kube-apiserver %s, helm %s) in %d.%03ds\n' "$key" "$k8s_version" "$helm_version" $((ms / 1000)) $((ms % 1000)) >&2
  echo "$out"
}
if cached; then exit 0; fi
# One build of these inputs at a time: the lock is held until this script exits. A run
# that waited finds the binaries the other one built.
mkdir -p "$cache_root/testenv"
if command -v flock >/dev/null; then
  exec 9>"$cache_root/testenv/$key.lock"
  if ! flock -n 9; then
    echo "testenv: another build of $key is running; waiting for it..." >&2
    flock 9
  fi
  if cached; then exit 0; fi  # (also when the other build ended just before the lock)
else
  echo "testenv: flock not found: builds started at once are not serialized" >&2
fi
# A directory of this run's own: even without the lock, two builds never write the same files.
tmp="$out.tmp.$$"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp"
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
if [[ -x "$out/kube-apiserver" && -x "$out/kube-controller-manager" && -x "$out/etcd" && -x "$out/helmrender" ]]; then
  rm -rf "$tmp"  # another build of the same inputs finished first: keep its binaries in place
else
  rm -rf "$out" && mv "$tmp" "$out"
fi
ms=$(( ($(date +%s%N) - start) / 1000000 ))
printf 'testenv: built %s (kube-apiserver %s, helm %s) in %d.%03ds\n' "$key" "$k8s_version" "$helm_version" $((ms / 1000)) $((ms % 1000)) >&2
echo "$out"
