#!/usr/bin/env bash
# The README's main job: create/refresh .venv, then run GRPO on the embedded CPU default.
# Extra key=value overrides are passed through, e.g. `bash scripts/demo.sh loss_algo=gspo-token`.
# `bash scripts/demo.sh tools [key=value ...]`: the multi-turn calculator demo (configs/cpu_demo_tools.yml).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
CONFIG=configs/cpu_demo.yml
if [[ "${1:-}" == "tools" ]]; then
  CONFIG=configs/cpu_demo_tools.yml
  shift
fi
exec "$VENV/bin/python" -m maxtext_rl_plugin.train_rl "$CONFIG" "$@"
