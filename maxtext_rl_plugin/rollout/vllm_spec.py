"""The vLLM-TPU engine's declaration (`rollout_engine=vllm`): its capabilities and the configs it refuses.

Light (no JAX, no vLLM): the `maxtext_rl_plugin.rollout_engines` entry point `vllm` names `ENGINE`, which the first
pass reads before JAX is imported (rollout/engines.py says why). The checks that need the route's heavier modules
(`check_route`: the native mapping tables, MaxText's adapter config) run in the second pass (`typed_checks`). The
engine itself is rollout/vllm.py; it takes `vllm_config.VllmSettings`, read from the config where the run is built.
"""

# The second pass's checks and the run's binding import rollout/vllm_config inside the function: the first pass imports
# this module before JAX (rollout/engines.py), and vllm_config needs the native mapping tables (rollout/vllm_mapping.py:
# MaxText's checkpoint-conversion tables, JAX).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

from typing import Any

from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import engines
from maxtext_rl_plugin.rollout import precision
from maxtext_rl_plugin.rollout import vllm_maxtext

# Qwen3 variants the native route does not map (rollout/vllm_mapping._UNSUPPORTED_QWEN3 less the MoE ones): their vLLM
# route is MaxText's own decoder, which computes with the model's head_dim.
_ADAPTER_QWEN3 = ("qwen3-next", "qwen3-vl", "qwen3-omni", "qwen3-coder")
# The families the native route maps (rollout/vllm_mapping.SUPPORTED_FAMILIES; that module needs MaxText's tables) and
# its Qwen3 MoE names (vllm_mapping._UNSUPPORTED_QWEN3): what the first pass can tell of the route without them.
_NATIVE_FAMILIES = ("qwen3-", "llama3.1-")
_MOE_QWEN3 = ("qwen3-30b", "qwen3-235b")


def qwen3_head_dim_reason(model_name: str, head_dim: int) -> str | None:
  """Why vLLM-TPU would sample a different function than the trainer's Qwen3, or None.

  tpu-inference 0.32.0 pads head_dim to a multiple of 128 (64 excepted) and Qwen3's q/k RMS norm then averages over
  the padded width (tests/tpu_contract/test_forward.py shows the divergence). Every released Qwen3 has head_dim 128;
  only shrunk test models hit this, so it is refused rather than approximated by rescaling the norm weights.
  """
  if str(model_name).startswith("qwen3-") and int(head_dim) % 128 and int(head_dim) != 64:
    return (
        f"rollout_engine=vllm with {model_name} needs head_dim 64 or a multiple of 128: tpu-inference pads it to "
        f"{-(-int(head_dim) // 128) * 128} and normalises Qwen3's q/k over the padded width (use rollout_engine=embedded)"
    )
  return None


def check_head_dim(pc: Any) -> None:
  """The native route's head_dim rule, for the dense Qwen3 models it runs (the MoE ones, the variants it does not map
  and a config naming MaxTextForCausalLM take MaxText's own attention, which computes with the model's head_dim);
  `check_route` decides the route itself in the second pass."""
  if int(value_or(pc, "num_experts", 1)) > 1:
    return
  try:
    if vllm_maxtext.selected(pc.vllm_hf_overrides):
      return
  except Unresolved:  # the config as written: unset (no adapter named) or set in a form only the schema types
    if "vllm_hf_overrides" in pc:
      return
  if str(pc.model_name).startswith(_ADAPTER_QWEN3):
    return
  reason = qwen3_head_dim_reason(pc.model_name, pc.head_dim)
  if reason:
    raise ConfigError(f"invalid value for 'head_dim'={pc.head_dim!r}: {reason}")


def _quantized_adapter(name: str) -> str:
  return (
      f"rollout_quantization={name} on vLLM's MaxTextForCausalLM route: MaxText's decoder inside vLLM has no quantized "
      "weight path (its `quantization` quantizes inside a float model's forward)"
  )


def route_precision_refusal(model_name: str, adapter: bool, value: Any) -> str | None:
  """Why vLLM cannot sample the precision `value` (`rollout_quantization`) on this route (one line), or None.

  The native route (Llama 3.1, dense Qwen3) serves int8 and fp8: tpu-inference quantizes the engine with Qwix PTQ and
  the sync writes its QArray kernels (rollout/vllm_quantized.py; tests/tpu_contract/test_quantized_sync.py proves the
  logits), LoRA included (merged on the trainer side, then quantized). Every other family takes MaxText's decoder
  inside vLLM, which has no quantized weight path: refused rather than sampled in float."""
  name = precision.requested(value)
  if not name or not adapter:
    return None
  return (
      f"{_quantized_adapter(name)}, and {model_name} takes it (tpu-inference's native Llama 3.1 and dense Qwen3 "
      f"classes serve it); use rollout_engine=embedded or rollout_quantization=''"
  )


def check_quantization(pc: Any) -> None:
  """The first pass's refusal of a quantized sampler on MaxText's decoder inside vLLM, where the config as written
  already says the route: an MoE model, a family the native classes do not run, `vllm_hf_overrides` naming
  MaxTextForCausalLM (an unresolved value is left to `check_route`, which decides the route)."""
  try:
    named = vllm_maxtext.selected(pc.vllm_hf_overrides)
  except Unresolved:
    named = False
  model = str(pc.model_name)
  adapter = (
      named
      or int(value_or(pc, "num_experts", 1)) > 1
      or not model.startswith(_NATIVE_FAMILIES)
      or model.startswith(_ADAPTER_QWEN3 + _MOE_QWEN3)
  )
  reason = route_precision_refusal(model, adapter, value_or(pc, "rollout_quantization", ""))
  if reason:
    raise ConfigError(reason)


