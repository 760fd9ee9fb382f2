"""Shared fixtures. JAX runs on CPU; tests that need 8 devices are marked `multidevice`."""

import importlib.util
import os
import pathlib

import pytest

from maxtext_rl_plugin.launch import __main__ as launch_main

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

REPO = pathlib.Path(__file__).resolve().parents[1]
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
