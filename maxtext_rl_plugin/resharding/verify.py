"""The weight-sync guard (`rl.verify_weight_sync` = off | first | every_n): per-array checksums on both sides.

Checksums are computed on device on both sides (a wrapping uint32 sum of the bit patterns weighted by odd,
position-dependent weights: any single changed element or bit changes it, and so do permutations) and compared on the
host; a mismatch raises `WeightSyncError` naming the first bad parameter path.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from maxtext_rl_plugin.resharding import trees

PyTree = Any

VERIFY_POLICIES = ("off", "first", "every_n")


def verify_due(policy: str, every: int, n: int) -> bool:
  """Whether sync number `n` (1-based) is checked under `rl.verify_weight_sync` = `policy`: the first one, and with
  every_n also every `every`-th (1, N, 2N, ...). Every engine's guard asks this one function."""
  if policy == "first":
    return n == 1
  if policy == "every_n":
    return n == 1 or n % int(every) == 0
  return False


_GOLDEN = np.uint32(0x9E3779B1)  # odd multiplier: distinct indices get well-mixed, always-odd weights
_OFFSET = np.uint32(0x7F4A7C15)


def _words(x: jax.Array) -> jax.Array:
  """The array's bit pattern as uint32 words (any dtype), so float equality is bitwise (-0.0 != 0.0, NaNs)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing dim of 2 words
  raise TypeError(f"unsupported dtype for the weight-sync checksum: {x.dtype}")


def _axis_weights(n: int, axis: int) -> jax.Array:
  """Odd, index-dependent uint32 weights for one axis (a different offset per axis breaks symmetry)."""
  i = jnp.arange(n, dtype=jnp.uint32)
  return (i * _GOLDEN + _OFFSET * jnp.uint32(2 * axis + 1)) | jnp.uint32(1)


def _halve(s: jax.Array, axis: int) -> jax.Array:
  """Sum `s` along `axis` by pairwise halving: elementwise adds, which XLA:CPU vectorises (its integer
  reductions it does not), and never crossing a shard boundary when `axis` is not sharded."""
  while s.shape[axis] > 1:
    n = s.shape[axis]
    if n % 2:
      first = jax.lax.slice_in_dim(s, 0, 1, axis=axis) + jax.lax.slice_in_dim(s, n - 1, n, axis=axis)
      s = jnp.concatenate([first, jax.lax.slice_in_dim(s, 1, n - 1, axis=axis)], axis=axis)
      continue
    s = jax.lax.slice_in_dim(s, 0, n // 2, axis=axis) + jax.lax.slice_in_dim(s, n // 2, n, axis=axis)
  return s


def _checksum(x: jax.Array, sharded_dims: tuple[int, ...] = ()) -> jax.Array:
  """Wrapping uint32 sum of the bit pattern weighted by a product of per-axis odd weights.

  Every weight is odd, so changing any single word changes the sum mod 2^32; position-dependent weights
  make it sensitive to permutations. Wrapping integer sums are exact in any order, so both sides agree
  bit for bit whatever their sharding. Unsharded axes are folded by halving (local, vectorised; 9x
  faster than `jnp.sum` on CPU), the sharded ones last with `jnp.sum` (local partials + all-reduce).
  """
  u = _words(x)
  if u.ndim == 0:
    u = u.reshape(1)
  s = u
  for axis in range(u.ndim):
    w = _axis_weights(u.shape[axis], axis)
    s = s * w.reshape((-1,) + (1,) * (u.ndim - 1 - axis))
    if axis not in sharded_dims:
      s = _halve(s, axis)
  return jnp.sum(s, dtype=jnp.uint32)


def _sharded_dims(x: jax.Array) -> tuple[int, ...]:
  """Dimensions of `x` split across devices (all of them when the sharding is not a NamedSharding)."""
  sharding = x.sharding
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return ()
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return tuple(range(x.ndim))
  dims = []
  for d, entry in enumerate(sharding.spec):
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    if math.prod(sharding.mesh.shape[a] for a in axes) > 1:
      dims.append(d)
  return tuple(dims)


def _checksums_body(leaves: list, sharded: tuple) -> jax.Array:
  return jnp.stack([_checksum(x, d) for x, d in zip(leaves, sharded)]) if leaves else jnp.zeros((0,), jnp.uint32)


_checksums_jit = jax.jit(_checksums_body, static_argnums=1)


@functools.lru_cache(maxsize=None)
def _replicated_checksums_jit(mesh: jax.sharding.Mesh):
  return jax.jit(_checksums_body, static_argnums=1, out_shardings=NamedSharding(mesh, P()))


def checksums(tree: PyTree) -> np.ndarray:
  """uint32[n_arrays] checksums of a tree's arrays, computed on their own devices (one jit per device set)."""
  _, leaves, _ = trees.flatten(tree)
  with jax.transfer_guard("allow"):
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]  # host arrays: default device
  out = np.zeros((len(leaves),), np.uint32)
  groups: dict[frozenset, list[int]] = collections.defaultdict(list)
  for i, x in enumerate(leaves):
    groups[frozenset(x.sharding.device_set)].append(i)
  # Tunix's sync_weights runs under transfer guards that forbid explicit device->host copies on CPU;
  # these are 8 bytes per array, read on purpose.
  with jax.transfer_guard("allow"):
    for idx in groups.values():
      sub = [leaves[i] for i in idx]
      out[idx] = np.asarray(jax.device_get(_checksums_jit(sub, tuple(_sharded_dims(x) for x in sub))))
  return out


