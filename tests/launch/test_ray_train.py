"""`launch ray --num-workers 2` end to end (slow): train_rl as one 2-process JAX program on a local Ray cluster.

One launch checks what a multi-controller run must do: the embedded engine, rewards and loss on a batch sharded over
both processes; Orbax checkpoints written by both; the console, metrics, batch records, eval and summary written once,
by process 0; step 1 equal to a one-process run of the same config; and, with `--max-failures 1`, a worker SIGKILLed
after step 3's checkpoint makes Ray restart the group, whose every process resumes from step 3 (no batch repeated or
skipped). The driver's environment forces 8 host devices, as the multidevice test pass does: workers must not
inherit it (the batch of 2 would not divide over 8 devices).
"""

from __future__ import annotations

import json
import re

import pytest

import _ray_job as job


def _pids_of(out: str, worker: int) -> set[str]:
  """Every pid that worker `worker` had, across the first group and its restart."""
  return {m.group(1) for m in re.finditer(rf"pid=(\d+)\S* worker {worker}/2: jax.distributed.initialize", out)}


@pytest.mark.slow
@pytest.mark.extended  # tests/launch/test_launch_ray.py is the default tier's two-worker Ray run
@pytest.mark.solo
@pytest.mark.timeout(1800)
def test_ray_two_workers_train_match_one_process_and_resume_after_a_restart(tmp_path):
  pytest.importorskip("ray.train.v2.jax", reason="ray[train] not installed (pip install 'maxtext-rl-plugin[launch]')")
  out = job.ray_job(
      tmp_path,
      "num_batches=4",
      flags=("--max-failures", "1"),
      kill_worker1_at_checkpoint=3,
      driver_env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
  )
  run = tmp_path / "runs" / "ray2"
  # Two groups ran: the first trained steps 1-3 from scratch, the restart resumed from step 3 on every process.
  zeros, ones = _pids_of(out, 0), _pids_of(out, 1)
  assert len(zeros) == len(ones) == 2, out[-6000:]
  assert set(re.findall(r"from checkpoint step (\d+)", out)) == {"3"}, out[-6000:]
  assert out.count("from checkpoint step 3 (next batch index 3)") >= 2, out[-6000:]  # both processes of the restart
  # Process 0 alone writes: these console lines come from a worker-0 pid only (Ray may echo a worker's line twice).
  for line in ("TensorBoard logs:", "step 1/4 |", "step 4/4 |", "eval after RL @ step 4"):
    assert any(re.search(rf"pid={p}\S* .*{re.escape(line)}", out) for p in zeros), line
    assert not any(re.search(rf"pid={p}\S* .*{re.escape(line)}", out) for p in ones), line
  assert json.loads((run / "summary.json").read_text())["eval_after"]
  recs = [r for r in job.records(run, "metrics.jsonl") if "reward/mean" in r]
  assert [r["step"] for r in recs] == [1, 2, 3, 4]
  batches = job.records(run, "batches.jsonl")
  assert [b["step"] for b in batches] == [1, 2, 3, 4]
  ids = [i for b in batches for i in b["ids"]]
  assert len(ids) == len(set(ids)) == 8
  # Both processes wrote their part of every checkpoint (Orbax multi-process), the restart's included. MaxText's RL
  # default storage (checkpoint_storage_use_ocdbt: false) has no per-process OCDBT folders; each process that writes
  # arrays records their metadata in its own array_metadatas/process_<index> file.
  for step in ("1", "3", "4"):
    assert sorted(x.name for x in (run / "checkpoints" / step / "params" / "array_metadatas").iterdir()) == [
        "process_0",
        "process_1",
    ]
  # The same config on one process and one device: same global batch, same samples (the sampling key does not depend
  # on the device count), so the same rewards exactly; loss and gradient agree to float32 summation order.
  job.assert_same_step(recs[0], job.one_process(tmp_path, "one"))
