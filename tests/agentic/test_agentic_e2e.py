"""Multi-turn GRPO with the calculator through `train_rl` (rl.use_agentic_rollout): trains, evaluates, resumes exactly.

One module-scoped set of tiny runs (the cpu_tiny model with the demo's tokenizer, on synthetic_task=products with a
40-step warm start whose demonstrations all call the calculator, so RL's episodes really call it):
  * run `ag`: 2 RL steps, then rerun to 3 steps (resumed from checkpoint step 2);
  * run `ref`: 3 uninterrupted steps from the same warm start (its SFT checkpoint copied in), the resume reference.
`rl.log_sampler_trainer_agreement=true` makes the loss mask visible end to end: the sampler's log-prob of an
environment token is 0 and the trainer's is not, so the agreement metric (masked like the loss) is ~0 only when the
environment's tokens are out of the mask.
"""

import math
import shutil

import pytest

from test_train_e2e import read_jsonl
from test_train_e2e import read_tb_scalars
from test_train_e2e import train

# The episode task and its warm start (tests/run/test_multiprocess_rollouts.py runs the same episodes across processes).
EPISODES = (
    "synthetic_task=products",
    "synthetic_max_value=99",
    "synthetic_tool_rate=1.0",
    "sft_warmup_steps=40",
    "sft_batch_size=8",
    "sft_learning_rate=3e-3",
    "max_prefill_predict_length=32",
    "max_target_length=80",
    "rl.use_agentic_rollout=true",
    "rl.agentic_max_turns=2",
    "rl.agentic_turn_tokens=24",
    "rl.log_sampler_trainer_agreement=true",
)
AGENTIC = (
    "tokenizer_path=tokenizers/arith-bpe-512",
    "vocab_size=528",
    "use_chat_template=false",
    "data_template_path=cpu_demo_template.json",
    *EPISODES,
    # The 3-step run's schedule for all three runs (the 2-step first run included), so the resumed run can continue
    # the uninterrupted one bit for bit: by default the schedule is sized by num_batches.
    "learning_rate_schedule_steps=3",
)
QUIET = ("eval_before_training=false", "eval_after_training=false")


@pytest.fixture(name="runs", scope="module")
def runs_fixture(tmp_path_factory):
  out = tmp_path_factory.mktemp("agentic")
  first = train(out, "ag", *AGENTIC, "num_batches=2")
  (out / "ref" / "checkpoints").mkdir(parents=True)
  shutil.copytree(out / "ag" / "checkpoints" / "sft", out / "ref" / "checkpoints" / "sft")
  ref = train(out, "ref", *AGENTIC, *QUIET, "num_batches=3")
  resumed = train(out, "ag", *AGENTIC, "eval_before_training=false", "num_batches=3")
  return out, first, ref, resumed


def test_multi_turn_run_trains_evaluates_and_reports_episode_figures(runs):
  out, first, _, resumed = runs
  recs = read_jsonl(out / "ag" / "metrics.jsonl")
  steps = [r for r in recs if "reward/mean" in r]
  assert [r["step"] for r in steps] == [1, 2, 3]
  keys = ("turns_mean", "tool_calls_mean", "tool_call_rate", "tool_errors", "masked_tokens", "masked_fraction")
  for r in steps:
    assert all(f"agentic/{k}" in r for k in keys), sorted(r)
    assert 1.0 <= r["agentic/turns_mean"] <= 2.0
    assert 0.0 <= r["agentic/masked_fraction"] < 1.0
    assert r["agentic/masked_tokens"] == 0 or r["agentic/tool_calls_mean"] > 0  # only tool answers are masked
  masked = [r for r in steps if r["agentic/masked_tokens"] > 0]
  assert masked, "no step had an episode with a tool answer: the warm start did not teach the call format"
  for r in masked:  # environment tokens (sampler log-prob 0, trainer's not) are out of the masked agreement metric
    assert r["mismatch/logp_abs_diff_max"] < 1e-3, r
    assert math.isfinite(r["loss"])
  evals = [r for r in recs if "eval/accuracy" in r]
  assert [r["step"] for r in evals] == [0, 2, 3]
  assert all("eval/agentic/tool_call_rate" in r and "eval/agentic/turns_mean" in r for r in evals)
  tb = read_tb_scalars(out / "ag" / "tensorboard")
  assert set(tb["agentic/tool_call_rate"]) == {1, 2, 3} and "agentic/masked_tokens" in tb
  assert "SFT warm start step 40/40" in first.stdout and "tool-call rate" in first.stdout
  assert "turns/episode" in resumed.stdout and "masked tokens" in resumed.stdout


def test_resumed_multi_turn_run_matches_the_uninterrupted_one(runs):
  out, _, ref, resumed = runs
  assert "from checkpoint step 2" in resumed.stdout
  assert "SFT warm start: restored" in ref.stdout and "SFT warm start: restored" in resumed.stdout
  assert read_jsonl(out / "ag" / "batches.jsonl") == read_jsonl(out / "ref" / "batches.jsonl")
  got = {r["step"]: r for r in read_jsonl(out / "ag" / "metrics.jsonl") if "reward/mean" in r}
  want = {r["step"]: r for r in read_jsonl(out / "ref" / "metrics.jsonl") if "reward/mean" in r}
  for step in (1, 2, 3):  # the episodes of step 3 were sampled again after the restart, with the step's own seed
    for key in ("reward/mean", "agentic/masked_tokens", "agentic/tool_calls_mean", "agentic/turns_mean"):
      assert got[step][key] == pytest.approx(want[step][key], abs=1e-6), (step, key)
  # Same schedule, same restored params and optimizer state, same episodes: every step's update is the same, step 3's
  # (trained after the restart) included. The KL term is ~1e-5 here (all rewards 0), so compare exactly.
  assert "note: the learning-rate schedule" not in resumed.stdout
  for step in (1, 2, 3):
    for key in ("loss", "kl", "grad_norm"):
      assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
