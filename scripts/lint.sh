#!/usr/bin/env bash
# MaxText's style checks on this repo: pyink (2-space indent, 122 columns; pyproject.toml) and pylint (pylintrc).
# Run by the README's test command (scripts/test.sh); `bash scripts/lint.sh --fix` rewrites the formatting.
# Uses .venv (the `lint` extra pins MaxText's tool versions); creates/refreshes it like every other script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
PATHS=(maxtext_rl_plugin rewards tests scripts)
status=0
if [ "${1:-}" = "--fix" ]; then
  "$VENV/bin/python" -m pyink "${PATHS[@]}"
else
  "$VENV/bin/python" -m pyink --check --diff "${PATHS[@]}" || { status=1; echo "lint: pyink would reformat (bash scripts/lint.sh --fix)"; }
fi
# pylintrc's jobs=2 is the faster wall by hand; the test command runs it beside the tests with one job
# (MAXTEXT_RL_LINT_JOBS=1): 141 CPU-s against 198 for two, which re-infer the shared imports (docs/DEVELOPMENT.md).
"$VENV/bin/python" -m pylint --rcfile=pylintrc --jobs="${MAXTEXT_RL_LINT_JOBS:-2}" --recursive=y "${PATHS[@]}" || { status=1; echo "lint: pylint findings above"; }
[ $status -eq 0 ] && echo "lint: pyink and pylint clean"
exit $status
