"""Synchronous vs asynchronous rollouts: `python -m maxtext_rl_plugin.bench async [--help]`.

Runs the same GRPO job twice in one process, `rl.off_policy_steps=0` (rollout -> update -> sync) and
`rl.off_policy_steps=1` (the next batch is sampled while the current one trains, run/async_rollout.py), on a disaggregated
split of forced CPU devices (MaxText's Pathways split: trainer on the first half, sampler on the second), and reports
steps/s and the median seconds of each phase after the warm-up steps (compilation).

The overlap model, from the synchronous run's phase medians (R = rollout + reward, T = logps + train, S = weight sync,
O = the rest of the step): a synchronous step costs R + T + S + O, an overlapped one max(R, T) + S + O, so the
predicted speed-up is (R + T + S + O) / (max(R, T) + S + O); it is at most 2x, reached when R == T and S, O are small.
On a CPU host every forced device shares the same cores, so the measured speed-up shows what is left over (host work,
Python, idle cores) rather than two accelerators working side by side; on disaggregated TPU meshes the two halves are
separate chips and the model's prediction is the number to expect.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

from maxtext_rl_plugin.bench import common

# JAX (and every plugin module that imports it) is imported inside functions, after `common.force_host_devices`
# has set XLA_FLAGS: XLA reads the host device count once, when the backend starts.
# pylint: disable=import-outside-toplevel

DEFAULT_MODEL = [
    "base_emb_dim=256",
    "base_mlp_dim=1024",
    "base_num_decoder_layers=4",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=64",
]
_PHASES = ("rollout", "reward", "logps", "train", "weight_sync")


def _parse(argv):
  """The command line (see --help)."""
  p = common.ArgumentParser(
      prog="python -m maxtext_rl_plugin.bench async", description=__doc__.split("\n", maxsplit=1)[0]
  )
  p.add_argument("--steps", type=common.positive_int, default=6, help="measured RL steps per mode (after --warmup)")
  p.add_argument("--warmup", type=common.non_negative_int, default=2, help="steps dropped from the medians (compilation)")
  p.add_argument(
      "--devices", type=common.positive_int, default=8, help="forced host devices on CPU (half trainer, half sampler)"
  )
  p.add_argument("--colocated", action="store_true", help="trainer and sampler share all devices instead")
  p.add_argument("--config", default="configs/cpu_tiny.yml")
  p.add_argument("overrides", nargs="*", help="extra key=value overrides (model size, batch, ...)")
  return p.parse_args(argv)


def _run(args, k: int, out_dir: str) -> list[dict]:
  """One GRPO job with rl.off_policy_steps=k; its per-step metric records."""
  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin.run import loop as trainer
  from maxtext_rl_plugin.run import build

  split = [] if args.colocated else ["use_pathways=true", f"chips_per_vm={args.devices // 2}"]
  argv = [
      args.config,
      *DEFAULT_MODEL,
      *split,
      f"base_output_directory={out_dir}",
      f"run_name=k{k}",
      f"num_batches={args.warmup + args.steps}",
      "enable_checkpointing=false",
      "num_test_batches=0",
      "eval_interval=0",
      "batch_size=4",
      "rl.num_generations=4",
      "max_target_length=192",
      f"rl.off_policy_steps={k}",
      *args.overrides,
  ]
  parsed = config_lib.parse(argv)
  run = build.build_run(parsed.hyperparameters(), parsed)
  run.metrics_file = os.path.join(out_dir, f"k{k}.jsonl")
  history = trainer.train(run)["history"]
  return [r for r in history if "perf/step_s" in r]


def _medians(records: list[dict], warmup: int) -> dict[str, float]:
  rows = records[warmup:] or records
  out = {p: statistics.median(r.get(f"time/{p}_s", 0.0) for r in rows) for p in _PHASES}
  out["step"] = statistics.median(r["perf/step_s"] for r in rows)
  for key in ("wait_rollout_s", "wait_sync_s", "producer_idle_s", "policy_lag"):
    out[key] = statistics.median(r.get(f"async/{key}", 0.0) for r in rows)
  return out


def overlap_model(m: dict[str, float]) -> dict[str, float]:
  """The synchronous step's phases regrouped: what overlapping rollouts with updates can save (module docstring)."""
  r = m["rollout"] + m["reward"]
  t = m["logps"] + m["train"]
  s = m["weight_sync"]
  o = max(0.0, m["step"] - r - t - s)
  return {
      "R": r,
      "T": t,
      "S": s,
      "O": o,
      "sync_step": r + t + s + o,
      "async_step": max(r, t) + s + o,
      "predicted_speedup": (r + t + s + o) / (max(r, t) + s + o),
  }


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  common.force_host_devices(args.devices)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  with tempfile.TemporaryDirectory(prefix="bench_async_") as out:
    sync = _medians(_run(args, 0, out), args.warmup)
    ahead = _medians(_run(args, 1, out), args.warmup)
  model = overlap_model(sync)
  print(f"{'phase (median s)':<22}{'sync':>10}{'async k=1':>12}")
  for p in (*_PHASES, "step", "wait_rollout_s", "wait_sync_s", "producer_idle_s", "policy_lag"):
    print(f"{p:<22}{sync[p]:>10.3f}{ahead[p]:>12.3f}")
  print(
      f"overlap model from the synchronous phases: R={model['R']:.3f} T={model['T']:.3f} S={model['S']:.3f} "
      f"O={model['O']:.3f}: sync {model['sync_step']:.3f}s, overlapped {model['async_step']:.3f}s, predicted "
      f"speed-up {model['predicted_speedup']:.2f}x"
  )
  print(
      common.finite_json(
          {
              "bench": "async",
              "split": "colocated" if args.colocated else f"disaggregated {args.devices // 2}+{args.devices // 2}",
              "sync_steps_per_s": 1.0 / sync["step"],
              "async_steps_per_s": 1.0 / ahead["step"],
              "measured_speedup": sync["step"] / ahead["step"],
              "predicted_speedup": model["predicted_speedup"],
              "sync_phases_s": sync,
              "async_phases_s": ahead,
              "cpu_count": os.cpu_count(),
          }
      )
  )
  return 0
