#!/usr/bin/env bash
# Create or refresh .venv at the repo root with Python 3.12 and install the plugin in editable mode.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run on its own. Re-installs only when
# setup.cfg, setup.py or pyproject.toml changed since the last install (a stamp file holds their hash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRAS="${MAXTEXT_RL_EXTRAS:-cpu,test,launch,lint}"

find_python() {
  for cand in "${PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12" \
      /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      echo "$cand"; return 0
    fi
  done
  echo "error: Python 3.12 not found (MaxText needs >= 3.12); set PYTHON=/path/to/python3.12" >&2
  return 1
}

# ensure_venv DIR TAG: (re)create DIR as a Python 3.12 virtual environment unless it already is one.
ensure_venv() {
  if [ ! -x "$1/bin/python" ] || ! "$1/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    local py
    py="$(find_python)"
    echo "[$2] creating $1 with $py"
    rm -rf "$1"
    "$py" -m venv "$1"
  fi
}

# stamp_stale STAMP WANT: true when the install recorded in STAMP is not WANT (then install, and write WANT to STAMP).
stamp_stale() {
  [ ! -f "$1" ] || [ "$(cat "$1")" != "$2" ]
}

# pip_install PYTHON ARGS...: `pip install -q ARGS` into PYTHON's environment, by uv when it can be had (pinned below;
# the same resolution as pip: the two installs of .venv froze to the same 188 versions), else by pip. Measured on the
# 2-core machine with warm caches, bytecode compiled as pip does: .venv 30 s instead of ~80 s, .venv-tpu's 7.3 GB 27 s
# instead of 178 s: uv links files out of its cache where pip unpacks every wheel again, and compiles on both cores.
# MAXTEXT_RL_NO_UV=1 keeps pip. Pip's `--force-reinstall` is uv's `--reinstall`; the other flags used here are both's.
UV_PIN="uv==0.13.9"
pip_install() {
  local py=$1
  shift
  local uv
  uv="$(dirname "$py")/uv"
  if [ "${MAXTEXT_RL_NO_UV:-0}" != 1 ] && [ ! -x "$uv" ]; then
    "$py" -m pip install -q --disable-pip-version-check "$UV_PIN" >/dev/null 2>&1 || true
  fi
  if [ "${MAXTEXT_RL_NO_UV:-0}" != 1 ] && [ -x "$uv" ]; then
    local args=()
    for a in "$@"; do
      if [ "$a" = "--force-reinstall" ]; then args+=(--reinstall); else args+=("$a"); fi
    done
    # --compile-bytecode: pip writes every module's .pyc at install; without it each process that may not write
    # them (PYTHONDONTWRITEBYTECODE, a read-only image) compiles the stack's sources again at every import (measured:
    # the Ray test 119 s against 73 s, pass 3 +116 CPU-s).
    "$uv" pip install -q --compile-bytecode --python "$py" "${args[@]}"
  else
    "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location 'file:" || true
  fi
}

# scripts/tpu_contract_venv.sh borrows the functions above only.
if [ "${1:-}" = "--functions-only" ]; then return 0; fi

ensure_venv "$VENV" venv
STAMP="$VENV/.maxtext_rl_plugin.stamp"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $EXTRAS"
if stamp_stale "$STAMP" "$WANT"; then
  echo "[venv] installing maxtext-rl-plugin[$EXTRAS] (editable); ~30 s with warm caches, first time ~2 min"
  pip_install "$VENV/bin/python" -e "$ROOT[$EXTRAS]"
  "$VENV/bin/python" -c 'import maxtext_rl_plugin' || { echo "error: install failed" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
fi

# libtpu for the AOT compile (compile_topology, maxtext_rl_plugin/aot/; tests/aot/test_aot.py): its own --target dir, put
# on PYTHONPATH only by the compile subprocesses, so the CPU JAX of .venv never looks for a TPU. ~640 MB, ~20 s warm.
AOT_LIBTPU="$ROOT/.venv-aot-libtpu"
AOT_WANT="libtpu==0.0.50.1"
if [ "${MAXTEXT_RL_SKIP_AOT_LIBTPU:-0}" != 1 ] && stamp_stale "$AOT_LIBTPU/.stamp" "$AOT_WANT"; then
  echo "[venv] installing $AOT_WANT into $AOT_LIBTPU (AOT compile for TPU topologies)"
  rm -rf "$AOT_LIBTPU"
  pip_install "$VENV/bin/python" --no-deps --target "$AOT_LIBTPU" "$AOT_WANT"
  if [ -d "$AOT_LIBTPU/libtpu" ]; then echo "$AOT_WANT" > "$AOT_LIBTPU/.stamp"; fi
fi
