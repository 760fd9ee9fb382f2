"""The CPU host-assembly path: destination shards built straight from the source shards into pooled host buffers.

On the CPU `device_put` path JAX gathers every array into a new host array before slicing it for the destination
devices; here each destination shard is copied from the overlapping source shards into a 64-byte-aligned buffer from
`HOST_BUFFERS`, which XLA:CPU adopts zero-copy as that shard's device buffer (one copy per sync instead of two).
"""

from __future__ import annotations

import collections
import gc
import math
import sys
import threading
from typing import Sequence

import jax
import numpy as np

# On the CPU device_put path, build each destination shard straight from the source shards (`put_cpu`) instead of
# JAX's gather of every array into a new host array; False restores JAX's own path (bench reshard compares both).
HOST_ASSEMBLY = True


def _unheld(bufs: list, i: int) -> bool:
  """Whether only `bufs` refers to `bufs[i]` (getrefcount counts its own argument too); a view handed to XLA, or any
  other view, keeps the buffer as its base and so a reference."""
  return sys.getrefcount(bufs[i]) == 2


class _HostBuffers:
  """The host buffers behind the sampler's CPU arrays on the host-assembly path: one buffer per destination shard.

  XLA:CPU adopts a numpy buffer zero-copy when it starts on a 64-byte boundary (`jax.device_put(..., may_alias=True)`,
  and by chance under the default `may_alias=None`), so an assembled shard *becomes* the device buffer: one copy per
  sync instead of two. That same adoption is why a buffer is written only when no array holds it any more: XLA keeps
  a reference to the numpy buffer for as long as the array's device buffer lives, and drops it when the array is
  deleted (`release_buffers`) or collected. So a sync that released the sampler's previous chunk refills those pages
  -- no new page faults -- while an array still alive (a pinned rollout snapshot, `reshard_donate=false`) is never
  overwritten. (An earlier single scratch buffer was overwritten by the next chunk while the previous chunk's arrays,
  adopted zero-copy whenever that buffer happened to be 64-byte aligned, still pointed into it.)"""

  def __init__(self):
    self._lock = threading.Lock()
    self._bufs: dict[int, list[np.ndarray]] = collections.defaultdict(list)  # by byte size, raw (unaligned) buffers

  @staticmethod
  def _aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes]

  @staticmethod
  def drain() -> None:
    """Let XLA drop its references to the host buffers of arrays deleted a moment ago, once per batch of `take`s.

    XLA drops its reference to a deleted array's host buffer from a queue that JAX drains in a gc callback
    (`jax._src.lib`, jax#14882), so a buffer released a moment ago looks held until the next collection. One
    young-generation collection per chunk, before its takes, frees what that chunk's release freed (one per shard
    only repeated it)."""
    gc.collect(0)

  def take(self, nbytes: int) -> np.ndarray:
    """A 64-byte-aligned uint8 buffer of `nbytes` that no array holds (reused if one is free, else new); `drain`
    first when arrays were just deleted."""
    buf = self._reuse(nbytes)
    if buf is None:
      with self._lock:
        self._bufs[nbytes].append(np.empty((nbytes + _ALIGN,), np.uint8))
        buf = self._aligned(self._bufs[nbytes][-1], nbytes)
    return buf

  def _reuse(self, nbytes: int) -> np.ndarray | None:
    with self._lock:
      bufs = self._bufs.get(nbytes, [])
      for i in range(len(bufs)):
        if _unheld(bufs, i):
          bufs.append(bufs.pop(i))  # in use from now on; the next take looks at the others first
          return self._aligned(bufs[-1], nbytes)
    return None

  def trim(self) -> int:
    """Drop the buffers no array holds (after a sync: what it did not reuse); returns the bytes dropped."""
    self.drain()
    dropped = 0
    with self._lock:
      for nbytes, bufs in list(self._bufs.items()):
        keep = [bufs[i] for i in range(len(bufs)) if not _unheld(bufs, i)]
        dropped += (len(bufs) - len(keep)) * nbytes
        if keep:
          self._bufs[nbytes] = keep
        else:
          del self._bufs[nbytes]
    return dropped

  def held_bytes(self) -> int:
    with self._lock:
      return sum(n * len(b) for n, b in self._bufs.items())

  def addresses(self) -> set[int]:
    """Start addresses of the buffers handed out (a shard adopted from this pool has one as its buffer pointer)."""
    with self._lock:
      return {self._aligned(b, n).ctypes.data for n, bufs in self._bufs.items() for b in bufs}


HOST_BUFFERS = _HostBuffers()
_ALIGN = 64  # bytes: XLA:CPU's minimum alignment for adopting a host buffer without a copy


def _bounds(index: tuple, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def _needs_host_assembly(x, sharding) -> bool:
  """A CPU array headed for other devices *and* another layout: what JAX's `device_put` gathers on the host."""
  if not isinstance(x, jax.Array) or not isinstance(sharding, jax.sharding.Sharding) or not x.is_fully_addressable:
    return False
  if next(iter(x.devices())).platform != "cpu" or x.sharding.device_set == sharding.device_set:
    return False
  src = {_bounds(sh.index, x.shape) for sh in x.addressable_shards}
  return not all(_bounds(i, x.shape) in src for i in sharding.addressable_devices_indices_map(x.shape).values())


def _assemble_on_host(x: jax.Array, sharding) -> jax.Array:
  """`x` on `sharding`, each destination shard copied straight from the source shards that overlap it (read in place:
  on CPU a shard's buffer is host memory) into a buffer from `HOST_BUFFERS`, which XLA:CPU adopts as that shard's
  device buffer.

  JAX's own path (`x._value`) first gathers the whole array into a new host array -- one more copy, and fresh pages
  to fault in on every sync, since each sync's source arrays are new -- then slices it and copies each slice again.
  """
  sources, seen = [], set()
  for sh in x.addressable_shards:
    b = _bounds(sh.index, x.shape)
    if b not in seen:  # replicated source shards: read one
      seen.add(b)
      sources.append((b, np.asarray(sh.data)))
  singles = []
  for device, index in sharding.addressable_devices_indices_map(x.shape).items():
    dst = _bounds(index, x.shape)
    shape = tuple(hi - lo for lo, hi in dst)
    piece = HOST_BUFFERS.take(math.prod(shape) * x.dtype.itemsize).view(x.dtype).reshape(shape)
    for src, data in sources:
      overlap = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(dst, src)]
      if any(lo >= hi for lo, hi in overlap):
        continue
      piece[tuple(slice(lo - d0, hi - d0) for (lo, hi), (d0, _) in zip(overlap, dst))] = data[
          tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(overlap, src))
      ]
    singles.append(jax.device_put(piece, device, may_alias=True))
  return jax.make_array_from_single_device_arrays(x.shape, sharding, singles)


def put_cpu(arrays: list, shardings: list) -> list:
  """`jax.device_put(arrays, shardings)`, except that CPU arrays needing a host gather are assembled shard by shard
  (`_assemble_on_host`)."""
  assemble = [_needs_host_assembly(x, s) for x, s in zip(arrays, shardings)]
  if not any(assemble):
    return list(jax.device_put(arrays, shardings))
  HOST_BUFFERS.drain()  # the sampler's buffers of this chunk were released just before (move.reshard)
  out = list(arrays)
  rest = [i for i, a in enumerate(assemble) if not a]
  if rest:
    for i, y in zip(rest, jax.device_put([arrays[i] for i in rest], [shardings[i] for i in rest])):
      out[i] = y
  for i, a in enumerate(assemble):
    if a:
      out[i] = _assemble_on_host(arrays[i], shardings[i])
  return out
