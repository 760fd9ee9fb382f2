"""Trainer -> sampler weight sync: Pathways resharding or `jax.device_put`, chunked, with a correctness guard.

In disaggregated RL the trainer owns one device set (e.g. FSDP over half the chips) and the sampler
another (e.g. tensor parallel over the other half). After every optimizer step the new weights move
from the trainer layout to the sampler layout. This module is the one place that does it:

* **Backend.** On Pathways (`JAX_PLATFORMS` contains `proxy` and `pathwaysutils` imports) each chunk
  goes through `pathwaysutils.experimental.reshard.sidechannel_reshard_with_intermediate_sharding`
  with resharding-plan caching; if only the stable API exists, through
  `pathwaysutils.reshard.reshard_with_intermediate_sharding`; elsewhere through `jax.device_put`.
  The path is logged once (`backend_path()`), never chosen silently (Tunix 0.1.7's `reshard_pytree`
  falls back to `device_put` at debug level).
  The intermediate-sharding variant only looks for an intermediate layout when it is given *one*
  source and *one* destination sharding; Tunix and MaxText pass whole pytrees, so it never finds one
  for them. We therefore call it once per (source sharding, destination sharding) group, which is
  what lets an FSDP-8 -> TP-4 weight avoid the all-gather.
* **Chunking** (`rl.reshard_chunk_size` = parameter arrays per chunk, MaxText's meaning; unset: chunks of at
  most `DEFAULT_CHUNK_BYTES` on the device_put path, one chunk on Pathways): each chunk is moved and waited
  for before the next one starts, and -- with `reshard_donate` -- the sampler's previous buffers of that
  chunk are freed just before its new ones are made, so the sampler holds at most one chunk more than one
  copy of the weights instead of two full copies.
* **Guard** (`rl.verify_weight_sync` = off | first | every_n): per-array checksums computed on device
  on both sides (a wrapping uint32 sum of the bit patterns weighted by odd, position-dependent
  weights: any single changed element or bit changes it, and so do permutations) and compared on the
  host; a mismatch raises `WeightSyncError` naming the first bad parameter path.

`install_into_rl_cluster` plugs this into Tunix's `RLCluster` (see its docstring for why it wraps the
rollout's `update_params` rather than replacing `RLCluster.sync_weights`).
"""

from __future__ import annotations

import collections
import functools
import gc
import math
import sys
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from absl import logging
from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import utils as rl_utils

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import pathways
from maxtext_rl_plugin.errors import ConfigError

# pathwaysutils is optional (Pathways images, the `tpu` extra): imported only where a Pathways path is taken.
# pylint: disable=import-outside-toplevel

PATH_PATHWAYS_EXPERIMENTAL = "pathways_experimental"
PATH_PATHWAYS = "pathways"
PATH_DEVICE_PUT = "device_put"
VERIFY_POLICIES = ("off", "first", "every_n")


def verify_due(policy: str, every: int, n: int) -> bool:
  """Whether sync number `n` (1-based) is checked under `rl.verify_weight_sync` = `policy`: the first one, and with
  every_n also every `every`-th (1, N, 2N, ...). Every engine's guard asks this one function."""
  if policy == "first":
    return n == 1
  if policy == "every_n":
    return n == 1 or n % int(every) == 0
  return False


PyTree = Any
_logged_paths: set[str] = set()


class WeightSyncError(RuntimeError):
  """The sampler does not hold the weights the trainer sent (or the trees do not correspond)."""


# ---------------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------------


def pathways_requested() -> bool:
  """Whether the process runs on the Pathways proxy backend (the decision lives in `pathways.requested`)."""
  return pathways.requested()


def backend_path() -> str:
  """Which resharding path is active: 'pathways_experimental', 'pathways' or 'device_put' (logged once)."""
  path, why = PATH_DEVICE_PUT, "JAX_PLATFORMS has no 'proxy' (not a Pathways backend)"
  if pathways_requested():
    try:
      import pathwaysutils
    except ImportError:
      path, why = (
          PATH_DEVICE_PUT,
          "JAX_PLATFORMS=proxy but pathwaysutils is not installed (pip install 'maxtext-rl-plugin[tpu]')",
      )
    else:
      del pathwaysutils
      pathways.require_initialized()  # train_rl.main initialised it before JAX started; too late to do it here
      try:
        from pathwaysutils.experimental import reshard as _  # pylint: disable=unused-import  # a probe

        path, why = PATH_PATHWAYS_EXPERIMENTAL, "sidechannel reshard with intermediate sharding, cached plans"
      except ImportError:
        try:
          from pathwaysutils import reshard as _  # pylint: disable=unused-import,reimported  # a probe

          path, why = (
              PATH_PATHWAYS,
              "pathwaysutils.experimental.reshard unavailable; IFRT reshard with intermediate sharding",
          )
        except ImportError:
          path, why = PATH_DEVICE_PUT, "pathwaysutils has no reshard module"
  if path not in _logged_paths:
    _logged_paths.add(path)
    log = logging.warning if (pathways_requested() and path == PATH_DEVICE_PUT) else logging.info
    log("weight sync path: %s (%s)", path, why)
  return path


