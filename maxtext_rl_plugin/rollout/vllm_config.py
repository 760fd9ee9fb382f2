"""What a config asks of vLLM-TPU, before any engine exists: the route, the per-host split, the engine's arguments.

Device-free and vLLM-free (print_config and the run's build read it; rollout/vllm.py builds the engine from it):
- the route (`choose_route`): MaxText's own decoder inside vLLM (`MaxTextForCausalLM`, rollout/vllm_maxtext.py) when
  `vllm_hf_overrides` names it or the plugin has no native mapping for the family, else the native tpu-inference class
  (rollout/vllm_mapping.py); which routes tests/tpu_contract proves by logits (`PROVEN_*`, `unproven_reason`);
- what refuses a config (`check_config`, `vllm_head_dim_reason`); one engine per host in a multi-controller run
  (`per_host_parallelism`);
- `vllm.LLM(...)` and `vllm.SamplingParams(...)` keyword arguments from MaxText's keys.
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import jax.numpy as jnp

from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import vllm_mapping
from maxtext_rl_plugin.rollout import vllm_maxtext
from maxtext_rl_plugin.rollout import vllm_spec

# ------------------------------------------------------------------------------- config -> vLLM


def per_host_parallelism(config: Any, hosts: int) -> Any:
  """The rollout parallelism keys one host's engine gets when `hosts` engines sample side by side (a
  multi-controller run): `rollout_data_parallelism` keeps MaxText's meaning, the whole sampler's data parallelism
  (hosts x each engine's replicas), so each engine gets its `hosts`-th part; tensor and expert parallelism are
  within a host. -1 stays -1 (derived from the host's devices)."""
  dp = int(config.rollout_data_parallelism)
  if hosts > 1 and dp != -1 and dp % hosts:
    raise ConfigError(
        f"invalid value for 'rollout_data_parallelism'={dp}: a multi-controller run samples on one vLLM engine per "
        f"host, so the sampler's data parallelism must be a multiple of its {hosts} hosts (or -1, derived per host)"
    )
  return types.SimpleNamespace(
      rollout_tensor_parallelism=int(config.rollout_tensor_parallelism),
      rollout_data_parallelism=dp if dp == -1 else dp // max(hosts, 1),
      rollout_expert_parallelism=int(config.rollout_expert_parallelism),
  )


def vllm_engine_kwargs(
    config: Any, num_sampler_devices: int, *, device_ids: Sequence[int] | None = None, hosts: int = 1
) -> dict:
  """The `vllm.LLM(...)` keyword arguments for a plugin config and `num_sampler_devices` rollout chips.

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
        per_host_parallelism(config, hosts), num_sampler_devices
    )
  except ValueError as e:
    raise ConfigError(f"rollout parallelism{where}: {str(e).strip().splitlines()[0]}") from None
  tp, dp, ep = par["tensor_parallel_size"], par["data_parallel_size"], par["expert_parallel_size"]

  strategy = {"expert_parallelism": ep, "enable_dp_attention": bool(config.enable_dp_attention)}
  if device_ids is not None:
    strategy["device_indexes"] = [int(i) for i in device_ids]
  additional = vllm_maxtext.as_dict(config.vllm_additional_config, "vllm_additional_config")
  additional.setdefault("sharding", {}).setdefault("sharding_strategy", {}).update(strategy)

  kwargs: dict[str, Any] = {
      # vLLM reads the architecture (config.json) and tokenizer from the HF id/dir, as MaxText's train_rl does.
      "model": config.tokenizer_path,
      "tokenizer": config.tokenizer_path,
      # Never load checkpoint weights: the trainer's are synced in before the first generate.
      "load_format": "dummy",
      "dtype": jnp.dtype(config.weight_dtype).name,
      "max_model_len": int(config.max_target_length + config.kv_cache_buffer),
      "gpu_memory_utilization": float(config.hbm_utilization_vllm),
      "tensor_parallel_size": tp,
      "data_parallel_size": dp,
      "enable_expert_parallel": ep > 1 or bool(config.enable_expert_parallel),
      "async_scheduling": bool(config.async_scheduling),
      "enable_prefix_caching": bool(config.enable_prefix_caching),
      # Only the sampled token's log-prob is needed (old-policy log-probs / importance ratios).
      "max_logprobs": 1,
      "logprobs_mode": "processed_logprobs",
      "disable_log_stats": True,
      "additional_config": additional,
  }
  if config.max_num_seqs is not None:
    kwargs["max_num_seqs"] = int(config.max_num_seqs)
  if config.max_num_batched_tokens is not None:
    kwargs["max_num_batched_tokens"] = int(config.max_num_batched_tokens)
  if config.vllm_block_size is not None:
    kwargs["block_size"] = int(config.vllm_block_size)
  if config.vllm_hf_config_path:
    kwargs["hf_config_path"] = config.vllm_hf_config_path
  overrides = {}
  if config.override_model_config:
    # A shrunk model must get vLLM's model built with the trainer's shapes, not the hub config's.
    overrides = vllm_mapping.hf_config_from_maxtext(config)
  overrides.update(vllm_maxtext.as_dict(config.vllm_hf_overrides, "vllm_hf_overrides"))
  if overrides:
    kwargs["hf_overrides"] = overrides
  return kwargs


def sampling_params_kwargs(config: Any, *, greedy: bool = False) -> dict:
  """`vllm.SamplingParams(...)` keyword arguments from the config's decode/stop keys.

  `greedy` is evaluation's argmax decoding (temperature 0). The tokenizer's EOS is added by the engine.
  """
  stop_strings = list(config.stop_strings) if config.stop_strings else None
  kwargs: dict[str, Any] = {
      "n": 1,  # Tunix repeats each prompt num_generations times itself
      "max_tokens": int(config.max_target_length - config.max_prefill_predict_length),
      "temperature": 0.0 if greedy else float(config.decode_sampling_temperature),
      "top_p": 1.0 if greedy else float(config.decode_sampling_nucleus_p),
      "top_k": 0 if greedy else int(config.decode_sampling_top_k),  # 0 disables top-k in vLLM
      "stop_token_ids": [int(t) for t in config.stop_token_ids],
      "logprobs": 0,  # the sampled token's log-prob only
      "skip_special_tokens": True,
      # Stop strings are matched on text; keep them so the reward functions see the closing tag.
      "stop": stop_strings,
      "detokenize": stop_strings is not None,
      "include_stop_str_in_output": stop_strings is not None,
  }
  return kwargs


# ------------------------------------------------------------------------------- routes


def choose_route(config: Any) -> tuple[bool, str | None]:
  """(adapter route?, why it was chosen when the user did not ask for it).

  MaxText's key decides first (`vllm_hf_overrides` naming MaxTextForCausalLM, `vllm_maxtext.selected`); otherwise the
  native class when the plugin maps the family onto one (rollout/vllm_mapping.py), else MaxText's own decoder inside
  vLLM, with the one-line reason the native route refuses it.
  """
  if vllm_maxtext.selected(config):
    return True, None
  why = vllm_mapping.native_refusal(config.model_name)
  return why is not None, why


# Families whose route tests/tpu_contract proves by logits against MaxText's forward (docs/models.md).
PROVEN_NATIVE = ("llama3.1-", "qwen3-")
PROVEN_ADAPTER = ("llama3.1-", "qwen3-30b", "qwen3-235b", "mixtral-", "gemma3-")


def unproven_reason(config: Any) -> str | None:
  """Why the vLLM route `config` takes is not proven by the forward check (one line), or None when it is."""
  adapter, _ = choose_route(config)
  if config.model_name.startswith(PROVEN_ADAPTER if adapter else PROVEN_NATIVE):
    return None
  route = vllm_maxtext.ARCHITECTURE if adapter else "the native class"
  return f"vLLM's {route} route for {config.model_name} is not proven by tests/tpu_contract (docs/models.md)"


def vllm_head_dim_reason(model_name: str, head_dim: int) -> str | None:
  """Why vLLM-TPU would sample a different function than the trainer's Qwen3, or None (vllm_spec says why)."""
  return vllm_spec.qwen3_head_dim_reason(model_name, head_dim)


def check_config(config: Any) -> None:
  """Device-free checks of the vLLM route a config takes (print_config and training run them): one ConfigError line."""
  # The head_dim rule is about the native classes (tpu-inference pads head_dim, Qwen3's q/k norm then differs);
  # MaxText's own attention inside vLLM computes with the model's head_dim.
  adapter, _ = choose_route(config)
  if adapter:
    vllm_maxtext.check_config(config)
    return
  reason = vllm_head_dim_reason(config.model_name, config.head_dim)
  if reason:
    raise ConfigError(f"invalid value for 'head_dim'={config.head_dim}: {reason}")
