"""Embedded KV-cache rollout engine on MaxText's own model code (the CPU/GPU default; Tunix `BaseRollout`).

MaxText's MaxEngine/OfflineEngine need JetStream (see NOTES.md), so this engine drives the MaxText
`Transformer` directly the way MaxEngine's `_nnx_run_model` does: merge (graphdef, params, nnx.Cache
state, rest), call with `model_mode=MODEL_MODE_PREFILL` then `MODEL_MODE_AUTOREGRESSIVE`, read the
cache back with `nnx.state(model, nnx.Cache)`.

One jitted program per compile key does everything on device:
  1. batched prefill of left-padded prompts (segment id 0 on pads, per-row positions starting at 0 at the
     first real token), so MaxText's prefill cache holds every prompt once;
  2. `num_generations` samples per prompt by `jnp.repeat`-ing the prefill cache and last logits over the
     batch axis (the shared prompt is never re-prefilled);
  3. a `lax.while_loop` decode over MaxText's autoregressive cache, with per-row stop on EOS / any
     `stop_token_ids`, exiting early once every row has stopped; sampled tokens and their log-probs
     (see `sampling.py` for which log-prob) are written into fixed [N, T] buffers.
Stop *strings* end a row on device when its last tokens equal the string's own tokenization (early
exit), and are decided on host after the loop: the row is cut at the first token whose decoded prefix
contains one (which also catches other tokenizations); tokens, log-probs and lengths are cut together.

Shapes are bucketed (`rollout_prefill_buckets`, `rollout_batch_buckets`) and the compiled executable is
cached per (batch bucket, prompt bucket, max_new_tokens, num_generations, sampling filters), so an RL
run compiles a handful of programs, not one per step (`compile_count` counts them).

Completion policy (plugin-wide): a completion INCLUDES its stop token (EOS or a stop-token id), positions
after it are pad, so Tunix's "not pad" completion mask is 1 up to and including the stop token. A row that
runs out of budget has no stop token.

MaxText bakes the decode batch size and the AR-cache length into static `KVCache` attributes at
construction (`micro_batch_size_to_train_on`, `max_target_length - max_prefill_predict_length`); they
decide the shape of the "active" segment-id write and the wrap-around of the AR write index. The engine
therefore builds the decode-mode model abstractly once (`nnx.eval_shape`, no weights) and sets those
three attributes per compile key before taking its graphdef; the weights are always the rollout actor's.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Any, Optional, Sequence, Tuple

from absl import logging
from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
from tunix.rl import common as tunix_common
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin.rollout import sampling

# nnx.Cache leaf names of MaxText's standard `KVCache` and their logical layout.
_KV_LEAVES = {
    "cached_prefill_key": "prefill",
    "cached_prefill_value": "prefill",
    "cached_prefill_key_scale": "prefill",
    "cached_prefill_value_scale": "prefill",
    "cached_ar_key": "ar",
    "cached_ar_value": "ar",
    "cached_ar_key_scale": "ar",
    "cached_ar_value_scale": "ar",
}
_SEG_LEAVES = {"cache_prefill_segment_id": "prefill", "cache_ar_segment_id": "ar"}
# In-loop stop-string early exit: up to 8 stop strings of up to 16 tokens (fixed so they never recompile).
_MAX_STOP_SEQS = 8
_STOP_WINDOW = 16


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

  @property
  def mask(self) -> np.ndarray:
    return np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]


def _next_bucket(n: int, buckets: Sequence[int]) -> int:
  """Smallest bucket >= n; beyond the largest, the next multiple of the largest (logged)."""
  buckets = sorted(int(b) for b in buckets)
  i = bisect.bisect_left(buckets, n)
  if i < len(buckets):
    return buckets[i]
  top = buckets[-1]
  return -(-n // top) * top


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class _Key:
  prompts: int  # prefill batch (prompts per call, padded)
  generations: int
  prompt_len: int
  new_tokens: int
  spec: sampling.SamplingSpec
  num_stop_ids: int


class EmbeddedRollout(base_rollout.BaseRollout):
  """JAX KV-cache rollout engine over a `TunixMaxTextAdapter` (see the module docstring).

  Tunix constructs it as `cls(rollout_actor=, tokenizer=, mesh=, rollout_config=)`; bind the plugin
  config with `functools.partial(EmbeddedRollout, config=cfg)` (else the actor's MaxText config is used).
  """

  def __init__(
      self,
      rollout_actor: Any,
      tokenizer: Any,
      mesh: jax.sharding.Mesh,
      rollout_config: Optional[base_rollout.RolloutConfig] = None,
      *,
      config: Any = None,
  ):
    from maxtext.common import common_types  # pylint: disable=import-outside-toplevel
    from maxtext.inference import kvcache  # pylint: disable=import-outside-toplevel
    from maxtext.utils import model_creation_utils  # pylint: disable=import-outside-toplevel

    self._actor = _on_rollout_mesh(rollout_actor, mesh, (config if config is not None else rollout_actor.base.config))
    self._tokenizer = tokenizer
    self._mesh = mesh
    self._rollout_config = rollout_config
    self.config = config if config is not None else rollout_actor.base.config
    cfg = self.config
    self._modes = (common_types.MODEL_MODE_PREFILL, common_types.MODEL_MODE_AUTOREGRESSIVE)

    self._pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    self._eos_id = int(tokenizer.eos_token_id)
    extra = [int(t) for t in (getattr(cfg, "stop_token_ids", None) or [])]
    self._stop_ids = [self._eos_id] + [t for t in dict.fromkeys(extra) if t != self._eos_id]
    self._stop_strings = [s for s in (getattr(cfg, "stop_strings", None) or []) if s]
    if self._pad_id in self._stop_ids:
      logging.warning(
          "EmbeddedRollout: stop token %d is also the pad id; Tunix's 'not pad' completion mask will "
          "not train it (GenerationResult.lengths still counts it)",
          self._pad_id,
      )
    self._prefill_buckets = list(getattr(cfg, "rollout_prefill_buckets", None) or [32, 64, 128, 256, 512, 1024, 2048])
    self._batch_buckets = list(getattr(cfg, "rollout_batch_buckets", None) or [1, 2, 4, 8, 16, 32, 64, 128, 256])
    self._default_sampling = sampling.SamplingParams.create(
        getattr(cfg, "decode_sampling_temperature", 1.0),
        getattr(cfg, "decode_sampling_top_k", 0),
        getattr(cfg, "decode_sampling_nucleus_p", 1.0),
    )
    self._default_new_tokens = int(cfg.max_target_length) - int(cfg.max_prefill_predict_length)
    self._vocab_size = int(cfg.vocab_size)

    # Decode-capable abstract models (shapes only); their graphdefs are merged with the actor's weights.
    with warnings_off(), logical_axis_rules(cfg.logical_axis_rules):
      self._abstract = {
          mode: nnx.eval_shape(model_creation_utils.get_nnx_create_model_fn(cfg, mesh=mesh, model_mode=mode))
          for mode in self._modes
      }
    self._kv_modules = {
        mode: [m for _, m in nnx.iter_graph(model) if isinstance(m, kvcache.KVCache)]
        for mode, model in self._abstract.items()
    }
    if not self._kv_modules[self._modes[1]]:
      raise NotImplementedError(f"model {cfg.model_name} has no MaxText KVCache in autoregressive mode")
    for m in self._kv_modules[self._modes[1]]:
      if getattr(m, "is_gdn", False) or getattr(m, "is_deepseek_v4", False) or type(m) is not kvcache.KVCache:
        raise NotImplementedError(f"embedded rollout supports MaxText's standard KVCache only, not {type(m).__name__}")
    kv0 = self._kv_modules[self._modes[1]][0]
    self._axis_order = {"prefill": tuple(kv0.prefill_cache_axis_order), "ar": tuple(kv0.ar_cache_axis_order)}
    _, cache_abs, _ = nnx.split(self._abstract[self._modes[1]], nnx.Cache, ...)
    self._cache_template = nnx.to_pure_dict(cache_abs)

    # Data parallelism: the batch goes over the mesh axes MaxText maps "activation_batch" to.
    rules = dict((k, v) for k, v in reversed(list(cfg.logical_axis_rules)))  # first rule wins
    axes = rules.get("activation_batch", ())
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    self._batch_axes = tuple(a for a in axes if a in mesh.shape)
    self._dp = int(np.prod([mesh.shape[a] for a in self._batch_axes])) if self._batch_axes else 1
    # MaxText's rules replicate the KV cache over the data axes (`cache_batch: []`: its serving engines
    # run one replica per data shard). Here one program serves the whole data-parallel batch, so the cache
    # is sharded over the same axes as the batch (first matching rule wins, so prepending overrides).
    self._rules = tuple((name, self._batch_axes) for name in ("cache_batch", "cache_batch_prefill")) + tuple(
        (k, v) for k, v in cfg.logical_axis_rules if k not in ("cache_batch", "cache_batch_prefill")
    )

    self._compiled: dict[Any, Any] = {}
    self._rest: dict | None = None  # RNG-stream state of the decode model (never drawn from; built once)
    self.compile_count = 0
    self._generate_calls = 0
    self.last_decode_steps = 0  # tokens generated by the last call's decode loop (< max_new_tokens on early exit)
    self.compile_seconds = 0.0
    self._logps_fns: dict[Any, Any] = {}
    self._lora_merger = lora_lib.Merger(cfg) if lora_lib.has_adapters(self._actor) else None
    logging.info(
        "EmbeddedRollout: stop ids %s, stop strings %s, data-parallel %d over %s",
        self._stop_ids,
        self._stop_strings,
        self._dp,
        self._batch_axes,
    )

  # ------------------------------------------------------------------ Tunix BaseRollout contract
  def pad_id(self) -> int:
    return self._pad_id

  def eos_id(self) -> int:
    return self._eos_id

  def model(self) -> Any:
    return self._actor

  # Set by `resharding.attach_to_rl_cluster` on disaggregated runs: the chunked, guarded trainer -> sampler copy.
  weight_sync: Any = None
  # When set (the plugin's trainer with a per-host sampler mesh), sampling keys are per row: generation j of prompt i
  # draws its step-t token with fold_in(fold_in(fold_in(rng, prompt_offset + i), j), t), so a row samples the same
  # tokens however the batch is split across calls, chunks, buckets and processes (each process samples its own
  # prompts and passes their global index). None: one key per call for the whole batch (the default).
  prompt_offset: Optional[int] = None
  # Set by `snapshot_weights`: the weights generate() samples with instead of the actor's current ones.
  _pinned: Any = None

  def snapshot_weights(self) -> None:
    """From now on sample with the actor's weights as they are now, even while the actor is updated, until the next
    snapshot (`release_snapshot` returns to the live weights).

    For rollouts that run ahead of the trainer on a colocated engine (async_rollout.py): the actor's arrays are the
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

      def apply(new):
        self._install(new, None)
        return nnx.state(self._actor, *filt)

      self.weight_sync.sync(params, current=nnx.state(self._actor, *filt), apply=apply)
      return
    self._install(params, filter_types)

  def _install(self, params: Any, filter_types: Optional[Tuple[Any, ...]] = None) -> None:
    """Swap the actor's weights in place (resharded by Tunix when `filter_types` is given, else as they are)."""
    if filter_types is not None:
      from tunix.rl import reshard  # pylint: disable=import-outside-toplevel

      params = reshard.reshard_pytree(params, nnx.state(self._actor, filter_types))
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
    unique, group = _consecutive_groups(ids)
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
    return base_rollout.RolloutOutput(
        text=res.texts,
        logits=None,
        tokens=[res.tokens[i, : res.lengths[i]] for i in range(len(res.texts))],
        left_padded_prompt_tokens=res.left_padded_prompts,
        logprobs=[res.logps[i, : res.lengths[i]] for i in range(len(res.texts))],
    )

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
    with self._mesh, logical_axis_rules(self.config.logical_axis_rules):
      return fn(
          state,
          distributed.global_batch(prompt_tokens, self._mesh, self._batch_axes),
          distributed.global_batch(completion_tokens, self._mesh, self._batch_axes),
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
    stop_seqs = self._stop_sequences(strings)

    # Chunk so one call never exceeds the largest batch bucket.
    max_rows = max(max(self._batch_buckets), G)
    per_call = max(1, max_rows // G)
    parts = []
    for start in range(0, len(prompt_token_lists), per_call):
      if self.prompt_offset is None:
        rng, sub = jax.random.split(rng)
      else:
        sub = _row_keys(
            rng,
            self.prompt_offset + start,
            _next_bucket(min(per_call, len(prompt_token_lists) - start) * G, self._batch_buckets),
            G,
            self._dp,
        )
      parts.append(
          self._generate_chunk(prompt_token_lists[start : start + per_call], G, T, spec, params, stop_ids, stop_seqs, sub)
      )
    tokens = np.concatenate([p[0] for p in parts])
    logps = np.concatenate([p[1] for p in parts])
    prompt_lens = np.repeat(np.array([len(p) for p in prompt_token_lists], np.int32), G)
    width = max(int(prompt_pad_to or 0), int(prompt_lens.max()))
    left = np.full((len(prompt_lens), width), self._pad_id, np.int32)
    for i, p in enumerate(prompt_token_lists):
      left[i * G : (i + 1) * G, width - len(p) :] = np.asarray(p, np.int32)
    return self._finalize(tokens, logps, prompt_lens, left, stop_ids, strings)

  # ------------------------------------------------------------------ internals
  def _stop_sequences(self, strings: Sequence[str]) -> np.ndarray:
    """[_MAX_STOP_SEQS, _STOP_WINDOW] token ids of each stop string's own tokenization, right-aligned,
    -1 = wildcard, rows of -2 never match. Only an early-exit hint for the decode loop: the host-side
    text check in _finalize decides where a row ends (other tokenizations of a stop string are found
    there, just without the early exit)."""
    seqs = np.full((_MAX_STOP_SEQS, _STOP_WINDOW), -2, np.int32)
    row = 0
    for text in strings:
      ids = self._tokenizer.encode(text, add_special_tokens=False)
      if not ids or len(ids) > _STOP_WINDOW or row == _MAX_STOP_SEQS:
        continue
      seqs[row] = -1
      seqs[row, _STOP_WINDOW - len(ids) :] = ids
      row += 1
    return seqs

  def _generate_chunk(self, prompts, G, T, spec, params, stop_ids, stop_seqs, rng):
    n_prompts = len(prompts)
    lp = _next_bucket(max(len(p) for p in prompts), self._prefill_buckets)
    rows = _next_bucket(n_prompts * G, self._batch_buckets)
    pb = _round_up(max(1, -(-rows // G)), self._dp)  # prefill batch: whole groups, divisible by the dp size
    toks = np.full((pb, lp), self._pad_id, np.int32)
    lens = np.ones((pb,), np.int32)
    for i, p in enumerate(prompts):
      toks[i, lp - len(p) :] = np.asarray(p, np.int32)
      lens[i] = len(p)
    active = np.zeros((pb * G,), bool)
    active[: n_prompts * G] = True
    # Stop ids padded to a multiple of 8 with -1 (never sampled) so adding one does not recompile.
    stop_arr = np.full((max(8, _round_up(len(stop_ids), 8)),), -1, np.int32)
    stop_arr[: len(stop_ids)] = stop_ids
    key = _Key(pb, G, lp, T, spec, len(stop_arr))
    state = self._pinned if self._pinned is not None else self._decode_params()
    if self._rest is None:
      self._rest = self._rest_state()
    rest = self._rest
    batch_sh = NamedSharding(self._mesh, P(self._batch_axes or None))
    args = (
        state,
        rest,
        # Every process holds the same prompts (distributed.py); each places the shards its devices hold.
        distributed.global_array(toks, NamedSharding(self._mesh, P(self._batch_axes or None, None))),
        distributed.global_array(lens, batch_sh),
        distributed.global_array(active, batch_sh),
        distributed.replicated(rng, self._mesh) if np.ndim(rng) == 1 else distributed.global_array(rng, batch_sh),
        distributed.replicated(np.float32(params.temperature), self._mesh),
        distributed.replicated(np.float32(params.top_p), self._mesh),
        distributed.replicated(stop_arr, self._mesh),
        distributed.replicated(stop_seqs, self._mesh),
    )
    sig = (
        key,
        jax.tree.structure(args),
        tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(args[:2])),
        np.shape(rng),  # one key, or one per row (prompt_offset)
    )
    compiled = self._compiled.get(sig)
    with self._mesh, logical_axis_rules(self._rules):
      if compiled is None:
        t0 = time.perf_counter()
        with warnings_off():
          compiled = jax.jit(self._program(key)).lower(*args).compile()
        dt = time.perf_counter() - t0
        self.compile_count += 1
        self.compile_seconds += dt
        self._compiled[sig] = compiled
        logging.info("EmbeddedRollout: compiled %s in %.1fs", key, dt)
      out_tokens, out_logps, steps = compiled(*args)
    n = n_prompts * G
    self.last_decode_steps = max(self.last_decode_steps, int(steps))
    return distributed.to_host(out_tokens)[:n], distributed.to_host(out_logps)[:n]

  def _decode_params(self):
    """The decode program's weights: the actor's params; on a LoRA actor, the base with the current adapters merged
    in (the decode model is MaxText's plain one; re-merged only after the adapters change, see lora.Merger)."""
    if self._lora_merger is None:
      return nnx.state(self._actor.base, nnx.Param)
    return self._lora_merger.merged(self._actor.base)

  def _rest_state(self) -> dict:
    """Non-param, non-cache state (RNG streams) of the decode model, taken from the actor where it has it.

    The decode-mode model declares fewer RNG streams than the train-mode actor; inference never draws
    from them (dropout is off), but nnx.merge needs every variable.
    """
    rest_abs = nnx.to_pure_dict(nnx.state(self._abstract[self._modes[1]], nnx.Not(nnx.Any(nnx.Param, nnx.Cache))))
    actor_rest = nnx.to_pure_dict(nnx.state(self._actor.base, nnx.Not(nnx.Any(nnx.Param, nnx.Cache))))

    def pick(path, leaf):
      node = actor_rest
      for k in path:
        node = node.get(k.key) if isinstance(node, dict) else None
      if node is not None and getattr(node, "shape", None) == leaf.shape and node.dtype == leaf.dtype:
        return node
      if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.split(jax.random.key(0), leaf.shape) if leaf.shape else jax.random.key(0)
      return jnp.zeros(leaf.shape, leaf.dtype)

    return jax.tree_util.tree_map_with_path(pick, rest_abs)

  def _graphdef(self, mode: str, batch: int, prompt_len: int, new_tokens: int):
    """Graphdef of the abstract `mode` model with its KVCache statics set for this compile key."""
    for m in self._kv_modules[mode]:
      m.batch = batch
      m.max_prefill_length = prompt_len
      m.max_target_length = prompt_len + new_tokens
    graphdef, _ = nnx.split(self._abstract[mode])
    return graphdef

  def _zero_cache(self, batch: int, prompt_len: int, ar_len: int) -> dict:
    """Zero nnx.Cache pure dict for `batch` rows, a `prompt_len` prefill cache and an `ar_len` AR cache."""
    lengths = {"prefill": prompt_len, "ar": ar_len}

    def make(path, leaf):
      name = path[-1].key
      shape = list(leaf.shape)
      if name in _KV_LEAVES:
        part = _KV_LEAVES[name]
        lead = len(shape) - 4
        order = self._axis_order[part]
        shape[lead + order.index(0)] = batch
        shape[lead + order.index(1)] = lengths[part]
      elif name in _SEG_LEAVES:
        lead = len(shape) - 2
        shape[lead], shape[lead + 1] = batch, lengths[_SEG_LEAVES[name]]
      elif name == "cached_ar_lengths":
        shape[-1] = batch
      elif name != "cache_ar_index":
        raise NotImplementedError(f"unsupported MaxText cache variable {name}")
      return jnp.zeros(shape, leaf.dtype)

    return jax.tree_util.tree_map_with_path(make, self._cache_template)

  def _batch_axis(self, name: str, ndim: int) -> int | None:
    """Batch axis of a MaxText KVCache leaf (leading dims are scanned-layer axes)."""
    if name in _KV_LEAVES:
      return ndim - 4 + self._axis_order[_KV_LEAVES[name]].index(0)
    if name in _SEG_LEAVES:
      return ndim - 2
    if name == "cached_ar_lengths":
      return ndim - 1
    return None

  def _shard_cache(self, cache: dict) -> dict:
    """Pin every cache leaf's batch axis to the data axes (MaxText's own rules replicate the cache)."""
    if self._dp == 1:
      return cache

    def pin(path, leaf):
      axis = self._batch_axis(path[-1].key, leaf.ndim)
      if axis is None:
        return leaf
      spec = [None] * leaf.ndim
      spec[axis] = self._batch_axes
      return jax.lax.with_sharding_constraint(leaf, NamedSharding(self._mesh, P(*spec)))

    return jax.tree_util.tree_map_with_path(pin, cache)

  def _repeat_cache(self, cache: dict, G: int, batch: int, ar_len: int) -> dict:
    """Prefill cache of P prompts -> decode cache of P*G rows (prompt KV repeated, fresh AR cache)."""
    fresh = self._zero_cache(batch, 1, ar_len)

    def expand(path, leaf, zero):
      name = path[-1].key
      if name in _KV_LEAVES and _KV_LEAVES[name] == "prefill":
        return jnp.repeat(leaf, G, axis=leaf.ndim - 4 + self._axis_order["prefill"].index(0))
      if name == "cache_prefill_segment_id":
        return jnp.repeat(leaf, G, axis=leaf.ndim - 2)
      return zero

    return jax.tree_util.tree_map_with_path(expand, cache, fresh)

  def _program(self, key: _Key):
    """The jitted prefill + G-way expansion + decode loop for one compile key."""
    prefill_mode, ar_mode = self._modes
    B, G, L, T = key.prompts, key.generations, key.prompt_len, key.new_tokens
    N = B * G
    gd_prefill = self._graphdef(prefill_mode, B, L, T)
    gd_ar = self._graphdef(ar_mode, N, L, T)
    pad_id = self._pad_id
    spec = key.spec

    def run_model(graphdef, params, rest, cache, tokens, positions, segment_ids, mode):
      _, _, cache_state, rest_state = nnx.split(self._abstract[mode], nnx.Param, nnx.Cache, ...)
      nnx.replace_by_pure_dict(cache_state, cache)
      nnx.replace_by_pure_dict(rest_state, rest)
      model = nnx.merge(graphdef, params, cache_state, rest, copy=True)
      # The decoder's hidden states, then the output head on the last position only: Transformer.__call__
      # would project every prompt position onto the vocabulary (B x L x 150k), which dominates prefill;
      # the decoder's own full-sequence logits are unused and dead-code-eliminated by XLA.
      _, hidden, _ = model.decoder(
          shared_embedding=model.token_embedder,
          decoder_input_tokens=tokens,
          decoder_positions=positions,
          decoder_segment_ids=segment_ids,
          deterministic=True,
          model_mode=mode,
      )[:3]
      logits = model.logits_from_hidden_states_for_vocab_tiling(hidden[:, -1:, :], deterministic=True, model_mode=mode)
      return logits, nnx.to_pure_dict(nnx.state(model, nnx.Cache))

    def stopped(tok, window, stop_ids, stop_seqs):
      """Stop-id hit, or the last generated tokens spell a stop string's tokenization."""
      window = jnp.concatenate([window[:, 1:], tok[:, None]], axis=1)
      seq_hit = jnp.all((stop_seqs[None] == -1) | (window[:, None, :] == stop_seqs[None]), axis=-1).any(-1)
      return jnp.isin(tok, stop_ids) | seq_hit, window

    def program(params, rest, tokens, lens, active, rng, temperature, top_p, stop_ids, stop_seqs):
      # Prefill: left-padded prompts; pads get segment 0 (masked), real tokens positions 0..len-1.
      segment = (jnp.arange(L)[None, :] >= (L - lens)[:, None]).astype(jnp.int32)
      positions = jnp.maximum(jnp.cumsum(segment, axis=1) - 1, 0)
      logits, cache = run_model(
          gd_prefill, params, rest, self._zero_cache(B, L, T), tokens, positions, segment, prefill_mode
      )
      last = jnp.repeat(logits[:, -1, :], G, axis=0)
      cache = self._shard_cache(self._repeat_cache(cache, G, N, T))
      lens_n = jnp.repeat(lens, G)
      per_row = rng.ndim == 2  # [N, 2] raw keys, one per row (prompt_offset)
      if per_row:
        sub = jax.vmap(jax.random.fold_in, in_axes=(0, None))(rng, 0)
      else:
        rng, sub = jax.random.split(rng)
      tok, lp = sampling.sample(last, sub, spec, temperature, top_p, per_row)
      hit, window = stopped(tok, jnp.full((N, _STOP_WINDOW), -2, jnp.int32), stop_ids, stop_seqs)
      done = hit | ~active
      out_tokens = jnp.full((N, T), pad_id, jnp.int32).at[:, 0].set(tok)
      out_logps = jnp.zeros((N, T), jnp.float32).at[:, 0].set(lp)

      def cond(carry):
        step, _, done, *_ = carry
        return (step < T) & ~jnp.all(done)

      def body(carry):
        step, tok, done, cache, out_tokens, out_logps, rng, window = carry
        pos = (lens_n + step - 1)[:, None]
        logits, cache = run_model(gd_ar, params, rest, cache, tok[:, None], pos, None, ar_mode)
        cache = self._shard_cache(cache)
        if per_row:
          sub = jax.vmap(jax.random.fold_in, in_axes=(0, None))(rng, step)
        else:
          rng, sub = jax.random.split(rng)
        new, lp = sampling.sample(logits[:, -1, :], sub, spec, temperature, top_p, per_row)
        new = jnp.where(done, pad_id, new)
        lp = jnp.where(done, 0.0, lp)
        out_tokens = jax.lax.dynamic_update_index_in_dim(out_tokens, new, step, axis=1)
        out_logps = jax.lax.dynamic_update_index_in_dim(out_logps, lp, step, axis=1)
        hit, window = stopped(new, window, stop_ids, stop_seqs)
        return step + 1, new, done | hit, cache, out_tokens, out_logps, rng, window

      carry = (jnp.int32(1), tok, done, cache, out_tokens, out_logps, rng, window)
      steps, _, _, _, out_tokens, out_logps, _, _ = jax.lax.while_loop(cond, body, carry)
      return out_tokens, out_logps, steps

    return program

  def _finalize(self, tokens, logps, prompt_lens, left, stop_ids, stop_strings) -> GenerationResult:
    """Lengths from the first stop token, then host-side stop-string cuts; pads/zeros after the end."""
    N, T = tokens.shape
    stop_set = np.asarray(stop_ids, np.int32)
    lengths = np.full((N,), T, np.int32)
    reasons = ["length"] * N
    for i in range(N):
      hits = np.nonzero(np.isin(tokens[i], stop_set))[0]
      if hits.size:
        lengths[i] = hits[0] + 1
        reasons[i] = "eos" if tokens[i, hits[0]] == self._eos_id else "stop_token"
      if stop_strings:
        cut = _stop_string_cut(self._tokenizer, tokens[i, : lengths[i]], stop_strings)
        if cut is not None and cut < lengths[i]:
          lengths[i], reasons[i] = cut, "stop_string"
        elif cut is not None and reasons[i] == "length":
          reasons[i] = "stop_string"
    mask = np.arange(T)[None, :] < lengths[:, None]
    tokens = np.where(mask, tokens, self._pad_id).astype(np.int32)
    logps = np.where(mask, logps, 0.0).astype(np.float32)
    texts = self._tokenizer.batch_decode([tokens[i, : lengths[i]].tolist() for i in range(N)], skip_special_tokens=True)
    return GenerationResult(tokens, lengths, logps, prompt_lens, left, list(texts), reasons)


def _on_rollout_mesh(actor: Any, mesh: jax.sharding.Mesh, cfg: Any) -> Any:
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
  from maxtext_rl_plugin import resharding  # pylint: disable=import-outside-toplevel

  logging.info(
      "EmbeddedRollout: disaggregated (trainer on %d devices, rollout mesh %s); copying the actor onto the "
      "rollout mesh",
      len(actor_devices),
      dict(mesh.shape),
  )
  with logical_axis_rules(cfg.logical_axis_rules):
    return resharding.model_on_mesh(actor, mesh, cfg.logical_axis_rules)


def _row_keys(rng: jax.Array, first_prompt: int, rows: int, generations: int, dp: int) -> np.ndarray:
  """uint32[N, 2] raw keys of the rows of one chunk (N: the chunk's padded row count, as `_generate_chunk` pads it):
  row r is generation r % G of global prompt first_prompt + r // G."""
  n = _round_up(max(1, -(-rows // generations)), dp) * generations
  prompt = first_prompt + np.arange(n) // generations
  gen = np.arange(n) % generations
  base = jax.random.key_data(rng) if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng

  def key(p, g):
    return jax.random.fold_in(jax.random.fold_in(base, p), g)

  return np.asarray(jax.vmap(key)(jnp.asarray(prompt, jnp.uint32), jnp.asarray(gen, jnp.uint32)))


def _consecutive_groups(ids: list[list[int]]) -> tuple[list[list[int]], int]:
  """(unique prompts, G) when `ids` is each prompt repeated G times in a row; else (ids, 1)."""
  n = len(ids)
  g = 1
  while g < n and ids[g] == ids[0]:
    g += 1
  if g > 1 and n % g == 0 and all(ids[i] == ids[i - i % g] for i in range(n)):
    return [ids[i] for i in range(0, n, g)], g
  return ids, 1


def _stop_string_cut(tokenizer, tokens: np.ndarray, stop_strings: list[str]) -> int | None:
  """Number of tokens up to and including the one whose decoded prefix first contains a stop string."""

  def contains(k: int) -> bool:
    text = tokenizer.decode(tokens[:k].tolist(), skip_special_tokens=False)
    return any(s in text for s in stop_strings)

  if len(tokens) == 0 or not contains(len(tokens)):
    return None
  lo, hi = 1, len(tokens)  # contains(hi) is true; find the smallest such k
  while lo < hi:
    mid = (lo + hi) // 2
    if contains(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo


class warnings_off:  # pylint: disable=invalid-name
  """MaxText model construction/tracing emits a flood of deprecation warnings; keep logs readable."""

  def __enter__(self):
    import warnings  # pylint: disable=import-outside-toplevel

    self._cm = warnings.catch_warnings()
    self._cm.__enter__()
    warnings.simplefilter("ignore")

  def __exit__(self, *exc):
    return self._cm.__exit__(*exc)
