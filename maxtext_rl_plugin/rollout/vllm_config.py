"""What a config asks of vLLM-TPU, before any engine exists: the route, the per-host split, the engine's arguments.

Device-free and vLLM-free (print_config and the run's build read it; rollout/vllm.py builds the engine from it):
- `VllmSettings`: every key the engine reads, read once from the sampler's config (`from_config`, where the run is
  assembled: run/build.py); the engine and the functions here take it, never the config;
- the route (`choose_route`): MaxText's own decoder inside vLLM (`MaxTextForCausalLM`, rollout/vllm_maxtext.py) when
  `vllm_hf_overrides` names it or the plugin has no native mapping for the family, else the native tpu-inference class
  (rollout/vllm_mapping.py); which routes tests/tpu_contract proves by logits (`PROVEN_*`, `unproven_reason`). The
  refusals of a config are the engine's own checks (rollout/vllm_spec.py); one engine per host in a multi-controller
  run (`per_host_parallelism`);
- `vllm.LLM(...)` and `vllm.SamplingParams(...)` keyword arguments from MaxText's keys.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping, Sequence

import jax.numpy as jnp

from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.resharding import maxtext_layout
from maxtext_rl_plugin.resharding.sync import SyncSettings
from maxtext_rl_plugin.rollout import vllm_mapping
from maxtext_rl_plugin.rollout import vllm_maxtext
from maxtext_rl_plugin.rollout import vllm_quantized

# ------------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """MaxText's rollout parallelism keys, under their names (MaxText's `get_rollout_kwargs_for_parallelism` reads them);
  -1 is derived from the device count."""

  rollout_tensor_parallelism: int
  rollout_data_parallelism: int
  rollout_expert_parallelism: int


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
  """The config's decode and stop keys (`decode_sampling_*`, `stop_token_ids`, `stop_strings`), as vLLM's defaults."""

  max_tokens: int  # max_target_length - max_prefill_predict_length
  temperature: float
  top_p: float
  top_k: int
  stop_token_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class VllmSettings:
  """What the vLLM engine reads from the sampler's config, read once (`from_config`).

  The route: `adapter_route` (MaxText's decoder inside vLLM) and `route_reason` (why, when the user did not ask for it),
  `unproven` (why the forward check does not prove it; None when it does). On the adapter route `adapter` (the
  adapter's maxtext_config) and `layers` (the trainer's layer structure MaxText's converter reads) are set. The
  `vllm.LLM` arguments follow MaxText's keys; `hf_overrides` and `additional_config` are the keys' mappings as parsed
  (`hf_overrides` with a shrunk model's shapes first), never mutated. `sync`: the weight-sync options every engine
  shares; `lora_scale`: alpha / rank of a LoRA actor (None without LoRA).
  """

  model_name: str
  tokenizer_path: str
  adapter_route: bool
  route_reason: str | None
  unproven: str | None
  parallelism: Parallelism
  enable_dp_attention: bool
  enable_expert_parallel: bool
  dtype: str
  max_model_len: int
  hbm_utilization: float
  async_scheduling: bool
  enable_prefix_caching: bool
  max_num_seqs: int | None
  max_num_batched_tokens: int | None
  block_size: int | None
  hf_config_path: str | None
  hf_overrides: Mapping[str, Any]
  additional_config: Mapping[str, Any]
  capture_routing: bool
  sampling: SamplingDefaults
  sync: SyncSettings
  free_kv_cache: bool
  param_scan_axis: int
  lora_scale: float | None
  adapter: vllm_maxtext.AdapterSettings | None = None
  layers: maxtext_layout.TrainerLayers | None = None

  @classmethod
  def from_config(cls, config: Any) -> "VllmSettings":
    """The settings of a typed (sampler) config: the one place the vLLM engine's modules read it. A malformed mapping
    key (`vllm_additional_config`, `vllm_hf_overrides`) is one ConfigError line."""
    adapter, why = choose_route(config.model_name, config.vllm_hf_overrides)
    additional = vllm_maxtext.as_dict(config.vllm_additional_config, "vllm_additional_config")
    if not adapter:  # a quantized sampler: tpu-inference's Qwix rules (rollout/vllm_quantized.py)
      additional = vllm_quantized.with_quantization(additional, config.rollout_quantization)
    # A shrunk model must get vLLM's model built with the trainer's shapes, not the hub config's.
    overrides = vllm_mapping.HfShape.from_config(config).as_dict() if config.override_model_config else {}
    overrides.update(vllm_maxtext.as_dict(config.vllm_hf_overrides, "vllm_hf_overrides"))
    lora = lora_lib.LoraSettings.from_config(config)
    return cls(
        model_name=str(config.model_name),
        tokenizer_path=config.tokenizer_path,
        adapter_route=adapter,
        route_reason=why,
        unproven=unproven_reason(config.model_name, adapter),
        parallelism=Parallelism(
            rollout_tensor_parallelism=int(config.rollout_tensor_parallelism),
            rollout_data_parallelism=int(config.rollout_data_parallelism),
            rollout_expert_parallelism=int(config.rollout_expert_parallelism),
        ),
        enable_dp_attention=bool(config.enable_dp_attention),
        enable_expert_parallel=bool(config.enable_expert_parallel),
        dtype=jnp.dtype(config.weight_dtype).name,
        max_model_len=int(config.max_target_length + config.kv_cache_buffer),
        hbm_utilization=float(config.hbm_utilization_vllm),
        async_scheduling=bool(config.async_scheduling),
        enable_prefix_caching=bool(config.enable_prefix_caching),
        max_num_seqs=None if config.max_num_seqs is None else int(config.max_num_seqs),
        max_num_batched_tokens=None if config.max_num_batched_tokens is None else int(config.max_num_batched_tokens),
        block_size=None if config.vllm_block_size is None else int(config.vllm_block_size),
        hf_config_path=config.vllm_hf_config_path or None,
        hf_overrides=overrides,
        additional_config=additional,
        capture_routing=(bool(config.rl.router_replay) or bool(config.return_routed_experts))
        and moe.MoeSettings.from_config(config).is_moe,
        sampling=SamplingDefaults(
            max_tokens=int(config.max_target_length - config.max_prefill_predict_length),
            temperature=float(config.decode_sampling_temperature),
            top_p=float(config.decode_sampling_nucleus_p),
            top_k=int(config.decode_sampling_top_k),
            stop_token_ids=tuple(int(t) for t in config.stop_token_ids),
            stop_strings=tuple(config.stop_strings or ()),
        ),
        sync=SyncSettings.from_config(config),
        free_kv_cache=bool(config.free_kv_cache_during_weight_sync),
        param_scan_axis=int(config.param_scan_axis),
        lora_scale=lora.scale if lora.enable else None,
        adapter=vllm_maxtext.AdapterSettings.from_config(config) if adapter else None,
        layers=maxtext_layout.TrainerLayers.from_config(config) if adapter else None,
    )


# ------------------------------------------------------------------------------- settings -> vLLM


def per_host_parallelism(parallelism: Parallelism, hosts: int) -> Parallelism:
  """The rollout parallelism one host's engine gets when `hosts` engines sample side by side (a multi-controller run):
  `rollout_data_parallelism` keeps MaxText's meaning, the whole sampler's data parallelism (hosts x each engine's
  replicas), so each engine gets its `hosts`-th part; tensor and expert parallelism are within a host. -1 stays -1
  (derived from the host's devices)."""
  dp = parallelism.rollout_data_parallelism
  if hosts > 1 and dp != -1 and dp % hosts:
    raise ConfigError(
        f"invalid value for 'rollout_data_parallelism'={dp}: a multi-controller run samples on one vLLM engine per "
        f"host, so the sampler's data parallelism must be a multiple of its {hosts} hosts (or -1, derived per host)"
    )
  return dataclasses.replace(parallelism, rollout_data_parallelism=dp if dp == -1 else dp // max(hosts, 1))


def vllm_engine_kwargs(
    settings: VllmSettings, num_sampler_devices: int, *, device_ids: Sequence[int] | None = None, hosts: int = 1
) -> dict:
  """The `vllm.LLM(...)` keyword arguments for the settings and `num_sampler_devices` rollout chips.

  tp/dp/ep come from `rollout_{tensor,data,expert}_parallelism` (at most one -1, derived from the device
  count, MaxText's rule); `device_ids` pins vLLM-TPU's mesh to the rollout devices. With `hosts` > 1 the engine is
  one host's (`per_host_parallelism`): `num_sampler_devices` and `device_ids` are that host's.
  """
  # Here, not at the top: model_creation_utils imports MaxText's whole model zoo and its tokenizer dependencies
  # (tiktoken, ...), which the TPU image's vLLM import check (tests/tpu_contract/test_image_check.py) does not have.
  from maxtext.utils import model_creation_utils  # pylint: disable=import-outside-toplevel

  where = f" (per host: {hosts} hosts x {num_sampler_devices} devices)" if hosts > 1 else ""
  try:
    par = model_creation_utils.get_rollout_kwargs_for_parallelism(
        per_host_parallelism(settings.parallelism, hosts), num_sampler_devices
    )
  except ValueError as e:
    raise ConfigError(f"rollout parallelism{where}: {str(e).strip().splitlines()[0]}") from None
  tp, dp, ep = par["tensor_parallel_size"], par["data_parallel_size"], par["expert_parallel_size"]

  strategy = {"expert_parallelism": ep, "enable_dp_attention": settings.enable_dp_attention}
  if device_ids is not None:
    strategy["device_indexes"] = [int(i) for i in device_ids]
  additional = copy.deepcopy(dict(settings.additional_config))
  additional.setdefault("sharding", {}).setdefault("sharding_strategy", {}).update(strategy)

  kwargs: dict[str, Any] = {
      # vLLM reads the architecture (config.json) and tokenizer from the HF id/dir, as MaxText's train_rl does.
      "model": settings.tokenizer_path,
      "tokenizer": settings.tokenizer_path,
      # Never load checkpoint weights: the trainer's are synced in before the first generate.
      "load_format": "dummy",
      "dtype": settings.dtype,
      "max_model_len": settings.max_model_len,
      "gpu_memory_utilization": settings.hbm_utilization,
      "tensor_parallel_size": tp,
      "data_parallel_size": dp,
      "enable_expert_parallel": ep > 1 or settings.enable_expert_parallel,
      "async_scheduling": settings.async_scheduling,
      "enable_prefix_caching": settings.enable_prefix_caching,
      # Only the sampled token's log-prob is needed (old-policy log-probs / importance ratios).
      "max_logprobs": 1,
      "logprobs_mode": "processed_logprobs",
      "disable_log_stats": True,
      "additional_config": additional,
  }
  if settings.max_num_seqs is not None:
    kwargs["max_num_seqs"] = settings.max_num_seqs
  if settings.max_num_batched_tokens is not None:
    kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
  if settings.block_size is not None:
    kwargs["block_size"] = settings.block_size
  if settings.hf_config_path:
    kwargs["hf_config_path"] = settings.hf_config_path
  if settings.hf_overrides:
    kwargs["hf_overrides"] = copy.deepcopy(dict(settings.hf_overrides))
  return kwargs


def sampling_params_kwargs(sampling: SamplingDefaults, *, greedy: bool = False) -> dict:
  """`vllm.SamplingParams(...)` keyword arguments from the config's decode/stop keys.

  `greedy` is evaluation's argmax decoding (temperature 0). The tokenizer's EOS is added by the engine.
  """
  stop_strings = list(sampling.stop_strings) or None
  kwargs: dict[str, Any] = {
      "n": 1,  # Tunix repeats each prompt num_generations times itself
      "max_tokens": sampling.max_tokens,
      "temperature": 0.0 if greedy else sampling.temperature,
      "top_p": 1.0 if greedy else sampling.top_p,
      "top_k": 0 if greedy else sampling.top_k,  # 0 disables top-k in vLLM
      "stop_token_ids": list(sampling.stop_token_ids),
      "logprobs": 0,  # the sampled token's log-prob only
      "skip_special_tokens": True,
      # Stop strings are matched on text; keep them so the reward functions see the closing tag.
      "stop": stop_strings,
      "detokenize": stop_strings is not None,
      "include_stop_str_in_output": stop_strings is not None,
  }
  return kwargs


# ------------------------------------------------------------------------------- routes


def choose_route(model_name: str, hf_overrides: Any) -> tuple[bool, str | None]:
  """(adapter route?, why it was chosen when the user did not ask for it), for `model_name` and `vllm_hf_overrides`.

  MaxText's key decides first (`vllm_hf_overrides` naming MaxTextForCausalLM, `vllm_maxtext.selected`); otherwise the
  native class when the plugin maps the family onto one (rollout/vllm_mapping.py), else MaxText's own decoder inside
  vLLM, with the one-line reason the native route refuses it.
  """
  if vllm_maxtext.selected(hf_overrides):
    return True, None
  why = vllm_mapping.native_refusal(model_name)
  return why is not None, why


# Families whose route tests/tpu_contract proves by logits against MaxText's forward (docs/models.md).
PROVEN_NATIVE = ("llama3.1-", "qwen3-")
PROVEN_ADAPTER = ("llama3.1-", "qwen3-30b", "qwen3-235b", "mixtral-", "gemma3-")


def unproven_reason(model_name: str, adapter: bool) -> str | None:
  """Why the vLLM route (`adapter`: `choose_route`'s) of `model_name` is not proven by the forward check (one line), or
  None when it is."""
  if str(model_name).startswith(PROVEN_ADAPTER if adapter else PROVEN_NATIVE):
    return None
  route = vllm_maxtext.ARCHITECTURE if adapter else "the native class"
  return f"vLLM's {route} route for {model_name} is not proven by tests/tpu_contract (docs/models.md)"
