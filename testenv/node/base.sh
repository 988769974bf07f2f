#!/usr/bin/env bash
# The base image of the node's project image (images.sh), made without an image registry:
# Debian bookworm's python3 (3.11) from debootstrap (the minbase variant; the Debian archive
# the machine's apt is configured with is the only download), shaped like the official python:3.11-slim the Dockerfile names:
# pip and setuptools installed into /usr/local with their RECORD files (from Debian's own
# wheels, python3-pip-whl), no EXTERNALLY-MANAGED marker, `python` on PATH. Committed with
# buildah (`buildah from scratch`), saved as an OCI archive. Cached like the other builds
# (../lib.sh: keyed by this script, a second run costs a hash and a stat, locked).
#
# debootstrap and buildah run in a private mount namespace (unshare --mount): whatever
# they mount goes with it. Prints the directory holding base.tar on stdout.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../lib.sh"
SUITE=bookworm
# The Debian archive this machine's apt takes $SUITE from, read from the files apt itself
# reads (deb822 /etc/apt/sources.list.d/*.sources, then the one-line sources.list and
# sources.list.d/*.list, under $SHARED_SVC_APT_ETC, default /etc/apt): no archive's host is
# written here. $SHARED_SVC_DEBIAN_MIRROR overrides it.
debian_mirror() {
  python3 - "$SUITE" "${SHARED_SVC_APT_ETC:-/etc/apt}" <<'PY'
import glob
import sys

suite, etc = sys.argv[1], sys.argv[2]


def stanzas(text):
    block, key = {}, None
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if block:
                yield block
            block, key = {}, None
        elif line.lstrip().startswith("#"):
            continue
        elif line[0] in " \t" and key:
            block[key] += " " + line.strip()
        else:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            block[key] = value.strip()


for path in sorted(glob.glob(f"{etc}/sources.list.d/*.sources")):
    with open(path) as f:
        for b in stanzas(f.read()):
            if b.get("enabled", "yes").lower() == "no":
                continue
            if "deb" in b.get("types", "").split() and suite in b.get("suites", "").split():
                print(b.get("uris", "").split()[0])
                sys.exit(0)
for path in [f"{etc}/sources.list", *sorted(glob.glob(f"{etc}/sources.list.d/*.list"))]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = line.split("#", 1)[0].split()
        if words[:1] != ["deb"]:
            continue
        words = words[1:]
        if words and words[0].startswith("["):  # [options]
            while words and not words[0].endswith("]"):
                words.pop(0)
            words = words[1:]
        if len(words) >= 2 and words[1] == suite:
            print(words[0])
            sys.exit(0)
sys.exit(1)
PY
}
MIRROR=${SHARED_SVC_DEBIAN_MIRROR:-$(debian_mirror)} || {
  echo "node-base: no Debian archive for $SUITE in this machine's apt sources; set SHARED_SVC_DEBIAN_MIRROR" >&2
  exit 1
}
PACKAGES=python3,python3-venv,python-is-python3,ca-certificates,passwd
name=node-base kind=node-base
key=$( {
  echo "$SUITE $MIRROR $PACKAGES"
  cat "$here/base.sh" "$here/../lib.sh"
} | sha256sum | cut -c1-16)
what="debootstrap $SUITE: $PACKAGES"
complete() { [[ -s "$1/base.tar" ]]; }
cached_or_locked
echo "node-base: debootstrap $SUITE from $MIRROR (a few minutes)..." >&2
rootfs="$tmp/rootfs"
unshare --mount --propagation private bash -euo pipefail -c '
  rootfs=$1 suite=$2 mirror=$3 packages=$4 tmp=$5
  debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >"$tmp/debootstrap.log" 2>&1 \
    || { tail -20 "$tmp/debootstrap.log" >&2; exit 1; }
  mount -t proc proc "$rootfs/proc"
  chroot "$rootfs" /bin/sh -euc "
    rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED
    pip=\$(ls /usr/share/python-wheels/pip-*.whl)
    python3 \$pip/pip install --quiet --no-index --no-cache-dir --disable-pip-version-check \
      \$pip /usr/share/python-wheels/setuptools-*.whl
    python -m pip --version
    apt-get clean
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/* /tmp/*
  "
  umount "$rootfs/proc"
' _ "$rootfs" "$SUITE" "$MIRROR" "$PACKAGES" "$tmp" >&2
tar -C "$rootfs" --numeric-owner -cf "$tmp/rootfs.tar" .
store="$tmp/storage"
unshare --mount --propagation private bash -euo pipefail -c '
  b() { buildah --root "$1/root" --runroot "$1/run" --storage-driver vfs "${@:2}"; }
  store=$1 tmp=$2
  ctr=$(b "$store" from scratch)
  b "$store" add --quiet "$ctr" "$tmp/rootfs.tar" /
  b "$store" config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin \
    --env LANG=C.UTF-8 --cmd python3 --label org.opencontainers.image.title=shared-svc-node-base "$ctr"
  b "$store" commit --quiet "$ctr" localhost/shared-svc-node-base:latest >/dev/null
  b "$store" push --quiet localhost/shared-svc-node-base:latest "oci-archive:$tmp/base.tar:localhost/shared-svc-node-base:latest"
' _ "$store" "$tmp" >&2
rm -rf "$rootfs" "$tmp/rootfs.tar" "$store"
publish
