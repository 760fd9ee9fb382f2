"""The embedded engine's declaration (`rollout_engine=embedded`): its capabilities and the models it refuses.

Light (no JAX): the `maxtext_rl_plugin.rollout_engines` entry point `embedded` names `ENGINE`, which the first pass
reads before JAX is imported (rollout/engines.py says why). The engine itself is rollout/embedded.py.
"""

from __future__ import annotations

from typing import Any

from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import engines
from maxtext_rl_plugin.rollout import precision

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
        per_host=True,  # on a per-host sampler mesh (distributed.split_local_devices), with `prompt_offset`
        multi_turn=True,
        row_keys=True,
        snapshots=True,
        sample_dtype_key="dtype",  # MaxText's own decode: the trainer's compute dtype
        quantized_weights=("int8", "fp8"),  # read back in its decode program (rollout/quantized_weights.py)
        weight_sync="engine",
    ),
    checks=(check_model, precision.check),
    summary="the plugin's JAX KV-cache engine on MaxText's model code (CPU/GPU/TPU)",
)
