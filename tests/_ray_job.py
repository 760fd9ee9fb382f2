"""The `launch ray --num-workers 2` job driven from a test: shared by tests/launch/test_ray_train.py
and tests/launch/test_ray_disaggregated.py (two files, so pytest-xdist's loadfile scheduling can run the two Ray jobs on
different workers), and the one-process reference run their first step is compared with.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", **extra)
  return env


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


def records(run_dir: pathlib.Path, name: str) -> list[dict]:
  return [json.loads(l) for l in (run_dir / name).read_text().splitlines() if l.strip()]


def ray_job(
    tmp_path,
    *overrides,
    flags=(),
    kill_worker1_at_checkpoint: int | None = None,
    name: str = "ray2",
    driver_env: dict | None = None,
) -> str:
  """Run the 2-worker job; with `kill_worker1_at_checkpoint`, SIGKILL worker 1 once that checkpoint is complete.
  `driver_env` adds to the launching process's environment (what the workers must or must not inherit)."""
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
          env=_env(RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0", **(driver_env or {})),
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
        pids = worker_pids(log.read_text(errors="replace"))
        killed = int(pids[1])
        os.kill(killed, signal.SIGKILL)
      rc = p.wait(timeout=1200)
    finally:
      if p.poll() is None:
        p.kill()
  out = log.read_text(errors="replace")
  assert rc == 0, out[-8000:]
  return out


def one_process(tmp_path, run_name: str, *overrides, devices: int = 1) -> dict:
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
  (one,) = [r for r in records(tmp_path / "runs" / run_name, "metrics.jsonl") if "reward/mean" in r]
  return one


def assert_same_step(two: dict, one: dict) -> None:
  """The same global batch and the same samples (sampling keys do not depend on the device or process count), so the
  same rewards exactly; loss and gradient agree to float32 summation order (rel 1e-5: the only difference is the
  order of the cross-process all-reduce and of the per-device partial sums)."""
  assert two["reward/std"] > 0 and two["grad_norm"] > 1e-3  # the comparison below is not vacuous
  assert two["reward/mean"] == one["reward/mean"] and two["reward/std"] == one["reward/std"]
  assert two["completion/length_mean"] == one["completion/length_mean"]
  assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)
  assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
  assert two["train/pg_loss"] == pytest.approx(one["train/pg_loss"], rel=1e-5, abs=1e-6)


def worker_pids(out: str) -> dict[int, str]:
  """Ray prefixes worker lines with the worker's pid; the launcher's first worker line names its JAX process index.
  The last group started (after a restart) wins."""
  pids = {}
  for m in re.finditer(r"pid=(\d+)\S* worker (\d)/2: jax.distributed.initialize", out):
    pids[int(m.group(2))] = m.group(1)
  return pids
