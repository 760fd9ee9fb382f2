"""The sampler's own precision (`rollout_quantization`): which engines and models can sample with quantized weights.

Light (no JAX): the first pass runs `check` on the config as written, within a second. The key's name is MaxText's
word for quantized weights (`quantization`, which quantizes the trainer) with the `rollout_` prefix of the sampler's
other keys (`rollout_engine`, `rollout_seed`), and its values are the spellings MaxText's `quantization` and vLLM's
engine argument `quantization` use (`int8`, `fp8`). resharding/quantize.py states the format (per-output-channel
scales, FP8 e4m3fn and int8, Qwix's rounding); rollout/quantized_weights.py how the embedded engine holds and reads it.

What each route serves, and why (the refusals are one line each):

* embedded: `int8` and `fp8` on every model it samples (its decode program reads the quantized kernels back; MoE
  experts are quantized per expert, the router stays in float), LoRA included (adapters merged in float, the merged
  kernels quantized once per adapter change).
* vllm: refused at this pin. tpu-inference 0.32.0 quantizes a float checkpoint only through Qwix PTQ on its native JAX
  classes (`additional_config.quantization.qwix.rules`), which replaces each kernel by a Qwix `QArray` in the engine's
  state; the plugin's vLLM sync (rollout/vllm_sync.py) writes float kernels and its mapping tables name no QArray
  leaves, and MaxText's decoder inside vLLM (MaxTextForCausalLM) has no quantized weight path (its `quantization` is
  AQT in the forward). tests/tpu_contract/test_quantized_layers.py holds what is proven at the pin: the bytes and
  scales a quantized sync would send equal Qwix's own quantization of the same weights, and tpu-inference's FP8 linear
  computes with them as the embedded engine's dequantize-on-read does.
"""

from __future__ import annotations

from typing import Any

from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import engines

KEY = "rollout_quantization"
NONE = ""  # the sampler computes with weight_dtype weights, as MaxText's own `quantization: ''`
CHOICES = (NONE, "int8", "fp8")
_WHY = {
    "vllm": "tpu-inference 0.32.0 quantizes a float checkpoint only through Qwix PTQ on its native classes, whose QArray "
    "kernels the plugin's vLLM sync does not write yet (rollout/precision.py)",
}


def requested(config: Any) -> str:
  """The config's sampler precision ('', 'int8' or 'fp8')."""
  value = value_or(config, KEY, NONE)
  return NONE if value in (None, False, "", "none", "None") else str(value)


def refusal(config: Any, engine: str) -> str | None:
  """Why `engine` cannot sample this config's quantized weights (one line), or None: the formats its `EngineSpec`
  declares (`Capabilities.quantized_weights`, rollout/engines.py) are the ones it serves."""
  name = requested(config)
  if name == NONE or engine == engines.AUTO:
    return None
  if name not in CHOICES:
    return f"invalid value for '{KEY}'={name!r}: expected one of '', int8, fp8"
  if name in engines.spec(engine).capabilities.quantized_weights:
    return None
  why = _WHY.get(engine, "its EngineSpec declares no quantized weights (Capabilities.quantized_weights)")
  return f"{KEY}={name} with rollout_engine={engine}: {why}; use rollout_engine=embedded or {KEY}=''"


def check(config: Any) -> None:
  """The first pass's refusal (config as written) of a precision the named engine cannot serve."""
  engine = str(value_or(config, "rollout_engine", "auto"))
  reason = refusal(config, engine)
  if reason:
    raise ConfigError(reason)
