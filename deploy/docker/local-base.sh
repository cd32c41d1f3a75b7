#!/usr/bin/env bash
# A Python 3.11 base image made from Debian packages alone, for hosts that reach Debian's
# archive but no container registry. Tags localhost/python:3.11-bookworm-local; build with
#   buildah bud --isolation chroot --build-arg PYTHON_IMAGE=localhost/python:3.11-bookworm-local \
#     -f deploy/docker/Dockerfile -t localhost/kvgate .
# Needs root, debootstrap and podman (for `podman import`).
set -euo pipefail
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$rootfs" "$mirror"
# Debian's own pip refuses to install into the system Python (PEP 668): a venv on PATH
# stands in for the official image's /usr/local Python.
chroot "$rootfs" python3 -m venv /opt/python
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | podman import \
  --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' - localhost/python:3.11-bookworm-local
