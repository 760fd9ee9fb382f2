#!/bin/bash
# Push the image build_image.sh made to Google Container/Artifact Registry, as MaxText's
# docker_upload_runner.sh does: the result is what `xpk workload create-pathways --docker-image` takes.
#
# Usage: bash dependencies/scripts/upload_image.sh CLOUD_IMAGE_NAME=<name> [PROJECT=<gcp project>]
#          [LOCAL_IMAGE_NAME=maxtext_rl_plugin_image] [TAG=latest] [REGISTRY=gcr.io]
# Needs `gcloud auth configure-docker` (Artifact Registry Writer); PROJECT defaults to gcloud's project.
set -euo pipefail

for ARGUMENT in "$@"; do
  if [[ "$ARGUMENT" != *=* ]]; then
    echo "error: arguments are KEY=VALUE, got '$ARGUMENT'" >&2
    exit 2
  fi
  KEY="$(echo "${ARGUMENT%%=*}" | tr '[:lower:]' '[:upper:]')"
  VALUE="${ARGUMENT#*=}"
  case "$KEY" in
    CLOUD_IMAGE_NAME|PROJECT|LOCAL_IMAGE_NAME|TAG|REGISTRY) export "$KEY=$VALUE" ;;
    *) echo "error: unknown key '$KEY' (CLOUD_IMAGE_NAME, PROJECT, LOCAL_IMAGE_NAME, TAG, REGISTRY)" >&2; exit 2 ;;
  esac
done

if [[ -z "${CLOUD_IMAGE_NAME:-}" ]]; then
  echo "error: CLOUD_IMAGE_NAME is unset, e.g. CLOUD_IMAGE_NAME=\${USER}_rl_plugin" >&2
  exit 2
fi
LOCAL_IMAGE_NAME="${LOCAL_IMAGE_NAME:-maxtext_rl_plugin_image}"
TAG="${TAG:-latest}"
REGISTRY="${REGISTRY:-gcr.io}"
if [[ -z "${PROJECT:-}" ]]; then
  PROJECT="$(gcloud config get-value project 2>/dev/null || true)"
fi
if [[ -z "$PROJECT" ]]; then
  echo "error: no GCP project: pass PROJECT=<id> or run 'gcloud config set project <id>'" >&2
  exit 2
fi

if ! docker image inspect "$LOCAL_IMAGE_NAME" >/dev/null 2>&1; then
  echo "error: local image '$LOCAL_IMAGE_NAME' not found; build it with dependencies/scripts/build_image.sh" >&2
  exit 1
fi

REMOTE="$REGISTRY/$PROJECT/$CLOUD_IMAGE_NAME:$TAG"
echo "[upload_image] $LOCAL_IMAGE_NAME -> $REMOTE"
docker tag "$LOCAL_IMAGE_NAME" "$REMOTE"
docker push "$REMOTE"
echo "[upload_image] done; use: xpk workload create-pathways ... --docker-image $REGISTRY/$PROJECT/$CLOUD_IMAGE_NAME"
