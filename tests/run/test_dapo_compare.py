"""scripts/dapo_compare.py: the DAPO-and-kin demo table from metrics files (hand-computed numbers), and its variants'
overrides load as the config they claim."""

import importlib.util
import json
import os
import statistics

import pytest

from maxtext_rl_plugin.config.load import load_config

_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "dapo_compare.py"
)
_spec = importlib.util.spec_from_file_location("dapo_compare", _PATH)
dapo_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dapo_compare)


def _write(out, name, records, finished=True):
  os.makedirs(os.path.join(out, "runs", name), exist_ok=True)
  with open(os.path.join(out, "runs", name, "metrics.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  if finished:
    with open(os.path.join(out, "runs", name, "summary.json"), "w", encoding="utf-8") as f:
      f.write("{}")


def _plain(step, reward, zvf, trunc):
  return {
      "step": step,
      "reward/mean": reward,
      "reward/zero_variance_group_fraction": zvf,
      "completion/truncated_fraction": trunc,
      "perf/step_s": 30.0,
  }


def _ds(step, reward, refills, dropped, first_inf):
  return {
      "step": step,
      "reward/mean": reward,
      "completion/truncated_fraction": 0.0,
      "perf/step_s": 60.0,
      "dynamic_sampling/refill_rounds": refills,
      "dynamic_sampling/extra_rollouts": refills * 8.0,
      "dynamic_sampling/dropped_groups": dropped,
      "dynamic_sampling/first_round_informative_fraction": first_inf,
      "reward/zero_variance_group_fraction": 0.0,
  }


@pytest.fixture(name="out")
def fixture_out(tmp_path):
  """batch_size 2, 4 generations: 8 rollouts a round."""
  out = str(tmp_path)
  _write(
      out,
      "grpo_s0",
      [
          {"step": 0, "eval/accuracy": 0.2},
          _plain(1, 0.1, 0.5, 0.0),
          _plain(2, 0.9, 0.25, 0.1),  # step 2 is rewritten by a resume below: last one wins
          {"step": 2, "eval/accuracy": 0.3},
          _plain(2, 0.2, 0.25, 0.1),
          _plain(3, 0.3, 0.0, 0.0),
          _plain(4, 0.4, 0.25, 0.1),
          {"step": 4, "eval/accuracy": 0.5},
      ],
  )
  _write(
      out,
      "dapo_s0",
      [
          {"step": 0, "eval/accuracy": 0.1},
          _ds(1, 0.5, 1, 2, 0.0),
          _ds(2, 0.7, 0, 1, 0.5),
          {"step": 2, "eval/accuracy": 0.4},
      ],
  )
  _write(
      out,
      "dapo_s1",
      [
          {"step": 0, "eval/accuracy": 0.2},
          _ds(1, 0.5, 0, 0, 1.0),
          _ds(2, 0.6, 0, 0, 1.0),
          {"step": 2, "eval/accuracy": 0.6},
      ],
  )
  _write(out, "notarun", [{"step": 1, "reward/mean": 1.0}])
  _write(out, "grpo_s7", [{"step": 1, "reward/mean": 1.0}], finished=False)  # still running
  with open(os.path.join(out, "walls.jsonl"), "w", encoding="utf-8") as f:
    f.write(json.dumps({"run": "grpo_s0", "seconds": 150.0, "rc": 0}) + "\n")
    f.write(json.dumps({"run": "dapo_s0", "seconds": 999.0, "rc": 1}) + "\n")  # a failed attempt: not its wall time
    f.write(json.dumps({"run": "dapo_s1", "seconds": 200.0, "rc": 0}) + "\n")
  # dapo_s1 trained its seed's warm start (60 s): its wall time without it is 140 s.
  with open(os.path.join(out, "dapo_s1.log"), "w", encoding="utf-8") as f:
    f.write("SFT warm start step 1/300 | loss 66.6\n")
  os.makedirs(os.path.join(out, "runs", "dapo_s1", "checkpoints", "sft", "300", "meta"))
  with open(
      os.path.join(out, "runs", "dapo_s1", "checkpoints", "sft", "300", "meta", "metadata"), "w", encoding="utf-8"
  ) as f:
    f.write(json.dumps({"steps": 300, "seconds": 60.0}))
  return out


def test_run_stats_by_hand(out):
  stats = dapo_compare.collect(out, batch_size=2, num_generations=4)
  assert sorted(stats) == ["dapo_s0", "dapo_s1", "grpo_s0"]
  assert sorted(dapo_compare.collect(out, 2, 4, running=True)) == ["dapo_s0", "dapo_s1", "grpo_s0", "grpo_s7"]
  g = stats["grpo_s0"]
  assert g["steps"] == 4 and g["before"] == 0.2 and g["after"] == 0.5 and g["gain"] == pytest.approx(0.3)
  assert g["reward_k"] == 2 and g["reward_first"] == pytest.approx(0.15) and g["reward_last"] == pytest.approx(0.35)
  assert g["rollouts"] == 32 and g["prompts"] == 8
  assert g["gain_per_1k_rollouts"] == pytest.approx(0.3 / 0.032)
  assert g["zero_var_fraction"] == pytest.approx(0.25) and g["first_round_zero_var"] == pytest.approx(0.25)
  assert g["truncated"] == pytest.approx(0.05) and g["rl_s"] == 120.0 and g["wall_s"] == 150.0
  assert g["curve"] == {0: (0.2, 0.0, 0.0), 2: (0.3, 16.0, 60.0), 4: (0.5, 32.0, 120.0)}
  d = stats["dapo_s0"]
  # Step 1 sampled 2 rounds (4 groups, 2 dropped), step 2 one round (2 groups, 1 dropped): 3 of 6 groups.
  assert d["rollouts"] == 24 and d["prompts"] == 6
  assert d["zero_var_fraction"] == pytest.approx(0.5) and d["first_round_zero_var"] == pytest.approx(0.75)
  assert d["curve"][2] == (0.4, 24.0, 120.0) and d["wall_s"] is None


def test_table_rows_and_variant_summary(out):
  text = dapo_compare.table(out, batch_size=2, num_generations=4)
  rows, curve = {}, {}
  for line in text.splitlines():
    if line.startswith("| "):
      (rows if line.split(" | ")[0].strip("| ") not in rows else curve)[line.split(" | ")[0].strip("| ")] = line
  assert "| 20.0% | 50.0% | +30.0 |" in rows["grpo_s0"] and "| 2.5 |" in rows["grpo_s0"]
  assert "30.0% @2 (16, 1.0)" in rows["grpo_s0"]
  gains = [30.0, 40.0]  # dapo_s0: 10% -> 40%, dapo_s1: 20% -> 60%
  assert f"+{statistics.fmean(gains):.1f} ± {statistics.stdev(gains):.1f} (+30.0 .. +40.0)" in rows["dapo"]
  assert rows["dapo"].startswith("| dapo | 2 |")
  assert rows["dapo_s1"].endswith("| 2.3 (+ SFT 1.0) |") and rows["dapo_s0"].endswith("| - |")
  assert "notarun" not in text
  # Accuracy against rollouts and RL minutes, means over seeds: dapo @2 = (40% + 60%) / 2 at (24 + 16) / 2 rollouts
  # and 2 x 60 s; no dapo run reached step 4.
  assert curve["dapo"] == "| dapo | 50.0% (20, 2.0) | - |"


@pytest.mark.parametrize("variant", list(dapo_compare.VARIANTS))
def test_variant_overrides_load(variant):
  argv = dapo_compare.command("/tmp/x", variant, 1, True, 7, 5)[3:]
  cfg = load_config(argv)
  assert (cfg.num_batches, cfg.rollout_seed, cfg.synthetic_seed, cfg.synthetic_teacher_error_rate) == (7, 1, 1235, 0.0)
  assert cfg.rl.dynamic_sampling == (variant in ("grpo_ds", "dapo"))
  assert cfg.rl.advantage_estimator == ("drgrpo" if variant == "drgrpo" else "grpo")
  if variant == "dapo":
    assert (cfg.rl.epsilon_high, cfg.rl.overlong_buffer_len, cfg.rl.mask_truncated_completions) == (0.28, 6, True)
