"""rollout/precision.py: the refusals of a sampler precision a route cannot serve, one line each, in the first pass."""

import dataclasses
import types

import pytest

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import engines
from maxtext_rl_plugin.rollout import precision


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_the_embedded_engine_and_vllm_serve_both_formats(q):
  """vLLM serves them on its native route (rollout/vllm_quantized.py); its spec refuses MaxText's decoder route itself."""
  assert engines.spec("embedded").precision_refusal(q) is None
  assert engines.spec("vllm").precision_refusal(q) is None
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


def test_a_quantized_vllm_sampler_on_maxtexts_decoder_is_refused_in_one_line():
  """The native route (the tiny Llama) passes; an MoE model (MaxText's decoder inside vLLM) ends with one line in the
  first pass. (`python -m maxtext_rl_plugin.train_rl configs/cpu_tiny.yml rollout_engine=vllm rollout_quantization=fp8
  model_name=qwen3-30b-a3b` ends with it, exit 2, before the schema's imports.)"""
  config_lib.parse(["configs/cpu_tiny.yml", "head_dim=128", "rollout_engine=vllm", "rollout_quantization=fp8"])
  with pytest.raises(ConfigError, match=r"^rollout_quantization=fp8 on vLLM's MaxTextForCausalLM route: .*embedded"):
    config_lib.parse(
        ["configs/cpu_tiny.yml", "rollout_engine=vllm", "rollout_quantization=fp8", "model_name=qwen3-30b-a3b"]
    )
  with pytest.raises(ConfigError, match="rollout_quantization"):
    config_lib.parse(["configs/cpu_tiny.yml", "rollout_quantization=fp4"])


def test_the_route_decides_on_the_typed_config():
  """The second pass (`check_route`) decides the route exactly: MaxText's decoder refuses a quantized sampler, the
  native classes serve it; `auto` passes vLLM over for the former with the same reason."""
  from maxtext_rl_plugin.rollout import vllm_spec  # pylint: disable=import-outside-toplevel

  assert vllm_spec.route_precision_refusal("llama3.1-8b", False, "int8") is None
  assert vllm_spec.route_precision_refusal("mixtral-8x7b", True, "") is None
  why = vllm_spec.route_precision_refusal("mixtral-8x7b", True, "int8")
  assert why.startswith("rollout_quantization=int8 on vLLM's MaxTextForCausalLM route") and "\n" not in why
  cfg = types.SimpleNamespace(model_name="mixtral-8x7b", vllm_hf_overrides="", rollout_quantization="int8", head_dim=128)
  with pytest.raises(ConfigError, match="^rollout_quantization=int8 on vLLM's MaxTextForCausalLM route"):
    vllm_spec.check_route(cfg)
  assert vllm_spec.auto_passes_over(cfg).startswith("rollout_quantization=int8 on vLLM's MaxTextForCausalLM")