def global_checksums(leaves: list) -> np.ndarray:
  """uint32 checksums of arrays that may span other processes' devices (a multi-controller trainer mesh), the same
  values on every process: one jit per mesh whose result is replicated on it, so each process reads its own copy.
  Every process must call it with the same arrays in the same order (the reductions are collectives)."""
  out = np.zeros((len(leaves),), np.uint32)
  groups: dict[Any, list[int]] = collections.defaultdict(list)
  for i, x in enumerate(leaves):
    groups[x.sharding.mesh if isinstance(x.sharding, NamedSharding) else None].append(i)
  with jax.transfer_guard("allow"):
    for mesh, idx in groups.items():
      sub = [leaves[i] for i in idx]
      if mesh is None or all(x.is_fully_addressable for x in sub):
        out[idx] = checksums(sub)
        continue
      sums = _replicated_checksums_jit(mesh)(sub, tuple(_sharded_dims(x) for x in sub))
      out[idx] = np.asarray(sums.addressable_data(0))
  return out


def verify(src_tree: PyTree, dst_tree: PyTree, *, dst_shardings: PyTree | None = None) -> None:
  """Raise `WeightSyncError` naming the first parameter whose sampler copy differs from the trainer's.

  Compares structure, shape, dtype, (if given) the expected destination sharding, then per-array
  on-device checksums of the bit patterns.
  """
  src_paths, src, src_def = trees.flatten(src_tree)
  dst_paths, dst, dst_def = trees.flatten(dst_tree)
  trees.check_same_structure(src_paths, src_def, dst_paths, dst_def, "weight sync check")
  expected = None
  if dst_shardings is not None:
    _, expected, _ = trees.flatten(dst_shardings)
  for i, (p, a, b) in enumerate(zip(src_paths, src, dst)):
    if isinstance(b, jax.Array) and b.is_deleted():
      raise trees.WeightSyncError(
          f"weight sync check failed at '{p}': the sampler still holds its previous, released buffer "
          "(its update did not install this array)"
      )
    if a.shape != b.shape or a.dtype != b.dtype:
      raise trees.WeightSyncError(
          f"weight sync check failed at '{p}': trainer {a.dtype}{list(a.shape)} vs sampler {b.dtype}{list(b.shape)}"
      )
    if expected is not None and not trees.as_sharding(expected[i]).is_equivalent_to(b.sharding, b.ndim):
      raise trees.WeightSyncError(
          f"weight sync check failed at '{p}': sampler array is on {b.sharding}, "
          f"expected {trees.as_sharding(expected[i])}"
      )
  cs, cd = checksums(src), checksums(dst)
  bad = np.nonzero(cs != cd)[0]
  if bad.size:
    i = int(bad[0])
    raise trees.WeightSyncError(
        f"weight sync check failed: sampler's '{src_paths[i]}' differs from the trainer's "
        f"(checksum {int(cd[i]):#010x} vs {int(cs[i]):#010x}; {bad.size} of {len(src)} arrays differ)"
    )
