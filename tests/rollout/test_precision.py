"""rollout/precision.py: the refusals of a sampler precision a route cannot serve, one line each, in the first pass."""

import types

import pytest

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import precision


def _cfg(engine, q):
  return types.SimpleNamespace(rollout_engine=engine, rollout_quantization=q)


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_the_embedded_engine_serves_both_formats_and_vllm_neither(q):
  assert precision.refusal(_cfg("embedded", q), "embedded") is None
  assert precision.refusal(_cfg("auto", q), "auto") is None  # resolved by run/build, which then skips vLLM
  why = precision.refusal(_cfg("vllm", q), "vllm")
  assert why.startswith(f"rollout_quantization={q} with rollout_engine=vllm: tpu-inference 0.32.0") and "\n" not in why
  assert precision.refusal(_cfg("vllm", ""), "vllm") is None


def test_a_quantized_vllm_sampler_is_refused_in_one_line():
  """(The first pass's time: `python -m maxtext_rl_plugin.train_rl configs/cpu_tiny.yml head_dim=128
  rollout_engine=vllm rollout_quantization=fp8` ends with this line, exit 2, before the schema's imports.)"""
  with pytest.raises(ConfigError, match=r"^rollout_quantization=fp8 with rollout_engine=vllm: .*rollout_engine=embedded"):
    config_lib.parse(["configs/cpu_tiny.yml", "head_dim=128", "rollout_engine=vllm", "rollout_quantization=fp8"])
  with pytest.raises(ConfigError, match="rollout_quantization"):
    config_lib.parse(["configs/cpu_tiny.yml", "rollout_quantization=fp4"])
