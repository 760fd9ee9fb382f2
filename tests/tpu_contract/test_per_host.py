"""vLLM in a multi-controller run (Ray workers, TPU VMs without Pathways): one engine per host, fed by the per-host
weight sync (resharding/per_host.py), on two real JAX processes with 4 CPU devices each (gloo collectives).

The trainer is a tiny MaxText Llama 3.1 whose weights span all 8 devices; each process's `VllmRollout` builds its
engine on its own 4 devices (tpu-inference's `device_indexes`, TP 4 within the host, MaxText's
`rollout_data_parallelism=2` = 2 hosts x 1 replica) and syncs the global weights into the real tpu-inference
`LlamaForCausalLM` behind forward.ShimLLM (_per_host_engine.py). Each host's engine logits must equal MaxText's forward
of the global trainer weights (first sync, and after a real optimizer step and re-sync), the hosts' greedy tokens must
agree, and the guard (`rl.verify_weight_sync`) must name the host of a stale second sync and of a host given the
shards of its other devices, on both processes. Tolerance as test_forward.py.
"""

from __future__ import annotations

import os

import pytest

from test_forward import REL_TOL

import _two_processes as two_processes  # tests/_two_processes.py: pytest puts tests/ (its conftest's folder) on the path


def test_one_engine_per_host_computes_the_global_trainers_function(tmp_path):
  outs = two_processes.run(
      tmp_path,
      "tpu_contract/_per_host_engine.py",
      str(tmp_path),
      devices_per_process=4,
      timeout=900,
      env={"TPU_ACCELERATOR_TYPE": os.environ.get("TPU_ACCELERATOR_TYPE", "v5litepod-4")},
  )
  for p, o in enumerate(outs):
    print(f"host {p}: first sync gap {o['first_sync']['gap']:.2e}, after a step {o['after_step']['gap']:.2e}")
    assert o["process"] == p and o["per_host"] and o["trainer_global"] and o["engine_local"]
    assert o["device_indexes"] == o["local_ids"] and o["tp_dp"] == [4, 1]
    for when in ("first_sync", "after_step"):
      assert o[when]["gap"] < REL_TOL, (p, when)
      assert o[when]["tokens"] == o[when]["maxtext_greedy"], (p, when)
    assert o["before_resync"]["gap"] > 100 * REL_TOL  # the step changed the function: the re-sync is what matches
    assert o["resync"] is None and o["clean_again"] is None
    assert o["stale"].startswith("weight sync check failed on host 0 (JAX process 0): its engine's "), o["stale"]
    assert "model.layers.0.self_attn.q_proj.kernel" in o["engine_sharded"]  # TP within the host, as on a TPU
    assert o["wrong_shards"].startswith("weight sync check failed on host 1 (JAX process 1): its engine's ")
    assert o["other_rows"].startswith(
        "weight sync check failed on host 1 (JAX process 1): its engine's 'model.embed.embedding' differs"
    )
  assert outs[0]["local_ids"] != outs[1]["local_ids"]
  for when in ("first_sync", "after_step"):
    assert outs[0][when]["tokens"] == outs[1][when]["tokens"]  # every host's engine samples the same function


@pytest.mark.extended  # ~2 x 110 CPU-s: two train_rl processes, each decoding eagerly through the stand-in
def test_a_two_process_train_rl_samples_from_one_vllm_engine_per_host(tmp_path):
  """`train_rl` for 2 GRPO steps with `rollout_engine=vllm` in a multi-controller run (_per_host_train.py): each
  process builds one engine on its own devices, the plugin's per-host sync fills it (checked every sync), each host
  samples its share of the batch, and the step's records hold the whole batch's rewards, an update and the parity
  gate's figures against the global trainer (float32 both sides)."""
  outs = two_processes.run(
      tmp_path,
      "tpu_contract/_per_host_train.py",
      str(tmp_path),
      devices_per_process=4,
      timeout=900,
      env={"TPU_ACCELERATOR_TYPE": os.environ.get("TPU_ACCELERATOR_TYPE", "v5litepod-4")},
  )
  for p, o in enumerate(outs):
    assert o["process"] == p and o["rc"] == 0 and o["engines"] == 1
    assert o["device_indexes"] == [o["local_ids"]]  # the engine on this process's own devices
  steps = [r for r in outs[0]["records"] if "reward/mean" in r]
  print(
      "\n".join(
          str({k: v for k, v in r.items() if k.startswith(("step", "reward/mean", "parity", "time/weight"))})
          for r in steps
      )
  )
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    assert r["opt/updates"] >= 1 and r["time/weight_sync_s"] > 0
    assert r["parity/tokens"] > 0 and r["parity/logp_abs_diff_mean"] < 1e-4, r  # the engine samples the trainer
