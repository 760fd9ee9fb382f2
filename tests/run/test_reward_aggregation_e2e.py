"""rl.reward_aggregation=gdpo with rl.reward_weights end to end: a real 2-step `train_rl` of the tiny model on two
rewards with a 10x spread difference (tests/data/multi_rewards.py), under DAPO's dynamic sampling (the gdpo kept-group
rule in the refill loop), its per-reward metrics every step, and a resume
that changes a weight (noted in one line, not refused), and a wrong weight count refused in one line. The advantages'
formula is tests/algorithms/test_reward_aggregation.py's (NumPy re-derivation); here the step metrics agree with each
other (the weighted total, the kept-group rule)."""

import json
import pathlib

import pytest

import _in_process as in_process
from _tiny import SMALL_VOCAB

REPO = pathlib.Path(__file__).resolve().parents[2]
G = 4
_RUN = [
    "configs/cpu_tiny.yml",
    *SMALL_VOCAB,
    "max_prefill_predict_length=48",
    "max_target_length=64",
    "decode_sampling_temperature=30",  # distinct completions: both rewards vary in most groups
    "reward_functions=wide_reward,narrow_reward",
    f"reward_functions_path={REPO / 'tests' / 'data' / 'multi_rewards.py'}",
    "rl.reward_aggregation=gdpo",
    "rl.dynamic_sampling=true",  # the kept-group rule of gdpo (reward_aggregation.kept_groups) in the refill loop
    "rl.max_refill_rounds=1",
    "metrics_file=metrics.jsonl",
    "eval_before_training=false",
    "eval_after_training=false",
    "num_test_batches=0",
    "checkpoint_period=1",
    "batch_size=2",
    f"rl.num_generations={G}",
]


def _run(out, *extra, check=True):
  p = in_process.train_rl([*_RUN, f"base_output_directory={out}", "run_name=gdpo", *extra])
  if check:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p


def _steps(out) -> list[dict]:
  path = pathlib.Path(out) / "gdpo" / "metrics.jsonl"
  return [r for r in (json.loads(l) for l in path.read_text().splitlines() if l.strip()) if "reward/mean" in r]


def test_gdpo_with_weights_trains_logs_each_reward_and_resumes_with_a_noted_weight_change(tmp_path):
  _run(tmp_path, "num_batches=2", "rl.reward_weights=[1,0.5]")
  steps = _steps(tmp_path)
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    for name in ("wide_reward", "narrow_reward"):
      assert {f"reward/{name}/{k}" for k in ("mean", "std", "zero_spread_fraction")} <= set(r), sorted(r)
      assert 0.0 <= r[f"reward/{name}/zero_spread_fraction"] <= 1.0
    # reward/mean is the weighted total: 1 * wide + 0.5 * narrow (the rows' means are linear).
    assert r["reward/mean"] == pytest.approx(
        r["reward/wide_reward/mean"] + 0.5 * r["reward/narrow_reward/mean"], rel=1e-5
    )
    # gdpo keeps a group when either weighted reward varies: no more flat groups than either reward alone has.
    flat = r["reward/zero_variance_group_fraction"]
    assert flat <= min(r["reward/wide_reward/zero_spread_fraction"], r["reward/narrow_reward/zero_spread_fraction"])
    # dynamic sampling's trained batch: its flat groups are exactly the slots it could not fill
    assert flat == r["dynamic_sampling/short_groups"] / 2 and r["dynamic_sampling/kept_groups"] >= 1
  p = _run(tmp_path, "num_batches=3", "rl.reward_weights=[1,0.25]")
  assert "from checkpoint step 2" in p.stdout
  assert "note: resuming with rl.reward_weights=[1.0, 0.25], not the [1.0, 0.5]" in p.stdout, p.stdout[-2000:]
  assert [r["step"] for r in _steps(tmp_path)] == [1, 2, 3]
  p = _run(tmp_path, "num_batches=3", "rl.reward_weights=[1]", check=False)  # a run's wrong count: one line
  assert (
      p.returncode == 2 and "1 weights for 2 reward functions (reward_functions: wide_reward, narrow_reward)" in p.stderr
  )
  assert p.stderr.startswith("error: invalid value for 'rl.reward_weights'") and p.stderr.count("\n") == 1
