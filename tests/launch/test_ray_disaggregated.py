"""`launch ray --num-workers 2` disaggregated (slow): each process trains on one device and samples on another."""

from __future__ import annotations

import pytest

import _ray_job as job


@pytest.mark.slow
@pytest.mark.extended  # tests/launch/test_launch_ray.py is the default tier's two-worker Ray run
@pytest.mark.solo
@pytest.mark.timeout(1800)
def test_ray_two_workers_disaggregated_match_one_process(tmp_path):
  """2 Ray workers x 2 CPU devices, use_pathways=true + chips_per_vm=2: each process gives one device to the trainer
  (a global 2-device mesh) and samples on its other device (a per-host sampler mesh) the prompts it owns. Every weight
  sync is checked bit for bit; step 1 equals one process disaggregated on 2 devices (trainer 1, sampler 1)."""
  pytest.importorskip("ray.train.v2.jax", reason="ray[train] not installed (pip install 'maxtext-rl-plugin[launch]')")
  split = ("use_pathways=true", "rl.verify_weight_sync=every_n", "rl.verify_weight_sync_every=1")
  out = job.ray_job(
      tmp_path, "num_batches=2", "chips_per_vm=2", *split, flags=("--cpu-devices-per-worker", "2"), name="dis2"
  )
  assert "devices: trainer 2, sampler 1 (disaggregated" in out
  assert "weight syncs: 2, verified bit-exact: 2" in out
  recs = [r for r in job.records(tmp_path / "runs" / "dis2", "metrics.jsonl") if "reward/mean" in r]
  assert [r["step"] for r in recs] == [1, 2] and all(r["time/weight_sync_s"] > 0 for r in recs)
  one = job.one_process(tmp_path, "dis1", "chips_per_vm=1", *split, devices=2)
  job.assert_same_step(recs[0], one)
