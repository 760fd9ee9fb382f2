"""train_rl as one multi-process JAX program (multi-controller: Ray workers, multi-host TPU without Pathways).

* `maxtext_rl_plugin.distributed` on two plain processes (gloo CPU collectives): global arrays built from the same host
  data on every process hold exactly that data, reductions across processes are right, typed PRNG keys move memory
  kinds, and processes that disagree on a value fail loudly.
* The `launch ray --num-workers 2` job end to end (slow): train_rl with the embedded engine, rewards, loss, Orbax
  checkpoints written by both processes, greedy eval and the summary written once by process 0; its step 1 matches a
  one-process run of the same config; a rerun with more num_batches resumes with no batch repeated, and with
  `--max-failures 1` a killed worker makes Ray restart the group, which resumes from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import types

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest
from tunix.rl import utils as rl_utils
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import models
from maxtext_rl_plugin.rollout import embedded

REPO = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", **extra)
  return env


def _two_processes(tmp_path, mode: str, devices_per_process: int = 1) -> list[dict]:
  """Run tests/_multiprocess_worker.py in `mode` as a 2-process JAX program; what each process saw."""
  addr = f"127.0.0.1:{_free_port()}"
  extra = (
      {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}"} if devices_per_process > 1 else {}
  )
  with contextlib.ExitStack() as stack:
    procs = [
        stack.enter_context(
            subprocess.Popen(
                [
                    sys.executable,
                    str(REPO / "tests" / "_multiprocess_worker.py"),
                    str(i),
                    addr,
                    str(tmp_path / f"p{i}.json"),
                    mode,
                ],
                cwd=REPO,
                env=_env(**extra),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        for i in (0, 1)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(l[-3000:] for l in logs)
  return [json.loads((tmp_path / f"p{i}.json").read_text()) for i in (0, 1)]


def test_distributed_helpers_on_two_processes(tmp_path):
  outs = _two_processes(tmp_path, "helpers")
  host = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) ** 1.5
  for i, o in enumerate(outs):
    assert o["process"] == i and not o["fully_addressable"]
    # Each process holds its own half of the rows (sharded, not replicated), bit for bit the source rows.
    np.testing.assert_array_equal(np.asarray(o["local_rows"][0], np.float32), host[2 * i : 2 * i + 2])
    np.testing.assert_array_equal(np.asarray(o["to_host"], np.float32), host)
    np.testing.assert_allclose(o["row_sums"], host.sum(axis=1), rtol=1e-6)
    assert o["total"] == pytest.approx(float(host.sum()), rel=1e-6)
    assert o["odd_rows_replicated"] is True  # 3 rows over 2 processes: replicated, never a ragged shard
    assert o["key_memory_kind"] == "pinned_host"
    np.testing.assert_array_equal(o["w_back"], host)
    assert o["restore_sharding_replicated"] is True and o["agree"] == 5 and o["from_writer"] == 100
    assert o["disagree"].startswith("CheckpointError: processes disagree on the process index: [0, 1]")
  assert outs[0]["key_data"] == outs[1]["key_data"]
  np.testing.assert_array_equal(
      outs[0]["key_data"], np.asarray(jax.random.key_data(jax.random.split(jax.random.key(7), 2)))
  )


def test_disaggregated_split_weight_sync_and_rollout_slices_on_two_processes(tmp_path):
  """2 processes x 2 devices: the trainer mesh spans each process's first device, each process samples on a mesh of
  its own second device. The weight sync lands the trainer's arrays on every process's sampler bit for bit (under
  Tunix's transfer guards, checked by the sync's own guard, which also catches a corrupted copy); each process
  samples its own half of the prompt groups and every process then holds the whole batch, also on the trainer mesh."""
  outs = _two_processes(tmp_path, "split", devices_per_process=2)
  host = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) ** 1.5
  keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 2)))
  texts = [f"p{i // 2}-row{i}-é" * (i + 1) for i in range(4)]
  for i, o in enumerate(outs):
    assert [p for p, _ in o["trainer"]] == [0, 1]  # one trainer device per process: a global mesh
    assert [p for p, _ in o["sampler"]] == [i] and o["sampler"][0] not in o["trainer"]  # a per-host sampler mesh
    assert o["w_global"] and o["held_local"] and set(o["held_devices"]) == {o["sampler"][0][1]}
    np.testing.assert_array_equal(np.asarray(o["w"], np.float32), host)
    np.testing.assert_array_equal(np.asarray(o["b"], np.float32), host[0] * -3.0)
    np.testing.assert_array_equal(np.asarray(o["k"], np.uint32), keys)
    assert o["num_verified"] == 1 and o["corrupt_caught"]
    assert o["own"] == [2 * i, 2 * i + 2]
    np.testing.assert_array_equal(np.asarray(o["rows"], np.float32), host * 2.0)
    np.testing.assert_array_equal(np.asarray(o["on_trainer"], np.float32), host * 2.0)
    assert o["texts"] == texts


def test_one_process_helpers_equal_jax_and_tunix():
  """On one process the helpers are what they replace: device_put for placement, Tunix's memory-kind move."""
  mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
  host = np.arange(6, dtype=np.float32).reshape(2, 3)
  x = distributed.global_batch(host, mesh)
  ref = jax.device_put(host, NamedSharding(mesh, P("fsdp", None)))
  assert x.sharding == ref.sharding
  np.testing.assert_array_equal(distributed.to_host(x), np.asarray(ref))
  tree = {"w": ref, "b": jax.device_put(np.ones(3, np.float32), NamedSharding(mesh, P()))}
  ours, theirs = distributed.put_on_memory_kind(tree, "pinned_host"), rl_utils.put_params_on_memory_kind(
      tree, "pinned_host"
  )
  for k in tree:
    assert ours[k].sharding == theirs[k].sharding and ours[k].sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(theirs[k]))
  assert distributed.restore_sharding(x, mesh) == x.sharding  # one process: shardings restore as they are
  assert distributed.agree(3, "x") == 3 and distributed.agree_from_writer(4) == 4


