#!/usr/bin/env bash
# The README's test command: create/refresh .venv, then run the whole suite on CPU.
# Four pytest passes: most tests see one CPU device (pass 1); tests marked `multidevice` (resharding between
# disjoint meshes) need 8 forced host devices, which XLA only honours at process start (pass 2); tests/tpu_contract
# runs in .venv-tpu (the TPU image's pins on CPU, scripts/tpu_contract_venv.sh) against the real tpu-inference models
# (pass 3, in the background from the start); tests marked `solo` (several processes in collectives: Ray, two-process
# JAX) run last, one at a time, on an otherwise idle machine (pass 4).
# MAXTEXT_RL_SKIP_TPU_CONTRACT=1 skips the third pass (it says so); CI leaves it unset and installs .venv-tpu.
# Speed (docs/DEVELOPMENT.md, "Test-suite time"): passes 1-2 run on pytest-xdist workers (MAXTEXT_RL_TEST_WORKERS,
# default 2; `-n 0` among the arguments runs serially), end-to-end runs whose promise is not about a process run
# train_rl in the worker's own process (tests/_in_process.py), every process of the run shares one JAX compilation
# cache (a temporary directory of this run only, removed at exit), lint runs at the lowest priority after pass 1, and
# each pass prints its slowest tests plus the time of every step ("[time] ...").
# Two tiers (docs/DEVELOPMENT.md, "Two tiers"): tests marked `extended` repeat at length what the default suite checks
# once (the demo's learning claim, model families past one per code path, the benchmark harnesses, the Ray
# topologies); every pass leaves them out unless MAXTEXT_RL_TEST_EXTENDED=1, which runs the whole suite (~35 min).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
T_RUN=$SECONDS
took() { echo "[time] $1: $((SECONDS - $2)) s"; }
# cpu LABEL CMD...: run CMD; with GNU time on the machine, also print the CPU seconds it and its children used, the
# budget that decides this command's wall on 2 cores (docs/DEVELOPMENT.md, "Test-suite time").
cpu() {
  local label=$1
  shift
  if [ -x /usr/bin/time ]; then /usr/bin/time -f "[cpu] $label: %U s user + %S s sys" "$@"; else "$@"; fi
}
export JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=3
if [ "${MAXTEXT_RL_TEST_EXTENDED:-0}" = "1" ]; then
  TIER=""
  echo "[tier] the whole suite: the default tier and the tests marked extended"
else
  TIER=" and not extended"
  echo "[tier] the default tier (CI): tests marked extended are left out; MAXTEXT_RL_TEST_EXTENDED=1 runs them too"
