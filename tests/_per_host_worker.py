"""One process of a 2-process JAX program (gloo CPU collectives, 4 CPU devices each), run by
tests/resharding/test_per_host_sync.py: `python tests/_per_host_worker.py <process_id> <coordinator> <out.json>`.

The per-host weight sync (maxtext_rl_plugin/resharding/per_host.py): trainer arrays over all 8 devices onto each
process's own engine mesh (colocated: the same chips), and onto each process's last 2 chips from a trainer on every
process's first 2 (disaggregated); the guard on every host, and three same-shape mutations it must catch."""

import json
import sys

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_dtypes
import numpy as np

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.resharding import per_host
from maxtext_rl_plugin.resharding import trees


def host_arrays() -> dict[str, np.ndarray]:
  """The trainer's weights as host data, the same on every process (and in the test that checks the result)."""
  rng = np.random.default_rng(0)
  return {
      "embed": rng.standard_normal((16, 12)).astype(np.float32),
      "kernel": rng.standard_normal((8, 4, 16)).astype(np.float32),
      "norm": rng.standard_normal((12,)).astype(np.float32),
      "wo": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
  }


# (trainer spec on the 8-device mesh, engine spec on the per-host ("data", "model") mesh)
SPECS = {
    "embed": (P("fsdp", None), P("model", None)),
    "kernel": (P(None, None, "fsdp"), P(None, "model", None)),
    "norm": (P(), P()),
    "wo": (P(None, "fsdp"), P(None, "model")),
}


def _bits(x) -> list:
  """The array's bit pattern (bfloat16 as uint16), so equality is bitwise."""
  a = np.asarray(x)
  return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).tolist()


def _caught(fn) -> str | None:
  try:
    fn()
  except trees.WeightSyncError as e:
    return str(e)
  return None


def sync_onto(trainer_devices: list, engine_devices: list) -> tuple[dict, dict, dict]:
  """(trainer arrays, engine shardings, the synced local arrays) under Tunix's transfer guards, 2 arrays a chunk."""
  t_mesh = Mesh(np.asarray(trainer_devices), ("fsdp",))
  e_mesh = Mesh(np.asarray(engine_devices).reshape(1, -1), ("data", "model"))
  host = host_arrays()
  src = {k: distributed.global_array(v, NamedSharding(t_mesh, SPECS[k][0])) for k, v in host.items()}
  dst = {k: NamedSharding(e_mesh, SPECS[k][1]) for k in host}
  with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
    held = move.reshard(src, dst, chunk_size=2)
  return src, dst, held


def describe(src: dict, dst: dict, held: dict) -> dict:
  return {
      k: {
          "global_source": not src[k].is_fully_addressable,
          "local": held[k].is_fully_addressable,
          "sharding_ok": held[k].sharding == dst[k],
          "shards": sorted([d.id, list(s.data.shape)] for s in held[k].addressable_shards for d in [s.device]),
          "bits": _bits(held[k]),
      }
      for k in sorted(held)
  }


def main() -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
  me = jax.process_index()
  every = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  local = sorted(jax.local_devices(), key=lambda d: d.id)
  out: dict = {"process": me, "local_ids": [d.id for d in local]}

  # Colocated: the trainer over all 8 chips, each host's engine over its own 4.
  src, dst, held = sync_onto(every, local)
  out["colocated"] = describe(src, dst, held)
  source = per_host.source_checksums(src)
  out["clean"] = _caught(lambda: per_host.check_hosts(source, held))

  # A host given another host's shard: host 1's embedding rows 8-15 replaced by host 0's trainer rows 0-7.
  wrong = dict(held)
  if me == 1:
    rows = host_arrays()["embed"].copy()
    rows[8:] = rows[:8]
    wrong["embed"] = jax.device_put(rows, dst["embed"])
  out["other_host_rows"] = _caught(lambda: per_host.check_hosts(source, wrong))

  # The relayout's shards handed to the wrong local devices on host 1 (the real path, one function mutated).
  real = per_host.local_shards  # the mutation point of this test

  def rotated(y):
    shards = real(y)
    return [jax.device_put(shards[(i + 1) % len(shards)], s.device) for i, s in enumerate(y.addressable_shards)]

  if me == 1:
    per_host.local_shards = rotated
  _, _, mutated = sync_onto(every, local)
  per_host.local_shards = real
  out["rotated_shards"] = _caught(lambda: per_host.check_hosts(source, mutated))

  # A stale second sync on host 0: new trainer weights, host 0's engine keeps the first ones.
  new_src = {k: jax.jit(lambda x: x * 1.5 + 0.25)(v) for k, v in src.items()}
  new_held = move.reshard(new_src, dst, chunk_size=2)
  stale = held if me == 0 else new_held
  new_source = per_host.source_checksums(new_src)
  out["second_sync_clean"] = _caught(lambda: per_host.check_hosts(new_source, new_held))
  out["stale"] = _caught(lambda: per_host.check_hosts(new_source, stale))

  # Disaggregated per host: the trainer on every process's first 2 chips, each engine on its own last 2.
  trainer = [d for p in (0, 1) for d in [x for x in every if x.process_index == p][:2]]
  src, dst, held = sync_onto(trainer, local[2:])
  out["disaggregated"] = describe(src, dst, held)
  out["disaggregated_clean"] = _caught(lambda: per_host.check_hosts(per_host.source_checksums(src), held))

  distributed.barrier("done")
  with open(sys.argv[3], "w", encoding="utf-8") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
