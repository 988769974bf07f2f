#!/usr/bin/env bash
# The images the real node runs, built with buildah and saved as docker archives for
# `ctr images import` (no image registry is ever asked):
#   shared-svc.tar          docker.io/library/shared-svc:<version>: the checkout's own
#                           Dockerfile, unmodified, on base.sh's base (--build-arg
#                           PYTHON_IMAGE, the one build argument changed); the name the
#                           chart's defaults pull (image.repository shared-svc, tag appVersion)
#   shared-svc-rebuilt.tar  docker.io/library/shared-svc:<version>-rebuilt: the same build
#                           again with REVISION=rebuilt (another image id: `helm upgrade`)
#   pause.tar               localhost/pause:3.10: build.sh's static pause (the sandbox)
#   image.json              what the tests compare with: ids, sizes, the config
#
#   images.sh NODE_DIR BASE_DIR   # build.sh's and base.sh's directories
#
# Keyed by the Dockerfile, .dockerignore and the files it lets into the context
# (requirements.lock, pyproject.toml, README.md, shared_svc/), the base and the pause
# binary. pip inside the build reaches PyPI with the host's CA bundle mounted for the build
# only (never in the image). buildah runs with runc, --network host (no CNI bridge or
# firewall chain of its own) and a storage of its own, in a private mount namespace.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
node_dir=${1:?usage: images.sh NODE_DIR BASE_DIR}
base_dir=${2:?usage: images.sh NODE_DIR BASE_DIR}
source "$here/../lib.sh"
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/shared_svc/__init__.py")
name=node-images kind=node-images
key=$( {
  cd "$repo"
  cat Dockerfile .dockerignore requirements.lock pyproject.toml README.md
  find shared_svc -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
  sha256sum "$base_dir/base.tar" "$node_dir/pause"
  cat "$here/images.sh" "$here/../lib.sh"
} | sha256sum | cut -c1-16)
what="shared-svc $version on $(basename "$base_dir")"
complete() { [[ -s "$1/shared-svc.tar" && -s "$1/shared-svc-rebuilt.tar" && -s "$1/pause.tar" && -s "$1/image.json" ]]; }
cached_or_locked
echo "node-images: building shared-svc $version from the Dockerfile with buildah..." >&2
ca=/etc/ssl/certs/ca-certificates.crt
[[ -f $ca ]] || { echo "node-images: $ca not found (pip in the build needs a CA bundle)" >&2; exit 1; }
unshare --mount --propagation private bash -euo pipefail -c '
  store=$1 repo=$2 base=$3 pause=$4 version=$5 out=$6 ca=$7
  b() { buildah --root "$store/root" --runroot "$store/run" --storage-driver overlay "$@"; }
  b pull --quiet "oci-archive:$base" >/dev/null
  base_id=$(b images --quiet --noheading | head -1)
  b tag "$base_id" localhost/shared-svc-node-base:latest
  bud() {
    b bud --quiet --layers --pull=never --network host --isolation oci --runtime /usr/bin/runc \
      -v "$ca:$ca:ro" --build-arg PYTHON_IMAGE=localhost/shared-svc-node-base:latest \
      --build-arg VERSION="$version" "$@" -f "$repo/Dockerfile" "$repo" >/dev/null
  }
  bud --build-arg REVISION=testenv -t "docker.io/library/shared-svc:$version"
  bud --build-arg REVISION=rebuilt -t "docker.io/library/shared-svc:$version-rebuilt"
  ctr=$(b from scratch)
  b copy --quiet "$ctr" "$pause" /pause
  b config --entrypoint "[\"/pause\"]" --user 65535:65535 "$ctr"
  b commit --quiet "$ctr" localhost/pause:3.10 >/dev/null
  b push --quiet "docker.io/library/shared-svc:$version" "docker-archive:$out/shared-svc.tar:docker.io/library/shared-svc:$version"
  b push --quiet "docker.io/library/shared-svc:$version-rebuilt" "docker-archive:$out/shared-svc-rebuilt.tar:docker.io/library/shared-svc:$version-rebuilt"
  b push --quiet localhost/pause:3.10 "docker-archive:$out/pause.tar:localhost/pause:3.10"
  b images --json >"$out/images.json"
  b inspect --type image "docker.io/library/shared-svc:$version" >"$out/inspect.json"
  python3 -c "import json, sys; print(json.dumps({\"version\": sys.argv[1], \"images\": json.load(open(sys.argv[2])), \"config\": json.load(open(sys.argv[3]))[\"OCIv1\"][\"config\"]}, indent=1))" \
    "$version" "$out/images.json" "$out/inspect.json" >"$out/image.json"
  rm "$out/images.json" "$out/inspect.json"
' _ "$tmp/storage" "$repo" "$base_dir/base.tar" "$node_dir/pause" "$version" "$tmp" "$ca" >&2
rm -rf "$tmp/storage"
publish
