"""Host data <-> global arrays, the multi-controller way: the one place the plugin places data on a mesh.

In a multi-process JAX program (one process per host: Ray `JaxTrainer` workers, a multi-host TPU slice without
Pathways) a mesh spans devices this process cannot address. `jax.device_put(host, NamedSharding(global mesh))` then
raises "device_put's second argument must be a Device or a Sharding which represents addressable devices", and
`np.asarray` / `jax.device_get` of a sharded global array fails. Every place that moves data between host and a
mesh goes through this module instead; on one process the same calls give the same arrays as `jax.device_put`.

Convention (the plugin's, documented once here): **every process holds the same full host data**. Each process reads
the same batch (a pure function of seed and step), samples the same completions (the rollout program's outputs are
replicated, `to_host`), computes the same rewards and advantages, so `global_array(host, sharding)` builds the global
array from the full host copy and each process contributes only the shards its devices hold
(`jax.make_array_from_callback`). Nothing here takes a process-local slice: Tunix's `shard_input` does
(`make_array_from_process_local_data`), which is why the plugin hands Tunix arrays that are already global (Tunix
then passes them through unchanged) rather than host arrays it would concatenate across processes.

Disaggregated runs across processes (`split_local_devices`): the trainer mesh spans every process's first local
devices, the sampler mesh is each process's own last devices (per host, as tpu-inference needs). Weights reach it by
`to_process_local` (all-gather on the trainer mesh, then a local copy; bit-exact); each process samples only its own
prompt groups (`process_slice`), and `gather_rows` / `gather_texts` restore the convention above: every process then
holds the whole sampled batch.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from maxtext_rl_plugin.errors import CheckpointError, ConfigError


def process_count() -> int:
  return jax.process_count()


def is_multiprocess() -> bool:
  return jax.process_count() > 1


def check_device_split(trainer_devices: list, sampler_devices: list) -> None:
  """Refuse, in a multi-process program, a disaggregated split whose sampler is not this process's own devices (one
  line, before any model is built).

  Multi-controller JAX cannot copy arrays to a device set that spans several processes other than the source's, and a
  rollout jitted on such a set could not be run by the processes owning none of it. What works is a per-host sampler
  (`split_local_devices`: every process samples on its own devices, weights reach it by `to_process_local`); a
  multislice split (whole slices per role) is the Pathways path.
  """
  if not is_multiprocess() or list(trainer_devices) == list(sampler_devices):
    return
  me = jax.process_index()
  if any(d.process_index != me for d in sampler_devices) or {d.process_index for d in trainer_devices} != set(
      range(jax.process_count())
  ):
    raise ConfigError(
        f"a disaggregated trainer/sampler split ({len(trainer_devices)} + {len(sampler_devices)} devices) across "
        f"{jax.process_count()} JAX processes needs every process to own trainer devices and to sample on its own "
        "devices (use_pathways=true with chips_per_vm and trainer/sampler_devices_fraction, split per process); a "
        "split by slices needs one controller (Pathways)"
    )


def check_asynchronous(off_policy_steps: int, sampler_per_host: bool) -> None:
  """Refuse rollouts that run ahead in a thread (`rl.off_policy_steps` > 0) in a multi-process program whose sampler
  spans processes (colocated on the global trainer mesh): its rollout programs are themselves cross-process
  collectives, which the producer thread would issue in an order unrelated to the trainer's. A per-host sampler (a
  disaggregated split per process, or vLLM's one engine per host) samples on this process's devices only; the
  producer then hands every cross-process step (the gather of the rows) to the trainer's thread
  (run/async_rollout.py), so every process issues the same collectives in the same order."""
  if is_multiprocess() and off_policy_steps > 0 and not sampler_per_host:
    raise ConfigError(
        f"invalid value for 'rl.off_policy_steps'={off_policy_steps}: rollouts running ahead across "
        f"{jax.process_count()} JAX processes need a sampler on each process's own devices (a disaggregated split: "
        "trainer_devices_fraction/sampler_devices_fraction, or rollout_engine=vllm's engine per host); a colocated "
        "sampler's rollout is a program over every process's devices, which a thread cannot order with the "
        "trainer's; use rl.off_policy_steps=0 or split the devices"
    )


def _is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def global_array(host: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """The global array of `host` (the same full value on every process) laid out by `sharding`.

  Each process fills only its addressable shards from its own copy; no data crosses processes. On one process this
  equals `jax.device_put(host, sharding)` bit for bit.
  """
  if _is_key(host):  # typed PRNG keys: place the raw key data, rewrap (device_put has no multi-process key path)
    impl = jax.random.key_impl(host)
    return jax.random.wrap_key_data(global_array(jax.random.key_data(host), sharding), impl=impl)
  if isinstance(host, jax.Array) and not host.is_fully_addressable:
    if host.sharding == sharding:
      return host
    if sharding.is_fully_addressable:  # onto this process's own devices (a per-host sampler mesh)
      return to_process_local([host], [sharding])[0]
    return jax.device_put(host, sharding)
  arr = np.asarray(host)
  return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def to_process_local(arrays: list, shardings: list) -> list:
  """Global arrays (spanning other processes' devices) as this process's own full copies laid out by `shardings`,
  each over this process's devices only: the weight sync from a trainer mesh spanning every process to a per-host
  sampler mesh, which `jax.device_put` refuses across processes.

  Two device-to-device steps, no arithmetic (bit-exact): one jit per source mesh replicates every array on its own
  mesh (an all-gather every process joins, so every process must call this with the same arrays, in the same
  order), then each process copies its local replica onto its local sharding. The replicated intermediate holds
  one full copy of the chunk per source device: callers bound it by passing chunks (`move.reshard`).
  Arrays already fully addressable are `jax.device_put` directly.
  """
  out: list = [None] * len(arrays)
  by_mesh: dict[Any, list[int]] = {}
  for i, (x, s) in enumerate(zip(arrays, shardings)):
    if not s.is_fully_addressable:
      raise ValueError(f"to_process_local: {s} spans devices of other processes")
    if x.is_fully_addressable:
      out[i] = _put_local(x, s)
    else:
      by_mesh.setdefault(x.sharding.mesh, []).append(i)
  for mesh, idx in by_mesh.items():
    rep = NamedSharding(mesh, P())
    raw = [_raw(arrays[i]) for i in idx]
    gathered = jax.jit(lambda *xs: xs, out_shardings=tuple(rep for _ in raw))(*raw)
    for i, g in zip(idx, gathered):
      local = g.addressable_data(0)  # this process's full copy (one of its devices)
      out[i] = _rewrap(arrays[i], _put_local(local, shardings[i]))
  return out


def _raw(x: jax.Array) -> jax.Array:
  return jax.random.key_data(x) if _is_key(x) else x


def _rewrap(like: jax.Array, raw: jax.Array) -> jax.Array:
  return jax.random.wrap_key_data(raw, impl=jax.random.key_impl(like)) if _is_key(like) else raw


def _put_local(x: jax.Array, s: jax.sharding.Sharding) -> jax.Array:
  if _is_key(x):  # a key array's sharding also lays out its key data (one more, trailing, replicated dimension)
    return _rewrap(x, jax.device_put(jax.random.key_data(x), s))
  return jax.device_put(x, s)


def split_local_devices(devices: list, trainer_fraction: float, sampler_fraction: float) -> tuple[list, list]:
  """The multi-controller disaggregated split: every process gives its first local devices to the trainer and its
  last local devices to the sampler. Returns (trainer devices of every process: one global trainer mesh, this
  process's own sampler devices: a per-host sampler mesh, the shape tpu-inference needs multi-host too)."""
  by_process: dict[int, list] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  trainer: list = []
  sampler: list = []
  for p in sorted(by_process):
    local = by_process[p]
    n_t, n_s = int(len(local) * trainer_fraction), int(len(local) * sampler_fraction)
    if n_t < 1 or n_s < 1 or n_t + n_s > len(local):
      raise ConfigError(
          f"invalid value for 'trainer_devices_fraction'={trainer_fraction}: with sampler_devices_fraction="
          f"{sampler_fraction} each process's {len(local)} devices must split into >= 1 trainer and >= 1 sampler "
          "device without overlap"
      )
    trainer += local[:n_t]
    if p == jax.process_index():
      sampler = local[len(local) - n_s :]
  return trainer, sampler


def process_slice(n_groups: int) -> slice:
  """The prompt groups this process samples when every process samples its own share (a per-host sampler mesh):
  contiguous, in process order, the layout `global_batch` gives the rows on a process-major trainer mesh."""
  n = jax.process_count()
  if n_groups % n:
    raise ConfigError(
        f"invalid value for 'batch_size'={n_groups}: each of the {n} JAX processes samples an equal share of the "
        "prompts (a per-host sampler mesh), so batch_size must be divisible by the process count"
    )
  per = n_groups // n
  return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


def gather_rows(local: np.ndarray) -> np.ndarray:
  """Every process's `local` rows (same shape on each) concatenated in process order, on every process."""
  if not is_multiprocess():
    return np.asarray(local)
  return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def gather_texts(local: list[str]) -> list[str]:
  """Every process's strings (the same count on each) in process order, on every process (UTF-8 bytes through
  `gather_rows`, padded to the longest)."""
  if not is_multiprocess():
    return list(local)
  raw = [t.encode("utf-8") for t in local]
  width = int(gather_rows(np.asarray([max((len(b) for b in raw), default=0)], np.int64)).max())
  buf = np.zeros((len(raw), width + 1), np.uint8)  # +1: never a zero-width array
  lens = np.asarray([len(b) for b in raw], np.int64)
  for i, b in enumerate(raw):
    buf[i, : len(b)] = np.frombuffer(b, np.uint8)
  all_buf, all_lens = gather_rows(buf), gather_rows(lens)
  return [bytes(row[:k]).decode("utf-8") for row, k in zip(all_buf, all_lens)]


def batch_sharding(mesh: jax.sharding.Mesh, axes: Any, ndim: int) -> NamedSharding:
  """Leading (batch) axis over `axes` of `mesh` (a name, a tuple of names, or None), the rest replicated."""
  if ndim == 0:
    return NamedSharding(mesh, P())
  axes = tuple(a for a in ((axes,) if isinstance(axes, str) else tuple(axes or ())) if a in mesh.shape)
  return NamedSharding(mesh, P(axes or None, *([None] * (ndim - 1))))


def data_ways(mesh: jax.sharding.Mesh, axes: Any) -> int:
  """How many ways `batch_sharding(mesh, axes, ...)` splits the rows (1 when no named axis is in the mesh)."""
  lead = batch_sharding(mesh, axes, 1).spec[0]
  lead = (lead,) if isinstance(lead, str) else tuple(lead or ())
  return int(np.prod([mesh.shape[a] for a in lead] or [1]))


def rows_sharding(mesh: jax.sharding.Mesh, axes: Any, shape: tuple[int, ...]) -> NamedSharding:
  """The one rule for where a batch of `shape` lives on `mesh`: rows over `axes` when they divide, else replicated.

  It is Tunix's (`sft/sharding_utils.get_sharding`, what `shard_input` gives every train and log-prob input), so
  the run accepts whatever MaxText's own run accepts: MaxText's post_train/rl.yml defaults (1 prompt x 2 generations)
  train on a 32-chip trainer, replicated (`rows_note` says what that costs); the AOT compile lays out its examples by
  the same rule (aot/programs.py). Also eval batches of any size."""
  sharding = batch_sharding(mesh, axes, len(shape))
  if shape and shape[0] % data_ways(mesh, axes):
    return NamedSharding(mesh, P())
  return sharding


def rows_note(rows: int, mesh: jax.sharding.Mesh, axes: Any) -> str | None:
  """One `note:` line when the train micro-batch's `rows` do not split over the trainer's data axis (None when they
  do): the run is valid (Tunix replicates the rows) but pays for rows it does not have."""
  ways = data_ways(mesh, axes)
  if rows % ways == 0:
    return None
  return (
      f"note: the train micro-batch of {rows} rows does not split over the trainer's {ways}-way data axis: it is "
      f"replicated (as Tunix's shard_input does), and the model's activation sharding pads it to one row per device, "
      f"so an update costs what {-(-rows // ways) * ways} rows would; a train_micro_batch_size "
      f"(or batch_size) x rl.num_generations divisible by {ways} uses every device"
  )


def global_batch(host: Any, mesh: jax.sharding.Mesh, axes: Any = ("fsdp",)) -> jax.Array:
  """`host` (same on every process) as a global array laid out by `rows_sharding` (Tunix's `data_sharding_axis`,
  default fsdp, which its `shard_input` then accepts as already placed)."""
  if isinstance(host, jax.Array) and not host.is_fully_addressable:
    return host
  arr = np.asarray(host)
  return global_array(arr, rows_sharding(mesh, axes, arr.shape))


def replicated(host: Any, mesh: jax.sharding.Mesh) -> jax.Array:
  return global_array(host, NamedSharding(mesh, P()))


def mesh_of(tree: Any) -> jax.sharding.Mesh | None:
  """The mesh of the first `NamedSharding` leaf of `tree` (None when it has none)."""
  for x in jax.tree.leaves(tree):
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding):
      return s.mesh
  return None


def restore_sharding(x: Any, mesh: jax.sharding.Mesh | None) -> jax.sharding.Sharding | None:
  """The sharding a checkpoint leaf restores into: `x`'s own, except a leaf this process alone holds (an optimizer
  step count Tunix has not yet laid out on the mesh) in a multi-process run, which restores replicated on `mesh` (a
  per-process single-device array would be a different array on every process and breaks the first jitted update)."""
  s = getattr(x, "sharding", None)
  if s is None or mesh is None or not is_multiprocess() or not s.is_fully_addressable:
    return s
  return NamedSharding(mesh, P())


def put(tree: Any, shardings: Any) -> Any:
  """`jax.device_put(tree, shardings)` that also works when the shardings span other processes' devices.

  Host leaves (NumPy, scalars, this process's own arrays) must be the same on every process (`global_array`); global
  arrays are resharded by `jax.device_put` (same device set: a collective every process joins); PRNG key arrays
  travel as their key data.
  """
  if not is_multiprocess():
    return jax.device_put(tree, shardings)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: global_array(x, shardings), tree)
  return jax.tree.map(global_array, tree, shardings)


