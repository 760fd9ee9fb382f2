"""Shared fixtures. JAX runs on CPU; tests that need 8 devices are marked `multidevice`.

One JAX persistent compilation cache per test run: every process of the run (this one, pytest-xdist's workers, the
`train_rl` subprocesses the end-to-end tests start) compiles each program once. The directory is the run's own
(`MAXTEXT_RL_TEST_JAX_CACHE`, made by scripts/test.sh for its passes, else a temporary directory removed when this
pytest exits) and replaces any JAX_COMPILATION_CACHE_DIR of the caller's shell, so a test run never reads or fills the
cache of a user's own runs. The thresholds are zero so the tiny test programs (milliseconds to compile) are cached too.
"""

import atexit
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

import jax
import pytest

from maxtext_rl_plugin.launch import __main__ as launch_main

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

TEST_JAX_CACHE_ENV = "MAXTEXT_RL_TEST_JAX_CACHE"


def _use_run_compilation_cache() -> str:
  """Point this process and every process it starts at the test run's compilation cache; returns its path."""
  path = os.environ.get(TEST_JAX_CACHE_ENV)
  if not path:  # pytest run by hand: this process (the xdist controller, if any) makes it; workers inherit the env
    path = tempfile.mkdtemp(prefix="maxtext-rl-test-jax-cache-")
    os.environ[TEST_JAX_CACHE_ENV] = path
    atexit.register(shutil.rmtree, path, True)
  flags = {
      "jax_compilation_cache_dir": path,
      "jax_persistent_cache_min_compile_time_secs": 0,
      "jax_persistent_cache_min_entry_size_bytes": -1,
      # No size bound: with one, JAX's LRU cache globs the whole directory and reads every entry's atime file on each
      # write (lru_cache._evict_if_needed), quadratic in the entries; a test run writes thousands (every eager op's
      # program), which cost 42 of 98 s of one tpu_contract test (cProfile) and more in the shared passes. Without it
      # there is no file lock either: a read that races a write of the same entry fails to deserialize, which JAX
      # turns into a warning and a recompile (compiler._cache_read), never a wrong program.
      "jax_compilation_cache_max_size": -1,
  }
  for name, value in flags.items():
    os.environ[name.upper()] = str(value)  # read by `import jax` in subprocesses
    jax.config.update(name, value)  # this process imported jax already
  return path


_use_run_compilation_cache()

REPO = pathlib.Path(__file__).resolve().parents[1]

# Tests mirror the source tree (tests/<room>/test_*.py, no __init__.py: a folder is not a package that could shadow a
# library's module). A test module imports another's helpers by module name (test_trainer_updates._train), wherever
# that module lives: every room is on the path, after everything else.
sys.path.extend(
    str(room)
    for room in sorted((REPO / "tests").iterdir())
    if room.is_dir() and room.name not in ("data", "tpu_contract", "__pycache__")
)

# Test modules, longest first (seconds of one xdist worker, measured: docs/DEVELOPMENT.md "Test-suite time").
# scripts/test.sh runs `--dist loadfile --no-loadscope-reorder`: a worker that frees up takes the next module in this
# order, so the long end-to-end modules start at once and the short ones fill the end (longest-processing-time-first).
# xdist's default order (modules with the most tests first) started the one-test Ray and demo modules last.
_LONGEST_FIRST = (
    "test_reliability",
    "test_trainer_updates",
    "test_async_rollout",
    "test_demo",
    "test_train_e2e",
    "test_agentic_e2e",
    "test_lora",
    "test_moe",
    "test_aot",
    "test_gcs_run",
    "test_warm_start",
    "test_accumulation",
    "test_dynamic_sampling_e2e",
    "test_reward_aggregation_e2e",
    "test_train_rm",
    "test_engines",
    "test_bench_gpu",
    "test_evaluation",
    "test_rollout_embedded",
    "test_install",
    "test_config",
    "test_bad_input",
    "test_docs",
    "test_launch_ray",
    "test_bench",
    "test_multiprocess",
    "test_validation",
    "test_vllm_rollout",
    "test_algorithms",
)


def pytest_collection_modifyitems(items):
  """Longest modules first; a stable sort keeps each module's own order and the rest in collection order."""
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


# tests/tpu_contract needs the TPU image's stack (.venv-tpu, scripts/tpu_contract_venv.sh); scripts/test.sh runs it
# there in its own pass. The main venv has no tpu_inference, so it does not collect that directory at all.
collect_ignore = [] if importlib.util.find_spec("tpu_inference") else ["tpu_contract"]
_GSM8K_CANDIDATES = [
    os.environ.get("GSM8K_DIR", ""),
    REPO.parent / "shared" / "data" / "gsm8k",
    REPO.parent.parent / "shared" / "data" / "gsm8k",
]


GSM8K_FIXTURE = REPO / "tests" / "data" / "gsm8k"  # 300 train + 100 test rows of real GSM8K (see its README)


@pytest.fixture(scope="session")
def gsm8k_fixture_dir() -> pathlib.Path:
  """Real GSM8K rows shipped with the tests (tests/data/gsm8k: the first 300 train and 100 test rows)."""
  return GSM8K_FIXTURE


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
  """The full GSM8K JSONL files (../shared/data/gsm8k or $GSM8K_DIR), for full-size checks only."""
  for cand in _GSM8K_CANDIDATES:
    if cand and (pathlib.Path(cand) / "test.jsonl").is_file():
      return pathlib.Path(cand)
  pytest.skip(
      "full-size check: the full GSM8K (8,792 rows) is not at ../shared/data/gsm8k and GSM8K_DIR is unset; "
      "the 400-row fixture in tests/data/gsm8k covers the same checks at small size"
  )
  return None  # not reached: pytest.skip raises


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
  return REPO


@pytest.fixture
def launch_cli(capsys):
  """Runs `python -m maxtext_rl_plugin.launch ARGV` in-process; returns (exit code, stdout, stderr)."""

  def run(argv):
    try:
      rc = launch_main.main(argv)
    except SystemExit as e:
      rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err

  return run


@pytest.fixture(scope="session")
def gcs():
  """A GCS endpoint on loopback (fake-gcs-server, tests/_gcs.py) with its variables set for every client of the stack,
  one per test process: gcsfs and google-cloud-storage keep the endpoint they were first built with, so every module
  of a worker shares this one."""
  import _gcs  # pylint: disable=import-outside-toplevel  # only tests on gs:// start the server

  with _gcs.emulator(until_exit=True) as emu:  # until the process exits: see _gcs.emulator
    saved = {k: os.environ.get(k) for k in emu.env()}
    os.environ.update(emu.env())
    try:
      yield emu
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
