"""vLLM's second route: MaxText's own decoder inside vLLM (`MaxTextForCausalLM`, MaxText 0.2.5's vLLM adapter).

MaxText's `train_rl` selects it with `vllm_hf_overrides='{"architectures":["MaxTextForCausalLM"]}'`; the plugin reads
the key with the same meaning (`selected`). vLLM then builds `maxtext.integration.vllm.maxtext_vllm_adapter`'s
`MaxTextForCausalLM`, which runs MaxText's decoder with tpu-inference's paged attention and fused-MoE kernels, so every
decoder MaxText has (dense, MoE, Gemma's local/global pattern) can sample, not only the families tpu-inference has a
native JAX class for (rollout/vllm_mapping.py). What the route needs from the plugin:

* registration: the adapter is registered with tpu-inference here (`register_adapter`, MaxText's `register()`), not
  through a separately installed `vllm.general_plugins` entry point;
* the adapter's own MaxText config: `vllm_additional_config`'s `maxtext_config` (MaxText's meaning: pyconfig overrides
  over MaxText's `configs/inference/vllm.yml`). Given, it is passed on with `model_name` checked against the trainer's;
  absent, the plugin derives it from the trainer's config (model name, the shrunk shapes of an
  `override_model_config` model, dtypes), once (`AdapterSettings.from_config`). `prefuse_moe_weights` is set for MoE
  models at TP > 1, as MaxText's own `prepare_direct_sync_additional_config` does (the fused-MoE kernel splits `wi` per
  shard);
* the weight sync: the trainer's tree in the adapter's layout (resharding/maxtext_layout.py: MaxText's
  `MaxTextToMaxTextConverter`), moved by the plugin's resharding and written into the engine's state.

No private name of MaxText or tpu-inference is used here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Mapping

from absl import logging

from maxtext_rl_plugin.errors import ConfigError

ARCHITECTURE = "MaxTextForCausalLM"

# The trainer's architecture keys a shrunk (`override_model_config`) model needs in the adapter's config, read from
# the resolved trainer config. The adapter raises base_num_kv_heads / padded_base_moe_mlp_dim itself for TP.
_SHAPE_KEYS = (
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "base_mlp_dim",
    "base_moe_mlp_dim",
    "base_num_decoder_layers",
    "head_dim",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "sparse_matmul",
    "capacity_factor",
    "megablox",
)


def as_dict(value: Any, key: str) -> dict:
  """A mapping key (`vllm_hf_overrides`, `vllm_additional_config`) given as a mapping or a JSON object string (both
  spellings reach pyconfig); anything else is one line naming the key."""
  if not value:
    return {}
  if isinstance(value, Mapping):
    return dict(value)
  if isinstance(value, str):
    try:
      parsed = json.loads(value)
    except json.JSONDecodeError:
      parsed = None
    if isinstance(parsed, dict):
      return parsed
  raise ConfigError(f"invalid value for '{key}'={value!r}: expected a mapping or a JSON object")


def selected(hf_overrides: Any) -> bool:
  """MaxText's rule (`maxtext_vllm_rollout.uses_maxtext_vllm_adapter`): `vllm_hf_overrides` names the adapter."""
  if isinstance(hf_overrides, str):
    return ARCHITECTURE in hf_overrides
  architectures = as_dict(hf_overrides, "vllm_hf_overrides").get("architectures", ())
  if isinstance(architectures, str):
    architectures = (architectures,)
  return ARCHITECTURE in architectures


