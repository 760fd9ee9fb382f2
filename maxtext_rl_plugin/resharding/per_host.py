"""Trainer weights -> one engine per host: the weight sync of a multi-controller run (Ray workers, TPU VMs without
Pathways), where every JAX process runs its own sampler on its own chips and the trainer's arrays span all of them.

`jax.device_put` cannot move a global array onto one process's devices, and an all-gather to every device
(`distributed.to_process_local`, the fallback) holds a full copy of each weight per trainer device. Instead:

1. one jitted program per chunk re-lays the trainer's global arrays onto a (hosts, *local axes) mesh
   (`hosts_mesh`): replicated over `hosts`, and within a host sharded exactly as the engine's own sharding asks
   (the same `PartitionSpec` over the same local axes); XLA's collectives move only what each device needs;
2. each process then builds its engine arrays from its addressable shards of that result
   (`jax.make_array_from_single_device_arrays` over its local mesh): no copy, no host round trip.

When the trainer and the samplers use different chips of each host (a disaggregated per-host split,
`distributed.split_local_devices`), step 1 lands on the trainer's own chips laid out like the sampler's and each
process copies its shards device to device onto its sampler chips (step 2 becomes a local `jax.device_put`).
Chunking is the caller's (`move.reshard`), so the peak is one chunk over one copy of the weights.

The guard (`check_hosts`, under `rl.verify_weight_sync`): the trainer-side checksums of the engine-layout arrays
(`source_checksums`, computed where the global arrays live and read by every process) against each host's installed
weights; every process raises the same `WeightSyncError` naming the first host and the parameter that differ.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
import numpy as np

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.resharding import trees
from maxtext_rl_plugin.resharding import verify

HOSTS = "hosts"


def _by_process(devices) -> dict[int, list]:
  """Each process's devices among `devices`, sorted by id (the order every process computes alike)."""
  out: dict[int, list] = {}
  for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
    out.setdefault(d.process_index, []).append(d)
  return out


def _positions(local_mesh: Mesh, local_devices: Sequence) -> np.ndarray:
  """Where each device of `local_mesh` sits among `local_devices` (sorted by id): the layout every host repeats."""
  pos = {d.id: i for i, d in enumerate(sorted(local_devices, key=lambda d: d.id))}
  return np.asarray([pos[d.id] for d in local_mesh.devices.flat], np.int64).reshape(local_mesh.devices.shape)


@functools.lru_cache(maxsize=None)
def _checked_positions(key: tuple) -> None:
  """Every process must lay its engine over the same local positions (one all-gather per distinct layout)."""
  mine = np.asarray(key, np.int64)
  with jax.transfer_guard("allow"):  # a few ints, read on purpose (Tunix's sync_weights forbids transfers on CPU)
    every = distributed.gather_rows(mine[None])
  if not (every == mine[None]).all():
    raise ConfigError(
        "every host must build its sampler over the same local device positions (a per-host engine mesh); got "
        + "; ".join(f"process {p}: {row.tolist()}" for p, row in enumerate(every))
    )


def hosts_mesh(local_mesh: Mesh, devices: Sequence | None = None) -> Mesh:
  """The (hosts, *local axes) mesh of this per-host `local_mesh`.

  Without `devices`: host p's block is process p's devices at the positions this process's local mesh uses (checked
  equal on every process). With `devices` (the trainer's chips of a disaggregated per-host split): host p's block is
  process p's devices among them, in id order, shaped like the local mesh (the staging layout).
  """
  size, shape = local_mesh.devices.size, local_mesh.devices.shape
  if devices is None:
    groups = _by_process(jax.devices())
    positions = _positions(local_mesh, groups[jax.process_index()])
    _checked_positions(tuple(int(i) for i in positions.flat))
  else:
    groups = _by_process(devices)
    positions = np.arange(size).reshape(shape)
  blocks = []
  for p in sorted(groups):
    if len(groups[p]) < size:
      raise ConfigError(
          f"process {p} has {len(groups[p])} devices for a per-host sampler of {size} (every host must have the "
          "same number of sampler devices)"
      )
    blocks.append(np.asarray(groups[p], dtype=object)[positions])
  return Mesh(np.stack(blocks), (HOSTS, *local_mesh.axis_names))


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _raw(x: jax.Array) -> jax.Array:
  return jax.random.key_data(x) if _is_key(x) else x


def _rewrap(like: jax.Array, raw: jax.Array) -> jax.Array:
  return jax.random.wrap_key_data(raw, impl=jax.random.key_impl(like)) if _is_key(like) else raw


def _identity(*xs):
  return xs


_relayout_cache: dict = {}


