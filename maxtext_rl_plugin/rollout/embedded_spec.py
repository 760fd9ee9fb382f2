"""The embedded engine's declaration (`rollout_engine=embedded`): its capabilities, the models it refuses, and what it
reads of the sampler's config (`EmbeddedSettings`).

Light (no JAX at import): the `maxtext_rl_plugin.rollout_engines` entry point `embedded` names `ENGINE`, which the
first pass reads before JAX is imported (rollout/engines.py says why). The engine itself is rollout/embedded.py; it
takes `EmbeddedSettings` and MaxText's abstract decode models, which the spec's `bind` (run/engine.py: MaxText's model
creation takes the config whole) makes where the run is built. This module is where the embedded engine reads the
config (rollout/engines.py says why); the engine, its decode program and their helpers never see it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import engines

# What the embedded engine's KV-cached decode cannot run (rollout/decode.MaxTextSampler refuses their caches).
ATTENTION_REFUSED = {
    "mla": "multi-head latent attention (DeepSeek, Kimi) keeps an MlaKVCache, whose layout the embedded engine does not "
    "know",
    "compressed": "DeepSeek-V4's compressed attention keeps its own cache, which the embedded engine does not know",
}
BLOCKS_REFUSED = {
    "qwen3_next": "the gated-DeltaNet layers keep a recurrent state cache the embedded engine does not run",
    "qwen3_5": "the gated-DeltaNet layers keep a recurrent state cache the embedded engine does not run",
}


def _name(value: Any) -> str:
  """An enum's value (the typed config) or the string itself (the config as written)."""
  return str(getattr(value, "value", value))


def check_model(pc: Any) -> None:
  """The embedded engine needs a model whose decode cache it knows (docs/models.md: "refused")."""
  attention, block = _name(pc.attention_type), _name(pc.decoder_block)
  why = ATTENTION_REFUSED.get(attention) or BLOCKS_REFUSED.get(block)
  if why:
    raise ConfigError(
        f"rollout_engine=embedded cannot sample {pc.model_name} (decoder_block={block}, attention_type={attention}): "
        f"{why}; use rollout_engine=vllm on a TPU (docs/models.md)"
    )


ENGINE = engines.EngineSpec(
    name="embedded",
    engine="maxtext_rl_plugin.rollout.embedded:EmbeddedRollout",
    capabilities=engines.Capabilities(
        routing_capture=True,  # records every MoE layer's routing in its decode program (moe.py)
        lora=True,  # samples with the adapters merged (lora.Merger)
        per_host="split",  # on a per-host sampler mesh (distributed.split_local_devices), with `prompt_offset`
        multi_turn=True,
        row_keys=True,
        snapshots=True,
        sample_dtype_key="dtype",  # MaxText's own decode: the trainer's compute dtype
        quantized_weights=("int8", "fp8"),  # read back in its decode program (rollout/quantized_weights.py)
        weight_sync="engine",
    ),
    checks=(check_model,),
    summary="the plugin's JAX KV-cache engine on MaxText's model code (CPU/GPU/TPU)",
    bind="maxtext_rl_plugin.run.engine:embedded_arguments",
    auto=engines.AutoChoice(rank=0, backends=("cpu", "gpu", "tpu")),  # what `auto` takes where nothing ranks higher
    aot_programs="maxtext_rl_plugin.aot.run:embedded_rollout",
)


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """What the decode program (rollout/decode.MaxTextSampler) reads of the sampler's config besides MaxText's model."""

  model_name: str
  weight_dtype: Any  # MaxText's dtype: what quantized kernels are read back as
  dtype: Any  # MaxText's compute dtype (the tied head's, unless logits_dot_in_fp32)
  logical_axis_rules: tuple[tuple[str, Any], ...]
  decoder_block: str
  sliding_window_size: int
  max_target_length: int
  # MaxText's output head for tied embeddings (rollout/head.TiedHead)
  logits_via_embedding: bool = False
  logits_dot_in_fp32: bool = False
  normalize_embedding_logits: bool = False
  final_logits_soft_cap: float | None = None
  cast_logits_to_fp32: bool = False

  @classmethod
  def from_config(cls, cfg: Any) -> "DecodeSettings":
    return cls(
        model_name=str(cfg.model_name),
        weight_dtype=cfg.weight_dtype,
        dtype=cfg.dtype,
        logical_axis_rules=tuple((k, v) for k, v in cfg.logical_axis_rules),
        decoder_block=_name(cfg.decoder_block),
        sliding_window_size=int(getattr(cfg, "sliding_window_size", 0) or 0),
        max_target_length=int(cfg.max_target_length),
        logits_via_embedding=bool(cfg.logits_via_embedding),
        logits_dot_in_fp32=bool(cfg.logits_dot_in_fp32),
        normalize_embedding_logits=bool(cfg.normalize_embedding_logits),
        final_logits_soft_cap=cfg.final_logits_soft_cap or None,
        cast_logits_to_fp32=bool(cfg.cast_logits_to_fp32),
    )


@dataclasses.dataclass(frozen=True)
class EmbeddedSettings:
  """What the embedded engine (rollout/embedded.py) reads of the sampler's config, read once (`from_config`).

  The defaults of a config without the plugin's keys (MaxText's own, e.g. an actor's) are the plugin's documented ones
  (config/schema.py)."""

  decode: DecodeSettings
  stop_token_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
  batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  temperature: float = 1.0  # decode_sampling_*: generate_tokens' defaults
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 0  # max_target_length - max_prefill_predict_length
  vocab_size: int = 0
  record_routing: bool = False  # an MoE model (num_experts > 1): every call records its routing
  lora_scale: float | None = None  # alpha / rank of the `lora:` block, for merging a LoRA actor's adapters
  param_scan_axis: int = 1
  scan_layers: bool = True
  quantization: str = ""  # rollout_quantization: the weight format it samples in ('' = the float weights)

  @classmethod
  def from_config(cls, cfg: Any) -> "EmbeddedSettings":
    lora = getattr(cfg, "lora", None)
    rank = float(getattr(lora, "lora_rank", 0) or 0)
    quantization = str(getattr(cfg, "rollout_quantization", "") or "")
    return cls(
        decode=DecodeSettings.from_config(cfg),
        stop_token_ids=tuple(int(t) for t in (getattr(cfg, "stop_token_ids", None) or [])),
        stop_strings=tuple(s for s in (getattr(cfg, "stop_strings", None) or []) if s),
        prefill_buckets=tuple(getattr(cfg, "rollout_prefill_buckets", None) or cls.prefill_buckets),
        batch_buckets=tuple(getattr(cfg, "rollout_batch_buckets", None) or cls.batch_buckets),
        temperature=getattr(cfg, "decode_sampling_temperature", 1.0),
        top_k=getattr(cfg, "decode_sampling_top_k", 0),
        top_p=getattr(cfg, "decode_sampling_nucleus_p", 1.0),
        max_new_tokens=int(cfg.max_target_length) - int(cfg.max_prefill_predict_length),
        vocab_size=int(cfg.vocab_size),
        record_routing=int(cfg.num_experts) > 1,
        lora_scale=float(lora.lora_alpha) / rank if rank else None,
        param_scan_axis=int(getattr(cfg, "param_scan_axis", 1)),
        scan_layers=bool(getattr(cfg, "scan_layers", True)),
        quantization="" if quantization == "none" else quantization,
    )
