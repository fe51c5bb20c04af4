#!/usr/bin/env bash
# Builds the stallfreed container image: the two binaries with stallfree's own libraries linked
# in (--dynamic_mode=off; the system libraries come from the image's apt), then
# `podman build` (or docker) with deploy/ as the context. Usage: deploy/build-image.sh [TAG]
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-stallfreed}
bazel build -c opt --dynamic_mode=off //server:stallfreed //client:stallfreectl
mkdir -p deploy/image
install -m 0755 bazel-bin/server/stallfreed bazel-bin/client/stallfreectl deploy/image/
if command -v podman >/dev/null; then tool=podman
elif command -v docker >/dev/null; then tool=docker
else
  echo "build-image: the binaries are in deploy/image/; neither podman nor docker is here:" \
       "run '<podman|docker> build -f deploy/Containerfile -t $tag deploy' where one is" >&2
  exit 1
fi
"$tool" build -f deploy/Containerfile -t "$tag" deploy
