"""End-of-run summary: a before/after table on the console, a reward/accuracy plot (summary.png), summary.json."""

# matplotlib is optional (write_plot) and slow to import: imported only to draw the plot.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import json
import os
from typing import Any

from maxtext_rl_plugin import storage


def _fmt(v, pct=False) -> str:
  """A summary table cell: '-' for missing, a percentage or three decimals."""
  if v is None:
    return "-"
  return f"{100 * v:.1f}%" if pct else f"{v:.3f}"


def read_history(path: str | None) -> list[dict[str, Any]] | None:
  """Every record of the run's metrics file (steps before a resume included), or None without a file."""
  if not path or not storage.isfile(path):
    return None
  out = []
  for line in storage.read_text(path).splitlines():
    try:
      rec = json.loads(line)
    except ValueError:
      continue
    if isinstance(rec, dict):
      out.append(rec)
  return out


def write_json(run_dir: str, summary: dict[str, Any]) -> None:
  """`<run>/summary.json` (all but the history), replaced atomically: a rerun of a finished run reads it."""
  text = json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2, default=str)
  storage.write_atomic(os.path.join(run_dir, "summary.json"), text)


def table(summary: dict[str, Any]) -> str:
  """The before/after RL table printed at the end of a run."""
  before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
  rows = [
      ("eval accuracy", "accuracy", True),
      ("format accuracy", "format_accuracy", True),
      ("partial accuracy", "partial_accuracy", True),
      ("mean reward", "reward_mean", False),
  ]
  if "agentic/tool_call_rate" in before or "agentic/tool_call_rate" in after:  # rl.use_agentic_rollout's episodes
    rows += [
        ("tool-call rate", "agentic/tool_call_rate", True),
        ("turns/episode", "agentic/turns_mean", False),
        ("tool errors", "agentic/tool_errors", False),
        ("masked tokens", "agentic/masked_tokens", False),
    ]
  lines = [f"{'metric':<18}{'before RL':>12}{'after RL':>12}{'change':>12}", "-" * 54]
  for label, key, pct in rows:
    b, a = before.get(key), after.get(key)
    delta = None if a is None or b is None else a - b
    d = "-" if delta is None else (f"{100 * delta:+.1f} pts" if pct else f"{delta:+.3f}")
    lines.append(f"{label:<18}{_fmt(b, pct):>12}{_fmt(a, pct):>12}{d:>12}")
  n = before.get("num_examples") or after.get("num_examples")
  if n:
    lines.append(
        f"(eval_sampling_strategy decoding on {int(n)} held-out examples)".replace(
            "eval_sampling_strategy", summary.get("eval_sampling", "greedy")
        )
    )
  return "\n".join(lines)


def plot(summary: dict[str, Any], path: str) -> str | None:
  """Reward and accuracy per RL step (with eval points) as a PNG; None when matplotlib is missing."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  hist = [r for r in summary.get("history", []) if "reward/mean" in r]
  evals = [r for r in summary.get("history", []) if "eval/accuracy" in r]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  steps = [r["step"] for r in hist]
  window = max(1, min(10, len(hist) // 5))  # per-step values of a small batch are noisy: show a trend too

  def noisy_and_trend(ax, values, label, color):
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=1, label=f"{label} (per step)")
    if window > 1:
      trend = [
          sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
          for i in range(len(values))
      ]
      ax.plot(steps, trend, color=color, linewidth=2, label=f"{label} ({window}-step mean)")

  noisy_and_trend(ax1, [r["reward/mean"] for r in hist], "train reward", "tab:blue")
  ax1.set_xlabel("RL step")
  ax1.set_ylabel("mean reward")
  ax1.grid(alpha=0.3)
  ax1.legend()
  if any("accuracy" in r for r in hist):
    noisy_and_trend(ax2, [100 * r.get("accuracy", float("nan")) for r in hist], "train accuracy, sampled", "tab:blue")
  if evals:
    xs, ys = [r["step"] for r in evals], [100 * r["eval/accuracy"] for r in evals]
    ax2.plot(xs, ys, "o--", color="tab:orange", markersize=8, label="eval accuracy (held out)")
    if all("eval/strict_accuracy" in r for r in evals):
      ax2.plot(
          xs,
          [100 * r["eval/strict_accuracy"] for r in evals],
          "s:",
          color="tab:green",
          markersize=5,
          label="eval strict accuracy (answer in the required format)",
      )
    for x, y in zip(xs, ys):
      ax2.annotate(f"{y:.1f}%", (x, y), textcoords="offset points", xytext=(0, 8), ha="center", color="tab:orange")
  ax2.set_xlabel("RL step")
  ax2.set_ylabel("accuracy (%)")
  ax2.grid(alpha=0.3)
  ax2.legend()
  fig.tight_layout()
  storage.makedirs(os.path.dirname(storage.absolute(path)))
  with storage.open_write_bytes(path) as buf:  # one upload in a bucket, a rename locally
    fig.savefig(buf, dpi=110, format="png")
  plt.close(fig)
  return path


def report(config, summary: dict[str, Any]) -> None:
  """Print the table and, with write_plot, save the reward/accuracy plot next to the run."""
  print("\n" + table(summary), flush=True)
  if config.write_plot:
    png = plot(summary, os.path.join(summary["run_dir"], "summary.png"))
    if png:
      summary["plot"] = png
      print(f"plot: {png}", flush=True)
  print(
      f"TensorBoard logs: {summary.get('tensorboard_dir')}  (tensorboard --logdir {summary.get('tensorboard_dir')})",
      flush=True,
  )
  if summary.get("metrics_file"):
    print(f"metrics file: {summary['metrics_file']}", flush=True)
