"""Rollouts ahead of the trainer, DAPO's dynamic sampling and multi-turn episodes across JAX processes (issue 62).

* The hand-over (run/async_rollout.py) on two plain processes with gloo collectives, seconds: a rollout thread one
  step ahead whose batches need a cross-process gather, beside a trainer whose steps reduce and install across
  processes, with one process's rollout thread late for every batch. Every process must issue the same collectives
  in the same order. (On CPU, gloo matches collectives by key, so a different order completes here with the right
  values; on accelerators each device runs its programs in issue order and the same difference is a hang. The
  order is what is checked: the same worker without hand-overs, the producer issuing its gathers itself, orders them
  differently on the two processes.)
* End to end (extended tier, `scripts/mp_run.py`: `train_rl` as two processes, as a Ray CPU worker runs it): each
  feature's two-process run against one process running the same global batch and seed, and a resume.

The end-to-end comparisons: the same global batch and the same samples (the sampling keys do not depend on the
process count), so rewards, lengths, the dynamic-sampling selection, the episodes' counters and the data positions are
equal exactly; loss, gradient norm, KL, IS weights and the mismatch figures agree to float32 summation order (the
cross-process all-reduce and the per-device partial sums add in another order than one device: rel 1e-4, abs 1e-6;
measured differences are ~1e-7 relative); the sampler-vs-trainer figures (mismatch/, parity/) are float32 noise of
two programs, 1e-7 to 1e-5 either way, compared to 5e-5 absolute.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import _in_process as in_process
import _two_processes as two_processes
from test_agentic_e2e import EPISODES

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
# Keys whose values are a float32 reduction whose order depends on the device layout (module docstring).
REDUCED = ("loss", "grad_norm", "kl", "entropy", "train/", "rollout_is/", "ratio_mean")
# Sampler-vs-trainer log-prob differences: float32 noise of two programs (~1e-7 to 1e-5), compared in absolute terms.
NOISE = ("mismatch/", "parity/")
EXACT_SKIP = ("time/", "perf/", "async/wait", "async/producer")


def _expected_order(steps: int) -> list[str]:
  """The trainer thread's fixed points with one step ahead (async_rollout's module docstring): batch 0 in take(0),
  then per step its update, the batch the next version samples (in publish) and the weight install."""
  out = ["batch 0"]
  for s in range(1, steps + 1):
    out += [f"update {s}"] + ([f"batch {s}"] if s < steps else []) + [f"install {s}"]
  return out


@pytest.mark.solo
@pytest.mark.timeout(300)
def test_rollouts_ahead_issue_the_same_collectives_in_the_same_order_on_every_process(tmp_path):
  for delayed in (0, 1):
    (tmp_path / f"late{delayed}").mkdir()
    outs = two_processes.run(tmp_path / f"late{delayed}", "run/_async_worker.py", "1", str(delayed), timeout=120)
    for o in outs:
      assert o["order"] == _expected_order(4), (delayed, o["order"])
      assert o["batches"] == [[[b, 0], [b, 1]] for b in range(4)]  # each batch: both processes' rows, in order
      assert o["versions"] == [0, 0, 1, 2]  # one step stale at most, as on one process
      assert o["installs"] == [[[100 * s, 0], [100 * s, 1]] for s in range(1, 5)]
      assert o["reductions"] == [1.0, 2.0, 3.0, 4.0]


# ------------------------------------------------------------------------------------------------ end to end
_COMMON = [
    "configs/cpu_tiny.yml",
    "tokenizer_path=tokenizers/arith-bpe-512",
    "vocab_size=528",
    "use_chat_template=false",
    "data_template_path=cpu_demo_template.json",
    "metrics_file=metrics.jsonl",
    "eval_before_training=false",
    "eval_after_training=false",
    "num_test_batches=0",
    "learning_rate_schedule_steps=3",  # the 3-step schedule for the 2-step first run too: a resume continues it
]
DYNAMIC = [
    "max_prefill_predict_length=48",
    "max_target_length=64",
    "decode_sampling_temperature=30",
    "reward_functions=prompt_bucket_reward",
    f"reward_functions_path={DATA / 'dynamic_sampling_rewards.py'}",
    "learning_rate=0.01",
    "batch_size=2",
    "rl.num_generations=4",
    "rl.dynamic_sampling=true",
    "rl.max_refill_rounds=2",
]
AGENTIC = list(EPISODES)
# Rollouts one step ahead need a per-host sampler: each process trains on one device and samples on its other one.
AHEAD = [
    "max_prefill_predict_length=48",
    "max_target_length=80",
    "decode_sampling_temperature=30",
    "reward_functions=alnum_share",
    f"reward_functions_path={DATA / 'delayed_rewards.py'}",  # process 1's rollout thread is late every batch
    "use_pathways=true",
    "rl.off_policy_steps=1",
    "rl.rollout_is=truncate",
    "rl.use_rollout_logps=false",
    "rl.log_sampler_trainer_agreement=true",
]


def _env(devices: int) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", MAXTEXT_RL_TEST_REWARD_DELAY_S="1")
  if devices > 1:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def two_process_run(out: pathlib.Path, name: str, *overrides: str, devices: int = 1) -> None:
  """`train_rl` as one JAX program of two processes (scripts/mp_run.py), `devices` CPU devices each."""
  argv = [*_COMMON, f"base_output_directory={out}", f"run_name={name}", *overrides]
  cmd = [sys.executable, "scripts/mp_run.py", "--num-processes", "2", "--devices-per-process", str(devices), "--"]
  p = subprocess.run(cmd + argv, cwd=REPO, env=_env(1), capture_output=True, text=True, timeout=1200, check=False)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]


def one_process_run(out: pathlib.Path, name: str, *overrides: str, devices: int = 1) -> None:
  """The same `train_rl` as one process (in this one unless it needs forced devices)."""
  env = _env(devices)
  if devices > 1:  # a forced device count is read when the backend starts: its own process
    argv = [sys.executable, "-m", "maxtext_rl_plugin.train_rl", *_COMMON, f"base_output_directory={out}"]
    p = subprocess.run(
        argv + [f"run_name={name}", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
  else:
    p = in_process.train_rl([*_COMMON, f"base_output_directory={out}", f"run_name={name}", *overrides], env=env)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]


def steps_of(out: pathlib.Path, name: str) -> list[dict]:
  recs = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines() if l.strip()]
  return [r for r in recs if "reward/mean" in r]


def assert_same_steps(two: list[dict], one: list[dict]) -> None:
  """Step by step: host figures equal, device reductions to float32 summation order (module docstring)."""
  assert [r["step"] for r in two] == [r["step"] for r in one]
  for a, b in zip(two, one):
    for k, v in b.items():
      if k.startswith(EXACT_SKIP):
        continue
      assert k in a, (a["step"], k)
      if k.startswith(NOISE):
        assert a[k] == pytest.approx(v, abs=5e-5), (a["step"], k, a[k], v)
      elif k.startswith(REDUCED):
        assert a[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (a["step"], k, a[k], v)
      else:
        assert a[k] == v, (a["step"], k, a[k], v)


def _batches(out: pathlib.Path, name: str) -> list[dict]:
  return [json.loads(l) for l in (out / name / "batches.jsonl").read_text().splitlines() if l.strip()]


@pytest.mark.slow
@pytest.mark.extended  # the default tier's check is the hand-over test above and the combined run below
@pytest.mark.solo
@pytest.mark.timeout(2400)
def test_dynamic_sampling_on_two_processes_equals_one_process_and_resumes(tmp_path):
  """Both processes keep the same groups and run the same refill rounds (process 0's flags, broadcast), and the data
  position is the global batch's: 3 steps whose selection and positions equal one process's, then a two-process run
  of 2 steps resumed to 3 continues at the stored position (the same prompts as the uninterrupted run)."""
  one_process_run(tmp_path, "one", *DYNAMIC, "num_batches=3")
  two_process_run(tmp_path, "two", *DYNAMIC, "num_batches=3")
  one = steps_of(tmp_path, "one")
  assert any(r["dynamic_sampling/refill_rounds"] > 0 for r in one)  # the comparison covers refills
  assert_same_steps(steps_of(tmp_path, "two"), one)
  assert _batches(tmp_path, "two") == _batches(tmp_path, "one")
  two_process_run(tmp_path, "resumed", *DYNAMIC, "num_batches=2", "checkpoint_period=1")
  two_process_run(tmp_path, "resumed", *DYNAMIC, "num_batches=3", "checkpoint_period=1")
  assert_same_steps(steps_of(tmp_path, "resumed"), one)
  assert _batches(tmp_path, "resumed") == _batches(tmp_path, "one")


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.solo
@pytest.mark.timeout(2400)
def test_multi_turn_episodes_on_two_processes_equal_one_process_and_resume(tmp_path):
  """Colocated on two processes (the turn programs span both): each process runs its own rows' tool calls and the
  observations are gathered every turn, so both continue from the same transcripts; the episodes' counters, the loss
  mask (masked tokens) and the loss equal one process's. The SFT warm start (which teaches the call format) is run
  once and copied into every run."""
  reward = ["reward_functions=alnum_share", f"reward_functions_path={DATA / 'multiprocess_rewards.py'}"]
  one_process_run(tmp_path, "sft", *AGENTIC, *reward, "num_batches=1")
  for name in ("one", "two", "resumed"):
    (tmp_path / name / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "sft" / "checkpoints" / "sft", tmp_path / name / "checkpoints" / "sft")
  one_process_run(tmp_path, "one", *AGENTIC, *reward, "num_batches=3")
  two_process_run(tmp_path, "two", *AGENTIC, *reward, "num_batches=3")
  one = steps_of(tmp_path, "one")
  assert any(r["agentic/masked_tokens"] > 0 for r in one)  # tool answers were masked: the comparison covers the mask
  assert_same_steps(steps_of(tmp_path, "two"), one)
  two_process_run(tmp_path, "resumed", *AGENTIC, *reward, "num_batches=2", "checkpoint_period=1")
  two_process_run(tmp_path, "resumed", *AGENTIC, *reward, "num_batches=3", "checkpoint_period=1")
  assert_same_steps(steps_of(tmp_path, "resumed"), one)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.solo
@pytest.mark.timeout(2400)
def test_rollouts_ahead_on_two_processes_with_a_late_rollout_thread_equal_one_process_and_resume(tmp_path):
  """rl.off_policy_steps=1 on two processes, each training on one device and sampling on its other one, process 1's
  rollout thread late by a second every batch (tests/data/delayed_rewards.py): the run finishes (its collectives
  ordered by the hand-overs), every batch but the first is one version stale, and rewards, IS weights and the
  mismatch figures equal one process disaggregated the same way (trainer 1 + sampler 1 device); a resume too."""
  one_process_run(tmp_path, "one", *AHEAD, "chips_per_vm=1", "num_batches=3", devices=2)
  two_process_run(tmp_path, "two", *AHEAD, "chips_per_vm=2", "num_batches=3", devices=2)
  one = steps_of(tmp_path, "one")
  assert [r["async/policy_lag"] for r in one] == [0.0, 1.0, 1.0]
  assert all(r["reward/std"] > 0 and "rollout_is/is_weight_mean" in r for r in one), one  # not vacuous
  assert_same_steps(steps_of(tmp_path, "two"), one)
  two_process_run(tmp_path, "resumed", *AHEAD, "chips_per_vm=2", "num_batches=2", "checkpoint_period=1", devices=2)
  two_process_run(tmp_path, "resumed", *AHEAD, "chips_per_vm=2", "num_batches=3", "checkpoint_period=1", devices=2)
  resumed = steps_of(tmp_path, "resumed")
  assert [r["async/policy_lag"] for r in resumed] == [0.0, 1.0, 0.0]  # the batch in flight is sampled again, fresh
  assert_same_steps(resumed[:2], one[:2])


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.solo
@pytest.mark.timeout(3600)
def test_all_three_together_on_two_processes_per_host_equal_one_process(tmp_path):
  """Multi-turn episodes with dynamic sampling, one step ahead, each process sampling on its own device: each host
  runs its own groups' episodes and tools (the per-host gather carries the loss masks), the refill decision is
  process 0's, and the gathers and broadcasts of the rollout thread run in the trainer's thread. One rollout
  micro-batch per prompt (`rollout_micro_batch_size=1`), so an episode's key is the same on one process as on two."""
  together = [
      *AGENTIC,
      "reward_functions=prompt_bucket_reward",
      f"reward_functions_path={DATA / 'dynamic_sampling_rewards.py'}",
      "rl.dynamic_sampling=true",
      "rl.max_refill_rounds=2",
      "rl.num_generations=4",
      "rollout_micro_batch_size=1",
      "use_pathways=true",
      "rl.off_policy_steps=1",
      "rl.rollout_is=truncate",
      "rl.use_rollout_logps=false",
  ]
  one_process_run(tmp_path, "sft", *together, "chips_per_vm=1", "rl.off_policy_steps=0", "num_batches=1", devices=2)
  for name in ("one", "two"):
    (tmp_path / name / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "sft" / "checkpoints" / "sft", tmp_path / name / "checkpoints" / "sft")
  one_process_run(tmp_path, "one", *together, "chips_per_vm=1", "num_batches=3", devices=2)
  two_process_run(tmp_path, "two", *together, "chips_per_vm=2", "num_batches=3", devices=2)
  one = steps_of(tmp_path, "one")
  assert any(r["agentic/masked_tokens"] > 0 for r in one) and any(r["dynamic_sampling/refill_rounds"] for r in one)
  assert [r["async/policy_lag"] for r in one] == [0.0, 1.0, 1.0]
  assert_same_steps(steps_of(tmp_path, "two"), one)