def _group_by_sharding_pair(arrays, shardings):
  """Indices grouped by (source sharding, destination sharding): one intermediate-sharding search per group."""
  groups: dict[tuple, list[int]] = collections.defaultdict(list)
  for i, (x, s) in enumerate(zip(arrays, shardings)):
    groups[(x.sharding, s)].append(i)
  return groups


def _staging_sharding(x, dst) -> jax.sharding.NamedSharding | None:
  """`dst`'s layout laid over `x`'s own devices, when a two-phase move applies (else None).

  Single-controller `jax.device_put` between two device sets *and* two partitionings takes JAX's
  `shard_sharded_device_array_slow_path`: when no source shard matches a destination shard it fetches
  the whole array to the host (`x._value`) and uploads slices -- an all-gather on one host. Instead we
  re-partition on the source devices first (an all-to-all inside the trainer mesh, compiled once) into
  a layout whose shard -> index map equals the destination's, then copy shard for shard to the sampler
  devices (JAX's batched copy fast path). Needs equally many devices on both sides.
  """
  if not isinstance(dst, jax.sharding.NamedSharding) or not isinstance(x, jax.Array) or not x.is_fully_addressable:
    return None
  src_devices = list(x.sharding._device_assignment)  # pylint: disable=protected-access  # JAX has no public ordered device list for every Sharding kind
  if len(src_devices) != dst.mesh.size or set(src_devices) == set(dst.device_set):
    return None
  mesh = jax.sharding.Mesh(
      np.array(src_devices, dtype=object).reshape(dst.mesh.devices.shape),
      dst.mesh.axis_names,
      axis_types=dst.mesh.axis_types,
  )
  return jax.sharding.NamedSharding(mesh, dst.spec, memory_kind=dst.memory_kind)


def _identity(xs):
  return xs


_staging_jit_cache: dict = {}


def _stage(xs: list, staging: list, donate: bool) -> list:
  key = (tuple(staging), donate)
  fn = _staging_jit_cache.get(key)
  if fn is None:
    fn = _staging_jit_cache[key] = jax.jit(_identity, out_shardings=list(staging), donate_argnums=(0,) if donate else ())
  return list(fn(xs))


def _device_put_two_phase(arrays: list, shardings: list, *, donate: bool) -> list:
  """Phase 1 re-partitions on the source devices (one program per device set), phase 2 copies shard for shard."""
  staged: dict[frozenset, list[int]] = collections.defaultdict(list)
  stagings: list = [None] * len(arrays)
  for i, (x, s) in enumerate(zip(arrays, shardings)):
    stagings[i] = _staging_sharding(x, s)
    if stagings[i] is not None and not x.sharding.is_equivalent_to(stagings[i], x.ndim):
      staged[frozenset(x.sharding.device_set)].append(i)
  moving = list(arrays)
  for idx in staged.values():  # phase 1: re-partition on the source devices, one program per device set
    for i, y in zip(idx, _stage([arrays[i] for i in idx], [stagings[i] for i in idx], donate)):
      moving[i] = y
  staged_idx = {i for idx in staged.values() for i in idx}
  if donate or not staged_idx:
    return list(jax.device_put(moving, shardings, donate=donate))
  return _put_mixed(moving, shardings, staged_idx)


def _put_mixed(moving: list, shardings: list, staged_idx: set[int]) -> list:
  """Phase 2: copy; staging buffers are donated (freed), the caller's source arrays never are."""
  out: list = [None] * len(moving)
  own = sorted(staged_idx)
  other = [i for i in range(len(moving)) if i not in staged_idx]
  for idx, donate in ((own, True), (other, False)):
    if idx:
      for i, y in zip(idx, jax.device_put([moving[i] for i in idx], [shardings[i] for i in idx], donate=donate)):
        out[i] = y
  return out


