"""Fixtures for tests/tpu_contract (run in .venv-tpu only; see tpu_models.py)."""

import pytest
import tpu_models  # pylint: disable=unused-import  # sets JAX_PLATFORMS / XLA_FLAGS before jax is imported


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tpu_models")
