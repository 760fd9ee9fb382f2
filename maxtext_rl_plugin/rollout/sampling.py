"""Token sampling for the embedded engine: greedy, temperature, top-k, top-p, with the learner's log-probs.

The returned log-prob of a sampled token is `log_softmax(logits / T)[token]` over the *full* vocabulary
(T = 1 for greedy). That is exactly what the learner recomputes (Tunix divides trainer and reference
logits by the rollout temperature), so importance ratios start at 1; top-k / top-p only restrict which
tokens can be drawn, they do not renormalise the reported log-prob.

Which filters run is static (`SamplingSpec`, part of the engine's compile key) so greedy decoding never
pays for a sort over the 150k-token vocabulary; the temperature and top-p values are traced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """Static shape of the sampler (hashable: part of the compile key)."""

  greedy: bool = True
  top_k: int = 0  # 0 = off
  use_top_p: bool = False


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """User-facing sampling knobs; `spec()` is the static part, `temperature`/`top_p` are traced."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False

  @classmethod
  def create(cls, temperature: float | None, top_k: int | None, top_p: float | None, greedy: bool = False):
    """Normalises the many 'off' spellings (None, 0, -1, p >= 1) used by MaxText and Tunix."""
    temperature = 1.0 if temperature is None else float(temperature)
    if temperature <= 0.0:  # Tunix: temperature 0 means greedy.
      greedy, temperature = True, 1.0
    top_k = int(top_k) if top_k is not None and int(top_k) > 0 else 0
    top_p = float(top_p) if top_p is not None and 0.0 < float(top_p) < 1.0 else 1.0
    return cls(temperature=temperature, top_k=top_k, top_p=top_p, greedy=bool(greedy))

  def spec(self, vocab_size: int) -> SamplingSpec:
    if self.greedy:
      return SamplingSpec(greedy=True)
    top_k = self.top_k if 0 < self.top_k < vocab_size else 0
    return SamplingSpec(greedy=False, top_k=top_k, use_top_p=self.top_p < 1.0)


def _nucleus_mask(sorted_logits: jax.Array, top_p: jax.Array) -> jax.Array:
  """Keep the smallest prefix of descending-sorted candidates whose probability mass reaches top_p."""
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  return mass_before < top_p  # the first candidate is always kept


def argmax(x: jax.Array, chunk: int = 128) -> jax.Array:
  """`jnp.argmax(x, -1)` (first maximum) for [B, V] via per-chunk maxima.

  XLA:CPU lowers argmax to a variadic (value, index) reduction that does not vectorise; over a 150k
  vocabulary it costs as much as the LM head. A plain max over [B, V/chunk, chunk], an argmax over the
  V/chunk chunk maxima and one over the winning chunk give the same index several times faster.
  """
  b, v = x.shape
  n = -(-v // chunk)
  if n * chunk != v:
    x = jnp.pad(x, ((0, 0), (0, n * chunk - v)), constant_values=-jnp.inf)
  blocks = x.reshape(b, n, chunk)
  best = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  within = jnp.argmax(jnp.take_along_axis(blocks, best[:, None, None], axis=1)[:, 0], axis=-1)
  return (best * chunk + within).astype(jnp.int32)


def logsumexp(x: jax.Array) -> jax.Array:
  """Row-wise logsumexp of finite [B, V] logits as two plain reductions (jax.nn.logsumexp's extra
  inf/where handling made it ~3x slower on XLA:CPU at a 150k vocabulary)."""
  m = jnp.max(x, axis=-1)
  return m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=-1))


def _categorical(rng: jax.Array, logits: jax.Array, per_row: bool) -> jax.Array:
  if per_row:  # one key per row: a row's draw does not depend on the batch it is sampled in
    return jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(rng, logits)
  return jax.random.categorical(rng, logits, axis=-1)


def sample(
    logits: jax.Array,
    rng: jax.Array,
    spec: SamplingSpec,
    temperature: jax.Array,
    top_p: jax.Array,
    per_row: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row of `logits[B, V]`; returns (tokens[B] int32, logps[B] float32). `per_row`: `rng` holds
  one key per row (B keys)."""
  logits = logits.astype(jnp.float32)
  # logp(token) = scaled[token] - logsumexp(scaled): never materialises a [B, V] log-softmax, which
  # costs as much as the LM head at a 150k vocabulary on CPU.
  scaled = logits if spec.greedy else logits / temperature
  if spec.greedy:
    tokens = argmax(scaled)
  elif spec.top_k > 0 or spec.use_top_p:
    if spec.top_k > 0:
      cand_logits, cand_ids = jax.lax.top_k(scaled, spec.top_k)
    else:
      cand_ids = jnp.argsort(-scaled, axis=-1)
      cand_logits = jnp.take_along_axis(scaled, cand_ids, axis=-1)
    if spec.use_top_p:
      cand_logits = jnp.where(_nucleus_mask(cand_logits, top_p), cand_logits, -jnp.inf)
    choice = _categorical(rng, cand_logits, per_row)
    tokens = jnp.take_along_axis(cand_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
  else:
    tokens = _categorical(rng, scaled, per_row).astype(jnp.int32)
  token_logits = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
  return tokens, token_logits - logsumexp(scaled)


def row_keys(rng: jax.Array, first_prompt: int, rows: int, generations: int) -> np.ndarray:
  """uint32[rows, 2] raw keys, one per decode row of a packed call: row r is generation r % G of global prompt
  first_prompt + r // G, so a row samples the same tokens however prompts are split over calls or processes."""
  prompt = first_prompt + np.arange(rows) // generations
  gen = np.arange(rows) % generations
  base = jax.random.key_data(rng) if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng

  def key(p, g):
    return jax.random.fold_in(jax.random.fold_in(base, p), g)

  return np.asarray(jax.vmap(key)(jnp.asarray(prompt, jnp.uint32), jnp.asarray(gen, jnp.uint32)))