def check_route(config: Any) -> None:
  """The second pass's checks of the route a typed config takes (print_config and training run them), one ConfigError
  line each: on MaxText's decoder inside vLLM, `prefuse_moe_weights` and the adapter's `maxtext_config`; on a native
  class, the head_dim rule (tpu-inference pads head_dim, Qwen3's q/k norm then differs; MaxText's own attention inside
  vLLM computes with the model's head_dim)."""
  from maxtext_rl_plugin.rollout import vllm_config

  adapter, _ = vllm_config.choose_route(config.model_name, config.vllm_hf_overrides)
  reason = route_precision_refusal(config.model_name, adapter, config.rollout_quantization)
  if reason:
    raise ConfigError(reason)
  if not adapter:
    reason = qwen3_head_dim_reason(config.model_name, config.head_dim)
    if reason:
      raise ConfigError(f"invalid value for 'head_dim'={config.head_dim}: {reason}")
    return
  if config.prefuse_moe_weights and int(config.num_experts) > 1:
    raise ConfigError(
        "invalid value for 'prefuse_moe_weights'=True with vLLM's MaxTextForCausalLM route: the trainer's fused wi is "
        "[all gate | all up] while the engine's is laid out per tensor-parallel shard (and padded), and MaxText's "
        "converter copies a fused source as is; leave it false (the sync fuses per shard from wi_0/wi_1)"
    )
  vllm_maxtext.AdapterSettings.from_config(config)  # a malformed or foreign maxtext_config is one line


def bind(config: Any, mesh: Any) -> dict:
  """The keyword arguments the run builds the engine with besides Tunix's four: its settings, read from the sampler's
  config once (`vllm_config.VllmSettings.from_config`; a malformed vLLM mapping key is one ConfigError line)."""
  del mesh  # the engine reads its devices off the mesh Tunix hands it
  from maxtext_rl_plugin.rollout import vllm_config

  return {"settings": vllm_config.VllmSettings.from_config(config)}


def auto_passes_over(config: Any) -> str | None:
  """Why `rollout_engine=auto` passes vLLM over for a typed config (one clause), or None: the native route's head_dim
  rule (it would sample another function than the trainer's), a quantized sampler on MaxText's decoder inside vLLM
  (`route_precision_refusal`), or a route tests/tpu_contract does not prove by logits
  (`rollout_engine=vllm` runs it anyway, saying so)."""
  from maxtext_rl_plugin.rollout import vllm_config

  adapter, _ = vllm_config.choose_route(config.model_name, config.vllm_hf_overrides)
  head_dim = None if adapter else qwen3_head_dim_reason(config.model_name, config.head_dim)
  name = precision.requested(config.rollout_quantization)
  quantized = _quantized_adapter(name) if name and adapter else None
  return head_dim or quantized or vllm_config.unproven_reason(config.model_name, adapter)


def routing_refusal(pc: Any, what: str) -> str | None:
  """Why vLLM cannot report this MoE model's routing (one line), or None (rollout/vllm_routing.py captures it).

  Every MoE family takes MaxText's decoder inside vLLM (the native classes map no MoE model at this pin), whose fused-MoE
  path records the top-k of the router's logits. DeepSeek-V3/V4 and Kimi-K2 select experts otherwise (MaxText's
  `deepseek_routing`: group-limited, bias-corrected scores), so what vLLM would report is not the routing it used.
  """
  name = str(pc.model_name)
  if name.startswith(("deepseek3", "deepseek4", "kimi-k2")):
    return (
        f"{what} with rollout_engine=vllm and {name}: MaxText's vLLM path records the top-k of the router logits, "
        "but this model selects experts by group-limited, bias-corrected routing, so the recorded experts are not the "
        "ones it used"
    )
  if bool(value_or(pc, "use_random_routing", False)):
    return f"{what} with use_random_routing=true: the routing is random, there is nothing to record or replay"
  return None


ENGINE = engines.EngineSpec(
    name="vllm",
    engine="maxtext_rl_plugin.rollout.vllm:VllmRollout",
    capabilities=engines.Capabilities(
        routing_capture=True,  # the MaxTextForCausalLM route (rollout/vllm_routing.py); `routing_refusal` says when not
        lora=True,  # adapters merged into their kernels on the trainer side
        per_host="process",  # one engine per JAX process in a multi-controller run (Pathways: one controller, one engine)
        multi_turn=True,
        row_keys=False,  # vLLM seeds its own sampler
        snapshots=False,  # holds its own copy of the weights; a colocated run cannot pin a version
        sample_dtype_key="weight_dtype",  # vllm_config passes weight_dtype as vLLM's dtype
        weight_sync="own",  # maps to vLLM's layout and writes inside tpu-inference's weight-update session
        # the native route: Qwix PTQ in the engine, QArray kernels in the sync (rollout/vllm_quantized.py);
        # `route_precision_refusal` (first pass: `check_quantization`) refuses MaxText's decoder inside vLLM
        quantized_weights=("int8", "fp8"),
    ),
    checks=(check_head_dim, check_quantization),
    typed_checks=("maxtext_rl_plugin.rollout.vllm_spec:check_route",),
    bind="maxtext_rl_plugin.rollout.vllm_spec:bind",  # VllmSettings, read from the sampler's config
    routing_refusal=routing_refusal,
    summary="vLLM-TPU (needs the [tpu] extra)",
    # `auto` prefers it on a TPU (and Pathways) where vLLM is installed, unless the config's route is unproven or
    # would sample another function (`auto_passes_over`); the embedded engine otherwise.
    auto=engines.AutoChoice(
        rank=1, backends=("tpu",), needs="vllm", passes_over="maxtext_rl_plugin.rollout.vllm_spec:auto_passes_over"
    ),
    aot_programs="maxtext_rl_plugin.aot.run:vllm_rollout",
)
