"""The embedded engine's sampler: MaxText's own model code as one jitted prefill + decode program per shape bucket.

MaxText's MaxEngine/OfflineEngine need JetStream, so this drives the MaxText `Transformer` directly the way
MaxEngine's `_nnx_run_model` does: merge (graphdef, params, nnx.Cache state, rest), call with
`model_mode=MODEL_MODE_PREFILL` then `MODEL_MODE_AUTOREGRESSIVE`, read the cache back with
`nnx.state(model, nnx.Cache)`. Like Tunix's `Sampler` under its `VanillaRollout`, it knows tokens, caches and
sampling, not prompts' text or weight versions (`embedded.py` is the rollout wrapper).

One program per compile key does everything on device:
  1. batched prefill of left-padded prompts (segment id 0 on pads, per-row positions starting at 0 at the first
     real token), so MaxText's prefill cache holds every prompt once;
  2. `num_generations` samples per prompt by repeating the prefill cache and last logits over the batch axis
     (`kv_cache.CacheLayout.repeat`: the shared prompt is never re-prefilled);
  3. a `lax.while_loop` decode over MaxText's autoregressive cache, with per-row stop on EOS / any stop token id
     and the stop strings' early exit (`stops.py`), exiting once every row has stopped; sampled tokens and their
     log-probs (`sampling.py`) are written into fixed [N, T] buffers;
  4. with `record_routing` (MoE models, `moe.py`), the experts every MoE layer routed each prompt token (prefill) and
     each fed-back completion token (decode step t routes completion token t-1) to, into [N, L, layers, k] and
     [N, T, layers, k] buffers (-1 where nothing was routed).

MaxText bakes the decode batch size and the AR-cache length into static `KVCache` attributes at construction
(`micro_batch_size_to_train_on`, `max_target_length - max_prefill_predict_length`); they decide the shape of the
"active" segment-id write and the wrap-around of the AR write index. So the decode-mode models are built
abstractly once (`nnx.eval_shape`, no weights; run/engine.decode_models, where the run is built: MaxText's model
creation takes the config whole, which this module never sees) and those three attributes are set per compile key
before taking the graphdef; the weights are always the caller's. What else the program reads of the config is
`embedded_spec.DecodeSettings`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any
import warnings

from absl import logging
from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np

from maxtext.common import common_types
from maxtext.inference import kvcache
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.resharding import quantize
from maxtext_rl_plugin.rollout import bucketing
from maxtext_rl_plugin.rollout import embedded_spec
from maxtext_rl_plugin.rollout import head
from maxtext_rl_plugin.rollout import kv_cache
from maxtext_rl_plugin.rollout import sampling
from maxtext_rl_plugin.rollout import stops


@dataclasses.dataclass(frozen=True)
class CompileKey:
  """Everything static about one program: a new value compiles a new executable."""

  prompts: int  # prefill batch (prompts per call, padded)
  generations: int
  prompt_len: int
  new_tokens: int
  spec: sampling.SamplingSpec
  num_stop_ids: int


class warnings_off:  # pylint: disable=invalid-name  # a context manager named like contextlib's
  """MaxText model construction/tracing emits a flood of deprecation warnings; keep logs readable."""

  def __enter__(self):
    self._cm = warnings.catch_warnings()
    self._cm.__enter__()
    warnings.simplefilter("ignore")

  def __exit__(self, *exc):
    return self._cm.__exit__(*exc)


# Decoder blocks with sliding-window (local) attention layers in MaxText 0.2.5 (`AttentionType.LOCAL_SLIDING`).
SLIDING_WINDOW_BLOCKS = ("gpt_oss", "gemma2", "gemma3", "gemma4", "olmo3")
# MaxText's model modes the program runs, each with its own abstract model: the prompts' prefill, then one token a step.
MODES = (common_types.MODEL_MODE_PREFILL, common_types.MODEL_MODE_AUTOREGRESSIVE)


def check_sliding_window(decoder_block: str, window: int, max_target_length: int) -> None:
  """Refuse a sliding window shorter than the sequence: measured on gpt-oss (tests/test_moe.py), the cached decode then
  differs from MaxText's full forward after the first token (window 8 over 20-token prompts); with the window at least
  max_target_length both agree token for token."""
  if decoder_block in SLIDING_WINDOW_BLOCKS and 0 < window < max_target_length:
    raise ConfigError(
        f"invalid value for 'sliding_window_size'={window} with rollout_engine=embedded and decoder_block="
        f"{decoder_block}: the embedded engine's KV-cached decode does not apply a window shorter than the sequence as "
        f"MaxText's forward does; set sliding_window_size >= max_target_length ({max_target_length}) or use the vLLM "
        "engine"
    )


class MaxTextSampler:
  """Prefill + decode programs of one MaxText model config on one mesh (see the module docstring)."""

  def __init__(
      self,
      settings: embedded_spec.DecodeSettings,
      models: dict[str, Any],
      mesh: jax.sharding.Mesh,
      pad_id: int,
      record_routing: bool = False,
  ):
    """`models`: MaxText's abstract (shape-only) model of each mode of `MODES` on `mesh` (run/engine.decode_models);
    their graphdefs are merged with the caller's weights."""
    check_sliding_window(settings.decoder_block, settings.sliding_window_size, settings.max_target_length)
    self.mesh = mesh
    self.pad_id = pad_id  # fills every position after a row's end
    self.weight_dtype = jnp.dtype(settings.weight_dtype)  # what quantized kernels are read back as (rollout_quantization)
    self.modes = MODES
    self._abstract = {mode: models[mode] for mode in self.modes}
    # MoE routing recorded by the decode models' own MoE layers (moe.Recording); the weights are unchanged.
    self.record_routing = bool(record_routing) and all(moe.record_routing(m) > 0 for m in self._abstract.values())
    self._kv_modules = {
        mode: [m for _, m in nnx.iter_graph(model) if isinstance(m, kvcache.KVCache)]
        for mode, model in self._abstract.items()
    }
    ar_kv = self._kv_modules[self.modes[1]]
    if not ar_kv:
      raise ConfigError(
          f"rollout_engine=embedded cannot sample {settings.model_name}: it has no MaxText KVCache in autoregressive "
          "mode"
      )
    for m in ar_kv:
      # Exactly MaxText's KVCache: a subclass (another model's cache) has its own layout this engine does not know.
      exact = type(m) is kvcache.KVCache  # pylint: disable=unidiomatic-typecheck  # subclasses are refused on purpose
      if getattr(m, "is_gdn", False) or getattr(m, "is_deepseek_v4", False) or not exact:
        raise ConfigError(
            f"rollout_engine=embedded cannot sample {settings.model_name}: the embedded engine decodes with MaxText's "
            f"standard KVCache only, not {type(m).__name__} (docs/models.md)"
        )

    # Data parallelism: the batch goes over the mesh axes MaxText maps "activation_batch" to (first rule wins).
    rules = dict(reversed(list(settings.logical_axis_rules)))
    axes = rules.get("activation_batch", ())
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    self.batch_axes = tuple(a for a in axes if a in mesh.shape)
    _, cache_abs, _ = nnx.split(self._abstract[self.modes[1]], nnx.Cache, ...)
    self.cache = kv_cache.CacheLayout(
        template=nnx.to_pure_dict(cache_abs),
        axis_order={"prefill": tuple(ar_kv[0].prefill_cache_axis_order), "ar": tuple(ar_kv[0].ar_cache_axis_order)},
        mesh=mesh,
        batch_axes=self.batch_axes,
    )
    self.dp = self.cache.dp
    # The cache is sharded over the batch's axes (kv_cache.CacheLayout.shard): prepending overrides MaxText's rule.
    self.rules = tuple((name, self.batch_axes) for name in ("cache_batch", "cache_batch_prefill")) + tuple(
        (k, v) for k, v in settings.logical_axis_rules if k not in ("cache_batch", "cache_batch_prefill")
    )
    # On CPU the tied output head runs from a table prepared once per weight version (head.py).
    self._tied_head = head.TiedHead(
        attend_dtype=jnp.float32 if settings.logits_dot_in_fp32 else settings.dtype,
        normalize_embedding_logits=settings.normalize_embedding_logits,
        final_logits_soft_cap=settings.final_logits_soft_cap,
        cast_logits_to_fp32=settings.cast_logits_to_fp32,
    )
    self._head_tables = head.TableCache() if head.applies(settings.logits_via_embedding, mesh) else None
    self.compiled: dict[Any, Any] = {}
    self.compile_count = 0
    self.compile_seconds = 0.0

  def rest_state(self, model: Any) -> dict:
    """Non-param, non-cache state (RNG streams) of the decode model, taken from `model` where it has it.

    The decode-mode model declares fewer RNG streams than the train-mode actor; inference never draws from them
    (dropout is off), but nnx.merge needs every variable.
    """
    rest_abs = nnx.to_pure_dict(nnx.state(self._abstract[self.modes[1]], nnx.Not(nnx.Any(nnx.Param, nnx.Cache))))
    actor_rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Any(nnx.Param, nnx.Cache))))

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

  def run(
      self,
      params: Any,
      rest: dict,
      packed: bucketing.PackedPrompts,
      key: CompileKey,
      rng: jax.Array | np.ndarray,
      sampling_params: sampling.SamplingParams,
      stop_ids: np.ndarray,
      stop_seqs: np.ndarray,
  ) -> tuple[np.ndarray, np.ndarray, int, tuple[np.ndarray, np.ndarray] | None]:
    """(tokens [N, T], log-probs [N, T], decode steps run, routing) on host for one packed call (compiled once per
    key); routing is (prompt [N, L, layers, k], completion [N, T, layers, k]) when recorded, else None.

    `rng`: one key for the call, or raw keys [N, 2], one per row (`sampling.row_keys`).
    """
    batch_sh = NamedSharding(self.mesh, P(self.batch_axes or None))
    args = (
        params,
        rest,
        # Every process holds the same prompts (distributed.py); each places the shards its devices hold.
        distributed.global_array(packed.tokens, NamedSharding(self.mesh, P(self.batch_axes or None, None))),
        distributed.global_array(packed.lengths, batch_sh),
        distributed.global_array(packed.active, batch_sh),
        distributed.replicated(rng, self.mesh) if np.ndim(rng) == 1 else distributed.global_array(rng, batch_sh),
        distributed.replicated(np.float32(sampling_params.temperature), self.mesh),
        distributed.replicated(np.float32(sampling_params.top_p), self.mesh),
        distributed.replicated(stop_ids, self.mesh),
        distributed.replicated(stop_seqs, self.mesh),
        None if self._head_tables is None else self._head_tables.table(params),
    )
    sig = (
        key,
        jax.tree.structure(args),
        tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(args[:2])),
        np.shape(rng),  # one key, or one per row
    )
    compiled = self.compiled.get(sig)
    with self.mesh, logical_axis_rules(self.rules):
      if compiled is None:
        t0 = time.perf_counter()
        with warnings_off():
          compiled = jax.jit(self.program(key)).lower(*args).compile()
        dt = time.perf_counter() - t0
        self.compile_count += 1
        self.compile_seconds += dt
        self.compiled[sig] = compiled
        logging.info("EmbeddedRollout: compiled %s in %.1fs", key, dt)
      out_tokens, out_logps, steps, routes = compiled(*args)
    routes = None if routes is None else tuple(distributed.to_host(r) for r in routes)
    return distributed.to_host(out_tokens), distributed.to_host(out_logps), int(steps), routes

  def _graphdef(self, mode: str, batch: int, prompt_len: int, new_tokens: int):
    """Graphdef of the abstract `mode` model with its KVCache statics set for this compile key."""
    for m in self._kv_modules[mode]:
      m.batch = batch
      m.max_prefill_length = prompt_len
      m.max_target_length = prompt_len + new_tokens
    graphdef, _ = nnx.split(self._abstract[mode])
    return graphdef

  def abstract_model(self, mode):
    """The abstract (shape-only) model of `mode` the programs are built from (the AOT compile builds its own)."""
    return self._abstract[mode]

  def program(self, key: CompileKey):
    """The prefill + G-way expansion + decode loop for one compile key (jitted by `run`; compiled AOT as is)."""
    # pylint: disable=invalid-name  # B, G, L, T, N: the shape names of the module docstring
    prefill_mode, ar_mode = self.modes
    B, G, L, T = key.prompts, key.generations, key.prompt_len, key.new_tokens
    N = B * G
    gd_prefill = self._graphdef(prefill_mode, B, L, T)
    gd_ar = self._graphdef(ar_mode, N, L, T)
    spec = key.spec
    pad_id = self.pad_id
    cache_layout = self.cache

    def run_model(graphdef, params, rest, cache, tokens, positions, segment_ids, mode, table):
      _, _, cache_state, rest_state = nnx.split(self._abstract[mode], nnx.Param, nnx.Cache, ...)
      nnx.replace_by_pure_dict(cache_state, cache)
      nnx.replace_by_pure_dict(rest_state, rest)
      # A quantized sampler's kernels (rollout_quantization) are read back here, inside the step, so XLA can fuse the
      # read into the matmul (rollout/quantized_weights.py); a float sampler's tree is unchanged.
      params = quantize.dequantize_tree(params, self.weight_dtype)
      model = nnx.merge(graphdef, params, cache_state, rest, copy=True)
      # The decoder's hidden states, then the output head on the last position only: Transformer.__call__ would
      # project every prompt position onto the vocabulary (B x L x 150k), which dominates prefill; the decoder's
      # own full-sequence logits are unused and dead-code-eliminated by XLA.
      _, hidden, _ = model.decoder(
          shared_embedding=model.token_embedder,
          decoder_input_tokens=tokens,
          decoder_positions=positions,
          decoder_segment_ids=segment_ids,
          deterministic=True,
          model_mode=mode,
      )[:3]
      if table is None:
        logits = model.logits_from_hidden_states_for_vocab_tiling(hidden[:, -1:, :], deterministic=True, model_mode=mode)
      else:  # the same function from the prepared table (head.py)
        logits = self._tied_head(model, hidden[:, -1:, :], table)
      route = moe.routing(model, tokens.shape[0]) if self.record_routing else None
      return logits, nnx.to_pure_dict(nnx.state(model, nnx.Cache)), route

    def draw(rng, step, per_row):
      """(rng', key of this step): per-row keys fold in the step; one call key is split."""
      if per_row:
        return rng, jax.vmap(jax.random.fold_in, in_axes=(0, None))(rng, step)
      return jax.random.split(rng)

    def program(params, rest, tokens, lens, active, rng, temperature, top_p, stop_ids, stop_seqs, table):
      # Prefill: left-padded prompts; pads get segment 0 (masked), real tokens positions 0..len-1.
      segment = (jnp.arange(L)[None, :] >= (L - lens)[:, None]).astype(jnp.int32)
      positions = jnp.maximum(jnp.cumsum(segment, axis=1) - 1, 0)
      logits, cache, route = run_model(
          gd_prefill, params, rest, cache_layout.zeros(B, L, T), tokens, positions, segment, prefill_mode, table
      )
      routes = None
      if route is not None:  # prompt routing of each generation's row; pads routed nowhere
        prompt_route = jnp.where(segment[:, :, None, None] > 0, route, moe.UNSET)
        routes = (jnp.repeat(prompt_route, G, axis=0), jnp.full((N, T) + route.shape[2:], moe.UNSET, jnp.int32))
      last = jnp.repeat(logits[:, -1, :], G, axis=0)
      cache = cache_layout.shard(cache_layout.repeat(cache, G, N, T))
      lens_n = jnp.repeat(lens, G)
      per_row = rng.ndim == 2  # [N, 2] raw keys, one per row
      rng, sub = draw(rng, 0, per_row)
      tok, lp = sampling.sample(last, sub, spec, temperature, top_p, per_row)
      hit, window = stops.stopped(tok, stops.empty_window(N), stop_ids, stop_seqs)
      done = hit | ~active
      out_tokens = jnp.full((N, T), pad_id, jnp.int32).at[:, 0].set(tok)
      out_logps = jnp.zeros((N, T), jnp.float32).at[:, 0].set(lp)

      def cond(carry):
        step, _, done, *_ = carry
        return (step < T) & ~jnp.all(done)

      def body(carry):
        step, tok, done, cache, out_tokens, out_logps, rng, window, routes = carry
        pos = (lens_n + step - 1)[:, None]
        logits, cache, route = run_model(gd_ar, params, rest, cache, tok[:, None], pos, None, ar_mode, table)
        if routes is not None:  # the routing of completion token step-1 (fed now), for rows still generating
          fed = jnp.where(done[:, None, None], moe.UNSET, route[:, 0])
          routes = (routes[0], jax.lax.dynamic_update_index_in_dim(routes[1], fed, step - 1, axis=1))
        cache = cache_layout.shard(cache)
        rng, sub = draw(rng, step, per_row)
        new, lp = sampling.sample(logits[:, -1, :], sub, spec, temperature, top_p, per_row)
        new = jnp.where(done, pad_id, new)
        lp = jnp.where(done, 0.0, lp)
        out_tokens = jax.lax.dynamic_update_index_in_dim(out_tokens, new, step, axis=1)
        out_logps = jax.lax.dynamic_update_index_in_dim(out_logps, lp, step, axis=1)
        hit, window = stops.stopped(new, window, stop_ids, stop_seqs)
        return step + 1, new, done | hit, cache, out_tokens, out_logps, rng, window, routes

      carry = (jnp.int32(1), tok, done, cache, out_tokens, out_logps, rng, window, routes)
      steps, _, _, _, out_tokens, out_logps, _, _, routes = jax.lax.while_loop(cond, body, carry)
      return out_tokens, out_logps, steps, routes

    return program
