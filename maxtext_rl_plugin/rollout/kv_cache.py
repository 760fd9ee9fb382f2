"""MaxText `KVCache` surgery for the embedded engine: zero caches for any compile bucket, one prompt's cache
repeated over its generations, the batch axis pinned to the data axes.

The engine never builds a cache with MaxText's own (static, per-model) sizes: every compile key has its own
batch, prefill length and AR length, so the cache is made from the abstract model's `nnx.Cache` template with
those three dimensions replaced. The layouts below are MaxText 0.2.5's standard `KVCache` (tested against it in
tests/rollout/test_rollout_embedded.py); any other cache variable is refused rather than guessed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np

# nnx.Cache leaf names of MaxText's standard `KVCache` and which part (prefill or autoregressive) they hold.
KV_LEAVES = {
    "cached_prefill_key": "prefill",
    "cached_prefill_value": "prefill",
    "cached_prefill_key_scale": "prefill",
    "cached_prefill_value_scale": "prefill",
    "cached_ar_key": "ar",
    "cached_ar_value": "ar",
    "cached_ar_key_scale": "ar",
    "cached_ar_value_scale": "ar",
}
SEG_LEAVES = {"cache_prefill_segment_id": "prefill", "cache_ar_segment_id": "ar"}


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """Where batch and length sit in each cache leaf, and how the batch is sharded.

  `template`: pure dict of the decode model's `nnx.Cache` (shapes and dtypes only); `axis_order`: MaxText's
  `prefill_cache_axis_order` / `ar_cache_axis_order` (batch is logical axis 0, length axis 1); `batch_axes`: the
  mesh axes the data-parallel batch is sharded over (empty: replicated).
  """

  template: dict
  axis_order: dict[str, tuple[int, ...]]
  mesh: jax.sharding.Mesh
  batch_axes: tuple[str, ...]

  @property
  def dp(self) -> int:
    """Data-parallel size: how many shards the batch is split into."""
    return int(np.prod([self.mesh.shape[a] for a in self.batch_axes])) if self.batch_axes else 1

  def zeros(self, batch: int, prompt_len: int, ar_len: int) -> dict:
    """Zero cache for `batch` rows, a `prompt_len` prefill cache and an `ar_len` AR cache."""
    lengths = {"prefill": prompt_len, "ar": ar_len}

    def make(path, leaf):
      name = path[-1].key
      shape = list(leaf.shape)
      if name in KV_LEAVES:
        part = KV_LEAVES[name]
        lead = len(shape) - 4
        order = self.axis_order[part]
        shape[lead + order.index(0)] = batch
        shape[lead + order.index(1)] = lengths[part]
      elif name in SEG_LEAVES:
        lead = len(shape) - 2
        shape[lead], shape[lead + 1] = batch, lengths[SEG_LEAVES[name]]
      elif name == "cached_ar_lengths":
        shape[-1] = batch
      elif name != "cache_ar_index":
        raise NotImplementedError(f"unsupported MaxText cache variable {name}")
      return jnp.zeros(shape, leaf.dtype)

    return jax.tree_util.tree_map_with_path(make, self.template)

  def batch_axis(self, name: str, ndim: int) -> int | None:
    """Batch axis of a cache leaf (leading dims are scanned-layer axes); None for leaves without one."""
    if name in KV_LEAVES:
      return ndim - 4 + self.axis_order[KV_LEAVES[name]].index(0)
    if name in SEG_LEAVES:
      return ndim - 2
    if name == "cached_ar_lengths":
      return ndim - 1
    return None

  def shard(self, cache: dict) -> dict:
    """Pin every leaf's batch axis to the data axes (inside jit).

    MaxText's rules replicate the cache over the data axes (`cache_batch: []`: its serving engines run one replica
    per data shard); here one program serves the whole data-parallel batch, so the cache follows the batch.
    """
    if self.dp == 1:
      return cache

    def pin(path, leaf):
      axis = self.batch_axis(path[-1].key, leaf.ndim)
      if axis is None:
        return leaf
      spec: list[Any] = [None] * leaf.ndim
      spec[axis] = self.batch_axes
      return jax.lax.with_sharding_constraint(leaf, NamedSharding(self.mesh, P(*spec)))

    return jax.tree_util.tree_map_with_path(pin, cache)

  def repeat(self, cache: dict, generations: int, batch: int, ar_len: int) -> dict:
    """Prefill cache of P prompts -> decode cache of P*G rows: the prompt KV repeated, a fresh AR cache.

    This is why a group's shared prompt is prefilled once however many samples it gets.
    """
    fresh = self.zeros(batch, 1, ar_len)

    def expand(path, leaf, zero):
      name = path[-1].key
      if name in KV_LEAVES and KV_LEAVES[name] == "prefill":
        return jnp.repeat(leaf, generations, axis=leaf.ndim - 4 + self.axis_order["prefill"].index(0))
      if name == "cache_prefill_segment_id":
        return jnp.repeat(leaf, generations, axis=leaf.ndim - 2)
      return zero

    return jax.tree_util.tree_map_with_path(expand, cache, fresh)
