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
SITE="${SITE:-/tmp/site}"
BUDGET_S="${BUDGET_S:-560}"
mkdir -p "$OUT" "$SITE"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3

ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 || { echo "error: no wheels in $ROOT/.whl: run scripts/gpu_wheels.sh and carry .whl"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl \
  || { echo "error: installing the carried wheels failed"; exit 2; }
# The installed layout (setup.cfg's package_dir: configs/ and rewards/ live inside the package), without a build
# backend; run from outside the checkout so its bare maxtext_rl_plugin/ does not shadow this one.
rm -rf "$SITE/maxtext_rl_plugin"
cp -r "$ROOT/maxtext_rl_plugin" "$SITE/" && cp -r "$ROOT/configs" "$SITE/maxtext_rl_plugin/configs" \
  && cp -r "$ROOT/rewards" "$SITE/maxtext_rl_plugin/rewards"
export PYTHONPATH="$SITE"
cd /tmp

{
  date -u
  nvidia-smi -L 2>/dev/null
  python3 -c 'import sys; print(sys.version)'
  python3 -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda|flax|optax|orbax|torch |transformers|maxtext|google-tunix|qwix|grain|numpy|ml.dtypes|tensorstore|chex) '
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
python3 -c 'import maxtext, tunix, maxtext_rl_plugin.run.loop, jax; print("imports ok; jax", jax.__version__, jax.devices())' \
  || { echo "error: the plugin stack does not import on this image (above)"; exit 3; }

python3 -m maxtext_rl_plugin.bench gpu --out "$OUT" --budget $((BUDGET_S - SECONDS)) "$@"