def test_split_local_devices_gives_every_process_trainer_and_its_own_sampler_devices():
  devs = [types.SimpleNamespace(process_index=p, id=10 * p + i) for p in (0, 1) for i in range(4)]
  trainer, sampler = distributed.split_local_devices(devs, 0.5, 0.5)
  assert [d.id for d in trainer] == [0, 1, 10, 11]  # one global trainer mesh: the first half of every process
  assert [d.id for d in sampler] == [2, 3]  # this process's (0) own last devices: a per-host sampler mesh
  trainer, sampler = distributed.split_local_devices(devs, 0.75, 0.25)
  assert [d.id for d in trainer] == [0, 1, 2, 10, 11, 12] and [d.id for d in sampler] == [3]
  with pytest.raises(distributed.ConfigError, match="must split into >= 1 trainer and >= 1 sampler"):
    distributed.split_local_devices(devs, 0.75, 0.5)  # 3 + 2 > 4 devices per process
  assert distributed.process_slice(4) == slice(0, 4)  # one process samples every prompt


def test_per_row_sampling_keys_do_not_depend_on_how_the_batch_is_split():
  """The embedded engine's `prompt_offset` mode (a per-host sampler: each process samples its own prompts): a row's
  tokens depend only on the call's key, its prompt's global index and its generation index, so sampling prompts 2-3
  on their own (offset 2, a smaller bucket) gives exactly the rows of one call over prompts 0-3."""
  rs = models.setup_devices(["configs/cpu_tiny.yml"])
  tok = models.load_tokenizer(rs.trainer_config)
  model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=tok.pad_token_id)
  engine = embedded.EmbeddedRollout(rollout_actor=model, tokenizer=tok, mesh=mesh)
  texts = ["Tom has 3 apples.", "What is 12 * 7?", "Hi", "Name a prime number larger than ten."]
  g = 3
  rc = base_rollout.RolloutConfig(max_tokens_to_generate=8, temperature=30.0, seed=11, max_prompt_length=32)

  def rows(prompts, offset):
    engine.prompt_offset = offset
    out = engine.generate([t for t in prompts for _ in range(g)], rc)
    return [c.tolist() for c in out.tokens], out.logprobs

  whole, whole_lp = rows(texts, 0)
  first, _ = rows(texts[:2], 0)
  second, second_lp = rows(texts[2:], 2)
  assert first + second == whole
  for a, b in zip(second_lp, whole_lp[2 * g :]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # float32 logits of a 4-row vs an 8-row batch
  assert len({tuple(r) for r in whole}) > len(texts)  # generations of a prompt differ: the keys are per row
  shifted, _ = rows(texts[2:], 0)
  assert shifted != second  # the global prompt index is part of the key
  engine.prompt_offset = None


# A run whose step-1 loss and gradient are not trivially zero: a random-init model's next-token distribution is
# nearly one-hot, so a high sampling temperature (the loss uses the same one) and a reward that varies between
# completions (tests/data/multiprocess_rewards.py) give non-zero advantages. The demo's 528-token tokenizer keeps the
# output layer small.
_RUN = [
    "tokenizer_path=tokenizers/arith-bpe-512",
    "vocab_size=528",
    "use_chat_template=false",
    "data_template_path=cpu_demo_template.json",
    "max_prefill_predict_length=48",
    "max_target_length=80",
    "decode_sampling_temperature=30",
    "reward_functions=alnum_share",
    f"reward_functions_path={REPO / 'tests' / 'data' / 'multiprocess_rewards.py'}",
    "metrics_file=metrics.jsonl",
    "checkpoint_period=1",
    "eval_before_training=false",
    "eval_batch_size=4",
]


def _records(run_dir: pathlib.Path, name: str) -> list[dict]:
  return [json.loads(l) for l in (run_dir / name).read_text().splitlines() if l.strip()]


def _ray(tmp_path, *overrides, flags=(), kill_worker1_at_checkpoint: int | None = None, name: str = "ray2") -> str:
  """Run the 2-worker job; with `kill_worker1_at_checkpoint`, SIGKILL worker 1 once that checkpoint is complete."""
  argv = [
      sys.executable,
      "-m",
      "maxtext_rl_plugin.launch",
      "ray",
      "--num-workers",
      "2",
      "--num-cpus",
      "2",
      "--config",
      "configs/cpu_tiny.yml",
      "--name",
      name,
      "--storage-path",
      str(tmp_path / "ray"),
      *flags,
      "--",
      f"base_output_directory={tmp_path / 'runs'}",
      *_RUN,
      *overrides,
  ]
  log = tmp_path / f"launch{len(list(tmp_path.glob('launch*.log')))}.log"
  with (
      open(log, "w", encoding="utf-8") as f,
      subprocess.Popen(
          argv,
          cwd=REPO,
          env=_env(RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0"),
          stdout=f,
          stderr=subprocess.STDOUT,
          text=True,
      ) as p,
  ):
    killed = None
    try:
      if kill_worker1_at_checkpoint is not None:
        done = tmp_path / "runs" / name / "checkpoints" / str(kill_worker1_at_checkpoint) / "commit_success.txt"
        deadline = time.time() + 900
        while not done.exists() and p.poll() is None and time.time() < deadline:
          time.sleep(1)
        pids = _worker_pids(log.read_text(errors="replace"))
        killed = int(pids[1])
        os.kill(killed, signal.SIGKILL)
      rc = p.wait(timeout=1200)
    finally:
      if p.poll() is None:
        p.kill()
  out = log.read_text(errors="replace")
  assert rc == 0, out[-8000:]
  return out


def _one_process(tmp_path, run_name: str, *overrides, devices: int = 1) -> dict:
  """Step 1's record of the same config run by one process (train_rl, num_batches=1) on `devices` CPU devices."""
  extra = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"} if devices > 1 else {}
  ref = subprocess.run(
      [
          sys.executable,
          "-m",
          "maxtext_rl_plugin.train_rl",
          "configs/cpu_tiny.yml",
          "num_batches=1",
          f"base_output_directory={tmp_path / 'runs'}",
          f"run_name={run_name}",
          *_RUN,
          "eval_after_training=false",
          *overrides,
      ],
      cwd=REPO,
      env=_env(**extra),
      capture_output=True,
      text=True,
      timeout=900,
      check=False,
  )
  assert ref.returncode == 0, ref.stderr[-4000:]
  (one,) = [r for r in _records(tmp_path / "runs" / run_name, "metrics.jsonl") if "reward/mean" in r]
  return one


def _assert_same_step(two: dict, one: dict) -> None:
  """The same global batch and the same samples (sampling keys do not depend on the device or process count), so the
  same rewards exactly; loss and gradient agree to float32 summation order (rel 1e-5: the only difference is the
  order of the cross-process all-reduce and of the per-device partial sums)."""
  assert two["reward/std"] > 0 and two["grad_norm"] > 1e-3  # the comparison below is not vacuous
  assert two["reward/mean"] == one["reward/mean"] and two["reward/std"] == one["reward/std"]
  assert two["completion/length_mean"] == one["completion/length_mean"]
  assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)
  assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
  assert two["train/pg_loss"] == pytest.approx(one["train/pg_loss"], rel=1e-5, abs=1e-6)


def _worker_pids(out: str) -> dict[int, str]:
  """Ray prefixes worker lines with the worker's pid; the launcher's first worker line names its JAX process index.
  The last group started (after a restart) wins."""
  pids = {}
  for m in re.finditer(r"pid=(\d+)\S* worker (\d)/2: jax.distributed.initialize", out):
    pids[int(m.group(2))] = m.group(1)
  return pids


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ray_two_workers_train_match_one_process_resume_and_restart(tmp_path):
  pytest.importorskip("ray.train.v2.jax", reason="ray[train] not installed (pip install 'maxtext-rl-plugin[launch]')")
  out = _ray(tmp_path, "num_batches=2")
  run = tmp_path / "runs" / "ray2"
  # Process 0 alone writes: the console lines come from worker 0's pid only (Ray may echo a worker's line twice),
  # and each step's record and batch appear once in the files.
  pids = _worker_pids(out)
  for line in ("TensorBoard logs:", "eval after RL @ step 2", "step 2/2 |"):
    assert re.search(rf"pid={pids[0]}\S* .*{re.escape(line)}", out), line
    assert not re.search(rf"pid={pids[1]}\S* .*{re.escape(line)}", out), line
  assert (run / "summary.json").is_file() and json.loads((run / "summary.json").read_text())["eval_after"]
  recs = [r for r in _records(run, "metrics.jsonl") if "reward/mean" in r]
  assert [r["step"] for r in recs] == [1, 2]
  assert [b["step"] for b in _records(run, "batches.jsonl")] == [1, 2]
  # Both processes wrote their shards of every checkpoint (Orbax multi-process).
  for step in ("1", "2"):
    assert sorted(x.name for x in (run / "checkpoints" / step / "params").glob("ocdbt.process_*")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]

  # The same config on one process and one device: same global batch, same samples (the sampling key does not depend
  # on the device count), so the same rewards exactly; loss and gradient agree to float32 summation order.
  _assert_same_step(recs[0], _one_process(tmp_path, "one"))

  # Rerun with more batches and --max-failures 1: every process resumes from step 2. Once step 3's checkpoint is
  # complete, worker 1 is SIGKILLed: Ray restarts the group, which resumes from step 3 and trains step 4 only.
  out = _ray(
      tmp_path, "num_batches=4", "eval_after_training=false", flags=("--max-failures", "1"), kill_worker1_at_checkpoint=3
  )
  assert "from checkpoint step 2 (next batch index 2)" in out
  assert "from checkpoint step 3 (next batch index 3)" in out, out[-6000:]
  batches = _records(run, "batches.jsonl")
  assert [b["step"] for b in batches] == [1, 2, 3, 4]
  ids = [i for b in batches for i in b["ids"]]
  assert len(ids) == len(set(ids)) == 8
  assert [r["step"] for r in _records(run, "metrics.jsonl") if "reward/mean" in r] == [1, 2, 3, 4]
  assert (run / "checkpoints" / "4").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ray_two_workers_disaggregated_match_one_process(tmp_path):
  """2 Ray workers x 2 CPU devices, use_pathways=true + chips_per_vm=2: each process gives one device to the trainer
  (a global 2-device mesh) and samples on its other device (a per-host sampler mesh) the prompts it owns. Every weight
  sync is checked bit for bit; step 1 equals one process disaggregated on 2 devices (trainer 1, sampler 1)."""
  pytest.importorskip("ray.train.v2.jax", reason="ray[train] not installed (pip install 'maxtext-rl-plugin[launch]')")
  split = ("use_pathways=true", "rl.verify_weight_sync=every_n", "rl.verify_weight_sync_every=1")
  out = _ray(tmp_path, "num_batches=2", "chips_per_vm=2", *split, flags=("--cpu-devices-per-worker", "2"), name="dis2")
  assert "devices: trainer 2, sampler 1 (disaggregated" in out
  assert "weight syncs: 2, verified bit-exact: 2" in out
  recs = [r for r in _records(tmp_path / "runs" / "dis2", "metrics.jsonl") if "reward/mean" in r]
  assert [r["step"] for r in recs] == [1, 2] and all(r["time/weight_sync_s"] > 0 for r in recs)
  one = _one_process(tmp_path, "dis1", "chips_per_vm=1", *split, devices=2)
  _assert_same_step(recs[0], one)
