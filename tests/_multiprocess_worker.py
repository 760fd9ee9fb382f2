"""One process of a 2-process JAX program (gloo CPU collectives), run by tests/test_multiprocess.py:
`python tests/_multiprocess_worker.py <process_id> <coordinator> <out.json> [helpers|split]`. Exercises
maxtext_rl_plugin.distributed on a mesh spanning both processes and writes what this process sees.

`split` (2 devices per process): the disaggregated multi-controller layout, a trainer mesh over each process's
first device and a per-host sampler mesh over its second; the weight sync, the per-process rollout slice and the
gather back to every process."""

import json
import sys

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.resharding import sync
from maxtext_rl_plugin.resharding import trees
from maxtext_rl_plugin.resharding import verify

HOST = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) ** 1.5  # the same on both processes


def helpers() -> dict:
  """The colocated helpers on a mesh over both processes' devices."""
  mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
  x = distributed.global_batch(HOST, mesh)
  out = {
      "process": jax.process_index(),
      "fully_addressable": bool(x.is_fully_addressable),
      "local_rows": [np.asarray(s.data).tolist() for s in x.addressable_shards],
      "to_host": distributed.to_host(x).tolist(),
      "row_sums": distributed.to_host(jax.jit(lambda a: a.sum(axis=1))(x)).tolist(),
      "total": float(jax.jit(lambda a: a.sum())(x)),  # replicated scalar: a cross-process reduction
      "odd_rows_replicated": distributed.global_batch(HOST[:3], mesh).sharding.is_fully_replicated,
  }
  # Typed PRNG keys on the global mesh (what Tunix's pinned-host snapshot trips on) move through put_on_memory_kind.
  keys = distributed.global_array(jax.random.split(jax.random.key(7), 2), NamedSharding(mesh, P()))
  moved = distributed.put_on_memory_kind({"k": keys, "w": x}, "pinned_host")
  out["key_memory_kind"] = moved["k"].sharding.memory_kind
  out["key_data"] = distributed.to_host(jax.random.key_data(moved["k"])).tolist()
  out["w_back"] = distributed.to_host(distributed.put_on_memory_kind(moved["w"], "device")).tolist()
  # A scalar this process alone holds (an unplaced optimizer count) restores replicated on the mesh.
  out["restore_sharding_replicated"] = distributed.restore_sharding(jax.numpy.int32(3), mesh) == NamedSharding(mesh, P())
  out["agree"] = distributed.agree(5, "a test value")
  out["from_writer"] = distributed.agree_from_writer(100 + jax.process_index())
  try:
    distributed.agree(jax.process_index(), "the process index")
    out["disagree"] = None
  except distributed.CheckpointError as e:
    out["disagree"] = f"{type(e).__name__}: {e}"
  return out


def split() -> dict:
  """The disaggregated split across processes: global trainer mesh, per-host sampler mesh."""
  trainer, sampler = distributed.split_local_devices(jax.devices(), 0.5, 0.5)
  t_mesh, s_mesh = Mesh(np.asarray(trainer), ("fsdp",)), Mesh(np.asarray(sampler), ("fsdp",))
  params = {
      "w": distributed.global_array(HOST, NamedSharding(t_mesh, P("fsdp", None))),
      "b": distributed.global_array(HOST[0] * -3.0, NamedSharding(t_mesh, P())),
      "k": distributed.global_array(jax.random.split(jax.random.key(3), 2), NamedSharding(t_mesh, P())),
  }
  dst = jax.tree.map(lambda _: NamedSharding(s_mesh, P()), params)
  ws = sync.WeightSync(dst=dst, verify_policy="first", chunk_size=1)
  # Under the transfer guards Tunix's sync_weights sets on CPU: the sync is device to device only.
  with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
    held = ws.sync(params)
  out = {
      "trainer": [[d.process_index, d.id] for d in trainer],
      "sampler": [[d.process_index, d.id] for d in sampler],
      "w_global": not params["w"].is_fully_addressable,
      "held_local": all(x.is_fully_addressable for x in jax.tree.leaves(held)),
      "held_devices": sorted(d.id for x in jax.tree.leaves(held) for d in x.sharding.device_set),
      "w": np.asarray(held["w"]).tolist(),
      "b": np.asarray(held["b"]).tolist(),
      "k": np.asarray(jax.random.key_data(held["k"])).tolist(),
      "num_verified": ws.num_verified,
  }
  # A corrupted sampler copy is caught by the same guard (the check is not vacuous).
  bad = dict(held, w=jax.device_put(np.asarray(held["w"]) + 1.0, held["w"].sharding))
  try:
    verify.verify(params, bad)
    out["corrupt_caught"] = False
  except trees.WeightSyncError:
    out["corrupt_caught"] = True
  # Rollouts: each process samples its own groups; every process then holds the whole batch.
  own = distributed.process_slice(4)
  texts = [f"p{jax.process_index()}-row{i}-é" * (i + 1) for i in range(own.start, own.stop)]
  rows = distributed.gather_rows(HOST[own] * 2.0)
  out["own"] = [own.start, own.stop]
  out["rows"] = rows.tolist()
  out["texts"] = distributed.gather_texts(texts)
  out["on_trainer"] = distributed.to_host(distributed.global_batch(rows, t_mesh)).tolist()
  return out


def main() -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
  mode = sys.argv[4] if len(sys.argv) > 4 else "helpers"
  out = split() if mode == "split" else helpers()
  distributed.barrier("done")
  with open(sys.argv[3], "w", encoding="utf-8") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
