#!/usr/bin/env bash
# Sourced by the GPU device scripts (scripts/gpu_bench.sh, scripts/gpu_moe_demo.sh): install the wheels carried in
# .whl/ (scripts/gpu_wheels.sh) into $SITE beside the image's JAX/CUDA, PyTorch and transformers, lay the plugin out as
# pip would install it (setup.cfg's package_dir: configs/ and rewards/ inside the package), export PYTHONPATH, cd /tmp
# (so the checkout's bare maxtext_rl_plugin/ does not shadow it) and write $OUT/versions.txt.
# Expects ROOT and OUT; exits 2/3 with one line when the wheels are missing or the stack does not import.
SITE="${SITE:-/tmp/site}"
mkdir -p "$OUT" "$SITE"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3

ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 || { echo "error: no wheels in $ROOT/.whl: run scripts/gpu_wheels.sh and carry .whl"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl \
  || { echo "error: installing the carried wheels failed"; exit 2; }
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
