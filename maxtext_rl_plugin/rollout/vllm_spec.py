"""The vLLM-TPU engine's declaration (`rollout_engine=vllm`): its capabilities and the configs it refuses.

Light (no JAX, no vLLM): the `maxtext_rl_plugin.rollout_engines` entry point `vllm` names `ENGINE`, which the first
pass reads before JAX is imported (rollout/engines.py says why). The checks that need the route's heavier modules
(`vllm_config.check_config`: the native mapping tables, MaxText's adapter config) run in the second pass
(`typed_checks`). The engine itself is rollout/vllm.py.
"""

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
  rollout/vllm_config.check_config decides the route itself in the second pass."""
  if int(value_or(pc, "num_experts", 1)) > 1:
    return
  try:
    if vllm_maxtext.selected(pc):
      return
  except Unresolved:  # the config as written: unset (no adapter named) or set in a form only the schema types
    if "vllm_hf_overrides" in pc:
      return
  if str(pc.model_name).startswith(_ADAPTER_QWEN3):
    return
  reason = qwen3_head_dim_reason(pc.model_name, pc.head_dim)
  if reason:
    raise ConfigError(f"invalid value for 'head_dim'={pc.head_dim!r}: {reason}")


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
        per_host=True,  # one engine per host in a multi-controller run without Pathways
        multi_turn=True,
        row_keys=False,  # vLLM seeds its own sampler
        snapshots=False,  # holds its own copy of the weights; a colocated run cannot pin a version
        sample_dtype_key="weight_dtype",  # vllm_config passes weight_dtype as vLLM's dtype
        weight_sync="own",  # maps to vLLM's layout and writes inside tpu-inference's weight-update session
    ),
    checks=(check_head_dim, precision.check),  # quantized_weights=(): rollout/precision.py says why
    typed_checks=("maxtext_rl_plugin.rollout.vllm_config:check_config",),
    routing_refusal=routing_refusal,
    summary="vLLM-TPU (needs the [tpu] extra)",
)
