"""The sampler's own precision (`rollout_quantization`): which engines and models can sample with quantized weights.

Light (no JAX, no config): the first pass asks the named engine's spec (`EngineSpec.precision_refusal`, run by
config/early_checks.check_engine) on the config as written, within a second. The key's name is MaxText's
word for quantized weights (`quantization`, which quantizes the trainer) with the `rollout_` prefix of the sampler's
other keys (`rollout_engine`, `rollout_seed`), and its values are the spellings MaxText's `quantization` and vLLM's
engine argument `quantization` use (`int8`, `fp8`). resharding/quantize.py states the format (per-output-channel
scales, FP8 e4m3fn and int8, Qwix's rounding); rollout/quantized_weights.py how the embedded engine holds and reads it.

What each route serves, and why (the refusals are one line each):

* embedded: `int8` and `fp8` on every model it samples (its decode program reads the quantized kernels back; MoE
  experts are quantized per expert, the router stays in float), LoRA included (adapters merged in float, the merged
  kernels quantized once per adapter change).
* vllm: `int8` and `fp8` on the native route (Llama 3.1, dense Qwen3), LoRA included (adapters merged on the trainer
  side, then quantized). tpu-inference 0.32.0 quantizes a float checkpoint through Qwix PTQ on its native JAX classes
  (`additional_config.quantization.qwix.rules`, which the plugin gives the engine), which replaces each kernel by a Qwix
  `QArray`; the sync writes those leaves (rollout/vllm_quantized.py says why this route, not vLLM's `quantization=fp8`).
  Refused: MaxText's decoder inside vLLM (MaxTextForCausalLM, every MoE family), which has no quantized weight path
  (its `quantization` quantizes inside a float model's forward): rollout/vllm_spec.py's `route_precision_refusal`.
  tests/tpu_contract/test_quantized_sync.py proves the route's logits.
"""

from __future__ import annotations

from typing import Any

KEY = "rollout_quantization"
NONE = ""  # the sampler computes with weight_dtype weights, as MaxText's own `quantization: ''`
CHOICES = (NONE, "int8", "fp8")


def requested(value: Any) -> str:
  """The sampler precision a `rollout_quantization` value asks for ('', 'int8' or 'fp8'; unset and 'none' are '')."""
  return NONE if value in (None, False, "", "none", "None") else str(value)


def refusal(engine: str, value: Any, served: tuple[str, ...], why: str = "") -> str | None:
  """Why the engine registered as `engine` cannot sample the precision `value` asks for (one line), or None.

  `served` are the formats its `EngineSpec` declares (`Capabilities.quantized_weights`, rollout/engines.py) and `why`
  its own reason for the others (`EngineSpec.quantization_refusal`); `EngineSpec.precision_refusal` passes both, so an
  engine registered by a third party is refused by what it declares, not by its name."""
  name = requested(value)
  if name == NONE:
    return None
  if name not in CHOICES:
    return f"invalid value for '{KEY}'={name!r}: expected one of '', int8, fp8"
  if name in served:
    return None
  why = why or "its EngineSpec declares no quantized weights (Capabilities.quantized_weights)"
  return f"{KEY}={name} with rollout_engine={engine}: {why}; use rollout_engine=embedded or {KEY}=''"