# On the CPU device_put path, build each destination shard straight from the source shards (`_put_cpu`) instead of
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

  def take(self, nbytes: int) -> np.ndarray:
    """A 64-byte-aligned uint8 buffer of `nbytes` that no array holds (reused if one is free, else new)."""
    buf = self._reuse(nbytes)
    if buf is None and self._bufs.get(nbytes):
      # XLA drops its reference to a deleted array's host buffer from a queue that JAX drains in a gc callback
      # (`jax._src.lib`, jax#14882), so a buffer released a moment ago looks held until the next collection.
      gc.collect(0)
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
    gc.collect(0)  # see `take`
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


def _put_cpu(arrays: list, shardings: list) -> list:
  """`jax.device_put(arrays, shardings)`, except that CPU arrays needing a host gather are assembled shard by shard
  (`_assemble_on_host`)."""
  assemble = [_needs_host_assembly(x, s) for x, s in zip(arrays, shardings)]
  if not any(assemble):
    return list(jax.device_put(arrays, shardings))
  out = list(arrays)
  rest = [i for i, a in enumerate(assemble) if not a]
  if rest:
    for i, y in zip(rest, jax.device_put([arrays[i] for i in rest], [shardings[i] for i in rest])):
      out[i] = y
  for i, a in enumerate(assemble):
    if a:
      out[i] = _assemble_on_host(arrays[i], shardings[i])
  return out


def _use_two_phase(arrays: list, two_phase: bool | None) -> bool:
  if two_phase is not None:
    return two_phase
  # On CPU the slow path's host gather *is* a memcpy and XLA:CPU collectives are slower than it
  # (measured: bench reshard); on GPU/TPU it would be a device->host->device round trip.
  return any(isinstance(x, jax.Array) and next(iter(x.devices())).platform != "cpu" for x in arrays[:1])


def _move(arrays: list, shardings: list, *, donate: bool, path: str, two_phase: bool | None = None) -> list:
  """Move one chunk of arrays to `shardings` on `path`; returns the new arrays in order."""
  if path == PATH_DEVICE_PUT:
    if distributed.is_multiprocess() and all(s.is_fully_addressable for s in shardings):
      # Multi-controller: a trainer mesh spanning every process -> this process's own sampler mesh.
      return distributed.to_process_local(arrays, shardings)
    if _use_two_phase(arrays, two_phase):
      return _device_put_two_phase(arrays, shardings, donate=donate)
    # JAX's single-controller reshard between different device sets *and* layouts assembles each array on
    # the host. On CPU host memory is device memory, so allow it even inside Tunix's sync_weights, which
    # forbids device<->host transfers on CPU; on GPU/TPU the two-phase path never touches the host.
    with jax.transfer_guard_device_to_host("allow"), jax.transfer_guard_host_to_device("allow"):
      if not donate and HOST_ASSEMBLY:
        return _put_cpu(arrays, shardings)
      return list(jax.device_put(arrays, shardings, donate=donate))
  if path == PATH_PATHWAYS_EXPERIMENTAL:
    from pathwaysutils.experimental import reshard as pw

    def fn(xs, src, dst):
      return pw.sidechannel_reshard_with_intermediate_sharding(xs, src, dst, donate=donate, cache_resharding_plans=True)

  else:
    from pathwaysutils import reshard as pw  # pylint: disable=reimported  # the older location

    def fn(xs, src, dst):
      return pw.reshard_with_intermediate_sharding(xs, src, dst, donate=donate)

  out: list = [None] * len(arrays)
  for (src, dst), idx in _group_by_sharding_pair(arrays, shardings).items():
    moved = fn([arrays[i] for i in idx], src, dst)
    for i, y in zip(idx, moved):
      out[i] = y
  return out


# ---------------------------------------------------------------------------------------------------
# Trees and shardings
# ---------------------------------------------------------------------------------------------------


def _is_sharding(x) -> bool:
  return isinstance(x, jax.sharding.Sharding)


