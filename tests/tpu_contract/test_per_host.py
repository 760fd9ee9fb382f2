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

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys

from test_forward import REL_TOL

HERE = pathlib.Path(__file__).resolve().parent


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_one_engine_per_host_computes_the_global_trainers_function(tmp_path):
  addr = f"127.0.0.1:{_free_port()}"
  env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  env.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
  with contextlib.ExitStack() as stack:
    procs = [
        stack.enter_context(
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "_per_host_engine.py"),
                    str(i),
                    addr,
                    str(tmp_path / f"p{i}.json"),
                    str(tmp_path),
                ],
                cwd=HERE.parents[1],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        for i in (0, 1)
    ]
    logs = [p.communicate(timeout=900)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(l[-4000:] for l in logs)
  outs = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in (0, 1)]
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
