"""The decode program's output head for tied embeddings on CPU: MaxText's function, from a table prepared per weights.

MaxText 0.2.5's tied head (`maxtext.layers.embeddings.attend_on_embedding`) casts the [vocab, emb] table to
bfloat16 inside every model call. In the engine's program XLA:CPU then converts and re-lays out the whole table on
every call -- once for prefill and once hoisted out of the decode loop -- and runs the prefill's one-position head as
a loop fusion: about 57 of the 62 ms that a batch-1 call costs before its first token on the 151,936-vocab tiny model
(5 ms with a 1,024 vocab). So on CPU the engine hands the program the table already rounded to bfloat16 (held in
float32 and laid out [emb, vocab]): the same values MaxText multiplies by, so the same logits up to summation order,
recomputed only when the embedding array changes (a JAX array is immutable: the same object is the same weights).
The rest of MaxText's `apply_output_head` (final norm, logit normalisation, soft cap, casts) is applied as it does.
On GPU/TPU MaxText's own head runs unchanged (`applies`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp


def applies(logits_via_embedding: bool, mesh: jax.sharding.Mesh) -> bool:
  """Tied embeddings (MaxText's `logits_via_embedding`) on a CPU mesh: where the prepared table is measured to pay
  (module docstring)."""
  return bool(logits_via_embedding) and all(d.platform == "cpu" for d in mesh.devices.flat)


@dataclasses.dataclass(frozen=True)
class TiedHead:
  """MaxText's `apply_output_head` for `logits_via_embedding`, with the table passed in (`prepare`)."""

  attend_dtype: Any
  normalize_embedding_logits: bool
  final_logits_soft_cap: float | None
  cast_logits_to_fp32: bool

  @classmethod
  def from_config(cls, cfg: Any) -> "TiedHead":
    return cls(
        attend_dtype=jnp.float32 if cfg.logits_dot_in_fp32 else cfg.dtype,
        normalize_embedding_logits=bool(cfg.normalize_embedding_logits),
        final_logits_soft_cap=cfg.final_logits_soft_cap or None,
        cast_logits_to_fp32=bool(cfg.cast_logits_to_fp32),
    )

  def __call__(self, model: Any, hidden: jax.Array, table: jax.Array) -> jax.Array:
    """Logits of `hidden` [B, L, emb] (the decoder's output before its final norm) with `table` [emb, vocab]."""
    y = model.decoder.decoder_norm(hidden)
    logits = jnp.dot(y, table, preferred_element_type=self.attend_dtype)
    if self.normalize_embedding_logits:
      logits = logits / jnp.sqrt(y.shape[-1])
    if self.final_logits_soft_cap:
      logits = jnp.tanh(logits / self.final_logits_soft_cap) * self.final_logits_soft_cap
    if self.cast_logits_to_fp32:
      logits = logits.astype(jnp.float32)
    return logits


@jax.jit
def _prepared(embedding: jax.Array) -> jax.Array:
  return embedding.astype(jnp.bfloat16).astype(jnp.float32).T


class TableCache:
  """The prepared table of the current embedding array, recomputed when that array object changes."""

  def __init__(self):
    self._source: jax.Array | None = None  # held, so its identity cannot be reused by another array
    self._table: jax.Array | None = None

  def table(self, params: Any) -> jax.Array:
    emb = params["token_embedder"]["embedding"]
    arr = emb[...] if isinstance(emb, nnx.Variable) else emb
    if arr is not self._source:
      self._source, self._table = arr, _prepared(arr)
    return self._table
