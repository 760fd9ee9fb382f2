#!/usr/bin/env bash
# Create or refresh .venv-tpu: the TPU image's pinned stack (vllm-tpu, tpu-inference, jax 0.11.2, ...) with
# CPU jax, for tests/tpu_contract (the real tpu-inference model classes built on CPU). Every package is
# pinned in dependencies/tpu-contract-requirements.txt and installed --no-deps; re-installs only when that
# file changed (a stamp holds its hash). Sourced by scripts/test.sh; safe to run on its own.
# First install: 12 min (711 s measured on a shared 2-core machine, download-bound) and 7.7 GB: PyPI's torch
# is a CUDA build and imports only with its nvidia-* libraries (~3 GB of the download).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TPU_VENV="${TPU_VENV:-$ROOT/.venv-tpu}"
TPU_REQS="$ROOT/dependencies/tpu-contract-requirements.txt"
source "$ROOT/scripts/venv.sh" --functions-only

ensure_venv "$TPU_VENV" tpu-venv
TPU_STAMP="$TPU_VENV/.tpu_contract.stamp"
TPU_WANT="$(sha256sum "$TPU_REQS" | cut -d' ' -f1)"
if stamp_stale "$TPU_STAMP" "$TPU_WANT"; then
  echo "[tpu-venv] installing the TPU image's pins (--no-deps, $(grep -c '==' "$TPU_REQS") packages); first time takes ~12 min"
  t0=$SECONDS
  # --no-deps: the pins are the whole closure; pip's resolver would reject the image's qwix override.
  # Pip's "dependency conflicts" notice lists what the CPU environment leaves out on purpose (libtpu, triton).
  "$TPU_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$TPU_REQS" 2>&1 \
    | grep -v "^WARNING: Location 'file:\|requires .*, which is not installed\|^ERROR: pip's dependency resolver\|^[a-z0-9_.-]* [0-9.a-z]* requires\|has requirement" || true
  JAX_PLATFORMS=cpu "$TPU_VENV/bin/python" -c 'import vllm, tpu_inference, torch, maxtext' >/dev/null 2>&1 \
    || { echo "error: .venv-tpu does not import vllm/tpu_inference/torch/maxtext after the install" >&2; exit 1; }
  echo "$TPU_WANT" > "$TPU_STAMP"
  echo "[tpu-venv] installed in $((SECONDS - t0)) s, $(du -sh "$TPU_VENV" | cut -f1)"
fi
# The plugin itself, editable and --no-deps (the pins above are the whole closure), so its installed layout holds as in
# the TPU image: `rewards/` is the package `maxtext_rl_plugin.rewards` only through setup.cfg's package_dir.
if ! (cd / && "$TPU_VENV/bin/python" -c 'import maxtext_rl_plugin.rewards' >/dev/null 2>&1); then
  echo "[tpu-venv] installing maxtext-rl-plugin (editable, --no-deps)"
  "$TPU_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT" 2>&1 \
    | grep -v "^WARNING: Location 'file:\|BuildBackendWarning\|Editable installation\|^ *!!\|^ *\*\+$\|Please be careful\|name as your package\|may take precedence\|with strategy, WheelFile\|^\s*$" || true
fi
