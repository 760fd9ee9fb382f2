"""One process of a 2-process JAX program (gloo CPU collectives), run by tests/run/test_multiprocess_rollouts.py:
`python tests/run/_async_worker.py <process_id> <coordinator> <out.json> <hand_over 0|1> <delayed process>`.

A `RolloutProducer` one step ahead (rl.off_policy_steps=1) whose batches need a cross-process gather (as a per-host
sampler's rows do) beside a trainer whose steps issue their own collectives (an all-reduce per step, a gather in each
weight install). The producer of `<delayed process>` sleeps before every batch, so without hand-overs the two
processes would issue the gathers and the trainer's collectives in different orders. What this process saw is written
as JSON: each step's batch (the gathered rows), the trainer's reductions, the versions that sampled the batches, and
the order in which this process issued its collectives (`order`), which must be the same on both processes."""

import json
import sys
import time

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.run import async_rollout

STEPS = 4


def main() -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
  me = jax.process_index()
  hand_over, delayed = sys.argv[4] == "1", int(sys.argv[5])
  mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
  total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))

  order = []  # the collectives in the order this process issued them

  def gather(name: str, rows: np.ndarray) -> np.ndarray:
    order.append(name)
    return distributed.gather_rows(rows)  # the same program for the batches and the installs: [1, 2] int64 rows

  def sample(b: int, phases: dict) -> list:
    del phases
    if me == delayed:
      time.sleep(0.4)  # this process's rollout thread is late for every batch
    local = np.asarray([[b, me]], np.int64)  # this process's own rows of batch b
    return async_rollout.cross_process(gather, f"batch {b}", local).tolist()

  installed = []
  producer = async_rollout.RolloutProducer(sample, off_policy_steps=1, start=0, end=STEPS, hand_over=hand_over)
  producer.start_producing()
  out = {"batches": [], "versions": [], "reductions": [], "installs": []}
  try:
    for step in range(1, STEPS + 1):
      item = producer.take(step - 1)
      out["batches"].append(item.value)
      out["versions"].append(item.version)
      x = distributed.global_batch(np.arange(2, dtype=np.float32) * step, mesh)  # the trainer's step: a reduction
      order.append(f"update {step}")
      out["reductions"].append(float(total(x)))

      def install(step=step):
        installed.append(gather(f"install {step}", np.asarray([[100 * step, me]], np.int64)).tolist())

      producer.publish(step, install)
  finally:
    producer.close(timeout=5)
  out["installs"] = installed
  out["order"] = order
  distributed.barrier("done")
  with open(sys.argv[3], "w", encoding="utf-8") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