def put_on_memory_kind(tree: Any, memory_kind: str) -> Any:
  """Every array of `tree` on `memory_kind` ("pinned_host", "device") with its own sharding otherwise unchanged;
  multi-process safe (what `tunix.rl.utils.put_params_on_memory_kind` does with one `jax.device_put`, which rejects
  typed PRNG keys of a global mesh)."""

  def move(x):
    if not isinstance(x, jax.Array):
      return x
    s = x.sharding
    if getattr(s, "memory_kind", None) == memory_kind:
      return x
    s = (
        NamedSharding(s.mesh, s.spec, memory_kind=memory_kind)
        if isinstance(s, NamedSharding)
        else s.with_memory_kind(memory_kind)
    )
    if _is_key(x):
      return jax.random.wrap_key_data(jax.device_put(jax.random.key_data(x), s), impl=jax.random.key_impl(x))
    return jax.device_put(x, s)

  return jax.tree.map(move, tree)


def to_host(x: Any) -> np.ndarray:
  """The full value of `x` on this process as NumPy (`np.asarray` for local or replicated arrays; an all-gather, which
  every process must join, for a global array sharded over other processes' devices)."""
  if not isinstance(x, jax.Array):
    return np.asarray(x)
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def is_writer_process() -> bool:
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Every process waits here until all arrive (a no-op on one process)."""
  if is_multiprocess():
    multihost_utils.sync_global_devices(name)


def agree_from_writer(value: int) -> int:
  """Process 0's `value` on every process (e.g. one timestamp for a file every process names)."""
  if not is_multiprocess():
    return value
  return int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(int(value), np.int64))))


def from_writer_rows(rows: np.ndarray) -> np.ndarray:
  """Process 0's `rows` on every process (the same shape on each): a decision made once and shared, e.g. the rewards
  dynamic sampling selects groups by, so a reward function that is not deterministic across hosts (a timeout, a
  remote judge) cannot make processes keep different groups or run different refill rounds. A broadcast rather than
  an all-gather: nothing is compared, the writer's value is the value."""
  if not is_multiprocess():
    return np.asarray(rows)
  return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(rows)))


def agree(value: int, what: str) -> int:
  """`value` (an int every process computed, e.g. the resume step): checked equal on every process, so a process that
  sees another checkpoint directory fails loudly instead of training a different step."""
  if not is_multiprocess():
    return value
  all_values = np.asarray(multihost_utils.process_allgather(np.asarray([int(value)], np.int64))).reshape(-1)
  if not np.all(all_values == all_values[0]):
    raise CheckpointError(
        f"processes disagree on {what}: {all_values.tolist()} (process {jax.process_index()} has "
        f"{value}); every process must see the same checkpoint directory (a shared mount or gs://)"
    )
  return value
