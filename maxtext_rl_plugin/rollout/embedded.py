"""Embedded KV-cache rollout engine on MaxText's own model code (the CPU/GPU default; Tunix `BaseRollout`).

The split follows Tunix's (`VanillaRollout` over its `Sampler`): this module is the rollout wrapper - Tunix's
engine contract, text in and out, which weights sample (live, a pinned snapshot, LoRA-merged, or a guarded
disaggregated sync), chunking a call into buckets and the per-call RNG - over `decode.MaxTextSampler`, which runs
MaxText's prefill + decode as one jitted program per shape bucket. The units under it are each in their own
module: `bucketing.py` (shapes), `kv_cache.py` (MaxText KVCache surgery), `sampling.py` (token draws and their
log-probs), `stops.py` (where a completion ends: the completion policy is stated there).

Shapes are bucketed (`rollout_prefill_buckets`, `rollout_batch_buckets`) and the compiled executable is cached per
(batch bucket, prompt bucket, max_new_tokens, num_generations, sampling filters), so an RL run compiles a handful
of programs, not one per step (`compile_count` counts them).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional, Sequence, Tuple

from absl import logging
from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
import numpy as np
from tunix.rl import common as tunix_common
from tunix.rl import reshard as tunix_reshard
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.rollout import bucketing
from maxtext_rl_plugin.rollout import contract
from maxtext_rl_plugin.rollout import decode
from maxtext_rl_plugin.rollout import embedded_spec
from maxtext_rl_plugin.rollout import quantized_weights
from maxtext_rl_plugin.rollout import sampling
from maxtext_rl_plugin.rollout import stops


@dataclasses.dataclass
class GenerationResult:
  """Completions for N = num_prompts * num_generations rows; rows of one prompt are contiguous."""

  tokens: np.ndarray  # [N, T] int32, right-padded with pad_id; includes the stop token when there is one
  lengths: np.ndarray  # [N] int32, number of real completion tokens (mask = arange(T) < lengths)
  logps: np.ndarray  # [N, T] float32, log-prob of each sampled token (0 after `lengths`)
  prompt_lengths: np.ndarray  # [N] int32
  left_padded_prompts: np.ndarray  # [N, Lp] int32, prompts left-padded with pad_id
  texts: list[str]  # decoded completions (special tokens skipped)
  finish_reason: list[str]  # "eos" | "stop_token" | "stop_string" | "length"
  # [N, Lp + T, layers, k] int32 on MoE models: the experts each prompt and completion token was routed to, laid out
  # like the trainer's input (moe.py); -1 where nothing was routed. None on dense models.
  routing: np.ndarray | None = None

  @property
  def mask(self) -> np.ndarray:
    return np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]


class EmbeddedRollout(contract.RolloutEngine):
  """JAX KV-cache rollout engine over a `TunixMaxTextAdapter` (see the module docstring).

  Tunix constructs it as `cls(rollout_actor=, tokenizer=, mesh=, rollout_config=)`; the run binds the rest with
  `functools.partial(EmbeddedRollout, **run.engine.embedded_arguments(sampler_config, mesh))` (the spec's `bind`):
  `settings`, what it reads of the sampler's config (embedded_spec.EmbeddedSettings), and `decode_models`, MaxText's
  abstract decode models on `mesh` (run/engine.decode_models: MaxText's model creation takes the config whole).
  """

  def __init__(
      self,
      rollout_actor: Any,
      tokenizer: Any,
      mesh: jax.sharding.Mesh,
      rollout_config: Optional[base_rollout.RolloutConfig] = None,
      *,
      settings: embedded_spec.EmbeddedSettings,
      decode_models: dict[str, Any],
  ):
    self.settings = settings
    self._actor = _on_rollout_mesh(rollout_actor, mesh, settings.decode.logical_axis_rules)
    self._tokenizer = tokenizer
    self._mesh = mesh
    self._rollout_config = rollout_config

    self._pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    self._eos_id = int(tokenizer.eos_token_id)
    extra = list(settings.stop_token_ids)
    # The pad id ends a completion too (stops.pad_stops says why: the trainer cannot represent a sampled pad token
    # mid-row). Like any pad-valued stop token it is kept as the row's last token and Tunix's 'not pad' completion
    # mask leaves it untrained (GenerationResult.lengths still counts it).
    self._stop_ids = list(dict.fromkeys([self._eos_id, *extra, *stops.pad_stops(self._pad_id, self._eos_id)]))
    self._stop_strings = list(settings.stop_strings)
    self._prefill_buckets = list(settings.prefill_buckets)
    self._batch_buckets = list(settings.batch_buckets)
    self._default_sampling = sampling.SamplingParams.create(settings.temperature, settings.top_k, settings.top_p)
    self._default_new_tokens = settings.max_new_tokens
    self._vocab_size = settings.vocab_size

    self.sampler = decode.MaxTextSampler(
        settings.decode, decode_models, mesh, self._pad_id, record_routing=settings.record_routing
    )
    # Routing of the Tunix generate() calls since the last take_routing(), per thread: the rollout producer's
    # (run/async_rollout.py) and the evaluation's calls may overlap.
    self._routing = threading.local()
    self._rest: dict | None = None  # RNG-stream state of the decode model (never drawn from; built once)
    self._generate_calls = 0
    self.last_decode_steps = 0  # tokens generated by the last call's decode loop (< max_new_tokens on early exit)
    self._logps_fns: dict[Any, Any] = {}
    self._lora_merger = None
    if lora_lib.has_adapters(self._actor):
      self._lora_merger = lora_lib.Merger(settings.lora_scale, settings.param_scan_axis)
    # rollout_quantization: the kernels it samples with are int8/FP8, read back in the decode program
    self._quantized = None
    if settings.quantization:
      self._quantized = quantized_weights.SamplerWeights(
          settings.quantization,
          scan_axis=settings.param_scan_axis if settings.scan_layers else None,
          dtype=settings.decode.weight_dtype,
      )
    if self._quantized is not None:
      logging.info("EmbeddedRollout: sampling with %s weights (rollout_quantization)", self._quantized.form.name)
    logging.info(
        "EmbeddedRollout: stop ids %s, stop strings %s, data-parallel %d over %s",
        self._stop_ids,
        self._stop_strings,
        self.sampler.dp,
        self.sampler.batch_axes,
    )

  @property
  def compile_count(self) -> int:
    """Programs compiled so far (a handful per run: one per shape bucket)."""
    return self.sampler.compile_count

  @property
  def compile_seconds(self) -> float:
    return self.sampler.compile_seconds

  # ------------------------------------------------------------------ Tunix BaseRollout contract
  def pad_id(self) -> int:
    return self._pad_id

  def eos_id(self) -> int:
    return self._eos_id

  def model(self) -> Any:
    return self._actor

  spec = embedded_spec.ENGINE
  # `prompt_offset` (contract.py), when set: generation j of prompt i draws its step-t token with
  # fold_in(fold_in(fold_in(rng, prompt_offset + i), j), t), so a row samples the same tokens however the batch is split
  # across calls, chunks, buckets and processes. `weight_sync` (contract.py): the chunked, guarded trainer -> sampler
  # copy its `update_params` runs on disaggregated runs.
  # Set by `snapshot_weights`: the weights generate() samples with instead of the actor's current ones.
  _pinned: Any = None

  def snapshot_weights(self) -> None:
    """The contract's snapshot (until the next one, or `release_snapshot`).

    For rollouts that run ahead of the trainer on a colocated engine (run/async_rollout.py): the actor's arrays are the
    trainer's and change under the producer. `nnx.state` returns the model's live Variables (an update shows through
    them), so the snapshot is a new tree of Variables over the current arrays: JAX arrays are immutable and Tunix's
    train step donates only the optimizer, so this keeps that weight version alive without copying it.
    """
    self._pinned = jax.tree.map(lambda x: x, self._decode_params())

  def release_snapshot(self) -> None:
    self._pinned = None

  def update_params(self, params: Any, filter_types: Optional[Tuple[Any, ...]] = None) -> None:
    """Install new weights; the next generate() uses them without recompiling.

    With a `weight_sync` (disaggregated runs) the trainer's params are resharded onto this engine's shardings in
    chunks (freeing the old buffers chunk by chunk), installed, and then compared with the trainer's by the sync's
    guard, so a bug in the install step is caught too. Without one, they are installed as Tunix's engines do.
    """
    if self.weight_sync is not None:
      filt = tuple(filter_types) if filter_types else (nnx.Param,)
      if self._quantized is not None and self._lora_merger is None:
        self._sync_quantized(params, filt)
        return

      def apply(new):
        self._install(new, None)
        return nnx.state(self._actor, *filt)

      self.weight_sync.sync(params, current=nnx.state(self._actor, *filt), apply=apply)
      return
    self._install(params, filter_types)

  def _sync_quantized(self, params: Any, filt: tuple) -> None:
    """A quantized sampler's sync: the trainer's weights quantized on its own devices, in chunks; the sync moves the
    quantized bytes and the scales onto this engine's shardings (the previous version's released chunk by chunk) and
    its guard compares them with the trainer's side (rollout/quantized_weights.py)."""
    current = self._quantized.held
    if current is None:  # the first sync: the version this engine was built with is the destination layout
      current = self._quantized.quantize(nnx.state(self._actor, *filt))
    self.weight_sync.sync(self._quantized.quantize(params), current=current, apply=self._quantized.install)

  def _install(self, params: Any, filter_types: Optional[Tuple[Any, ...]] = None) -> None:
    """Swap the actor's weights in place (resharded by Tunix when `filter_types` is given, else as they are)."""
    if filter_types is not None:
      params = tunix_reshard.reshard_pytree(params, nnx.state(self._actor, filter_types))
    dst = nnx.state(self._actor, nnx.Param)
    dst_dtype = jax.tree.leaves(dst)[0].dtype
    params = jax.tree.map(lambda x: x.astype(dst_dtype) if x.dtype != dst_dtype else x, params)
    nnx.update(self._actor, params)

  def generate(
      self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs
  ) -> base_rollout.RolloutOutput:
    """Tunix entry: GRPO passes each prompt repeated `num_generations` times consecutively; such runs
    are prefilled once and sampled G times."""
    del kwargs
    self._rollout_config = rollout_config
    ids = [self._tokenizer.encode(p) for p in prompts]
    max_prompt = int(rollout_config.max_prompt_length)
    if any(len(x) > max_prompt for x in ids):
      logging.warning(
          "EmbeddedRollout: prompts longer than max_prompt_length=%d are cut to their last tokens", max_prompt
      )
      ids = [x[-max_prompt:] for x in ids]
    unique, group = bucketing.consecutive_groups(ids)
    eos_tokens = rollout_config.eos_tokens
    params = sampling.SamplingParams.create(rollout_config.temperature, rollout_config.top_k, rollout_config.top_p)
    seed = rollout_config.seed
    rng = seed if isinstance(seed, jax.Array) else jax.random.PRNGKey(0 if seed is None else int(seed))
    # Tunix passes the same RolloutConfig.seed (None) every step: fold in a call counter so steps differ.
    # A caller that sets a seed per call (the plugin's trainer: a function of rollout_seed and the step,
    # so a resumed run samples like an uninterrupted one) gets exactly that seed.
    self._generate_calls += 1
    if seed is None:
      rng = jax.random.fold_in(rng, self._generate_calls)
    res = self.generate_tokens(
        unique,
        num_generations=group,
        max_new_tokens=int(rollout_config.max_tokens_to_generate),
        rng=rng,
        sampling_params=params,
        extra_stop_ids=eos_tokens,
        prompt_pad_to=max_prompt,
    )
    if self.prompt_offset is not None:  # Tunix's micro-batches are consecutive calls: the next one's prompts follow
      self.prompt_offset += len(unique)
    if res.routing is not None:
      self._routing.calls = getattr(self._routing, "calls", []) + [res.routing]
    return base_rollout.RolloutOutput(
        text=res.texts,
        logits=None,
        tokens=[res.tokens[i, : res.lengths[i]] for i in range(len(res.texts))],
        left_padded_prompt_tokens=res.left_padded_prompts,
        logprobs=[res.logps[i, : res.lengths[i]] for i in range(len(res.texts))],
    )

  def take_routing(self) -> np.ndarray | None:
    """The contract's routing (Tunix's rollout micro-batches are consecutive calls, so their rows concatenate in
    order); None on a dense model."""
    routing, self._routing.calls = getattr(self._routing, "calls", []), []
    return np.concatenate(routing, axis=0) if routing else None

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
    """The contract's turn (contract.RolloutEngine.generate_turn), through `generate_tokens`: a first turn's G rows
    share one prefill.

    The transcript is prefilled again each turn rather than appended to the previous turn's KV cache: the decode
    program returns tokens, not its cache (keeping [N, L+T] caches alive on device across a host round trip per turn,
    and compiling a second "append to an existing cache" program per bucket, is not built yet). Measured
    (`python -m maxtext_rl_plugin.bench agentic`, docs/agentic.md): re-prefill is a quarter of a turn at the CPU demo's
    48-token transcripts and most of a turn at 512 tokens, so cache reuse is the next step for long transcripts.
    """
    params = sampling.SamplingParams.create(rollout_config.temperature, rollout_config.top_k, rollout_config.top_p)
    res = self.generate_tokens(
        [list(c) for c in contexts],
        num_generations=num_generations,
        max_new_tokens=max_new_tokens,
        rng=rng,
        sampling_params=params,
        extra_stop_ids=rollout_config.eos_tokens,
        stop_strings=list(self._stop_strings) + [s for s in stop_strings if s not in self._stop_strings],
    )
    return [
        (res.tokens[i, : res.lengths[i]], res.logps[i, : res.lengths[i]], res.finish_reason[i])
        for i in range(len(res.lengths))
    ]

  def get_per_token_logps(
      self, prompt_tokens: jax.Array, completion_tokens: jax.Array, temperature: float | None = None
  ) -> jax.Array:
    """Log-probs of `completion_tokens` under the rollout weights (full forward, no cache), at the
    rollout temperature like Tunix's trainer/reference log-probs."""
    if temperature is None:
      temperature = (
          self._rollout_config.temperature if self._rollout_config is not None else self._default_sampling.temperature
      )
    temperature = float(temperature) if temperature and temperature > 0 else 1.0
    graphdef, state = nnx.split(self._actor)
    fn = self._logps_fns.get(temperature)  # the actor's graph is fixed; weights are an argument
    if fn is None:

      def _logps(state, prompt_tokens, completion_tokens):
        return tunix_common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            pad_id=self._pad_id,
            eos_id=self._eos_id,
            stop_gradient=True,
            return_logits=False,
            temperature=temperature,
        )

      fn = self._logps_fns[temperature] = jax.jit(_logps)
    with self._mesh, logical_axis_rules(self.settings.decode.logical_axis_rules):
      return fn(
          state,
          distributed.global_batch(prompt_tokens, self._mesh, self.sampler.batch_axes),
          distributed.global_batch(completion_tokens, self._mesh, self.sampler.batch_axes),
      )

  # ------------------------------------------------------------------ direct API
  def generate_tokens(
      self,
      prompt_token_lists: Sequence[Sequence[int]],
      *,
      num_generations: int = 1,
      greedy: bool = False,
      max_new_tokens: int | None = None,
      rng: jax.Array | None = None,
      sampling_params: sampling.SamplingParams | None = None,
      extra_stop_ids: Sequence[int] | None = None,
      stop_strings: Sequence[str] | None = None,
      prompt_pad_to: int | None = None,
      ignore_stop: bool = False,
  ) -> GenerationResult:
    """Generates `num_generations` completions per prompt (token ids, no padding, >= 1 token each).

    Sampling defaults to the config's decode_sampling_* keys; `greedy=True` forces argmax.
    `max_new_tokens` defaults to max_target_length - max_prefill_predict_length. Rows of prompt i are
    i*G .. i*G+G-1. `extra_stop_ids` add to EOS + stop_token_ids; `stop_strings` replaces the config's.
    `prompt_pad_to` fixes the width of `left_padded_prompts` (Tunix wants a constant one).
    `ignore_stop=True` always generates `max_new_tokens` (benchmarks; like vLLM's ignore_eos).
    """
    if not prompt_token_lists:
      raise ValueError("generate_tokens needs at least one prompt")
    if any(len(p) == 0 for p in prompt_token_lists):
      raise ValueError("generate_tokens: every prompt needs at least one token")
    G = int(num_generations)
    T = int(max_new_tokens if max_new_tokens is not None else self._default_new_tokens)
    if T < 1 or G < 1:
      raise ValueError(f"max_new_tokens ({T}) and num_generations ({G}) must be >= 1")
    params = sampling_params or self._default_sampling
    if greedy:
      params = dataclasses.replace(params, greedy=True)
    spec = params.spec(self._vocab_size)
    stop_ids = list(self._stop_ids) + [int(t) for t in (extra_stop_ids or []) if int(t) not in self._stop_ids]
    if ignore_stop:
      stop_ids, stop_strings = [], []
    rng = jax.random.PRNGKey(0) if rng is None else rng
    self.last_decode_steps = 0
    strings = self._stop_strings if stop_strings is None else [x for x in stop_strings if x]
    stop_seqs = stops.stop_sequences(self._tokenizer, strings)

    # Chunk so one call never exceeds the largest batch bucket.
    max_rows = max(*self._batch_buckets, G)
    per_call = max(1, max_rows // G)
    parts = []
    for start in range(0, len(prompt_token_lists), per_call):
      chunk = prompt_token_lists[start : start + per_call]
      packed = bucketing.pack(
          chunk,
          G,
          prefill_buckets=self._prefill_buckets,
          batch_buckets=self._batch_buckets,
          dp=self.sampler.dp,
          pad_id=self._pad_id,
      )
      if self.prompt_offset is None:
        rng, sub = jax.random.split(rng)
      else:
        sub = sampling.row_keys(rng, self.prompt_offset + start, packed.prompts * G, G)
      parts.append(self._generate_chunk(packed, len(chunk) * G, T, spec, params, stop_ids, stop_seqs, sub))
    tokens = np.concatenate([p[0] for p in parts])
    logps = np.concatenate([p[1] for p in parts])
    prompt_lens = np.repeat(np.array([len(p) for p in prompt_token_lists], np.int32), G)
    left = bucketing.left_padded(prompt_token_lists, G, prompt_pad_to or 0, self._pad_id)
    res = self._finalize(tokens, logps, prompt_lens, left, stop_ids, strings)
    if parts[0][2] is not None:
      routing = np.concatenate([moe.pad_layout(p[2][0], p[2][1], left.shape[1], T) for p in parts])
      # Tokens past a completion's end (host stop-string cuts) were routed but are not part of it.
      routing[:, left.shape[1] :][~res.mask] = moe.UNSET
      res.routing = routing
    return res

  # ------------------------------------------------------------------ internals
  def _generate_chunk(self, packed, rows, new_tokens, spec, params, stop_ids, stop_seqs, rng):
    """(tokens, log-probs, routing or None) of the first `rows` decode rows of one packed call, with the weights that
    sample now."""
    stop_arr = stops.stop_id_array(stop_ids)
    generations = packed.active.size // packed.prompts
    key = decode.CompileKey(packed.prompts, generations, packed.prompt_len, new_tokens, spec, len(stop_arr))
    state = self._pinned if self._pinned is not None else self._decode_params()
    if self._rest is None:
      self._rest = self.sampler.rest_state(self._actor.base)
    tokens, logps, steps, routes = self.sampler.run(state, self._rest, packed, key, rng, params, stop_arr, stop_seqs)
    self.last_decode_steps = max(self.last_decode_steps, steps)
    return tokens[:rows], logps[:rows], None if routes is None else (routes[0][:rows], routes[1][:rows])

  def _decode_params(self):
    """The decode program's weights: the actor's params; on a LoRA actor, the base with the current adapters merged
    in (the decode model is MaxText's plain one; re-merged only after the adapters change, see lora.Merger)."""
    if self._quantized is not None and self._quantized.held is not None:
      return self._quantized.held["base"]  # the version the last quantized sync installed
    if self._lora_merger is None:
      params = nnx.state(self._actor.base, nnx.Param)
    else:
      params = self._lora_merger.merged(self._actor.base)
    return params if self._quantized is None else self._quantized.of(params)

  def _finalize(self, tokens, logps, prompt_lens, left, stop_ids, stop_strings) -> GenerationResult:
    """Lengths from the first stop token, then host-side stop-string cuts; pads/zeros after the end."""
    lengths, reasons = stops.completion_ends(tokens, stop_ids, self._eos_id, self._tokenizer, stop_strings)
    mask = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    tokens = np.where(mask, tokens, self._pad_id).astype(np.int32)
    logps = np.where(mask, logps, 0.0).astype(np.float32)
    texts = self._tokenizer.batch_decode(
        [tokens[i, : lengths[i]].tolist() for i in range(len(lengths))], skip_special_tokens=True
    )
    return GenerationResult(tokens, lengths, logps, prompt_lens, left, list(texts), reasons)


def _on_rollout_mesh(actor: Any, mesh: jax.sharding.Mesh, rules: Any) -> Any:
  """The actor itself when it already lives on the rollout mesh (colocated), else the sampler's own copy.

  Tunix hands class-based engines the trainer's module; in a disaggregated run sampling on it would
  use the trainer's devices and Tunix would never sync weights (it sees shared arrays). The copy is
  laid out on the rollout mesh by MaxText's logical axis rules, from the trainer's current weights, so
  step 0 samples the trainer's weights; later syncs go through `resharding` (RLCluster.sync_weights).
  """
  leaves = jax.tree.leaves(nnx.state(actor, nnx.Param))
  actor_devices = set().union(*(set(x.sharding.device_set) for x in leaves)) if leaves else set()
  if actor_devices <= set(mesh.devices.flat):
    return actor
  logging.info(
      "EmbeddedRollout: disaggregated (trainer on %d devices, rollout mesh %s); copying the actor onto the "
      "rollout mesh",
      len(actor_devices),
      dict(mesh.shape),
  )
  with logical_axis_rules(rules):
    return move.model_on_mesh(actor, mesh, rules)
