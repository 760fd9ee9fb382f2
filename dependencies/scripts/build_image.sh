#!/bin/bash
# Build the maxtext-rl-plugin TPU image: MaxText's post-training image + the plugin (dependencies/Dockerfile).
#
# Mirrors MaxText's flow (seed tutorial, "Build and upload MaxText Docker image"):
#   1. MaxText's `dependencies/scripts/docker_build_dependency_image.sh WORKFLOW=post-training`, run in a
#      MaxText checkout, builds the post-training dependency image `maxtext_base_image`;
#   2. this script layers the plugin on it and tags the result LOCAL_IMAGE_NAME;
#   3. upload_image.sh CLOUD_IMAGE_NAME=... pushes it for `xpk workload create-pathways --docker-image`.
#
# Usage (KEY=VALUE arguments, like MaxText's scripts):
#   bash dependencies/scripts/build_image.sh MAXTEXT_REPO=~/maxtext            # steps 1 + 2
#   bash dependencies/scripts/build_image.sh BASE_IMAGE=gcr.io/p/maxtext-post   # step 2 on an existing image
# Keys:
#   WORKFLOW           post-training (default; passed to MaxText's script)
#   POST_TRAINING_SOURCE  forwarded to MaxText's script when set (e.g. local)
#   MAXTEXT_REPO       MaxText checkout to run step 1 in (needed unless BASE_IMAGE is given)
#   BASE_IMAGE         skip step 1 and build on this image
#   LOCAL_IMAGE_NAME   tag of the result (default maxtext_rl_plugin_image)
set -euo pipefail

ROOT="$(CDPATH='' cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)"

for ARGUMENT in "$@"; do
  if [[ "$ARGUMENT" != *=* ]]; then
    echo "error: arguments are KEY=VALUE, got '$ARGUMENT'" >&2
    exit 2
  fi
  KEY="${ARGUMENT%%=*}"
  VALUE="${ARGUMENT#*=}"
  case "$KEY" in
    WORKFLOW|POST_TRAINING_SOURCE|MAXTEXT_REPO|BASE_IMAGE|LOCAL_IMAGE_NAME) export "$KEY=$VALUE" ;;
    *) echo "error: unknown key '$KEY' (WORKFLOW, POST_TRAINING_SOURCE, MAXTEXT_REPO, BASE_IMAGE, LOCAL_IMAGE_NAME)" >&2; exit 2 ;;
  esac
done

WORKFLOW="${WORKFLOW:-post-training}"
LOCAL_IMAGE_NAME="${LOCAL_IMAGE_NAME:-maxtext_rl_plugin_image}"
case "$WORKFLOW" in
  post-training) ;;  # MaxText v0.2.3-v0.2.5's setup.sh accepts post-training, not post-training-experimental
  *) echo "error: WORKFLOW must be post-training (MaxText v0.2.5's setup.sh), got '$WORKFLOW'" >&2; exit 2 ;;
esac

command -v docker >/dev/null 2>&1 || { echo "error: docker not found on PATH" >&2; exit 1; }

if [[ -z "${BASE_IMAGE:-}" ]]; then
  if [[ -z "${MAXTEXT_REPO:-}" ]]; then
    echo "error: set MAXTEXT_REPO=<MaxText checkout> to build its post-training image, or BASE_IMAGE=<image> to reuse one" >&2
    exit 2
  fi
  # MaxText v0.2.3+ keeps its build scripts under src/dependencies/scripts/ (older trees: dependencies/scripts/).
  MAXTEXT_SCRIPT="$MAXTEXT_REPO/src/dependencies/scripts/docker_build_dependency_image.sh"
  [[ -f "$MAXTEXT_SCRIPT" ]] || MAXTEXT_SCRIPT="$MAXTEXT_REPO/dependencies/scripts/docker_build_dependency_image.sh"
  if [[ ! -f "$MAXTEXT_SCRIPT" ]]; then
    echo "error: $MAXTEXT_SCRIPT not found; is MAXTEXT_REPO a MaxText checkout?" >&2
    exit 2
  fi
  echo "[build_image] step 1: MaxText post-training image (WORKFLOW=$WORKFLOW) in $MAXTEXT_REPO"
  MAXTEXT_ARGS=("WORKFLOW=$WORKFLOW")
  if [[ -n "${POST_TRAINING_SOURCE:-}" ]]; then
    MAXTEXT_ARGS+=("POST_TRAINING_SOURCE=$POST_TRAINING_SOURCE")
  fi
  (cd "$MAXTEXT_REPO" && bash "$MAXTEXT_SCRIPT" "${MAXTEXT_ARGS[@]}")
  BASE_IMAGE=maxtext_base_image  # the tag MaxText's script builds
fi

echo "[build_image] step 2: plugin image $LOCAL_IMAGE_NAME on $BASE_IMAGE"
DOCKER_BUILDKIT=1 docker build --network host \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" \
  -f "$ROOT/dependencies/Dockerfile" \
  -t "$LOCAL_IMAGE_NAME" \
  "$ROOT"

echo "[build_image] built $LOCAL_IMAGE_NAME; push it with:"
echo "  bash dependencies/scripts/upload_image.sh CLOUD_IMAGE_NAME=<name> LOCAL_IMAGE_NAME=$LOCAL_IMAGE_NAME"
