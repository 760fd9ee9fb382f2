#!/usr/bin/env bash
# The one command the GPU device machine runs (docs/performance.md, "GPU figures: how to run"): install the wheels
# carried in .whl/ (scripts/gpu_wheels.sh) beside the image's JAX/CUDA, PyTorch and transformers, lay the plugin out
# as pip would install it, then run `python -m maxtext_rl_plugin.bench gpu` into $OUT (gpu_bench.json, gpu_bench.md,
# log.txt, versions.txt). Arguments go to the bench, e.g.
#   bash scripts/gpu_bench.sh --parts rollout --models qwen3-0.6b
# BUDGET_S (default 560) bounds the whole command: the device tool stops a command at 600 s, and a part still running
# at the budget is stopped with what it measured so far saved.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu_out}"
BUDGET_S="${BUDGET_S:-560}"
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
# shellcheck source=scripts/gpu_site.sh
source "$ROOT/scripts/gpu_site.sh"

python3 -m maxtext_rl_plugin.bench gpu --out "$OUT" --budget $((BUDGET_S - SECONDS)) "$@"
