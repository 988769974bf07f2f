#!/usr/bin/env bash
# The system packages the real node needs (testenv/node/), from Debian's archive with
# apt: runc (the OCI runtime of containerd and buildah; crun refuses this host's hybrid
# cgroup layout), buildah (builds the project's image from its Dockerfile), debootstrap
# (the base image), iptables (kube-proxy's rules, inside the node's network namespace),
# gcc and libc6-dev (the static pause of build.sh).
# Idempotent: when every package is installed it costs one dpkg-query and exits.
# Needs root to install; prints what is missing otherwise.
set -euo pipefail
packages=(runc buildah debootstrap iptables gcc libc6-dev)
missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ $status == installed ]] || missing+=("$p")
done
((${#missing[@]} == 0)) && exit 0
if ((EUID != 0)); then
  echo "node: missing Debian packages: ${missing[*]} (run as root: apt-get install ${missing[*]})" >&2
  exit 1
fi
echo "node: installing ${missing[*]} (apt)..." >&2
export DEBIAN_FRONTEND=noninteractive
# Other apt runs on the machine hold dpkg's lock for a while: wait for it.
apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >&2