fi
# One JAX persistent compilation cache for every process of this run (both xdist workers of every pass and the
# train_rl subprocesses they start; tests/conftest.py points JAX at it). Never a user's cache: a fresh directory.
MAXTEXT_RL_TEST_JAX_CACHE="$(mktemp -d -t maxtext-rl-test-jax-cache.XXXXXX)"
export MAXTEXT_RL_TEST_JAX_CACHE
tpu_log="$(mktemp)"
lint_log="$(mktemp)"
trap 'rm -rf "$MAXTEXT_RL_TEST_JAX_CACHE" "$tpu_log" "$lint_log"' EXIT
status=0
t=$SECONDS
source "$ROOT/scripts/venv.sh"
took "venv (installs only when setup.cfg changed)" "$t"
# The third pass (tests/tpu_contract in .venv-tpu) needs nothing of .venv: it installs and runs in the background from
# here, beside pass 1, so no core idles while it runs alone at the end (its tests are one process; measured,
# docs/DEVELOPMENT.md). It starts after the venv step, which is on the critical path and compiles bytecode on both
# cores. Its output is shown after pass 2.
tpu_pid=""
if [ $# -eq 0 ] && [ "${MAXTEXT_RL_SKIP_TPU_CONTRACT:-0}" != "1" ]; then
  (
    t=$SECONDS
    cpu ".venv-tpu install" bash "$ROOT/scripts/tpu_contract_venv.sh" || { echo "SKIPPED tests/tpu_contract: installing .venv-tpu failed (see the lines above)"; exit 3; }
    took ".venv-tpu install (background)" "$t"
    cd "$ROOT"
    t=$SECONDS
    rc=0
    # The plugin as the image installs it (scripts/tpu_contract_venv.sh): no PYTHONPATH, and -P keeps `python -m`
    # from putting the checkout first on sys.path, either of which would import maxtext_rl_plugin/ from the
    # checkout (without configs/ and rewards/, which only the install maps into the package). pytest itself puts
    # tests/tpu_contract on sys.path for its helper modules (forward.py, tpu_models.py).
    XLA_FLAGS="--xla_force_host_platform_device_count=4" TPU_ACCELERATOR_TYPE=v5litepod-4 \
      cpu "pass 3" "$ROOT/.venv-tpu/bin/python" -P -m pytest -q -rs --durations=25 -p no:cacheprovider -m "not network$TIER" tests/tpu_contract || rc=$?
    took "pass 3 (tests/tpu_contract in .venv-tpu, background)" "$t"
    exit $rc
  ) >"$tpu_log" 2>&1 &
  tpu_pid=$!
fi
cd "$ROOT"
# Style (MaxText's pyink and pylint settings, ~200 CPU-s) on a full run, in the background from here at the lowest
# priority. Started after pass 1 it was the run's tail once the Ray topologies left pass 4 (163 s waited for it); from
# here at nice 19 the wait was 93 s and the run 1,329 s; at nice 10 it waited 24 s but slowed pass 1 by 83 s (1,412 s,
# docs/DEVELOPMENT.md "Two tiers"). A finding fails the run; its output is shown at the end.
lint_pid=""
if [ $# -eq 0 ]; then
  (
    t=$SECONDS
    rc=0
    cpu lint env MAXTEXT_RL_LINT_JOBS=1 nice -n 19 bash "$ROOT/scripts/lint.sh" || rc=$?
    took "lint (background)" "$t"
    exit $rc
  ) >"$lint_log" 2>&1 &
  lint_pid=$!
fi
# xpk (launcher tests) lives outside the resolver on purpose: see the `xpk` extra in setup.cfg.
t=$SECONDS
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
  [ -z "$missing" ] || pip_install "$VENV/bin/python" --no-deps $missing
  took "xpk install" "$t"
fi
XDIST=()
if "$VENV/bin/python" -c 'import xdist' >/dev/null 2>&1; then
  # loadfile: a module's tests stay on one worker, so a module-scoped fixture (a training run, a built model) is
  # built once. (loadgroup does not group with pytest 9.2 + xdist 3.8: measured, docs/DEVELOPMENT.md.)
  # --no-loadscope-reorder: modules start in tests/conftest.py's longest-first order, not "most tests first".
  XDIST=(-n "${MAXTEXT_RL_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
fi
# `network` tests ask the package registry; they are an explicit check before changing pins (docs/DEVELOPMENT.md).
t=$SECONDS
cpu "pass 1" "$VENV/bin/python" -m pytest -q -rs --durations=25 "${XDIST[@]}" -m "not multidevice and not network and not solo$TIER" "$@" \
  || status=$?
took "pass 1 (one CPU device)" "$t"
# pytest exits 5 when nothing is collected. On a full run that means the `multidevice` marker was lost and every
# multidevice test silently vanished: a failure. Only a filtered run (extra arguments) may legitimately select none.
t=$SECONDS
rc=0
XLA_FLAGS="--xla_force_host_platform_device_count=8" \
  cpu "pass 2" "$VENV/bin/python" -m pytest -q -rs --durations=25 "${XDIST[@]}" -m "multidevice$TIER" "$@" || rc=$?
if [ $rc -ne 0 ] && { [ $rc -ne 5 ] || [ $# -eq 0 ]; }; then status=$rc; fi
took "pass 2 (multidevice, 8 forced CPU devices)" "$t"
# Third pass only on a full run (extra arguments select main-venv tests).
if [ $# -eq 0 ]; then
  if [ "${MAXTEXT_RL_SKIP_TPU_CONTRACT:-0}" = "1" ]; then
    echo "SKIPPED tests/tpu_contract: MAXTEXT_RL_SKIP_TPU_CONTRACT=1 (needs .venv-tpu, ~7.6 GB, scripts/tpu_contract_venv.sh)"
  else
    t=$SECONDS
    rc=0
    wait "$tpu_pid" || rc=$?
    took "waiting for pass 3" "$t"
    cat "$tpu_log"
    # 3: the install itself was impossible (no PyPI, no disk), said above; anything else is the pass's own result.
    if [ $rc -ne 0 ] && [ $rc -ne 3 ]; then status=$rc; fi
  fi
fi
# Last, with the machine to itself: the tests marked `solo` run several processes in collectives (a local Ray cluster,
# two-process JAX programs), which slowed down five times over beside pass 1's other worker, lint and the .venv-tpu
# install (the Ray job: 677 s there, 107 s alone; docs/DEVELOPMENT.md). One at a time, each has both cores.
t=$SECONDS
rc=0
cpu "pass 4" "$VENV/bin/python" -m pytest -q -rs --durations=10 -m "solo and not network$TIER" "$@" || rc=$?
if [ $rc -ne 0 ] && { [ $rc -ne 5 ] || [ $# -eq 0 ]; }; then status=$rc; fi
took "pass 4 (solo: multi-process and Ray, one at a time)" "$t"
# Lint last: it may still be running here (it only had the idle cycles of passes 2 and 4).
if [ -n "$lint_pid" ]; then
  t=$SECONDS
  wait "$lint_pid" || status=1
  took "waiting for lint" "$t"
  cat "$lint_log"
fi
took "scripts/test.sh total" "$T_RUN"
exit $status
