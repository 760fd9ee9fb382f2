"""Moving arrays to the sampler's shardings: one chunk at a time, the sampler's old buffers freed before each.

`reshard` plans chunks (`rl.reshard_chunk_size` = parameter arrays per chunk, MaxText's meaning; unset: chunks of at
most `DEFAULT_CHUNK_BYTES` on the device_put path, one chunk on Pathways), moves each on the backend's path
(backend.py) and waits for it before the next one starts; with `reshard_donate` the sampler's previous buffers of that
chunk are freed just before its new ones are made, so the sampler holds at most one chunk more than one copy of the
weights instead of two full copies. The intermediate-sharding variant of Pathways' reshard only looks for an
intermediate layout when it is given *one* source and *one* destination sharding; Tunix and MaxText pass whole pytrees,
so it never finds one for them. We therefore call it once per (source sharding, destination sharding) group, which is
what lets an FSDP-8 -> TP-4 weight avoid the all-gather.
"""

# pathwaysutils is optional (Pathways images, the `tpu` extra): imported only where a Pathways path is taken.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import collections
from typing import Any, Iterable, Sequence

from flax import nnx
import jax
import numpy as np

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.resharding import backend
from maxtext_rl_plugin.resharding import host_buffers
from maxtext_rl_plugin.resharding import per_host
from maxtext_rl_plugin.resharding import trees

PyTree = Any


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


def _use_two_phase(arrays: list, two_phase: bool | None) -> bool:
  if two_phase is not None:
    return two_phase
  # On CPU the slow path's host gather *is* a memcpy and XLA:CPU collectives are slower than it
  # (measured: bench reshard); on GPU/TPU it would be a device->host->device round trip.
  return any(isinstance(x, jax.Array) and next(iter(x.devices())).platform != "cpu" for x in arrays[:1])


def _move(arrays: list, shardings: list, *, donate: bool, path: str, two_phase: bool | None = None) -> list:
  """Move one chunk of arrays to `shardings` on `path`; returns the new arrays in order."""
  if path == backend.PATH_DEVICE_PUT:
    if distributed.is_multiprocess() and all(s.is_fully_addressable for s in shardings):
      # Multi-controller: a trainer mesh spanning every process -> this process's own sampler (per_host.py).
      return per_host.to_local(arrays, shardings)
    if _use_two_phase(arrays, two_phase):
      return _device_put_two_phase(arrays, shardings, donate=donate)
    # JAX's single-controller reshard between different device sets *and* layouts assembles each array on
    # the host. On CPU host memory is device memory, so allow it even inside Tunix's sync_weights, which
    # forbids device<->host transfers on CPU; on GPU/TPU the two-phase path never touches the host.
    with jax.transfer_guard_device_to_host("allow"), jax.transfer_guard_host_to_device("allow"):
      if not donate and host_buffers.HOST_ASSEMBLY:
        return host_buffers.put_cpu(arrays, shardings)
      return list(jax.device_put(arrays, shardings, donate=donate))
  if path == backend.PATH_PATHWAYS_EXPERIMENTAL:
    from pathwaysutils.experimental import reshard as pw_experimental

    def fn(xs, src, dst):
      return pw_experimental.sidechannel_reshard_with_intermediate_sharding(
          xs, src, dst, donate=donate, cache_resharding_plans=True
      )

  else:
    from pathwaysutils import reshard as pw  # the older location

    def fn(xs, src, dst):
      return pw.reshard_with_intermediate_sharding(xs, src, dst, donate=donate)

  out: list = [None] * len(arrays)
  for (src, dst), idx in _group_by_sharding_pair(arrays, shardings).items():
    moved = fn([arrays[i] for i in idx], src, dst)
    for i, y in zip(idx, moved):
      out[i] = y
  return out


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
    chunk_bytes = DEFAULT_CHUNK_BYTES if path == backend.PATH_DEVICE_PUT else None
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
  path = backend.backend_path()
  src_paths, src, src_def = trees.flatten(src_tree)
  dst_paths, dst, dst_def = trees.flatten(dst_shardings)
  trees.check_same_structure(src_paths, src_def, dst_paths, dst_def, "reshard")
  shardings = [trees.as_sharding(s) for s in dst]
  old = None
  if release is not None:
    rel_paths, old, rel_def = trees.flatten(release)
    trees.check_same_structure(src_paths, src_def, rel_paths, rel_def, "reshard release")
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
  if path == backend.PATH_DEVICE_PUT:
    host_buffers.HOST_BUFFERS.trim()  # buffers of old arrays this sync released but did not refill (a changed layout)
  if stats is not None:
    stats.update(
        bytes=sum(nbytes),
        chunks=len(chunks),
        max_chunk_bytes=max((sum(nbytes[i] for i in c) for c in chunks), default=0),
        path=path,
    )
  return jax.tree_util.tree_unflatten(src_def, out)


def model_on_mesh(model, mesh: jax.sharding.Mesh, rules):
  """A copy of an nnx `model` whose weights live on `mesh`, laid out by MaxText `rules` (the sampler's own copy).

  Tunix's RLCluster hands a class-based rollout engine the *trainer's* module (only its built-in
  'vanilla' engine gets a resharded copy), so a disaggregated engine must make its own copy on the
  rollout mesh; otherwise it samples on the trainer's devices and `sync_weights` is never called
  (Tunix sees shared arrays). Params get `trees.logical_shardings`; other state (RNG keys) is replicated.
  """

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = reshard(params, trees.logical_shardings(params, mesh, rules))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rest = jax.tree.map(lambda x: distributed.put(x, replicated) if isinstance(x, jax.Array) else x, rest)
  return nnx.merge(graphdef, params, rest)
