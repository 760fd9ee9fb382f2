"""Refusals the config as written decides, light enough for the first pass (no JAX, no schema, no model build).

Each was a traceback or a refusal after the model build (issue 51): a value outside an enumerated key's choices, an MoE
routing more experts per token than it has, trainer and sampler devices that overlap, a checkpoint I/O budget of 0
GB (found at the first save), a model family the embedded engine cannot decode, router replay where no layer can carry
the forced experts (no MoE, pipeline stages, an engine that does not report routing), a head_dim the vLLM route
refuses. `validation._light_checks` runs them in both passes (on the `RawConfig` of `config_precheck` and on the typed
config), so each is one `error:` line within a second or two.

The schema's enumerated choices (config/schema.py imports JAX and MaxText) are restated here; tests/test_bad_input.py
compares them with the schema's.
"""

from __future__ import annotations

from typing import Any

from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import vllm_maxtext

# The plugin schema's enumerated keys (config/schema.py `Literal[...]` fields) and their choices.
CHOICES: dict[str, tuple[str, ...]] = {
    "rollout_engine": ("auto", "embedded", "vllm"),
    "synthetic_task": ("word_problems", "products"),
    "rl.kl_estimator": ("k1", "k3"),
    "rl.advantage_norm": ("group_std", "batch_std", "none"),
    "rl.advantage_estimator": ("grpo", "rloo", "drgrpo"),
    "rl.agentic_tool_parser": ("qwen",),
    "rl.rollout_is": ("off", "truncate", "mask"),
    "rl.verify_weight_sync": ("off", "first", "every_n"),
    "rl.parity_check": ("off", "first", "every_n"),
}
# What the embedded engine's KV-cached decode cannot run (rollout/decode.MaxTextSampler refuses their caches).
EMBEDDED_ATTENTION_REFUSED = {
    "mla": "multi-head latent attention (DeepSeek, Kimi) keeps an MlaKVCache, whose layout the embedded engine does not "
    "know",
    "compressed": "DeepSeek-V4's compressed attention keeps its own cache, which the embedded engine does not know",
}
EMBEDDED_BLOCKS_REFUSED = {
    "qwen3_next": "the gated-DeltaNet layers keep a recurrent state cache the embedded engine does not run",
    "qwen3_5": "the gated-DeltaNet layers keep a recurrent state cache the embedded engine does not run",
}
# Checkpoint I/O budgets (checkpointing.Storage): a positive number, or null for Orbax's default. The OCDBT data file
# size may also be 0 (TensorStore: no limit), not negative.
_POSITIVE_OR_NULL = ("checkpoint_storage_concurrent_gb", "checkpoint_storage_device_host_concurrent_gb")


def _bad(key: str, value: Any, why: str) -> ConfigError:
  return ConfigError(f"invalid value for '{key}'={value!r}: {why}")


def _get(pc, key: str) -> Any:
  """A dotted key's value (AttributeError when the first pass cannot type it: the check waits for the second)."""
  value = pc
  for part in key.split("."):
    value = getattr(value, part)
  return value


def _experts(pc) -> int:
  """num_experts; 1 (MaxText's base.yml default) where the config as written leaves it to that default."""
  return int(value_or(pc, "num_experts", 1))


def _name(value: Any) -> str:
  """An enum's value (the typed config) or the string itself (the config as written)."""
  return str(getattr(value, "value", value))


def check_choices(pc) -> None:
  """An enumerated key holds one of its choices (pydantic refuses it too, after the schema's imports)."""
  for key, choices in CHOICES.items():
    try:
      value = _get(pc, key)
    except Unresolved:
      continue
    if value is not None and value not in choices:
      raise _bad(key, value, f"expected one of {', '.join(choices)}")


def check_moe(pc) -> None:
  """An MoE layer routes each token to num_experts_per_tok of its num_experts experts."""
  experts, per_tok = _experts(pc), int(value_or(pc, "num_experts_per_tok", 1))
  if experts > 1 and not 1 <= per_tok <= experts:
    raise _bad("num_experts_per_tok", per_tok, f"must be between 1 and num_experts={experts}")


def check_dropless(pc) -> None:
  """An MoE model routes without token dropping (capacity_factor <= 0), so the sampler and the trainer route alike."""
  capacity = value_or(pc, "capacity_factor", -1.0)
  if _experts(pc) > 1 and float(capacity) > 0:
    raise _bad(
        "capacity_factor",
        capacity,
        "token dropping depends on how many tokens share a forward (one per decode step in the rollout, the whole "
        "sequence in the trainer), so the sampled and the trained policy would differ; use dropless routing "
        "(capacity_factor=-1)",
    )


def check_device_fractions(pc) -> None:
  """The trainer takes the first `trainer_devices_fraction` of the devices and the sampler the last
  `sampler_devices_fraction` (models.setup_devices, as MaxText's): fractions that add up to more than 1 give some devices
  to both, which is neither the colocated run (both 1.0: every device is both) nor a disaggregated one."""
  t, s = float(pc.trainer_devices_fraction), float(pc.sampler_devices_fraction)
  if t + s > 1.0 and not t == s == 1.0:
    raise _bad(
        "trainer_devices_fraction",
        t,
        f"with sampler_devices_fraction={s} the trainer's first {t:g} and the sampler's last {s:g} of the devices "
        "overlap; make them add up to at most 1 (disaggregated), or set both to 1.0 (colocated)",
    )