def _flatten(tree: PyTree):
  """(paths, leaves, treedef) with Shardings as leaves."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_sharding)
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat], treedef


def _as_sharding(x) -> jax.sharding.Sharding:
  if _is_sharding(x):
    return x
  if hasattr(x, "sharding"):
    return x.sharding
  raise TypeError(f"destination leaf of type {type(x).__name__} is neither a Sharding nor an array")


def _check_same_structure(src_paths, src_def, dst_paths, dst_def, what: str) -> None:
  if src_def == dst_def:
    return
  for a, b in zip(src_paths, dst_paths):
    if a != b:
      raise WeightSyncError(f"{what}: trainer and sampler trees differ at '{a}' vs '{b}' (check the weight mapping)")
  longer = src_paths[len(dst_paths) :] or dst_paths[len(src_paths) :]
  raise WeightSyncError(
      f"{what}: trainer tree has {len(src_paths)} arrays, sampler tree {len(dst_paths)}"
      + (f" (first extra: '{longer[0]}')" if longer else "")
  )


def _fit_spec(spec: jax.sharding.PartitionSpec, shape: Sequence[int], mesh) -> jax.sharding.PartitionSpec:
  """Drop mesh axes that would not divide a dimension (e.g. TP=4 over 2 KV heads -> replicate that dim)."""
  out = []
  used: set[str] = set()
  for d, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    kept, size = [], 1
    for ax in axes:
      n = mesh.shape[ax]
      if n == 1 or ax in used or shape[d] % (size * n):
        continue
      kept.append(ax)
      size *= n
      used.add(ax)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return jax.sharding.PartitionSpec(*out)


def logical_shardings(state: PyTree, mesh: jax.sharding.Mesh, rules) -> PyTree:
  """NamedShardings on `mesh` for an nnx param state, from its logical axes and MaxText `logical_axis_rules`.

  This is how a sampler layout that differs from the trainer's (e.g. TP instead of FSDP) is derived from
  the same model definition; mesh axes that do not divide a dimension are dropped (replicated) so small
  models and odd head counts still shard.
  """

  logical = nnx.get_partition_spec(state)
  return _zip_shardings(state, nn.logical_to_mesh(logical, rules), mesh)


def model_on_mesh(model, mesh: jax.sharding.Mesh, rules):
  """A copy of an nnx `model` whose weights live on `mesh`, laid out by MaxText `rules` (the sampler's own copy).

  Tunix's RLCluster hands a class-based rollout engine the *trainer's* module (only its built-in
  'vanilla' engine gets a resharded copy), so a disaggregated engine must make its own copy on the
  rollout mesh; otherwise it samples on the trainer's devices and `sync_weights` is never called
  (Tunix sees shared arrays). Params get `logical_shardings`; other state (RNG keys) is replicated.
  """

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = reshard(params, logical_shardings(params, mesh, rules))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rest = jax.tree.map(lambda x: distributed.put(x, replicated) if isinstance(x, jax.Array) else x, rest)
  return nnx.merge(graphdef, params, rest)


def _zip_shardings(state: PyTree, mesh_specs: PyTree, mesh) -> PyTree:
  leaves, treedef = jax.tree_util.tree_flatten(state)
  specs = jax.tree_util.tree_leaves(mesh_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec) or x is None)
  if len(specs) != len(leaves):
    raise WeightSyncError(f"logical partition specs ({len(specs)}) do not match the state's arrays ({len(leaves)})")
  return jax.tree_util.tree_unflatten(
      treedef,
      [
          jax.sharding.NamedSharding(mesh, _fit_spec(s or jax.sharding.PartitionSpec(), x.shape, mesh))
          for x, s in zip(leaves, specs)
      ],
  )


# ---------------------------------------------------------------------------------------------------
# Resharding
# ---------------------------------------------------------------------------------------------------


# Default chunk budget on the `jax.device_put` path when `rl.reshard_chunk_size` is unset. It bounds the sampler's peak
# (one chunk over one copy: each chunk's old buffers are freed, and on CPU refilled, before its new ones); under memory
# pressure (bench reshard, 1 GiB model on a loaded 24 GiB host) the whole tree at once was 2.8x slower than these
# chunks. With room to spare, one chunk and these chunks time within noise of each other (docs/performance.md).
DEFAULT_CHUNK_BYTES = 64 * 2**20


def _chunks(n: int, chunk_size: int | None) -> list[range]:
  if chunk_size is None or chunk_size <= 0 or chunk_size >= n:
    return [range(n)]
  return [range(i, min(i + chunk_size, n)) for i in range(0, n, chunk_size)]


def chunks_by_bytes(nbytes: Sequence[int], limit: int) -> list[range]:
  """Consecutive arrays grouped into chunks of at most `limit` bytes (an array larger than that is a chunk alone)."""
  chunks, start, size = [], 0, 0
  for i, n in enumerate(nbytes):
    if i > start and size + n > limit:
      chunks.append(range(start, i))
      start, size = i, 0
    size += n
  if start < len(nbytes):
    chunks.append(range(start, len(nbytes)))
  return chunks or [range(0)]


def _plan_chunks(nbytes: Sequence[int], chunk_size: int | None, chunk_bytes: int | str | None, path: str) -> list[range]:
  """Chunks by array count (`chunk_size`, MaxText's `rl.reshard_chunk_size`) when given, else by bytes:
  `chunk_bytes` = 'auto' is `DEFAULT_CHUNK_BYTES` on the device_put path and one chunk on Pathways (which plans the
  whole transfer itself), None one chunk."""
  if chunk_size is not None:
    return _chunks(len(nbytes), chunk_size)
  if chunk_bytes == "auto":
    chunk_bytes = DEFAULT_CHUNK_BYTES if path == PATH_DEVICE_PUT else None
  if not chunk_bytes:
    return [range(len(nbytes))]
  return chunks_by_bytes(nbytes, int(chunk_bytes))


def buffer_ids(x: Any) -> set:
  """Identities of the device buffers behind `x` (a jax.Array can share buffers with a different Array)."""
  ids = {("obj", id(x))}
  try:
    ids |= {("buf", s.device.id, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}
  except Exception:  # pylint: disable=broad-exception-caught  # backends without raw pointers: the id only
    pass
  return ids


def release_buffers(old: Iterable[Any], keep: set) -> None:
  """Free a sampler's previous arrays now instead of at the next GC (`rl.reshard_donate`), every engine's one rule:
  never one that shares a buffer (`buffer_ids`) with anything in `keep` (the new weights, the trainer's arrays)."""
  for x in old:
    if isinstance(x, jax.Array) and not x.is_deleted() and not buffer_ids(x) & keep:
      x.delete()


def reshard(
    src_tree: PyTree,
    dst_shardings: PyTree,
    *,
    chunk_size: int | None = None,
    chunk_bytes: int | str | None = "auto",
    donate: bool = False,
    release: PyTree | None = None,
    stats: dict | None = None,
    two_phase: bool | None = None,
) -> PyTree:
  """`src_tree` moved to `dst_shardings` (same structure; leaves Shardings or arrays whose sharding is used).

  `chunk_size`: parameter arrays per chunk; each chunk is waited for before the next. When None, `chunk_bytes`
  bounds each chunk's bytes instead: 'auto' (the default) = `DEFAULT_CHUNK_BYTES` on the device_put path and all
  at once on Pathways; None = all at once.
  `donate`: donate the *source* buffers (only when the caller no longer needs them, e.g. a cast copy).
  `release`: the sampler's current arrays (same structure); each chunk's old buffers are deleted once its
  new ones are ready, which bounds the sampler's peak to one copy plus one chunk.
  `stats`: if given, filled with `bytes`, `chunks`, `max_chunk_bytes`, `path`.
  `two_phase` (device_put path only): re-partition on the source devices, then copy shard for shard,
  instead of JAX's host-gathering slow path; None = on for GPU/TPU arrays, off on CPU.
  """
  path = backend_path()
  src_paths, src, src_def = _flatten(src_tree)
  dst_paths, dst, dst_def = _flatten(dst_shardings)
  _check_same_structure(src_paths, src_def, dst_paths, dst_def, "reshard")
  shardings = [_as_sharding(s) for s in dst]
  old = None
  if release is not None:
    rel_paths, old, rel_def = _flatten(release)
    _check_same_structure(src_paths, src_def, rel_paths, rel_def, "reshard release")
  out: list = [None] * len(src)
  nbytes = [int(getattr(x, "nbytes", 0)) for x in src]
  chunks = _plan_chunks(nbytes, chunk_size, chunk_bytes, path)
  for chunk in chunks:
    if old is not None:  # the sampler is idle during a sync: free its old chunk before the new one lands
      release_buffers([old[i] for i in chunk], keep=set().union(*(buffer_ids(src[i]) for i in chunk)))
    moved = _move([src[i] for i in chunk], [shardings[i] for i in chunk], donate=donate, path=path, two_phase=two_phase)
    jax.block_until_ready(moved)
    for i, y in zip(chunk, moved):
      out[i] = y
  if path == PATH_DEVICE_PUT:
    HOST_BUFFERS.trim()  # buffers of old arrays this sync released but did not refill (a changed layout)
  if stats is not None:
    stats.update(
        bytes=sum(nbytes),
        chunks=len(chunks),
        max_chunk_bytes=max((sum(nbytes[i] for i in c) for c in chunks), default=0),
        path=path,
    )
  return jax.tree_util.tree_unflatten(src_def, out)


# ---------------------------------------------------------------------------------------------------
# Guard
# ---------------------------------------------------------------------------------------------------

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


@functools.partial(jax.jit, static_argnums=1)
def _checksums_jit(leaves: list, sharded: tuple) -> jax.Array:
  return jnp.stack([_checksum(x, d) for x, d in zip(leaves, sharded)]) if leaves else jnp.zeros((0,), jnp.uint32)


def checksums(tree: PyTree) -> np.ndarray:
  """uint32[n_arrays] checksums of a tree's arrays, computed on their own devices (one jit per device set)."""
  _, leaves, _ = _flatten(tree)
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


def verify(src_tree: PyTree, dst_tree: PyTree, *, dst_shardings: PyTree | None = None) -> None:
  """Raise `WeightSyncError` naming the first parameter whose sampler copy differs from the trainer's.

  Compares structure, shape, dtype, (if given) the expected destination sharding, then per-array
  on-device checksums of the bit patterns.
  """
  src_paths, src, src_def = _flatten(src_tree)
  dst_paths, dst, dst_def = _flatten(dst_tree)
  _check_same_structure(src_paths, src_def, dst_paths, dst_def, "weight sync check")
  expected = None
  if dst_shardings is not None:
    _, expected, _ = _flatten(dst_shardings)
  for i, (p, a, b) in enumerate(zip(src_paths, src, dst)):
    if isinstance(b, jax.Array) and b.is_deleted():
      raise WeightSyncError(
          f"weight sync check failed at '{p}': the sampler still holds its previous, released buffer "
          "(its update did not install this array)"
      )
    if a.shape != b.shape or a.dtype != b.dtype:
      raise WeightSyncError(
          f"weight sync check failed at '{p}': trainer {a.dtype}{list(a.shape)} vs sampler {b.dtype}{list(b.shape)}"
      )
    if expected is not None and not _as_sharding(expected[i]).is_equivalent_to(b.sharding, b.ndim):
      raise WeightSyncError(
          f"weight sync check failed at '{p}': sampler array is on {b.sharding}, expected {_as_sharding(expected[i])}"
      )
  cs, cd = checksums(src), checksums(dst)
  bad = np.nonzero(cs != cd)[0]
  if bad.size:
    i = int(bad[0])
    raise WeightSyncError(
        f"weight sync check failed: sampler's '{src_paths[i]}' differs from the trainer's "
        f"(checksum {int(cd[i]):#010x} vs {int(cs[i]):#010x}; {bad.size} of {len(src)} arrays differ)"
    )


# ---------------------------------------------------------------------------------------------------
# WeightSync
# ---------------------------------------------------------------------------------------------------


def _config_value(config, name: str, default):
  """`config.rl.<name>`, else `config.<name>`, else `default` (WeightSync takes MaxText configs and plain objects)."""
  rl = getattr(config, "rl", None)
  for obj in (rl, config):
    if obj is None:
      continue
    try:
      value = getattr(obj, name)
    except (AttributeError, KeyError, ValueError):
      continue
    return value
  return default


def _is_nnx_module(x) -> bool:
  return isinstance(x, nnx.Module)


class WeightSync:
  """Moves trainer weights into the sampler layout after each optimizer step, and checks they arrived.

  `dst` is one of: an nnx sampler model (updated in place; its current buffers are released chunk by chunk
  when `reshard_donate`), a tree of destination Shardings (or arrays, whose shardings are used), or None
  (shardings are then derived per call from `current=` or from `mesh`+`rules` and the source's logical
  axes). The trainer's and the sampler's trees are the same (the embedded engine runs the same MaxText module;
  engines with another layout, vLLM, map and reshard in their own update_params).
  Options come from `config` (`rl.reshard_chunk_size`, `reshard_donate`, `rl.verify_weight_sync`,
  `rl.verify_weight_sync_every`); keyword arguments override them. Without a chunk size, `chunk_bytes` bounds each
  chunk's bytes ('auto': `DEFAULT_CHUNK_BYTES` on the device_put path, one chunk on Pathways; None: one chunk).
  """

  def __init__(
      self,
      config=None,
      dst: Any = None,
      *,
      mesh: jax.sharding.Mesh | None = None,
      rules=None,
      chunk_size: int | None | str = "config",
      chunk_bytes: int | None | str = "auto",
      release_old: bool | None = None,
      verify_policy: str | None = None,
      verify_every: int | None = None,
  ):
    self.chunk_size = _config_value(config, "reshard_chunk_size", None) if chunk_size == "config" else chunk_size
    self.release_old = bool(_config_value(config, "reshard_donate", True) if release_old is None else release_old)
    self.verify_policy = str(verify_policy or _config_value(config, "verify_weight_sync", "first"))
    self.verify_every = int(verify_every or _config_value(config, "verify_weight_sync_every", 10))
    if self.verify_policy not in VERIFY_POLICIES:
      raise ConfigError(
          f"invalid value for 'rl.verify_weight_sync'='{self.verify_policy}': expected one of "
          + ", ".join(VERIFY_POLICIES)
      )
    if self.chunk_size is not None and int(self.chunk_size) < 1:
      raise ConfigError(
          f"invalid value for 'rl.reshard_chunk_size'={self.chunk_size}: expected a positive integer or null"
      )
    self.chunk_size = None if self.chunk_size is None else int(self.chunk_size)
    self.chunk_bytes = chunk_bytes  # used when chunk_size is None; 'auto': see reshard()
    self._model = dst if _is_nnx_module(dst) else None
    self._dst_shardings = (
        None if (dst is None or self._model is not None) else jax.tree.map(_as_sharding, dst, is_leaf=_is_sharding)
    )
    self._mesh, self._rules = mesh, rules
    self.num_syncs = 0
    self.num_verified = 0
    self.last_seconds = 0.0
    self.last_bytes = 0
    self.last_verify_seconds = 0.0
    self.last_stats: dict = {}
    self.path = backend_path()

  def _verify_due(self) -> bool:
    return verify_due(self.verify_policy, self.verify_every, self.num_syncs)

  def _model_state(self):

    return nnx.state(self._model, nnx.Param)

  def destination(self, mapped: PyTree, current: PyTree | None = None) -> PyTree:
    """The destination shardings for `mapped` (the mapped trainer tree)."""
    if current is not None:
      return jax.tree.map(_as_sharding, current, is_leaf=_is_sharding)
    if self._model is not None:
      return jax.tree.map(_as_sharding, self._model_state())
    if self._dst_shardings is not None:
      return self._dst_shardings
    if self._mesh is not None:
      self._dst_shardings = logical_shardings(mapped, self._mesh, self._rules or ())
      return self._dst_shardings
    raise ValueError("WeightSync needs a destination: a sampler model, shardings, current=, or mesh+rules")

  def sync(
      self,
      src_params: PyTree,
      *,
      current: PyTree | None = None,
      apply: Callable[[PyTree], PyTree] | None = None,
  ) -> PyTree:
    """Reshard `src_params` into the sampler layout, install it, check it per policy; returns the new tree.

    `current`: the sampler's current weights (their shardings are the destination; released chunk by
    chunk when `reshard_donate`). `apply(new) -> held`: installs the new tree into the sampler and returns
    what the sampler now holds, which is what the guard compares against the trainer's weights.
    """
    mapped = src_params
    if current is None and self._model is not None:
      current = self._model_state()
    dst_shardings = self.destination(mapped, current)
    stats: dict = {}
    t0 = time.perf_counter()
    new = reshard(
        mapped,
        dst_shardings,
        chunk_size=self.chunk_size,
        chunk_bytes=self.chunk_bytes,
        release=current if self.release_old else None,
        stats=stats,
    )
    if apply is not None:
      held = apply(new)
    elif self._model is not None:

      nnx.update(self._model, new)
      held = self._model_state()
    else:
      held = new
    self.last_seconds = time.perf_counter() - t0
    self.last_bytes = int(stats.get("bytes", 0))
    self.last_stats = stats
    self.num_syncs += 1
    if self._verify_due():
      t1 = time.perf_counter()
      verify(mapped, held, dst_shardings=dst_shardings)
      self.last_verify_seconds = time.perf_counter() - t1
      self.num_verified += 1
      logging.info(
          "weight sync %d verified: %d arrays, %.1f MiB bitwise equal on the sampler (%.3fs sync, %.3fs check)",
          self.num_syncs,
          len(jax.tree.leaves(mapped)),
          self.last_bytes / 2**20,
          self.last_seconds,
          self.last_verify_seconds,
      )
    else:
      logging.debug(
          "weight sync %d: %.1f MiB in %.3fs via %s",
          self.num_syncs,
          self.last_bytes / 2**20,
          self.last_seconds,
          stats.get("path"),
      )
    return held


# ---------------------------------------------------------------------------------------------------
# Tunix RLCluster hook
# ---------------------------------------------------------------------------------------------------


def install_into_rl_cluster(rl_cluster, weight_sync: WeightSync) -> None:
  """Route Tunix `RLCluster.sync_weights` through `weight_sync`.

  Tunix 0.1.7's `RLCluster.sync_weights` takes the actor's `nnx.Param` state and calls
  `rl_cluster.rollout.update_params(params, filter_types)`; each rollout engine then reshards with
  `tunix.rl.reshard.reshard_pytree` (whole tree, silent device_put fallback, no chunking, no check).
  We wrap that one method on the cluster's rollout *instance*: the params are resharded by
  `weight_sync` onto the shardings the engine's model currently has (freeing its old buffers chunk by
  chunk), handed to the engine's own `update_params` with `filter_types=None` -- Tunix's convention
  (VanillaRollout, the plugin's embedded engine) for "already on my shardings, install as is", so the
  engine does not reshard a second time -- and the guard then compares the trainer's weights with what
  the engine's model holds, so a bug in the engine's own install step is caught too.
  `RLCluster.sync_weights` itself stays Tunix's (transfer guards, anchor-policy snapshot, step
  counter; Tunix's learner waits for in-flight rollouts before calling it, so the sampler is idle),
  which is why we neither subclass nor replace it. Engines whose `model()` is not the nnx module
  holding the weights (vLLM) map and reshard inside their own `update_params` instead.
  """

  rollout = rl_cluster.rollout
  if not isinstance(rollout.model(), nnx.Module):
    raise TypeError(
        f"{type(rollout).__name__}.model() is not an nnx.Module holding the sampler weights; "
        "that engine must reshard inside its own update_params (e.g. with resharding.reshard)"
    )
  if getattr(rollout, "maxtext_rl_weight_sync", None) is not None:
    rollout.maxtext_rl_weight_sync = weight_sync
    return
  original = rollout.update_params

  def update_params(params, filter_types=None):
    filt = filter_types if filter_types else (nnx.Param,)
    current = nnx.state(rollout.model(), *filt)

    def apply(new):
      original(new, None)
      return nnx.state(rollout.model(), *filt)

    rollout.maxtext_rl_weight_sync.sync(params, current=current, apply=apply)

  rollout.maxtext_rl_weight_sync = weight_sync
  rollout.maxtext_rl_original_update_params = original
  rollout.update_params = update_params
  logging.info(
      "RLCluster weight sync routed through maxtext_rl_plugin.resharding (%s, chunk_size=%s, verify=%s)",
      weight_sync.path,
      weight_sync.chunk_size,
      weight_sync.verify_policy,
  )


def attach_to_rl_cluster(rl_cluster, config) -> WeightSync | None:
  """The trainer's one call after building the RLCluster: a `WeightSync` from `config`, installed, or None.

  The plugin's embedded engine runs the sync inside its own `update_params` (its `weight_sync` attribute); any
  other engine holding its weights in an nnx module gets its `update_params` wrapped (`install_into_rl_cluster`).

  None (and a log line saying why) when there is nothing to sync -- colocated runs where the rollout
  shares the actor's arrays (Tunix then never calls sync_weights) -- or when the engine keeps its weights
  outside an nnx module (vLLM, which reshards in its own update_params).
  """

  sampler = rl_cluster.rollout.model()
  if not isinstance(sampler, nnx.Module):
    logging.info(
        "weight sync: %s manages its own weights; not installing the plugin's sync", type(rl_cluster.rollout).__name__
    )
    return None
  if rl_utils.is_sharing_weights(rl_cluster.actor_trainer.model, sampler):
    logging.info("weight sync: colocated (the sampler shares the trainer's arrays); nothing to sync")
    return None
  ws = WeightSync(config)
  if hasattr(type(rl_cluster.rollout), "weight_sync"):
    rl_cluster.rollout.weight_sync = ws  # the plugin's own engine runs the guarded sync in its update_params
  else:
    install_into_rl_cluster(rl_cluster, ws)  # another engine: wrap its update_params (see that docstring)
  return ws
