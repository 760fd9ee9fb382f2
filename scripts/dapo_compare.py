"""GRPO, GRPO + dynamic sampling, DAPO and Dr. GRPO side by side on the CPU demo (docs/cpu_demo.md).

  python scripts/dapo_compare.py run --out /tmp/dapo_cmp --steps 40 --seeds 0 1 2 --clean-seeds 0
  python scripts/dapo_compare.py table /tmp/dapo_cmp

`run` trains each seed's SFT warm start once (in its first run's directory) and copies it into the other variants'
directories, so every variant of a seed starts from the same weights; runs go one at a time, niced, a
finished run (summary.json present) is skipped, and each run's wall time goes to `<out>/walls.jsonl`. `table` reads
every `<out>/runs/<variant>[_clean]_s<seed>/metrics.jsonl` and prints per-run rows and a per-variant summary as
Markdown. Rollouts count every sampled completion, refills included (dynamic sampling's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Overrides on top of configs/cpu_demo.yml (whose GRPO already aggregates per token: loss_agg_mode=token-mean).
VARIANTS = {
    "grpo": [],
    "grpo_ds": ["rl.dynamic_sampling=true"],
    # DAPO: dynamic sampling, clip-higher (0.2 / 0.28), token-level loss, overlong filtering and the soft overlong
    # penalty with a buffer of ~20% of the 32-token completion budget (the paper: 4096 of 20480).
    "dapo": [
        "rl.dynamic_sampling=true",
        "rl.epsilon_high=0.28",
        "rl.loss_agg_mode=token-mean",
        "rl.mask_truncated_completions=true",
        "rl.overlong_buffer_len=6",
        "rl.overlong_penalty_factor=1.0",
    ],
    # Dr. GRPO: r - mean_g without the std, loss over the constant completion budget (replaces this aggregation).
    "drgrpo": ["rl.advantage_estimator=drgrpo", "rl.loss_agg_mode=sequence-mean-token-mean"],
}
CLEAN = ["synthetic_teacher_error_rate=0"]
_RUN_RE = re.compile(r"^(?P<variant>[a-z_]+?)(?P<clean>_clean)?_s(?P<seed>\d+)$")


def run_name(variant: str, seed: int, clean: bool) -> str:
  return f"{variant}{'_clean' if clean else ''}_s{seed}"


def command(out: str, variant: str, seed: int, clean: bool, steps: int, eval_interval: int) -> list[str]:
  """The train_rl command line of one run (what docs/cpu_demo.md lists)."""
  return [
      os.path.join(ROOT, ".venv", "bin", "python"),
      "-m",
      "maxtext_rl_plugin.train_rl",
      "configs/cpu_demo.yml",
      f"run_name={run_name(variant, seed, clean)}",
      f"base_output_directory={os.path.join(out, 'runs')}",
      f"init_weights_seed={seed}",
      f"rollout_seed={seed}",
      f"synthetic_seed={1234 + seed}",
      f"num_batches={steps}",
      f"eval_interval={eval_interval}",
      *(CLEAN if clean else []),
      *VARIANTS[variant],
  ]


def _warm_start(runs_dir: str, seed: int, clean: bool) -> str | None:
  """The SFT checkpoint of a finished run with this seed and data (any variant: the warm start ignores rl.*)."""
  for v in VARIANTS:
    done = os.path.join(runs_dir, run_name(v, seed, clean))
    if os.path.exists(os.path.join(done, "summary.json")) and os.path.isdir(os.path.join(done, "checkpoints", "sft")):
      return os.path.join(done, "checkpoints", "sft")
  return None


def run_all(args) -> int:
  """Every (seed, variant) run, one at a time; the first variant of a seed trains the warm start the others copy."""
  runs_dir = os.path.join(args.out, "runs")
  os.makedirs(runs_dir, exist_ok=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  plan = [(s, False, v) for s in args.seeds for v in args.variants]
  plan += [(s, True, v) for s in args.clean_seeds for v in args.clean_variants]
  for seed, clean, variant in plan:
    name = run_name(variant, seed, clean)
    run_dir = os.path.join(runs_dir, name)
    if os.path.exists(os.path.join(run_dir, "summary.json")):
      print(f"{name}: done, skipped", flush=True)
      continue
    sft = _warm_start(runs_dir, seed, clean)
    if sft and not os.path.exists(os.path.join(run_dir, "checkpoints", "sft")):
      shutil.copytree(sft, os.path.join(run_dir, "checkpoints", "sft"))
    cmd = ["nice", "-n", str(args.nice), *command(args.out, variant, seed, clean, args.steps, args.eval_interval)]
    print(f"{name}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.time()
    with open(os.path.join(args.out, f"{name}.log"), "a", encoding="utf-8") as log:
      rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.time() - t0
    with open(os.path.join(args.out, "walls.jsonl"), "a", encoding="utf-8") as f:
      f.write(json.dumps({"run": name, "seconds": seconds, "rc": rc}) + "\n")
    print(f"{name}: rc {rc}, {seconds / 60:.1f} min", flush=True)
    if rc:
      return rc
  print(table(args.out), flush=True)
  return 0


def read_records(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def run_stats(records: list[dict], batch_size: int, num_generations: int, wall_s: float | None = None) -> dict:
  """One run's numbers from its metrics records (steps counted from 1; eval records carry eval/accuracy)."""
  steps = sorted({r["step"]: r for r in records if "reward/mean" in r}.values(), key=lambda r: r["step"])
  evals = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
  per_step = batch_size * num_generations
  rollouts = np.cumsum([per_step + r.get("dynamic_sampling/extra_rollouts", 0.0) for r in steps])
  rl_s = np.cumsum([r.get("perf/step_s", 0.0) for r in steps])
  sampled_groups = [batch_size * (1 + r.get("dynamic_sampling/refill_rounds", 0.0)) for r in steps]
  # Zero-variance groups among all sampled ones: dynamic sampling's dropped groups, else the trained batch's.
  zero = [
      r["dynamic_sampling/dropped_groups"]
      if "dynamic_sampling/dropped_groups" in r
      else r.get("reward/zero_variance_group_fraction", float("nan")) * batch_size
      for r in steps
  ]
  first_round_zero = [
      1.0 - r["dynamic_sampling/first_round_informative_fraction"]
      if "dynamic_sampling/first_round_informative_fraction" in r
      else r.get("reward/zero_variance_group_fraction", float("nan"))
      for r in steps
  ]
  k = min(10, len(steps) // 2) or 1
  rewards = [r["reward/mean"] for r in steps]
  before, after = evals.get(0, float("nan")), evals[max(evals)] if evals else float("nan")
  last = len(steps)
  return {
      "steps": last,
      "before": before,
      "after": after,
      "gain": after - before,
      "curve": {
          s: (a, float(rollouts[s - 1]) if 0 < s <= last else 0.0, float(rl_s[s - 1]) if 0 < s <= last else 0.0)
          for s, a in sorted(evals.items())
      },
      "reward_first": float(np.mean(rewards[:k])) if rewards else float("nan"),
      "reward_last": float(np.mean(rewards[-k:])) if rewards else float("nan"),
      "reward_k": k,
      "rollouts": float(rollouts[-1]) if last else 0.0,
      "prompts": float(rollouts[-1]) / num_generations if last else 0.0,
      "gain_per_1k_rollouts": (after - before) / (float(rollouts[-1]) / 1000.0) if last else float("nan"),
      "zero_var_fraction": float(np.sum(zero) / np.sum(sampled_groups)) if last else float("nan"),
      "first_round_zero_var": float(np.mean(first_round_zero)) if last else float("nan"),
      "short_groups": float(np.sum([r.get("dynamic_sampling/short_groups", 0.0) for r in steps])),
      "truncated": float(np.mean([r.get("completion/truncated_fraction", float("nan")) for r in steps])) if last else 0.0,
      "rl_s": float(rl_s[-1]) if last else 0.0,
      "wall_s": wall_s,
  }


def _walls(out: str) -> dict[str, float]:
  path = os.path.join(out, "walls.jsonl")
  if not os.path.exists(path):
    return {}
  return {r["run"]: r["seconds"] for r in read_records(path) if r.get("rc", 0) == 0}


def _trained_sft_seconds(out: str, name: str) -> float | None:
  """Seconds of the SFT warm start if run `name` trained it (its log shows the steps), else None (restored)."""
  log = os.path.join(out, f"{name}.log")
  meta = os.path.join(out, "runs", name, "checkpoints", "sft")
  if not os.path.exists(log):
    return None
  with open(log, encoding="utf-8", errors="replace") as f:
    if "SFT warm start step 1/" not in f.read():
      return None
  for step in os.listdir(meta) if os.path.isdir(meta) else []:
    path = os.path.join(meta, step, "meta", "metadata")
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        return float(json.load(f)["seconds"])
  return None


def collect(out: str, batch_size: int = 8, num_generations: int = 8, running: bool = False) -> dict[str, dict]:
  """{run name: run_stats} for every finished run under `<out>/runs` (summary.json written), and unfinished ones
  with `running`."""
  walls = _walls(out)
  stats = {}
  runs_dir = os.path.join(out, "runs")
  for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
    path = os.path.join(runs_dir, name, "metrics.jsonl")
    finished = os.path.exists(os.path.join(runs_dir, name, "summary.json"))
    if _RUN_RE.match(name) and os.path.exists(path) and (finished or running):
      records = read_records(path)
      if any("reward/mean" in r for r in records):
        stats[name] = run_stats(records, batch_size, num_generations, walls.get(name))
        sft = _trained_sft_seconds(out, name)
        if sft is not None and stats[name]["wall_s"] is not None:  # wall time of the RL part, like its siblings'
          stats[name]["wall_s"] -= sft
        stats[name]["sft_s"] = sft
  return stats


def _pct(x: float) -> str:
  return "-" if x is None or not np.isfinite(x) else f"{100 * x:.1f}%"


def _mean_spread(xs: list[float], scale: float = 1.0, fmt: str = "{:+.1f}") -> str:
  xs = [scale * x for x in xs if x is not None and np.isfinite(x)]
  if not xs:
    return "-"
  if len(xs) == 1:
    return fmt.format(xs[0])
  return f"{fmt.format(np.mean(xs))} ± {np.std(xs, ddof=1):.1f} ({fmt.format(min(xs))} .. {fmt.format(max(xs))})"


def _wall(s: dict) -> str:
  if s["wall_s"] is None:
    return "-"
  return f"{s['wall_s'] / 60:.1f}" + ("" if s.get("sft_s") is None else f" (+ SFT {s['sft_s'] / 60:.1f})")


def table(out: str, batch_size: int = 8, num_generations: int = 8, running: bool = False) -> str:
  """Markdown: one row per run, then one per variant (mean ± sample std (min .. max) over seeds)."""
  stats = collect(out, batch_size, num_generations, running)

  def order(name):
    m = _RUN_RE.match(name)
    return (bool(m["clean"]), list(VARIANTS).index(m["variant"]) if m["variant"] in VARIANTS else 99, int(m["seed"]))

  stats = {name: stats[name] for name in sorted(stats, key=order)}
  lines = [
      "| run | steps | eval acc. before | after | gain (pts) | eval curve: acc. @ step (rollouts, RL min) "
      "| reward first k -> last k | rollouts | gain / 1k rollouts | zero-var. groups (all sampled / 1st round) "
      "| truncated | RL min | wall min (excl. SFT) |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for name, s in stats.items():
    curve = "; ".join(f"{_pct(a)} @{st} ({ro:.0f}, {sec / 60:.1f})" for st, (a, ro, sec) in s["curve"].items())
    lines.append(
        f"| {name} | {s['steps']} | {_pct(s['before'])} | {_pct(s['after'])} | {100 * s['gain']:+.1f} | {curve} "
        f"| {s['reward_first']:.3f} -> {s['reward_last']:.3f} (k={s['reward_k']}) | {s['rollouts']:.0f} "
        f"| {100 * s['gain_per_1k_rollouts']:+.1f} | {_pct(s['zero_var_fraction'])} / {_pct(s['first_round_zero_var'])} "
        f"| {100 * s['truncated']:.2f}% | {s['rl_s'] / 60:.1f} | {_wall(s)} |"
    )
  groups: dict[str, list[dict]] = {}
  for name, s in stats.items():
    m = _RUN_RE.match(name)
    groups.setdefault(m["variant"] + (m["clean"] or ""), []).append(s)
  lines += [
      "",
      "| variant | seeds | eval acc. before | after | gain (pts) | reward first -> last | rollouts | gain / 1k rollouts "
      "| zero-var. groups (all sampled) | truncated | RL min | wall min (excl. SFT) |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for variant, ss in groups.items():

    def col(key, scale=100.0, fmt="{:.1f}", ss=ss):
      return _mean_spread([s[key] for s in ss], scale, fmt)

    walls = [s["wall_s"] for s in ss if s["wall_s"] is not None]
    lines.append(
        f"| {variant} | {len(ss)} | {col('before')} | {col('after')} | {col('gain', fmt='{:+.1f}')} "
        f"| {np.mean([s['reward_first'] for s in ss]):.3f} -> {np.mean([s['reward_last'] for s in ss]):.3f} "
        f"| {col('rollouts', 1.0, '{:.0f}')} | {col('gain_per_1k_rollouts', fmt='{:+.1f}')} "
        f"| {col('zero_var_fraction')}% | {col('truncated', fmt='{:.2f}')}% | {col('rl_s', 1 / 60)} "
        f"| {_mean_spread(walls, 1 / 60, '{:.1f}')} |"
    )
  # Accuracy against rollouts and RL minutes: each eval step's means over the variant's seeds.
  evals = sorted({st for ss in groups.values() for s in ss for st in s["curve"] if st > 0})
  lines += ["", "| variant | " + " | ".join(f"eval @ step {st}: acc. (rollouts, RL min)" for st in evals) + " |"]
  lines.append("| --- " * (len(evals) + 1) + "|")
  for variant, ss in groups.items():
    cells = []
    for st in evals:
      pts = [s["curve"][st] for s in ss if st in s["curve"]]
      cells.append(
          f"{100 * np.mean([p[0] for p in pts]):.1f}% ({np.mean([p[1] for p in pts]):.0f}, "
          f"{np.mean([p[2] for p in pts]) / 60:.1f})"
          if pts
          else "-"
      )
    lines.append(f"| {variant} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run", help="train every variant (one at a time), then print the table")
  r.add_argument("--out", default="/tmp/dapo_cmp")
  r.add_argument("--steps", type=int, default=40)
  r.add_argument("--eval-interval", type=int, default=20)
  r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  r.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  r.add_argument("--clean-seeds", type=int, nargs="*", default=[0])
  r.add_argument("--clean-variants", nargs="+", default=["grpo", "dapo"], choices=list(VARIANTS))
  r.add_argument("--nice", type=int, default=5)
  t = sub.add_parser("table", help="print the Markdown tables of the runs under OUT/runs")
  t.add_argument("out")
  t.add_argument("--running", action="store_true", help="include runs still in progress (no summary.json yet)")
  args = p.parse_args(argv)
  if args.cmd == "run":
    return run_all(args)
  print(table(args.out, running=args.running))
  return 0


if __name__ == "__main__":
  sys.exit(main())
