"""vLLM-TPU rollout engine (`rollout_engine=vllm`): a Tunix `BaseRollout` over `vllm.LLM`.

Why our own adapter rather than Tunix's `VllmRollout` or MaxText's `MaxTextVllmRollout`: in the pinned
stack (google-tunix 0.1.7, maxtext 0.2.5) MaxText's class reads RolloutConfig fields Tunix 0.1.7 does not
have, and Tunix's sampler imports vLLM at module import, frees the KV cache unconditionally and syncs
through mapping tables whose engine names it cannot check. This adapter keeps the API surface it touches
small and explicit (targeted: vllm-tpu 0.32.0 / tpu-inference 0.32.0, the pins in dependencies/):

- `vllm.LLM(**vllm_config.vllm_engine_kwargs(...))`, `vllm.SamplingParams(**...)`,
  `LLM.generate(prompts=[{"prompt_token_ids": ids}], sampling_params=, use_tqdm=False)` returning
  `RequestOutput.outputs[0].{token_ids, logprobs}`;
- weight sync through tpu-inference's weight-update session: `LLM.reset_prefix_cache()`,
  `LLM.collective_rpc("start_weight_update", kwargs={"free_kv_cache": ...})`, the in-process worker's
  `get_weights_state()` / `refresh_model_state_leaves()`, `collective_rpc("finish_weight_update")`;
- on MoE models under `rl.router_replay` or `return_routed_experts`: `LLM(enable_return_routed_experts=True)` and
  `CompletionOutput.routed_experts`, laid out like the trainer's input by rollout/vllm_routing.py and handed to the step
  by `take_routing`, as the embedded engine's routing is.

Two routes (`vllm_config.choose_route`, printed once per engine): a native tpu-inference class, synced by
`vllm_sync.write_weights` (the path tests/tpu_contract/test_forward.py runs into the real tpu-inference classes and
checks by their logits), or MaxText's own decoder inside vLLM (`MaxTextForCausalLM`, rollout/vllm_maxtext.py), synced
by `vllm_sync.write_adapter_weights` (tests/tpu_contract/test_forward_maxtext.py). A LoRA actor's adapters are merged
into their kernels on the trainer side (tpu-inference's JAX classes ignore LoRA metadata); adapter-only syncs send only
the adapted kernels.

vLLM starts from dummy weights (`load_format="dummy"`); the constructor syncs the trainer's weights before
returning and `generate` refuses to run until a sync succeeded, so step 0 samples the trainer's policy.
Completions keep the EOS/stop token that ended them (vLLM's behaviour), so the policy is trained to stop.
vLLM is imported lazily: without it, constructing the engine raises MissingExtraError (extra `tpu`).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence, Tuple

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import tokenizer_adapter
from tunix.generate import utils as tunix_gen_utils
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin import pathways
from maxtext_rl_plugin.resharding import maxtext_layout
from maxtext_rl_plugin.resharding import per_host
from maxtext_rl_plugin.resharding import verify
from maxtext_rl_plugin.errors import DataError, MissingExtraError
from maxtext_rl_plugin.rollout import contract
from maxtext_rl_plugin.rollout import stops as stops_lib
from maxtext_rl_plugin.rollout import vllm_config
from maxtext_rl_plugin.rollout import vllm_mapping
from maxtext_rl_plugin.rollout import vllm_maxtext
from maxtext_rl_plugin.rollout import vllm_routing
from maxtext_rl_plugin.rollout import vllm_spec
from maxtext_rl_plugin.rollout import vllm_sync

TARGET_API = "vllm-tpu==0.32.0, tpu-inference==0.32.0"


def import_vllm():
  """The `vllm` module, or a one-line MissingExtraError naming the extra to install."""
  try:
    import vllm  # pylint: disable=import-outside-toplevel  # optional: the `tpu` extra, TPU images only
  except ImportError:
    raise MissingExtraError("rollout_engine=vllm", "vllm", "tpu") from None
  return vllm


def _driver_worker(llm: Any) -> Any:
  """The in-process vLLM-TPU worker (VLLM_ENABLE_V1_MULTIPROCESSING=0), as Tunix's sampler reaches it."""
  return llm.llm_engine.model_executor.driver_worker


