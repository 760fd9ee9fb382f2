"""rollout/precision.py: the refusals of a sampler precision a route cannot serve, one line each, in the first pass."""

import dataclasses

import pytest

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import engines
from maxtext_rl_plugin.rollout import precision


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_the_embedded_engine_serves_both_formats_and_vllm_neither(q):
  assert engines.spec("embedded").precision_refusal(q) is None
  why = engines.spec("vllm").precision_refusal(q)
  assert why.startswith(f"rollout_quantization={q} with rollout_engine=vllm: tpu-inference 0.32.0") and "\n" not in why
  for unset in ("", None, "none"):
    assert engines.spec("vllm").precision_refusal(unset) is None


def test_what_an_engine_declares_decides_not_its_name():
  """An engine is refused by its declared formats (`Capabilities.quantized_weights`) and its own reason, whoever
  registered it: the vLLM spec with fp8 declared serves fp8 and still refuses int8; one without a reason gets the
  generic line."""
  vllm = engines.spec("vllm")
  fp8 = dataclasses.replace(vllm, capabilities=dataclasses.replace(vllm.capabilities, quantized_weights=("fp8",)))
  assert fp8.precision_refusal("fp8") is None and fp8.precision_refusal("int8").startswith("rollout_quantization=int8")
  plain = engines.EngineSpec(name="toy", engine="x:Y", capabilities=engines.Capabilities())
  assert plain.precision_refusal("int8") == (
      "rollout_quantization=int8 with rollout_engine=toy: its EngineSpec declares no quantized weights "
      "(Capabilities.quantized_weights); use rollout_engine=embedded or rollout_quantization=''"
  )
  assert (
      precision.refusal("toy", "fp4", ())
      == "invalid value for 'rollout_quantization'='fp4': expected one of '', int8, fp8"
  )


def test_a_quantized_vllm_sampler_is_refused_in_one_line():
  """(The first pass's time: `python -m maxtext_rl_plugin.train_rl configs/cpu_tiny.yml head_dim=128
  rollout_engine=vllm rollout_quantization=fp8` ends with this line, exit 2, before the schema's imports.)"""
  with pytest.raises(ConfigError, match=r"^rollout_quantization=fp8 with rollout_engine=vllm: .*rollout_engine=embedded"):
    config_lib.parse(["configs/cpu_tiny.yml", "head_dim=128", "rollout_engine=vllm", "rollout_quantization=fp8"])
  with pytest.raises(ConfigError, match="rollout_quantization"):
    config_lib.parse(["configs/cpu_tiny.yml", "rollout_quantization=fp4"])
