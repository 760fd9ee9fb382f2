"""Issue 63's CPU measurements (docs/rewards.md, "Several rewards" and "Reward models"): helpers for
scripts/rewards_measure.sh.

* `brevity` (a reward function, loaded with reward_functions_path=scripts/rewards_measure.py): 0.1 * (64 - n) / 32
  for a completion of n characters, clipped to [0, 0.1] (the first version, 0.1 * (1 - n / 32), was 0 on nearly every
  completion of the demo, ~15 tokens, and measured nothing): the second objective of the two-objective demo, whose
  spread (<= 0.1) is 10x narrower than check_answer's (0 or 1).
* `python scripts/rewards_measure.py pairs OUT.jsonl N [k=v ...]`: N preference pairs from the CPU demo's train split
  (configs/cpu_demo.yml + overrides): chosen = the true worked solution, rejected = the flawed teacher's
  (data/synthetic.adding_teacher, the demo's own flaw), both as the SFT warm start formats targets; rows where the
  teacher happens to be right are skipped.
* `python scripts/rewards_measure.py summary RUN_DIR...`: each run's eval accuracy before/after and the first/last 10
  steps' mean of every reward/<name>/mean, as one JSON line per run.
"""

import json
import pathlib
import sys

from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.data import load as data_load
from maxtext_rl_plugin.data import prompts as prompts_lib
from maxtext_rl_plugin.data import splits
from maxtext_rl_plugin.data import synthetic


def brevity(prompts, completions, **kwargs):
  """0.1 * (64 - characters) / 32, clipped to [0, 0.1] (module docstring)."""
  del prompts, kwargs
  return [0.1 * min(1.0, max(0.0, (64.0 - len(c)) / 32.0)) for c in completions]


def _pairs(out: str, n: int, overrides: list[str]) -> None:
  """Write `n` (true, flawed-teacher) pairs of the demo's train split to `out` (module docstring)."""
  config = config_lib.load_config(["configs/cpu_demo.yml", "synthetic_teacher_error_rate=0", *overrides])
  tok = tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config))
  train, _ = data_load.load_splits(data_load.DataSettings.from_config(config), tok)
  settings = prompts_lib.PromptSettings.from_config(config)
  rows = []
  for ex in (train[i] for i in range(len(train))):  # a DatasetSplit is indexed, not iterated
    if len(rows) >= n:
      break
    flawed, value = synthetic.adding_teacher(ex.solution)
    if str(value) == str(ex.answer):
      continue
    bad = splits.Example(ex.question, ex.answer, flawed, ex.prompt, ex.id)
    rows.append(
        {
            "prompt": ex.question,
            "chosen": prompts_lib.format_target(ex, settings),
            "rejected": prompts_lib.format_target(bad, settings),
        }
    )
  pathlib.Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  print(f"{len(rows)} pairs -> {out}")


def _summary(run_dirs: list[str]) -> None:
  """One JSON line per run directory (module docstring)."""
  for d in run_dirs:
    path = pathlib.Path(d) / "metrics.jsonl"
    if not path.exists():
      print(json.dumps({"run": d, "missing": True}))
      continue
    recs = [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
    steps = [r for r in recs if "reward/mean" in r]
    evals = [r for r in recs if "eval/accuracy" in r]
    out = {"run": d, "steps": len(steps)}
    pair = [r["eval/pair_accuracy"] for r in recs if "eval/pair_accuracy" in r]  # a train_rm run
    if pair:
      out["heldout_pair_accuracy"] = [pair[0], pair[-1]]
    if evals:
      out["eval_accuracy_before"] = evals[0]["eval/accuracy"]
      out["eval_accuracy_after"] = evals[-1]["eval/accuracy"]
      out["eval_steps"] = [r["step"] for r in evals]
    for key in sorted({k for r in steps for k in r if k.startswith("reward/") and k.endswith("/mean")}):
      vals = [r[key] for r in steps if key in r]
      out[key] = [round(sum(vals[:10]) / len(vals[:10]), 4), round(sum(vals[-10:]) / len(vals[-10:]), 4)]
    for key in ("completion/length_mean", "time/reward_s", "perf/step_s"):
      vals = [r[key] for r in steps if key in r]
      if vals:
        out[key] = [round(sum(vals[:10]) / len(vals[:10]), 3), round(sum(vals[-10:]) / len(vals[-10:]), 3)]
    print(json.dumps(out))


if __name__ == "__main__":
  if sys.argv[1] == "pairs":
    _pairs(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
  elif sys.argv[1] == "summary":
    _summary(sys.argv[2:])
  else:
    raise SystemExit(__doc__)