class VllmRollout(contract.RolloutEngine):
  """Rollouts from vLLM-TPU with trainer->vLLM weight sync; build with
  `functools.partial(VllmRollout, settings=VllmSettings.from_config(sampler_config))` (the spec's `bind`, which
  run/build.py calls).

  `settings` holds every key the engine reads (vllm_config.VllmSettings): vLLM's arguments are made from MaxText's keys
  (vllm_config.py), and on the MaxTextForCausalLM route MaxText builds its own model inside vLLM from the
  `maxtext_config` the settings carry (vllm_maxtext.py).
  """

  spec = vllm_spec.ENGINE

  @classmethod
  def ensure_available(cls) -> None:
    import_vllm()

  def __init__(
      self,
      rollout_actor: Any,
      tokenizer: Any,
      mesh: jax.sharding.Mesh,
      rollout_config: base_rollout.RolloutConfig,
      *,
      settings: vllm_config.VllmSettings | None = None,
  ):
    vllm = import_vllm()
    if settings is None:
      raise ValueError(
          "VllmRollout needs its settings: functools.partial(VllmRollout, settings=VllmSettings.from_config(cfg))"
      )
    self.adapter_route, why = settings.adapter_route, settings.route_reason
    if self.adapter_route:
      vllm_maxtext.register_adapter()
    self._vllm = vllm
    self.settings = settings
    self._mesh = mesh
    if not isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter):
      tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
    self._tokenizer = tokenizer
    # A multi-controller run without Pathways: one engine per host, on this process's devices of the rollout mesh
    # (tpu-inference looks `device_indexes` up in jax.local_devices()); each process samples its share of a batch.
    self.per_host = distributed.is_multiprocess() and not pathways.requested()
    devices = [d for d in mesh.devices.flat if not self.per_host or d.process_index == jax.process_index()]
    self.engine_kwargs = vllm_config.vllm_engine_kwargs(
        settings,
        len(devices),
        device_ids=[int(d.id) for d in devices],
        hosts=jax.process_count() if self.per_host else 1,
    )
    self._layout = None
    if self.adapter_route:
      self.engine_kwargs, source = vllm_maxtext.engine_kwargs(self.engine_kwargs, settings.adapter)
      self.route = vllm_maxtext.route_line(settings.model_name, source) + (f": {why}" if why else "")
      self._layout = maxtext_layout.AdapterLayout(
          settings.layers,
          tp=self.engine_kwargs["tensor_parallel_size"],
          prefuse_moe=bool(self.engine_kwargs["additional_config"]["maxtext_config"].get("prefuse_moe_weights")),
      )
    else:
      self.route = vllm_mapping.route_line(settings.model_name)
    # MoE routing capture (rl.router_replay, return_routed_experts): only MaxText's decoder inside vLLM reports it.
    self.capture_routing = settings.capture_routing
    if self.capture_routing:
      if not self.adapter_route:
        raise ValueError(
            "routing capture (rl.router_replay / return_routed_experts) needs vLLM's MaxTextForCausalLM route: "
            f"tpu-inference's native class for {settings.model_name} does not report the experts it routed to"
        )
      self.engine_kwargs = vllm_routing.capture_kwargs(self.engine_kwargs)
    # Routing of the generate() calls since the last take_routing(), per thread (as the embedded engine's).
    self._routing = threading.local()
    unproven = settings.unproven
    vllm_maxtext.log_route(self.route + (f" [{unproven}]" if unproven else ""))
    # In-process engine: the weight sync writes into the worker's arrays directly.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TPU_BACKEND_TYPE", "jax")
    if self.engine_kwargs["data_parallel_size"] > 1:
      os.environ["NEW_MODEL_DESIGN"] = "1"  # vLLM-TPU's DP needs its new model design
    logging.info("vLLM engine (%s): %s", TARGET_API, self.engine_kwargs)
    self.llm = vllm.LLM(**self.engine_kwargs)
    self._weights_valid = False
    self._syncs = 0
    self._hf_config: dict | None = None
    self._lora_base: dict[str, jax.Array] | None = None
    self.last_sync_bytes = 0
    # (prompt ids, completion ids) -> sampler log-probs, for every completion since the last weight sync.
    self._logps: dict[tuple[int, ...], dict[tuple[int, ...], np.ndarray]] = {}
    # Step 0 samples the trainer's weights, never vLLM's dummy init.
    self.update_params(_actor_params(rollout_actor))

  # --- BaseRollout -------------------------------------------------------------------------------

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  def generate(
      self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs
  ) -> base_rollout.RolloutOutput:
    """Sample one completion per prompt; `kwargs` override individual SamplingParams fields."""
    if not self._weights_valid:
      raise RuntimeError("vLLM does not hold a complete set of trainer weights (a sync failed); refusing to sample")
    tok = self._tokenizer
    prompt_ids = [self._encode(p) for p in prompts]
    longest = max(len(p) for p in prompt_ids)
    if longest > rollout_config.max_prompt_length:
      raise DataError(
          f"a prompt has {longest} tokens, more than max_prefill_predict_length={rollout_config.max_prompt_length}"
      )
    params = self._vllm.SamplingParams(**{**self._sampling_kwargs(rollout_config), **kwargs})
    outputs = self.llm.generate(
        prompts=[{"prompt_token_ids": ids} for ids in prompt_ids], sampling_params=params, use_tqdm=False
    )
    if len(outputs) != len(prompts):
      raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    texts, tokens, logps = [], [], []
    for out in outputs:
      comp = out.outputs[0]
      ids = np.asarray(list(comp.token_ids), dtype=np.int32)
      tokens.append(ids)
      texts.append(tok.decode(ids.tolist(), skip_special_tokens=True))
      lp = tunix_gen_utils.get_logprobs_from_vllm_output(list(comp.token_ids), comp.logprobs)
      if len(lp) != len(ids):
        raise RuntimeError("vLLM returned no per-token log-probs (SamplingParams.logprobs must be set)")
      logps.append(np.asarray(lp, dtype=np.float32))
    padded = np.full((len(prompt_ids), rollout_config.max_prompt_length), tok.pad_id(), dtype=np.int32)
    for i, ids in enumerate(prompt_ids):
      if ids:
        padded[i, -len(ids) :] = ids
    for ids, comp, lp in zip(prompt_ids, tokens, logps):
      self._logps.setdefault(tuple(ids), {})[tuple(comp.tolist())] = lp
    if self.capture_routing:
      routing = vllm_routing.batch_layout(
          outputs, [len(p) for p in prompt_ids], padded.shape[1], int(rollout_config.max_tokens_to_generate)
      )
      self._routing.calls = getattr(self._routing, "calls", []) + [routing]
    return base_rollout.RolloutOutput(
        text=texts, logits=None, tokens=tokens, left_padded_prompt_tokens=padded, logprobs=logps
    )

  def generate_turn(
      self,
      contexts: Sequence[Sequence[int]],
      *,
      num_generations: int,
      max_new_tokens: int,
      rollout_config: base_rollout.RolloutConfig,
      rng: jax.Array,
      stop_strings: Sequence[str] = (),
  ) -> list[contract.TurnRow]:
    """The contract's turn (contract.RolloutEngine.generate_turn) through the same `LLM.generate` call.

    Each context is sent `num_generations` times as `prompt_token_ids`; with `enable_prefix_caching` vLLM reuses the
    transcript's KV blocks from the previous turn. The finish reason follows vLLM's `CompletionOutput`:
    `finish_reason == "length"` -> "length"; a string `stop_reason` (a stop string) -> "stop_string"; otherwise a stop
    token ("eos" when it is EOS). `rng` is unused (vLLM seeds its own sampler, as for `generate`).
    """
    del rng
    if not self._weights_valid:
      raise RuntimeError("vLLM does not hold a complete set of trainer weights (a sync failed); refusing to sample")
    kw = self._sampling_kwargs(rollout_config)
    stops = list(kw.get("stop") or [])
    stops += [s for s in stop_strings if s and s not in stops]
    kw.update(
        max_tokens=int(max_new_tokens),
        stop=stops or None,
        detokenize=bool(stops),
        include_stop_str_in_output=bool(stops),
    )
    requests = [{"prompt_token_ids": [int(t) for t in c]} for c in contexts for _ in range(int(num_generations))]
    outputs = self.llm.generate(prompts=requests, sampling_params=self._vllm.SamplingParams(**kw), use_tqdm=False)
    if len(outputs) != len(requests):
      raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} prompts")
    eos = int(self._tokenizer.eos_id())
    rows = []
    for out in outputs:
      comp = out.outputs[0]
      ids = np.asarray(list(comp.token_ids), dtype=np.int32)
      lp = tunix_gen_utils.get_logprobs_from_vllm_output(list(comp.token_ids), comp.logprobs)
      if len(lp) != len(ids):
        raise RuntimeError("vLLM returned no per-token log-probs (SamplingParams.logprobs must be set)")
      if getattr(comp, "finish_reason", None) == "length":
        reason = "length"
      elif isinstance(getattr(comp, "stop_reason", None), str):
        reason = "stop_string"
      else:
        reason = "eos" if len(ids) and int(ids[-1]) == eos else "stop_token"
      rows.append((ids, np.asarray(lp, dtype=np.float32), reason))
    return rows

  def take_routing(self) -> np.ndarray | None:
    """The contract's routing (laid out by rollout/vllm_routing.py); None when the engine captures none (a dense model,
    no capture asked, or the native route)."""
    calls, self._routing.calls = getattr(self._routing, "calls", []), []
    return np.concatenate(calls, axis=0) if calls else None

  def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
    """The sampler's log-probs of `completion_tokens` [B, T] (0 past each completion), found by prompt and tokens.

    Rows may be any subset/order of the completions generated since the last weight sync (Tunix micro-batches
    both calls). A row that was not sampled under the current weights raises instead of returning a guess.
    """
    pad = self._tokenizer.pad_id()
    prompts = np.asarray(jax.device_get(prompt_tokens))
    comp = np.asarray(jax.device_get(completion_tokens))
    out = np.zeros(comp.shape, dtype=np.float32)
    for i in range(comp.shape[0]):
      row = prompts[i]
      first = int(np.argmax(row != pad)) if (row != pad).any() else len(row)
      candidates = self._logps.get(tuple(row[first:].tolist()), {})
      best = None
      for ids, lp in candidates.items():
        n = len(ids)
        if n <= comp.shape[1] and tuple(comp[i, :n].tolist()) == ids and (comp[i, n:] == pad).all():
          if best is None or n > len(best[0]):  # pad == EOS: prefer the completion that covers the EOS
            best = (ids, lp)
      if best is None:
        raise ValueError(f"completion row {i} was not sampled by vLLM since the last weight sync; no log-probs for it")
      out[i, : len(best[0])] = best[1]
    return jnp.asarray(out)

  def update_params(self, params: Any, filter_types: Optional[Tuple[Any, ...]] = None) -> None:
    """Map the trainer's MaxText parameters to vLLM's and write them into the engine (every one of them).

    Runs inside tpu-inference's weight-update session (KV cache freed or kept per
    `free_kv_cache_during_weight_sync`), `rl.reshard_chunk_size` MaxText tensors at a time so the
    HF-layout copies never exceed one chunk. Until a sync completes, `generate` refuses to sample.
    """
    settings = self.settings
    free_kv = settings.free_kv_cache
    flat = self._trainer_weights(params, filter_types)
    if self._hf_config is None and not self.adapter_route:  # the first sync is a full one: the shapes say the model
      self._hf_config = vllm_mapping.hf_config_from_params(flat, settings.model_name)
    llm = self.llm
    self._weights_valid = False
    self._logps = {}  # log-probs of the old weights
    # The prefix cache is scheduler-side: drop it first, or it serves blocks computed with old weights.
    llm.reset_prefix_cache()
    llm.collective_rpc("start_weight_update", kwargs={"free_kv_cache": free_kv})
    # Per host, the guard compares every host's engine with the trainer-side checksums (resharding/per_host.py).
    sources = {} if self.per_host and self._should_verify() else None
    try:
      worker = _driver_worker(llm)
      if self.adapter_route:
        written = vllm_sync.write_adapter_weights(
            worker.get_weights_state(),
            flat,
            self._layout,
            chunk_size=settings.sync.chunk_size,
            require_all=not self._lora_only(filter_types),
            source_checksums=sources,
        )
      else:
        written = vllm_sync.write_weights(
            worker.get_weights_state(),
            flat,
            settings.model_name,
            self._hf_config,
            param_scan_axis=settings.param_scan_axis,
            chunk_size=settings.sync.chunk_size,
            donate=settings.sync.release_old,
            require_all=not self._lora_only(filter_types),
            source_checksums=sources,
        )
      worker.refresh_model_state_leaves()
      if sources is not None:
        per_host.check_hosts(sources, vllm_mapping.engine_weights(worker.get_weights_state()))
      elif self._should_verify():
        vllm_sync.verify_engine_holds(worker, written)
    finally:
      llm.collective_rpc("finish_weight_update")
    self._weights_valid = True
    self._syncs += 1
    self.last_sync_bytes = sum(int(v.nbytes) for v in written.values())
    logging.info(
        "synced %d tensors (%.1f MiB) into vLLM (sync %d, kv cache %s)",
        len(written),
        self.last_sync_bytes / 2**20,
        self._syncs,
        "freed" if free_kv else "kept",
    )

  @staticmethod
  def _lora_only(filter_types: Optional[Tuple[Any, ...]]) -> bool:
    """Tunix's `sync_weights` of a LoRA actor passes only its `nnx.LoRAParam` state."""
    return bool(filter_types) and any(getattr(t, "__name__", "") == "LoRAParam" for t in filter_types)

  def _trainer_weights(self, params: Any, filter_types: Optional[Tuple[Any, ...]]) -> dict[str, jax.Array]:
    """`{MaxText path: array}` to sync: the params as given, with LoRA adapters merged into their kernels.

    tpu-inference 0.32.0's JAX classes ignore LoRA metadata, so adapters are merged on the trainer side
    (`lora.merge_flat`, `W + alpha/rank * A @ B`): an adapter-only sync sends only the adapted kernels (the frozen
    base ones, kept from the first full sync, are merged with the new adapters); a full sync of a LoRA actor sends
    the whole model with its adapted kernels merged.
    """
    flat = vllm_mapping.flatten_params(params)
    adapters = {k: v for k, v in flat.items() if lora_lib.is_adapter(k)}
    if not adapters and not self._lora_only(filter_types):
      return flat
    if self._lora_only(filter_types):
      if self._lora_base is None:
        raise RuntimeError("an adapter-only vLLM sync needs a full sync of the LoRA actor first")
      base = self._lora_base
    else:
      base = {k: v for k, v in flat.items() if k not in adapters}
    if self.settings.lora_scale is None:
      raise RuntimeError("the vLLM engine got LoRA adapters to sync, but its settings have no lora.enable_lora")
    merged = lora_lib.merge_flat(base, adapters, self.settings.lora_scale, self.settings.param_scan_axis)
    if self._lora_only(filter_types):
      return merged
    # The frozen base kernels of the adapted modules (the trainer never updates them), for adapter-only syncs.
    self._lora_base = {k: base[k] for k in merged}
    return {**base, **merged}

  def _should_verify(self) -> bool:
    """The same policy as every other engine's guard (verify.verify_due), for the sync about to complete."""
    sync = self.settings.sync
    return verify.verify_due(sync.verify_policy, sync.verify_every, self._syncs + 1)

  def pad_id(self) -> int:
    return self._tokenizer.pad_id()

  def eos_id(self) -> int:
    return self._tokenizer.eos_id()

  def model(self) -> Any:
    return None  # vLLM owns its model; Tunix only uses this for CPU offload, which vLLM does not support

  # --- helpers -----------------------------------------------------------------------------------

  def _encode(self, prompt: str) -> list[int]:
    """Token ids as the tokenizer encodes them, with a doubled leading BOS (chat template + encoder) collapsed."""
    ids = list(self._tokenizer.encode(prompt))
    bos = self._tokenizer.bos_id()
    while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
      ids = ids[1:]
    return ids

  def _sampling_kwargs(self, rollout_config: base_rollout.RolloutConfig) -> dict:
    """Config defaults, with Tunix's per-mode RolloutConfig (train vs. eval) deciding the decode knobs."""
    greedy = rollout_config.temperature is not None and rollout_config.temperature <= 0
    kw = vllm_config.sampling_params_kwargs(self.settings.sampling, greedy=greedy)
    kw["max_tokens"] = int(rollout_config.max_tokens_to_generate)
    if not greedy:
      kw["temperature"] = float(rollout_config.temperature)
      kw["top_p"] = 1.0 if rollout_config.top_p is None else float(rollout_config.top_p)
      kw["top_k"] = 0 if rollout_config.top_k in (None, -1) else int(rollout_config.top_k)
    eos = list(rollout_config.eos_tokens or [self._tokenizer.eos_id()])
    pad = stops_lib.pad_stops(self._tokenizer.pad_id(), self._tokenizer.eos_id())  # as the embedded engine (why there)
    kw["stop_token_ids"] = sorted(set(int(t) for t in eos + kw["stop_token_ids"] + pad))
    return kw


def _actor_params(rollout_actor: Any) -> Any:
  """The trainer's parameters: `nnx.state(model, nnx.Param)` for a module, the tree itself otherwise."""
  if isinstance(rollout_actor, nnx.Module):
    return nnx.state(rollout_actor, nnx.Param)
  return rollout_actor