def _relayout(xs: list, out_shardings: tuple) -> list:
  """The one program of a chunk: the global arrays `xs` re-laid out onto `out_shardings` (a collective every process
  joins, with the same arrays in the same order)."""
  fn = _relayout_cache.get(out_shardings)
  if fn is None:
    fn = _relayout_cache[out_shardings] = jax.jit(_identity, out_shardings=out_shardings)
  return list(fn(*xs))


def local_shards(out: jax.Array) -> list:
  """This process's shards of a re-laid-out array, one per local device (the buffers the engine array adopts)."""
  return [s.data for s in out.addressable_shards]


def _local_sharding(mesh: Mesh, like: NamedSharding) -> NamedSharding:
  return NamedSharding(mesh, like.spec, memory_kind=like.memory_kind)


def to_local(arrays: Sequence[jax.Array], shardings: Sequence[jax.sharding.Sharding]) -> list:
  """Global trainer arrays as this process's own arrays on its per-host engine `shardings` (module docstring).

  Every process calls it with the same arrays in the same order. Arrays already fully addressable are
  `jax.device_put`; destinations that are not `NamedSharding`s, or a trainer whose chips per host differ from the
  sampler's, take `distributed.to_process_local` (an all-gather, then a local copy).
  """
  out: list = [None] * len(arrays)
  groups: dict[tuple, list[int]] = {}
  fallback: list[int] = []
  for i, (x, s) in enumerate(zip(arrays, shardings)):
    if not s.is_fully_addressable:
      raise ValueError(f"per-host sync: {s} spans devices of other processes")
    if x.is_fully_addressable:
      out[i] = _rewrap(x, jax.device_put(_raw(x), s))
      continue
    if not isinstance(s, NamedSharding):
      fallback.append(i)
      continue
    src = frozenset(x.sharding.device_set)
    own = [d for d in src if d.process_index == jax.process_index()]
    if set(hosts_mesh(s.mesh).devices.flat) == src or len(own) == s.mesh.devices.size:
      groups.setdefault((src, s.mesh), []).append(i)
    else:
      fallback.append(i)
  for (src, local_mesh), idx in groups.items():
    mesh = hosts_mesh(local_mesh)
    direct = set(mesh.devices.flat) == src
    if not direct:  # the trainer's own chips, each host's block laid out like its sampler (then a local copy)
      mesh = hosts_mesh(local_mesh, devices=list(src))
    staging_local = Mesh(mesh.devices[jax.process_index()], local_mesh.axis_names)
    outs = _relayout([_raw(arrays[i]) for i in idx], tuple(_local_sharding(mesh, shardings[i]) for i in idx))
    for i, y in zip(idx, outs):
      local = jax.make_array_from_single_device_arrays(
          y.shape, _local_sharding(staging_local, shardings[i]), local_shards(y)
      )
      if not direct:
        local = jax.device_put(local, shardings[i])
      out[i] = _rewrap(arrays[i], local)
  if fallback:
    for i, y in zip(
        fallback, distributed.to_process_local([arrays[i] for i in fallback], [shardings[i] for i in fallback])
    ):
      out[i] = y
  return out


def source_checksums(named: Mapping[str, jax.Array]) -> dict[str, int]:
  """`{name: checksum}` of the trainer-side arrays (global or local), the same on every process (every process joins)."""
  names = sorted(named)
  sums = verify.global_checksums([named[n] for n in names])
  return {n: int(c) for n, c in zip(names, sums)}


def check_hosts(source: Mapping[str, int], installed: Mapping[str, Any]) -> None:
  """Every host's `installed` engine weights against the trainer's `source` checksums; on a mismatch every process
  raises the same `WeightSyncError` naming the first host and its first parameter that differ."""
  names = sorted(source)
  # A leaf still holding a buffer the sync released (its install did not take effect) differs too.
  missing = [i for i, n in enumerate(names) if installed.get(n) is None or installed[n].is_deleted()]
  present = [i for i in range(len(names)) if i not in set(missing)]
  local = verify.checksums([installed[names[i]] for i in present]) if present else np.zeros((0,), np.uint32)
  bad = sorted(missing + [i for i, c in zip(present, local) if int(c) != int(source[names[i]])])
  first = np.asarray([bad[0] if bad else -1, len(bad)], np.int64)
  with jax.transfer_guard("allow"):  # two ints per host, read on purpose
    every = distributed.gather_rows(first[None])
  failing = [p for p, (b, _) in enumerate(every) if b >= 0]
  if failing:
    p = failing[0]
    b, n_bad = (int(v) for v in every[p])
    raise trees.WeightSyncError(
        f"weight sync check failed on host {p} (JAX process {p}): its engine's '{names[b]}' differs from the "
        f"trainer's ({n_bad} of {len(names)} parameters there; {len(failing)} of {len(every)} hosts differ)"
    )
