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

`--processes N` runs the job as one JAX program of N local processes (gloo collectives, as a Ray CPU worker runs it),
each with `--devices` forced devices split into its own trainer half (one trainer mesh over every process) and its own
sampler half (a per-host sampler), so rollouts ahead cross processes through the hand-overs of run/async_rollout.py.
Process 0 prints the report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
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
      "--devices",
      type=common.positive_int,
      default=8,
      help="forced host devices on CPU (half trainer, half sampler), per process",
  )
  p.add_argument("--processes", type=common.positive_int, default=1, help="JAX processes of the job (gloo, local)")
  p.add_argument("--child", type=common.non_negative_int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
  p.add_argument("--colocated", action="store_true", help="trainer and sampler share all devices instead")
  p.add_argument("--config", default="configs/cpu_tiny.yml")
  p.add_argument("overrides", nargs="*", help="extra key=value overrides (model size, batch, ...)")
  return p.parse_args(argv)


def _run(args, k: int, out_dir: str) -> list[dict]:
  """One GRPO job with rl.off_policy_steps=k; its per-step metric records."""
  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin.run import loop as trainer
  from maxtext_rl_plugin.run import build

  per_vm = args.devices if args.processes > 1 else args.devices // 2  # several: each process splits its own devices
  split = [] if args.colocated else ["use_pathways=true", f"chips_per_vm={per_vm}"]
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


def _spawn(args, argv: list[str]) -> int:
  """`--processes N`: this command N times as one JAX program (process 0 reports); the worst exit code."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{s.getsockname()[1]}"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")
  cmd = [sys.executable, "-m", "maxtext_rl_plugin.bench", "async", *argv]
  with tempfile.TemporaryDirectory(prefix="bench_async_") as out, contextlib.ExitStack() as stack:
    flags = ["--coordinator", addr, "--out-dir", out]  # one run directory for every process
    procs = [
        stack.enter_context(subprocess.Popen([*cmd, "--child", str(i), *flags], env=env)) for i in range(args.processes)
    ]
    return max((p.wait() for p in procs), key=abs)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parse(argv)
  if args.processes > 1 and args.child is None:
    return _spawn(args, argv)
  common.force_host_devices(args.devices)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.child is not None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.processes, process_id=args.child)
  if args.child:  # process 0 reports (the others' records are empty: process 0 alone writes metrics)
    _run(args, 0, args.out_dir)
    _run(args, 1, args.out_dir)
    return 0
  with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
    out = args.out_dir or tmp
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
              "processes": args.processes,
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
