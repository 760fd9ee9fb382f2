"""Dynamic sampling end to end: real `train_rl` subprocesses on the tiny MaxText model, killed with SIGTERM and resumed
with the same command. References: an uninterrupted run's batches.jsonl and data positions (bit for bit), and the
synthetic stream's own positions (a synthetic example's id is its stream position)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import _in_process as in_process

REPO = pathlib.Path(__file__).resolve().parents[2]
B, G = 2, 4
# The CPU demo's 528-token tokenizer keeps the model small; at temperature 30 the random-init model's completions
# differ, and tests/data/dynamic_sampling_rewards.py gives all-1, all-0 and mixed groups.
_RUN = [
    "configs/cpu_tiny.yml",
    "tokenizer_path=tokenizers/arith-bpe-512",
    "vocab_size=528",
    "use_chat_template=false",
    "data_template_path=cpu_demo_template.json",
    "max_prefill_predict_length=48",
    "max_target_length=64",
    "decode_sampling_temperature=30",
    "reward_functions=prompt_bucket_reward",
    f"reward_functions_path={REPO / 'tests' / 'data' / 'dynamic_sampling_rewards.py'}",
    "metrics_file=metrics.jsonl",
    "checkpoint_period=1000",  # only the stop writes a checkpoint
    "eval_before_training=false",
    "eval_after_training=false",
    "num_test_batches=0",
    "num_batches=4",
    "learning_rate=0.01",
    "learning_rate_schedule_steps=7",  # the same schedule whatever the run's length
    f"batch_size={B}",
    f"rl.num_generations={G}",
    "rl.dynamic_sampling=true",
    "rl.max_refill_rounds=2",
]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("XLA_FLAGS", None)
  return env


def _cmd(out, name, *extra):
  return [
      sys.executable,
      "-m",
      "maxtext_rl_plugin.train_rl",
      *_RUN,
      f"base_output_directory={out}",
      f"run_name={name}",
  ] + list(extra)


def _run(out, name, *extra):
  """train_rl in this process (tests/_in_process.py); the SIGTERM tests start their own processes."""
  p = in_process.train_rl(_cmd(out, name, *extra)[3:])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p


def _kill_after_first_step(out, name, *extra) -> int:
  """Run it with a SIGTERM sent during its first reward call after step 1 trained (its batches.jsonl exists: a call of
  step 2's rounds, or of a batch sampled ahead); the step it stopped after. (A stop during a step's refill rounds
  abandons that step's batch: a signal during step 1's refills would stop the run before any step.)"""
  env = dict(_env(), DS_TEST_SIGTERM_AFTER_FILE=str(pathlib.Path(out) / name / "batches.jsonl"))
  p = subprocess.run(_cmd(out, name, *extra), cwd=REPO, capture_output=True, text=True, env=env, timeout=900, check=False)
  err = p.stderr
  assert p.returncode == 143, err[-3000:]
  last = err.strip().splitlines()[-1]
  return int(last.split("after step ")[1].split("/")[0])


def _steps(run: pathlib.Path) -> list[dict]:
  recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
  return [r for r in recs if "reward/mean" in r]


def _batches(run: pathlib.Path) -> list[dict]:
  return [json.loads(l) for l in (run / "batches.jsonl").read_text().splitlines() if l.strip()]


def _check_stream(run: pathlib.Path) -> list[float]:
  """Every prompt consumed once, in order: step s consumes stream positions [pos_{s-1}, pos_s) (B per round), trains
  only prompts from there, and no prompt twice."""
  recs, batches = _steps(run), _batches(run)
  assert [r["step"] for r in recs] == [b["step"] for b in batches] == [1, 2, 3, 4]
  prev, seen = 0, set()
  for r, b in zip(recs, batches):
    pos = int(r["data/next_position"])
    rounds = 1 + int(r["dynamic_sampling/refill_rounds"])
    assert pos - prev == B * rounds, (r["step"], prev, pos, rounds)
    assert r["dynamic_sampling/extra_rollouts"] == (rounds - 1) * B * G
    assert r["dynamic_sampling/dropped_groups"] == (
        r["dynamic_sampling/dropped_graded_all_correct"]
        + r["dynamic_sampling/dropped_graded_all_wrong"]
        + r["dynamic_sampling/dropped_graded_mixed"]
    )
    trained = [int(i.rsplit("-", 1)[1]) for i in b["ids"]]
    assert len(trained) == B - r["dynamic_sampling/short_groups"]  # masked fillers are not listed as trained
    # The trained batch's zero-variance groups are exactly its masked fillers.
    assert r["reward/zero_variance_group_fraction"] == r["dynamic_sampling/short_groups"] / B
    assert all(prev <= i < pos for i in trained), (r["step"], trained, prev, pos)
    assert not seen & set(trained)
    seen |= set(trained)
    prev = pos
  return [r["data/next_position"] for r in recs]


@pytest.mark.extended  # the resume position is also the LoRA resume test's below
def test_kill_and_resume_consumes_every_prompt_once_and_matches_the_uninterrupted_run(tmp_path):
  """Synchronous rollouts, micro-batches of one prompt, truncated completions masked, overlong penalty: a run killed
  after step 1 and resumed trains exactly the batches of the uninterrupted run."""
  extra = ["train_micro_batch_size=1", "rl.mask_truncated_completions=true", "rl.overlong_buffer_len=4"]
  _run(tmp_path, "ref", *extra)
  ref = tmp_path / "ref"
  positions = _check_stream(ref)
  assert positions[-1] > 4 * B  # refills happened (else this test shows nothing about them)
  stopped = _kill_after_first_step(tmp_path, "killed", *extra)
  assert 1 <= stopped < 4
  p = _run(tmp_path, "killed", *extra)
  assert f"from checkpoint step {stopped}" in p.stdout
  run = tmp_path / "killed"
  assert _batches(run) == _batches(ref)
  assert _check_stream(run) == positions
  for a, b in zip(_steps(run), _steps(ref)):
    assert a["dynamic_sampling/short_groups"] == b["dynamic_sampling/short_groups"]
    assert a["reward/mean"] == b["reward/mean"]


def test_rollouts_ahead_with_lora_resume_at_the_checkpointed_position(tmp_path):
  """rl.off_policy_steps=1 (refills in the producer thread, ahead of the trainer) with LoRA: after a kill the batches
  sampled ahead are re-consumed from the checkpoint's position; still every prompt once, in order. The parity gate
  checks every step sampled at the trainer's weights (step 1 and the first after the resume, a lag-0 batch): at
  temperature 30 this run samples the tokenizer's pad id mid-row, which the trainer used to drop from the row's context
  (3.7e-3 mean |dlogp| over the f32 tolerance, docs/moe.md) before completions ended at a sampled pad."""
  extra = [
      "rl.parity_check=every_n",
      "rl.parity_check_every=1",
      "rl.off_policy_steps=1",
      "rl.use_rollout_logps=false",
      "rl.rollout_is=truncate",
      "lora.enable_lora=true",
      "lora.lora_rank=4",
      "lora.lora_alpha=8",
  ]
  stopped = _kill_after_first_step(tmp_path, "async", *extra)
  assert 1 <= stopped < 4
  p = _run(tmp_path, "async", *extra)
  assert f"from checkpoint step {stopped}" in p.stdout
  _check_stream(tmp_path / "async")
  steps = _steps(tmp_path / "async")
  assert all(r["async/policy_lag"] <= 1 for r in steps)
  checked = [r["step"] for r in steps if "parity/logp_abs_diff_mean" in r]
  assert checked[0] == 1 and stopped + 1 in checked, checked  # every lag-0 step, the first after the resume among them
  assert all(r["parity/logp_abs_diff_mean"] < 1e-4 for r in steps if "parity/logp_abs_diff_mean" in r)


# ~67 s: the default tier checks a stop mid-run with test_reliability.py's SIGTERM checkpoint and resume, and the refill
# loop with the LoRA resume test above.
@pytest.mark.extended
def test_a_stop_during_refills_is_honoured_within_a_round(tmp_path):
  # Step 1 is informative; from step 2 on every group is uniform (informative_once), so step 2 refills up to
  # rl.max_refill_rounds=100 rounds. A SIGTERM during its second refill (the 4th reward call) used to wait for all 100
  # rounds (and the step); now the batch is abandoned after the round in flight, step 1 is checkpointed, exit 143. A
  # resume samples step 2 again from step 1's data position, as the uninterrupted run does.
  extra = ["reward_functions=informative_once", "rl.max_refill_rounds=100", "num_batches=3"]
  cmd = [a for a in _cmd(tmp_path, "stop") if not a.startswith(("reward_functions=", "rl.max_refill_rounds="))]
  env = dict(_env(), DS_TEST_SIGTERM_ON_CALL="4")
  p = subprocess.run(cmd + extra, cwd=REPO, capture_output=True, text=True, env=env, timeout=900, check=False)
  assert p.returncode == 143, p.stdout[-3000:] + p.stderr[-3000:]
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("error: stopped by SIGTERM after step 1/3; resume from checkpoint step 1"), p.stderr[-2000:]
  (rec,) = _steps(tmp_path / "stop")
  assert rec["step"] == 1 and rec["dynamic_sampling/kept_groups"] == B and rec["data/next_position"] == B
  assert _batches(tmp_path / "stop") == [{"step": 1, "ids": [f"synthetic-train-{i}" for i in range(B)]}]
  assert (tmp_path / "stop" / "checkpoints" / "1").is_dir() and not (tmp_path / "stop" / "checkpoints" / "2").exists()
