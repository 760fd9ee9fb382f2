#!/usr/bin/env bash
# Create or refresh .venv at the repo root with Python 3.12 and install the plugin in editable mode.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run on its own. Re-installs only when
# setup.cfg changed since the last install (a stamp file holds its hash).
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
# scripts/tpu_contract_venv.sh borrows find_python only.
if [ "${1:-}" = "--find-python-only" ]; then return 0; fi

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  PY="$(find_python)"
  echo "[venv] creating $VENV with $PY"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

STAMP="$VENV/.maxtext_rl_plugin.stamp"
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $EXTRAS"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[venv] installing maxtext-rl-plugin[$EXTRAS] (editable); first time takes ~2 min"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[$EXTRAS]" 2>&1 \
    | grep -v "^WARNING: Location 'file:" || true
  "$VENV/bin/python" -c 'import maxtext_rl_plugin' || { echo "error: install failed" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
fi
