"""The README's main job, shortened: configs/cpu_demo.yml with 40 RL steps instead of 100.

Checks the demo end to end with every production part (flawed-teacher SFT warm start + its checkpoint, the
demo tokenizer, the embedded engine, rewards, the plugin's loss, Orbax, TensorBoard, metrics_file, summary
table and plot) and that RL does what the demo claims: reward and held-out greedy accuracy go up. Runs are
seeded and deterministic on CPU; the margins below are well inside the measured gains (docs/cpu_demo.md).
"""

import json
import pathlib
import sys

import pytest
from transformers import AutoTokenizer

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.data import load
from maxtext_rl_plugin.data import prompts

import _in_process as in_process

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 40
SHORT = [f"num_batches={STEPS}", "num_test_batches=2", "eval_batch_size=32"]


def _run(out, *overrides):
  """Run the shortened demo under `out` as the README does; returns the finished process."""
  cmd = [
      sys.executable,
      "-m",
      "maxtext_rl_plugin.train_rl",
      "configs/cpu_demo.yml",
      f"base_output_directory={out}",
      f"metrics_file={out / 'metrics.jsonl'}",
      *SHORT,
      *overrides,
  ]
  p = in_process.train_rl(cmd[3:])
  assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-4000:]}"
  return p


def test_demo_tokenizer_round_trips_the_synthetic_distribution():
  cfg = config_lib.load_config(["configs/cpu_demo.yml"])
  tok = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
  assert len(tok) <= cfg.vocab_size and tok.pad_token_id != tok.eos_token_id
  train, evaluation = load.load_splits(load.DataSettings.from_config(cfg), tok)
  for ex in [*train.batch(0, 50), *(evaluation[i] for i in range(50))]:
    for text in (ex.prompt, prompts.format_target(ex, prompts.PromptSettings.from_config(cfg))):
      assert tok.decode(tok.encode(text)) == text
  ids = tok.encode("<answer>123</answer>")
  assert [tok.decode([i]) for i in ids] == ["<answer>", "1", "2", "3", "</answer>"]


@pytest.mark.extended  # 368 s: the learning claim, also measured at full length in docs/cpu_demo.md
def test_shortened_demo_rl_raises_reward_and_accuracy_and_rerun_resumes(tmp_path):
  p = _run(tmp_path)
  run = tmp_path / "cpu_demo"
  assert "SFT warm start step 300/300" in p.stdout
  assert "eval accuracy" in p.stdout and "before RL" in p.stdout and "after RL" in p.stdout
  png = run / "summary.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  evals = {r["step"]: r["eval/accuracy"] for r in recs if "eval/accuracy" in r}
  assert set(evals) == {0, 25, STEPS} and all(0.0 <= v <= 1.0 for v in evals.values())  # eval_interval: 25
  rewards = [r["reward/mean"] for r in recs if "reward/mean" in r]
  assert [r["step"] for r in recs if "reward/mean" in r] == list(range(1, STEPS + 1))
  first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
  assert last > first + 0.05, (first, last, rewards)
  assert evals[STEPS] > evals[0] + 0.10, evals
  assert (run / "checkpoints" / "sft").is_dir() and (run / "checkpoints" / str(STEPS)).is_dir()
  # The warm start already happened: a rerun restores it instead of training it again, then resumes RL.
  p2 = _run(tmp_path, f"num_batches={STEPS + 1}", "eval_before_training=false", "eval_after_training=false")
  assert "SFT warm start: restored 300 steps" in p2.stdout and "SFT warm start step" not in p2.stdout
  assert f"from checkpoint step {STEPS}" in p2.stdout