def register_adapter() -> None:
  """Register MaxTextForCausalLM with tpu-inference (MaxText's `register()`); one line when the adapter is absent."""
  try:
    # Here, not at the top: the adapter imports tpu_inference and vllm (the `tpu` extra, TPU images only).
    from maxtext.integration.vllm import maxtext_vllm_adapter  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError(
        f"rollout_engine=vllm runs this model through {ARCHITECTURE}, but MaxText's vLLM adapter "
        f"(maxtext.integration.vllm.maxtext_vllm_adapter) cannot be imported: {e}"
    ) from None
  maxtext_vllm_adapter.register()


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
  """What the route needs from the trainer's config, read once (`from_config`).

  `maxtext_config`: the adapter's `maxtext_config` overrides before the tensor-parallel-dependent
  `prefuse_moe_weights` (`adapter_maxtext_config` adds it), never mutated; `source`: 'given' (the user's
  `vllm_additional_config.maxtext_config`, its model_name checked against the trainer's) or 'derived' (from the trainer's
  config). `shrunk_moe`: (moe_mlp_dim, num_experts) of an `override_model_config` MoE model, the HF fields the adapter
  pads the MoE width from; None otherwise.
  """

  model_name: str
  maxtext_config: Mapping[str, Any]
  source: str
  num_experts: int
  shrunk_moe: tuple[int, int] | None = None

  @classmethod
  def from_config(cls, config: Any) -> "AdapterSettings":
    """The route's settings of a typed config; a malformed `vllm_additional_config.maxtext_config` is one line."""
    given = as_dict(config.vllm_additional_config, "vllm_additional_config").get("maxtext_config")
    if given is not None and not isinstance(given, Mapping):
      raise ConfigError(
          f"invalid value for 'vllm_additional_config': maxtext_config must be a mapping, got {type(given).__name__}"
      )
    if given:
      overrides = copy.deepcopy(dict(given))
      source = "given"
      name = overrides.setdefault("model_name", config.model_name)
      if name != config.model_name:
        raise ConfigError(
            f"invalid value for 'vllm_additional_config': maxtext_config.model_name={name!r} is not the trainer's "
            f"model_name={config.model_name!r} (the sampler must run the model being trained)"
        )
    else:
      source = "derived"
      overrides = {
          "model_name": config.model_name,
          "weight_dtype": _dtype_name(config.weight_dtype),
          "dtype": _dtype_name(config.dtype),
      }
      if config.override_model_config:
        overrides["override_model_config"] = True
        overrides.update({k: getattr(config, k) for k in _SHAPE_KEYS if getattr(config, k) is not None})
    experts = int(config.num_experts)
    shrunk = (int(config.moe_mlp_dim), experts) if config.override_model_config and experts > 1 else None
    return cls(str(config.model_name), overrides, source, experts, shrunk)


def adapter_maxtext_config(adapter: AdapterSettings, tensor_parallel_size: int) -> tuple[dict, str]:
  """The adapter's `maxtext_config` overrides for an engine of `tensor_parallel_size`, and where they came from."""
  overrides = copy.deepcopy(dict(adapter.maxtext_config))
  if adapter.num_experts > 1 and int(tensor_parallel_size) > 1:
    overrides["prefuse_moe_weights"] = True  # as MaxText's prepare_direct_sync_additional_config
  return overrides, adapter.source


def _dtype_name(dtype: Any) -> str:
  return getattr(dtype, "name", None) or getattr(getattr(dtype, "dtype", None), "name", None) or str(dtype)


def engine_kwargs(kwargs: dict, adapter: AdapterSettings) -> tuple[dict, str]:
  """`vllm.LLM` kwargs of the native route turned into the adapter route's (hf_overrides, additional_config), and
  where the adapter's `maxtext_config` came from."""
  out = dict(kwargs)
  hf = dict(out.get("hf_overrides") or {})
  hf["architectures"] = [ARCHITECTURE]
  if adapter.shrunk_moe is not None:
    hf["moe_intermediate_size"], hf["num_experts"] = adapter.shrunk_moe  # the adapter pads the MoE width from these
  out["hf_overrides"] = hf
  maxtext_config, source = adapter_maxtext_config(adapter, int(out["tensor_parallel_size"]))
  additional = copy.deepcopy(dict(out.get("additional_config") or {}))
  additional["maxtext_config"] = maxtext_config
  out["additional_config"] = additional
  return out, source


def route_line(model_name: str, source: str) -> str:
  """The one line a run prints for this route."""
  return (
      f"vLLM route: {ARCHITECTURE} (MaxText's {model_name} decoder inside vLLM; maxtext_config {source}; "
      "sync: MaxText's MaxTextToMaxTextConverter + plugin resharding)"
  )


def log_route(line: str) -> None:
  logging.info("%s", line)
  print(line, flush=True)
