#!/usr/bin/env bash
# Builds the image with buildah (no Docker engine needed), on a machine that reaches PyPI and
# Debian's mirror but no image registry: the base is made from Debian packages
# (image/debian-base.sh) and passed as BASE_IMAGE. The build runs the image's smoke test
# (image/smoke.py). Needs root and `apt-get install -y buildah mmdebstrap`.
#
#   image/build.sh                      # -> localhost/kvpilot:dev (the CPU variant)
#   TAG=localhost/kvpilot:cuda VARIANT=cuda \
#     TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 image/build.sh
#
# torch: where this machine's pip finds a local torch wheel (find-links, from PIP_FIND_LINKS or
# `pip config get global.find-links`) holding the pinned version, that folder is mounted into the
# build read-only and passed as TORCH_WHEELS; otherwise torch comes from TORCH_INDEX_URL.
# Set TORCH_WHEELS=none to skip the lookup, or to a folder to use that one.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${TAG:-localhost/kvpilot:dev}
VARIANT=${VARIANT:-cpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/kvpilot-base:bookworm}
STORAGE=(--storage-driver "${STORAGE_DRIVER:-vfs}")

if ! buildah "${STORAGE[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  BASE_TAG=$BASE_IMAGE image/debian-base.sh
fi

wheels=${TORCH_WHEELS:-}
if [ -z "$wheels" ]; then
  for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
    if compgen -G "$dir/torch-${TORCH_VERSION}+${VARIANT}*-cp311-*.whl" >/dev/null; then
      wheels=$dir
      break
    fi
  done
fi
args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "VARIANT=$VARIANT"
  --build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
if [ -n "$wheels" ] && [ "$wheels" != none ]; then
  echo "torch from the local wheels in $wheels"
  args+=(--volume "$wheels:/wheels:ro" --build-arg TORCH_WHEELS=/wheels)
fi

start=$(date +%s)
buildah "${STORAGE[@]}" bud --isolation chroot --layers "${args[@]}" -t "$TAG" .
echo "built $TAG in $(($(date +%s) - start)) s"
image/layers.sh "$TAG"
