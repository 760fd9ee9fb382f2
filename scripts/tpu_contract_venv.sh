#!/usr/bin/env bash
# Create or refresh .venv-tpu: the TPU image's pinned stack (vllm-tpu, tpu-inference, jax 0.11.2, ...) with
# CPU jax, for tests/tpu_contract (the real tpu-inference model classes built on CPU). Every package is
# pinned in dependencies/tpu-contract-requirements.txt and installed --no-deps; re-installs only when that
# file changed (a stamp holds its hash); the plugin itself is reinstalled, non-editable, on every run (below).
# Run by scripts/test.sh; safe to run on its own. First install: 12 min (711 s measured on a shared 2-core machine,
# download-bound) and 7.7 GB: PyPI's torch is a CUDA build and imports only with its nvidia-* libraries (~3 GB).
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
  pip_install "$TPU_VENV/bin/python" --no-deps -r "$TPU_REQS" 2>&1 \
    | grep -v "requires .*, which is not installed\|^ERROR: pip's dependency resolver\|^[a-z0-9_.-]* [0-9.a-z]* requires\|has requirement" || true
  JAX_PLATFORMS=cpu "$TPU_VENV/bin/python" -c 'import vllm, tpu_inference, torch, maxtext' >/dev/null 2>&1 \
    || { echo "error: .venv-tpu does not import vllm/tpu_inference/torch/maxtext after the install" >&2; exit 1; }
  echo "$TPU_WANT" > "$TPU_STAMP"
  echo "[tpu-venv] installed in $((SECONDS - t0)) s, $(du -sh "$TPU_VENV" | cut -f1)"
fi
# libtpu for compiling the vLLM rollout for a TPU topology (maxtext_rl_plugin/aot/vllm_programs.py,
# tests/tpu_contract/test_aot_vllm.py): the TPU image's libtpu, which matches this venv's jax 0.11.2 (PyPI's newest
# pairs with jax 0.12). Its own --target dir, put on PYTHONPATH only by the AOT compile subprocesses, so the contract
# tests' CPU JAX never looks for a TPU; stamp-guarded like .venv-aot-libtpu in scripts/venv.sh (~690 MB, ~10 s).
TPU_LIBTPU="${TPU_LIBTPU:-$ROOT/.venv-tpu-libtpu}"
TPU_LIBTPU_WANT="libtpu==0.0.48"
if [ "${MAXTEXT_RL_SKIP_AOT_LIBTPU:-0}" != 1 ] && stamp_stale "$TPU_LIBTPU/.stamp" "$TPU_LIBTPU_WANT"; then
  echo "[tpu-venv] installing $TPU_LIBTPU_WANT into $TPU_LIBTPU (AOT compile of the vLLM rollout)"
  t0=$SECONDS
  rm -rf "$TPU_LIBTPU"
  pip_install "$TPU_VENV/bin/python" --no-deps --target "$TPU_LIBTPU" "$TPU_LIBTPU_WANT"
  if [ -d "$TPU_LIBTPU/libtpu" ]; then
    echo "$TPU_LIBTPU_WANT" > "$TPU_LIBTPU/.stamp"
    echo "[tpu-venv] $TPU_LIBTPU_WANT installed in $((SECONDS - t0)) s, $(du -sh "$TPU_LIBTPU" | cut -f1)"
  fi
fi
# The plugin itself as the TPU image installs it (dependencies/Dockerfile step 2): a non-editable `--no-deps ".[tpu]"`
# install of the files the image copies, so tests/tpu_contract imports the installed package (configs/ and rewards/
# inside it through setup.cfg's package_dir, modules only if setup.py ships them), never the checkout. Reinstalled on
# every run: the sources change between runs. Built from a fresh copy, so no stale setuptools build/ folder of the
# checkout can put a deleted module into the wheel; --no-build-isolation builds with the pinned setuptools above.
t0=$SECONDS
PLUGIN_SRC="$(mktemp -d -t maxtext-rl-plugin-src.XXXXXX)"
(cd "$ROOT" && tar -cf - --exclude=__pycache__ --exclude='*.pyc' setup.py setup.cfg pyproject.toml README.md \
  maxtext_rl_plugin configs rewards) | tar -xf - -C "$PLUGIN_SRC"
pip_install "$TPU_VENV/bin/python" --no-deps --no-build-isolation --force-reinstall "$PLUGIN_SRC[tpu]"
rm -rf "$PLUGIN_SRC"
(cd / && "$TPU_VENV/bin/python" -c 'import maxtext_rl_plugin.rewards, maxtext_rl_plugin.configs' >/dev/null 2>&1) \
  || { echo "error: the plugin's non-editable install in .venv-tpu does not import" >&2; exit 1; }
echo "[tpu-venv] maxtext-rl-plugin installed as in the image (non-editable, --no-deps) in $((SECONDS - t0)) s"
