"""Shared fixtures. JAX runs on CPU; tests that need 8 devices are marked `multidevice`."""

import os
import pathlib

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

REPO = pathlib.Path(__file__).resolve().parents[1]
_GSM8K_CANDIDATES = [
    os.environ.get("GSM8K_DIR", ""),
    REPO.parent / "shared" / "data" / "gsm8k",
    REPO.parent.parent / "shared" / "data" / "gsm8k",
]


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
  """The real GSM8K JSONL files (../shared/data/gsm8k); skipped when not present."""
  for cand in _GSM8K_CANDIDATES:
    if cand and (pathlib.Path(cand) / "test.jsonl").is_file():
      return pathlib.Path(cand)
  pytest.skip("GSM8K not found at ../shared/data/gsm8k (set GSM8K_DIR)")


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
  return REPO


@pytest.fixture
def launch_cli(capsys):
  """Runs `python -m maxtext_rl_plugin.launch ARGV` in-process; returns (exit code, stdout, stderr)."""
  from maxtext_rl_plugin.launch import __main__ as launch_main  # pylint: disable=import-outside-toplevel

  def run(argv):
    try:
      rc = launch_main.main(argv)
    except SystemExit as e:
      rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err

  return run
