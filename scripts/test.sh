#!/usr/bin/env bash
# The README's test command: create/refresh .venv, then run the whole suite on CPU.
# Two pytest passes: most tests see one CPU device; tests marked `multidevice` (resharding between
# disjoint meshes) need 8 forced host devices, which XLA only honours at process start.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
# xpk (launcher tests) lives outside the resolver on purpose: see the `xpk` extra in setup.cfg.
if ! "$VENV/bin/python" -c 'import xpk.parser.core' >/dev/null 2>&1; then
  echo "[venv] installing xpk 1.16.0 for the launcher tests (--no-deps, pinned closure)"
  # Only what the main install lacks, so no package the plugin resolved is replaced.
  missing=$("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for line in open("scripts/xpk-test-requirements.txt"):
  line = line.strip()
  if line and not line.startswith("#"):
    try:
      md.version(line.split("==")[0])
    except md.PackageNotFoundError:
      print(line)
PY
)
  # shellcheck disable=SC2086
  [ -z "$missing" ] || "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps $missing 2>&1 \
    | grep -v "^WARNING: Location 'file:" || true
fi
export JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=3
status=0
"$VENV/bin/python" -m pytest -q -rs -m "not multidevice" "$@" || status=$?
# pytest exits 5 when nothing is collected. On a full run that means the `multidevice` marker was lost and every
# multidevice test silently vanished: a failure. Only a filtered run (extra arguments) may legitimately select none.
rc=0
XLA_FLAGS="--xla_force_host_platform_device_count=8" \
  "$VENV/bin/python" -m pytest -q -rs -m multidevice "$@" || rc=$?
if [ $rc -ne 0 ] && { [ $rc -ne 5 ] || [ $# -eq 0 ]; }; then status=$rc; fi
exit $status
