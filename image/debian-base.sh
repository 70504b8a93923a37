#!/usr/bin/env bash
# Builds a stand-in for python:3.11-slim from Debian packages (mmdebstrap, bookworm) and stores it
# in buildah's image store, for machines that reach Debian's mirror but no image registry:
#
#   image/debian-base.sh                       # -> localhost/kvpilot-base:bookworm
#   docker build --build-arg BASE_IMAGE=... .  # or image/build.sh, which calls this
#
# Like python:3.11-slim it holds Python 3.11 (Debian's, with venv and `python`), CA certificates
# and netbase; the Dockerfile's stages add the rest. CA certificates under
# /usr/local/share/ca-certificates on this machine (a TLS-inspecting egress proxy's) are trusted
# inside too, so that pip in the build reaches PyPI the way pip on the host does.
# Needs root, mmdebstrap and buildah (apt-get install -y buildah mmdebstrap).
set -euo pipefail
TAG=${BASE_TAG:-localhost/kvpilot-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
HOST_CA_DIR=${HOST_CA_DIR:-/usr/local/share/ca-certificates}
STORAGE=(--storage-driver "${STORAGE_DRIVER:-vfs}")

work=$(mktemp -d)
container=""
cleanup() {
  [ -z "$container" ] || buildah "${STORAGE[@]}" rm "$container" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

hooks=()
if compgen -G "$HOST_CA_DIR/*.crt" >/dev/null; then
  mkdir -p "$work/ca"
  cp "$HOST_CA_DIR"/*.crt "$work/ca/"
  hooks+=(--customize-hook="copy-in $work/ca/. /usr/local/share/ca-certificates/"
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null')
fi

echo "mmdebstrap $SUITE -> $work/rootfs.tar"
mmdebstrap --quiet --variant=minbase \
  --include=python3,python3-venv,python-is-python3,ca-certificates,netbase,tzdata \
  --aptopt='Acquire::Check-Valid-Until "false"' \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  "${hooks[@]}" \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  "$SUITE" "$work/rootfs.tar" \
  "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
  "deb $SECURITY_MIRROR $SUITE-security main"

container=$(buildah "${STORAGE[@]}" from scratch)
mnt=$(buildah "${STORAGE[@]}" mount "$container")
tar -C "$mnt" --numeric-owner -xpf "$work/rootfs.tar"
buildah "${STORAGE[@]}" umount "$container" >/dev/null
# What python:3.11-slim's config says, where it matters to the Dockerfile.
buildah "${STORAGE[@]}" config --env LANG=C.UTF-8 \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
  --cmd python3 "$container"
buildah "${STORAGE[@]}" commit --quiet --rm "$container" "$TAG" >/dev/null
container=""
echo "$TAG"
