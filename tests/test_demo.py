"""The README's main job, shortened: configs/cpu_demo.yml with a short warm start and a few RL steps.

Checks the demo's mechanics end to end with every production part (SFT warm start + its checkpoint, the
demo tokenizer, the embedded engine, rewards, the plugin's loss, Orbax, TensorBoard, metrics_file,
summary table and plot). Whether RL raises accuracy is a property of the full-length run, measured in
the closing note of the demo issue, not asserted here.
"""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(out, *overrides):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, "-m", "maxtext_rl_plugin.train_rl", "configs/cpu_demo.yml", f"base_output_directory={out}",
         f"metrics_file={out / 'metrics.jsonl'}", "sft_warmup_steps=30", "num_batches=3", "batch_size=4",
         "num_test_batches=1", "eval_batch_size=16", *overrides]
  p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=1200, check=False)
  assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-4000:]}"
  return p


def test_demo_tokenizer_round_trips_the_synthetic_distribution():
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel

  from maxtext_rl_plugin import config as config_lib, data  # pylint: disable=import-outside-toplevel

  cfg = config_lib.load_config(["configs/cpu_demo.yml"])
  tok = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
  assert len(tok) <= cfg.vocab_size and tok.pad_token_id != tok.eos_token_id
  train, evaluation = data.load_splits(cfg, tok)
  for ex in [*train.batch(0, 50), *(evaluation[i] for i in range(50))]:
    for text in (ex.prompt, data.format_target(ex, cfg)):
      assert tok.decode(tok.encode(text)) == text
  ids = tok.encode("<answer>123</answer>")
  assert [tok.decode([i]) for i in ids] == ["<answer>", "1", "2", "3", "</answer>"]


def test_shortened_demo_runs_end_to_end_and_rerun_skips_the_warm_start(tmp_path):
  p = _run(tmp_path)
  run = tmp_path / "cpu_demo"
  assert "SFT warm start step 30/30" in p.stdout
  assert "eval accuracy" in p.stdout and "before RL" in p.stdout and "after RL" in p.stdout
  png = run / "summary.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  evals = {r["step"]: r["eval/accuracy"] for r in recs if "eval/accuracy" in r}
  assert set(evals) == {0, 3} and all(0.0 <= v <= 1.0 for v in evals.values())
  assert [r["step"] for r in recs if "reward/mean" in r] == [1, 2, 3]
  assert (run / "checkpoints" / "sft").is_dir() and (run / "checkpoints" / "3").is_dir()
  # The warm start already happened: a rerun restores it instead of training it again.
  p2 = _run(tmp_path, "num_batches=4")
  assert "SFT warm start: restored 30 steps" in p2.stdout and "SFT warm start step" not in p2.stdout
  assert "from checkpoint step 3" in p2.stdout
