"""Evaluation metrics (maxtext_rl_plugin/run/evaluation.py) against MaxText's definitions, and the eval/profiler/output
keys of a real run (eval_interval, num_eval_passes, eval_mode, profiler=xplane, log_period, tensorboard_dir,
checkpoint_dir).

The metric reference is hand-counted from MaxText 0.2.5's `evaluate_rl.score_responses` rules (pass: any pass
correct; maj: the most frequent extracted answer; pass_at_1: the fraction correct), on real `ScoreResult`s graded by
the plugin's reward stack against gold answers.
"""

import json
import pathlib
import sys

import pytest

from maxtext_rl_plugin.run import evaluation
from maxtext_rl_plugin import rewards

import _in_process as in_process
from _tiny import SMALL_VOCAB

REPO = pathlib.Path(__file__).resolve().parents[2]


def _graded(texts, gold):
  return rewards.score_batch(texts, [gold] * len(texts))


def _fmt(x):
  """A completion in the required format (MaxText's match_format: reasoning, then the answer in tags)."""
  return f"<reasoning>work</reasoning><answer>{x}</answer>"


def test_pass_maj_and_pass_at_1_follow_maxtexts_definitions():
  # Problem A (gold 12): 1 of 3 passes right, majority wrong (two say 7).
  a = _graded([_fmt(7), _fmt(12), _fmt(7)], "12")
  # Problem B (gold 5): 2 of 3 right, one of them outside the answer tags (lenient fallback), majority right.
  b = _graded([_fmt(5), "so the result is 5", _fmt(4)], "5")
  # Problem C (gold 3): nothing extractable, then one right.
  c = _graded(["no idea", "no idea", _fmt(3)], "3")
  per = [evaluation.problem_scores(x) for x in (a, b, c)]
  assert [p["pass"] for p in per] == [1.0, 1.0, 1.0]
  assert [p["maj"] for p in per] == [0.0, 1.0, 1.0]  # C: None answers never win the vote
  assert [p["pass_at_1"] for p in per] == pytest.approx([1 / 3, 2 / 3, 1 / 3])
  out = evaluation.aggregate(per, 3, "maj")
  assert out["accuracy"] == pytest.approx(2 / 3) and out["maj@3"] == pytest.approx(2 / 3)
  assert out["pass@3"] == 1.0 and out["pass@1"] == pytest.approx(4 / 9)
  # Strict: B's lenient "so the result is 5" does not count; its tagged "5" still does.
  assert per[1]["pass_at_1_strict"] == pytest.approx(1 / 3)
  assert evaluation.aggregate(per, 3, "pass_at_1")["strict_accuracy"] == pytest.approx((1 / 3 + 1 / 3 + 1 / 3) / 3)


def test_one_pass_is_greedy_accuracy_in_every_mode():
  per = [evaluation.problem_scores(_graded([t], g)) for t, g in ((_fmt(1), "1"), (_fmt(2), "3"))]
  for mode in evaluation.EVAL_MODES:
    out = evaluation.aggregate(per, 1, mode)
    assert out["accuracy"] == 0.5 and "pass@1" not in out


def test_eval_sampling_comes_from_generation_configs():
  cfg = type(
      "C",
      (),
      {
          "eval_sampling_strategy": "standard",
          "generation_configs": {"standard": {"eval_temperature": 0.7, "eval_top_k": 50, "eval_top_p": 0.95}},
      },
  )
  assert evaluation.sampling_for(cfg) == {"temperature": 0.7, "top_k": 50, "top_p": 0.95}
  cfg.eval_sampling_strategy = "greedy"
  assert evaluation.sampling_for(cfg)["top_k"] == 1
  cfg.eval_sampling_strategy = "nope"
  with pytest.raises(KeyError):
    evaluation.sampling_for(cfg)


@pytest.mark.slow
def test_eval_interval_profiler_and_output_dirs_are_honoured(tmp_path):
  """3 steps, eval_interval=1, num_eval_passes=2 sampled, profiler on step 2, log_period=2.

  MaxText derives tensorboard_dir and checkpoint_dir from base_output_directory/run_name; both are used as derived.
  """
  tb, ck = tmp_path / "ev" / "tensorboard", tmp_path / "ev" / "checkpoints"
  metrics = tmp_path / "m.jsonl"
  cmd = [
      sys.executable,
      "-m",
      "maxtext_rl_plugin.train_rl",
      "configs/cpu_tiny.yml",
      *SMALL_VOCAB,
      f"base_output_directory={tmp_path}",
      "run_name=ev",
      "num_batches=3",
      "eval_interval=1",
      "num_eval_passes=2",
      "eval_sampling_strategy=standard",
      "eval_mode=pass",
      "num_test_batches=1",
      "eval_batch_size=2",
      "profiler=xplane",
      "skip_first_n_steps_for_profiler=1",
      "profiler_steps=1",
      "checkpoint_period=2",
      "log_period=2",
      f"metrics_file={metrics}",
  ]
  p = in_process.train_rl(cmd[3:])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
  recs = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
  evals = [r for r in recs if "eval/accuracy" in r]
  assert [r["step"] for r in evals] == [0, 1, 2, 3]  # before, every step, after
  assert all("eval/pass@2" in r and "eval/maj@2" in r and "eval/strict_accuracy" in r for r in evals)
  assert all(r["eval/accuracy"] == r["eval/pass@2"] for r in evals)
  # log_period=2: the console progress line at steps 2 and 3 (the last), every step in the metrics file.
  assert [l.split(" |")[0] for l in p.stdout.splitlines() if l.startswith("step ")] == ["step 2/3", "step 3/3"]
  assert sorted(r["step"] for r in recs if "reward/mean" in r) == [1, 2, 3]
  assert list(tb.glob("events.out.tfevents.*")), "TensorBoard events not under tensorboard_dir"
  assert list(tb.rglob("*.xplane.pb")), "profiler=xplane wrote no trace under tensorboard_dir"
  assert sorted(d.name for d in ck.iterdir() if d.name.isdigit()) == ["2", "3"]
