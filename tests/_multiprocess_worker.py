"""One process of a 2-process JAX program (gloo CPU collectives), run by tests/test_multiprocess.py:
`python tests/_multiprocess_worker.py <process_id> <coordinator> <out.json>`. Exercises maxtext_rl_plugin.distributed
on a mesh spanning both processes and writes what this process sees."""

import json
import sys

import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

from maxtext_rl_plugin import distributed  # pylint: disable=wrong-import-position

mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
host = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) ** 1.5  # the same on both processes
x = distributed.global_batch(host, mesh)
out = {
    "process": jax.process_index(),
    "fully_addressable": bool(x.is_fully_addressable),
    "local_rows": [np.asarray(s.data).tolist() for s in x.addressable_shards],
    "to_host": distributed.to_host(x).tolist(),
    "row_sums": distributed.to_host(jax.jit(lambda a: a.sum(axis=1))(x)).tolist(),
    "total": float(jax.jit(lambda a: a.sum())(x)),  # replicated scalar: a cross-process reduction
    "odd_rows_replicated": distributed.global_batch(host[:3], mesh).sharding.is_fully_replicated,
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
except Exception as e:  # pylint: disable=broad-exception-caught
  out["disagree"] = f"{type(e).__name__}: {e}"
distributed.barrier("done")
with open(sys.argv[3], "w", encoding="utf-8") as f:
  json.dump(out, f)
jax.distributed.shutdown()
