#!/usr/bin/env bash
# The README's test command: create/refresh .venv, then run the whole suite on CPU.
# Two pytest passes: most tests see one CPU device; tests marked `multidevice` (resharding between
# disjoint meshes) need 8 forced host devices, which XLA only honours at process start.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"
export JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=3
status=0
"$VENV/bin/python" -m pytest -q -m "not multidevice" "$@" || status=$?
XLA_FLAGS="--xla_force_host_platform_device_count=8" \
  "$VENV/bin/python" -m pytest -q -m multidevice "$@" || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
exit $status