def check_checkpoint_storage(pc) -> None:
  """Orbax's I/O budgets are positive (0 or less fails at the first save, after the step it was to keep)."""
  for key in _POSITIVE_OR_NULL:
    value = value_or(pc, key, None)  # the config as written may leave one to MaxText's default (positive)
    if value is not None and value <= 0:
      raise _bad(key, value, "must be > 0 (or null: Orbax's default)")
  size = value_or(pc, "checkpoint_storage_target_data_file_size_bytes", None)
  if size is not None and size < 0:
    raise _bad("checkpoint_storage_target_data_file_size_bytes", size, "must be >= 0 (0: no limit)")


def check_embedded_model(pc) -> None:
  """rollout_engine=embedded needs a model whose decode cache the engine knows (docs/models.md: "refused")."""
  if pc.rollout_engine != "embedded":
    return
  attention, block = _name(pc.attention_type), _name(pc.decoder_block)
  why = EMBEDDED_ATTENTION_REFUSED.get(attention) or EMBEDDED_BLOCKS_REFUSED.get(block)
  if why:
    raise ConfigError(
        f"rollout_engine=embedded cannot sample {pc.model_name} (decoder_block={block}, attention_type={attention}): "
        f"{why}; use rollout_engine=vllm on a TPU (docs/models.md)"
    )


def router_replay_refusal(pc) -> str | None:
  """Why `rl.router_replay=true` cannot run with this config (one line), or None (check_router_replay raises it)."""
  if not pc.rl.router_replay:
    return None
  if _experts(pc) <= 1:
    return f"rl.router_replay=true needs a mixture-of-experts model; {pc.model_name} has num_experts=1"
  # Every MoE family replays (moe.py forces the routing itself where MaxText's decoder does not); pipeline stages
  # slice the layers their own way and cannot carry each layer's forced experts.
  if int(pc.ici_pipeline_parallelism) > 1 or int(pc.dcn_pipeline_parallelism) > 1:
    return (
        "rl.router_replay=true with pipeline parallelism: the pipeline's stages run the layers with their own "
        "slicing, which cannot carry each layer's forced experts (MaxText refuses it too)"
    )
  if pc.rollout_engine == "vllm":
    why = vllm_capture_refusal(pc, "rl.router_replay=true")
    if why:
      return why
  elif pc.rollout_engine != "embedded":
    return (
        f"rl.router_replay=true needs rollout_engine=embedded or vllm: the {pc.rollout_engine} engine is chosen at "
        "launch, and replay needs an engine that reports the experts it routed each token to"
    )
  if pc.rl.use_agentic_rollout:
    return (
        "rl.router_replay=true with rl.use_agentic_rollout=true: multi-turn episodes re-prefill their transcripts, "
        "and their routing is not recorded yet"
    )
  if int(value_or(pc, "mtp_num_layers", 0) or 0) > 0:
    return "rl.router_replay=true with mtp_num_layers > 0: MaxText cannot replay routing with MTP"
  return None


def vllm_capture_refusal(pc, what: str) -> str | None:
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


def check_router_replay(pc) -> None:
  why = router_replay_refusal(pc)
  if why:
    raise ConfigError(why)


def check_return_routed_experts(pc) -> None:
  """MaxText's `return_routed_experts` (record each MoE layer's routing from inference): an MoE model, and on vLLM a
  model whose recorded experts are the ones it used. The embedded engine records every MoE model's routing anyway."""
  if not bool(value_or(pc, "return_routed_experts", False)):
    return
  if _experts(pc) <= 1:
    raise _bad("return_routed_experts", True, f"{pc.model_name} has num_experts=1: a dense model routes nothing")
  if pc.rollout_engine == "vllm":
    why = vllm_capture_refusal(pc, "return_routed_experts=true")
    if why:
      raise ConfigError(why)


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


# Qwen3 variants the native route does not map (rollout/vllm_mapping._UNSUPPORTED_QWEN3 less the MoE ones): their vLLM
# route is MaxText's own decoder, which computes with the model's head_dim.
_ADAPTER_QWEN3 = ("qwen3-next", "qwen3-vl", "qwen3-omni", "qwen3-coder")


def check_vllm_head_dim(pc) -> None:
  """The native vLLM route's head_dim rule, for the dense Qwen3 models it runs (the MoE ones, the variants it does not
  map and a config naming MaxTextForCausalLM take MaxText's own attention, which computes with the model's head_dim);
  rollout/vllm_config.check_config decides the route itself in the second pass."""
  if pc.rollout_engine != "vllm" or _experts(pc) > 1:
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
    raise _bad("head_dim", pc.head_dim, reason)


CHECKS = (
    check_choices,
    check_moe,
    check_dropless,
    check_device_fractions,
    check_checkpoint_storage,
    check_embedded_model,
    check_router_replay,
    check_return_routed_experts,
    check_vllm_head_dim,
)
