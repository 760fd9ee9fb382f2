"""One GRPO step, the plugin's loop vs Tunix 0.1.7's `GrpoLearner.train()`: `python -m maxtext_rl_plugin.bench step`.

Both sides are built by the plugin's `run/build.build_run` from the same config (same MaxText model and seed, so the
same initial weights; the same trainer/sampler split; the same rollout engine, the plugin's embedded KV-cache engine,
which Tunix drives through `RLCluster.generate` like any `BaseRollout`; the same reward functions, policy loss and
weight sync). They differ only in who runs the step: `trainer.train` (the plugin's loop) or Tunix's own
`GrpoLearner.train(dataset)` fed the same batches. Tunix's vanilla `Sampler` is not in the picture: it cannot sample
the MaxText model (bench rollout records why), and it is not needed here, since `GrpoLearner` accepts the plugin's
engine.

Both sides are timed by the same wrappers on the same `RLCluster` methods, so a phase means the same code on each:
rollout (`generate`), reward (the reward functions), logps (`get_ref_per_token_logps`, `get_old_per_token_logps`, the
plugin's trainer-side old log-probs), update (`update_actor`), sync (`sync_weights`); each phase is timed until
its results are ready (JAX dispatches asynchronously). A step runs from the end of one
weight sync to the end of the next; its overhead is what the loop spends outside those phases (batching, advantages,
metrics, logging). Steps up to `--warmup` compile and are dropped; of the rest, the step with the median total is
reported ("warm step").
"""

# jax, and everything that imports it, is imported inside the functions: XLA reads the forced host device count
# (common.force_host_devices) once, when the backend starts, so main() must set it before any jax import.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import collections
import functools
import os
import sys
import tempfile
import time

import numpy as np

from maxtext_rl_plugin.bench import common

PHASES = ("rollout", "reward", "logps", "update", "sync")
LOGPS_ARGS = ("prompt_tokens", "completion_tokens")  # the first two parameters of every log-probs method timed


def _parse(argv):
  """The command line (see --help)."""
  p = common.ArgumentParser(prog="python -m maxtext_rl_plugin.bench step", description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/cpu_tiny.yml", help="base yml")
  p.add_argument("--steps", type=common.positive_int, default=4, help="measured (warm) steps per side")
  p.add_argument(
      "--warmup", type=common.non_negative_int, default=2, help="steps per run dropped from the medians (compilation)"
  )
  p.add_argument(
      "--rounds",
      type=common.positive_int,
      default=1,
      help="runs per side, in ABBA order (Tunix, plugin, plugin, Tunix..)",
  )
  p.add_argument(
      "--devices", type=common.positive_int, default=8, help="forced host devices on CPU (half trainer, half sampler)"
  )
  p.add_argument("--colocated", action="store_true", help="trainer and sampler share the devices (no weight sync)")
  p.add_argument("overrides", nargs="*", help="extra key=value config overrides (model size, batch, ...)")
  return p.parse_args(argv)


class StepClock:
  """Per-phase seconds of each step, a step ending when its weight sync returns (the same wrappers on both sides)."""

  def __init__(self):
    from maxtext_rl_plugin.run import state

    self.timer = state.PhaseTimer()
    self.steps: list[dict[str, float]] = []
    self._counts = collections.Counter()
    self._last_end = time.perf_counter()

  def _counted(self, phase: str, fn):
    """`fn` timed as `phase`, its calls counted (the FLOP count of a step multiplies per-call work by them)."""
    timed = self.timer.wrap(phase, fn)

    def call(*args, **kwargs):
      out = timed(*args, **kwargs)
      if phase == "rollout":
        self._counts["rows"] += len(out.tokens)
        self._counts["generated_tokens"] += sum(len(t) for t in out.tokens)
      elif phase == "logps":  # (prompt_tokens, completion_tokens, ...): the padded shape the forward computes
        prompt, completion = (args[i] if len(args) > i else kwargs[k] for i, k in enumerate(LOGPS_ARGS))
        rows, seq = prompt.shape[0], prompt.shape[1] + completion.shape[1]
        self._counts["logps_tokens"] += rows * seq
        self._counts["seq_len"] = seq
      return out

    return functools.wraps(fn)(call)

  def instrument(self, run) -> None:
    """Wrap the run's cluster methods and reward functions (in place: the learner shares the list)."""
    import jax
    from flax import nnx

    cluster, wrap = run.rl_cluster, self._counted

    def blocking(fn, wait=jax.block_until_ready):
      # JAX dispatches asynchronously: a phase ends when its results exist, not when its call returns, or its time
      # would be charged to whichever later phase first waits on it (in both loops alike).
      return functools.wraps(fn)(lambda *a, **k: wait(fn(*a, **k)))

    def update_done(_):
      jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))

    cluster.generate = wrap("rollout", cluster.generate)
    cluster.get_ref_per_token_logps = wrap("logps", blocking(cluster.get_ref_per_token_logps))
    cluster.get_old_per_token_logps = wrap("logps", blocking(cluster.get_old_per_token_logps))
    run.trainer_logps = wrap("logps", blocking(run.trainer_logps))
    cluster.update_actor = wrap("update", blocking(cluster.update_actor, update_done))
    run.reward_fns[:] = [wrap("reward", fn) for fn in run.reward_fns]
    # A step ends with its weight sync; colocated runs (the sampler shares the trainer's arrays) have none and end
    # with their update (one optimizer update per step unless rl.num_iterations > 1 or mini-batches are set).
    if run.learner.should_sync_weights:
      cluster.sync_weights = self._closing_step(wrap("sync", cluster.sync_weights))
    else:
      cluster.update_actor = self._closing_step(cluster.update_actor)

  def _closing_step(self, fn):
    """`fn`, after which the current step is recorded as ended."""

    def call(*args, **kwargs):
      out = fn(*args, **kwargs)
      now = time.perf_counter()
      phases = {p: 0.0 for p in PHASES} | self.timer.reset()
      phases["total"] = now - self._last_end
      phases["counts"] = dict(self._counts)
      self._counts = collections.Counter()
      self.steps.append(phases)
      self._last_end = now
      return out

    return call

  def start(self) -> None:
    """The first step starts now (after the build, which is not part of any step)."""
    self._last_end = time.perf_counter()


def median_step(rows: list[dict]) -> dict:
  """The median warm step (by total; the lower middle for an even count) with its phases and overhead = total - sum
  of its phases: one real step, so the parts add up (medians taken phase by phase need not, and can go negative)."""
  rows = sorted(rows, key=lambda r: r["total"])
  out = dict(rows[(len(rows) - 1) // 2])
  out["overhead"] = out["total"] - sum(out[p] for p in PHASES)
  out["steps"] = len(rows)
  return out


def step_flops(cfg, counts: dict) -> dict[str, float]:
  """FLOPs of one step's phases (`bench.peak`'s counts: 2 x matmul params per token and pass, plus attention):
  rollout = prefill of each row's padded prompt + decode of the tokens really generated; logps = one forward over each
  scored sequence at the padded shape it is computed at; update = forward + backward (3 passes) over every row at that
  shape, `rl.num_iterations` times (both loops feed each row that often)."""
  from maxtext_rl_plugin.bench import peak as bench_peak

  rows = counts.get("rows", 0)
  prompt = int(cfg.max_prefill_predict_length)
  seq = counts.get("seq_len", int(cfg.max_target_length))
  new = counts.get("generated_tokens", 0) / rows if rows else 0.0
  return {
      "rollout": bench_peak.train_flops(cfg, rows * prompt, prompt, passes=1)
      + bench_peak.decode_flops(cfg, rows, prompt, new),
      "logps": bench_peak.train_flops(cfg, counts.get("logps_tokens", 0), seq, passes=1),
      "update": bench_peak.train_flops(cfg, rows * seq * int(cfg.rl.num_iterations), seq, passes=3),
  }


def build(args, side: str, out_dir: str):
  """A fresh run (model, meshes, engine, learner) for one side, instrumented; returns (run, clock)."""
  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin.run import build as run_build

  split = [] if args.colocated else ["use_pathways=true", f"chips_per_vm={args.devices // 2}"]
  argv = [
      args.config,
      *split,
      f"base_output_directory={out_dir}",
      f"run_name={side}",
      f"num_batches={args.warmup + args.steps}",
      "enable_checkpointing=false",
      "num_test_batches=0",
      "eval_interval=0",
      "eval_before_training=false",
      "eval_after_training=false",
      "batch_size=4",
      "rl.num_generations=4",
      # The parity gate adds a trainer forward to the first step of the plugin's loop, which Tunix's loop has no
      # counterpart of: off, so both sides do the same work (its cost is the old-policy forward's, in `logps`).
      "rl.parity_check=off",
      *args.overrides,
  ]
  parsed = config_lib.parse(argv)
  run = run_build.build_run(parsed.hyperparameters(), parsed)
  run.metrics_file = os.path.join(out_dir, f"{side}.jsonl")
  clock = StepClock()
  clock.instrument(run)
  return run, clock


def tunix_dataset(run):
  """The batches the plugin's loop trains on, as Tunix's learner reads them: numpy columns (it `jax.tree.map`s
  `np.repeat` over a batch, so a Python list of strings would be read as one leaf per string), not yet repeated."""
  n = int(run.config.num_batches)
  for k in range(n):
    batch = run.train_split.batch(k, run.config.batch_size)
    yield {
        "prompts": np.array([e.prompt for e in batch]),
        "answer": np.array([e.answer for e in batch]),
        "question": np.array([e.question for e in batch]),
    }


def measure(args, out_dir: str) -> dict:
  """`--rounds` rounds of both loops, each run on its own fresh build, in ABBA order (Tunix then the plugin, then the
  plugin then Tunix, ...) so a drift of the shared host's speed weighs on both sides alike; each side's warm steps are
  pooled over its runs."""
  from maxtext_rl_plugin.run import loop as trainer
  from maxtext_rl_plugin.bench import peak as bench_peak

  peak = bench_peak.measure_backend_peak_flops()
  runs: dict[str, list[list[dict]]] = {"plugin": [], "tunix": []}
  for r in range(args.rounds):
    for side in ("tunix", "plugin") if r % 2 == 0 else ("plugin", "tunix"):
      run, clock = build(args, f"{side}{r}", out_dir)
      clock.start()
      if side == "tunix":
        run.learner.train(tunix_dataset(run))
      else:
        trainer.train(run)
      runs[side].append(clock.steps)
  warm = {side: [row for steps in lists for row in steps[args.warmup :]] for side, lists in runs.items()}
  plugin, tunix = median_step(warm["plugin"]), median_step(warm["tunix"])
  cfg = run.config
  for side in (plugin, tunix):
    side["flops"] = step_flops(cfg, side.pop("counts"))
  return {
      "peak": peak,
      "plugin": plugin,
      "tunix": tunix,
      "phase_medians": {
          side: {k: float(np.median([row[k] for row in rows])) for k in (*PHASES, "total")} for side, rows in warm.items()
      },
      "per_step": runs,
      "batch": f"{cfg.batch_size} prompts x {cfg.rl.num_generations} generations",
      "new_tokens": int(cfg.max_target_length) - int(cfg.max_prefill_predict_length),
      "model": f"{cfg.model_name} emb {cfg.emb_dim} x {cfg.num_decoder_layers} layers, vocab {cfg.vocab_size}",
      "engine": run.engine_name,
  }


def report(m: dict, args) -> dict:
  """Print the side-by-side table; return the final JSON record (ratios plugin / Tunix)."""
  plugin, tunix = m["plugin"], m["tunix"]
  rows = (*PHASES, "overhead", "total")
  print(f"warm GRPO step (the median of {plugin['steps']} steps after {args.warmup} compile steps), seconds")
  print(f"{'phase':<10}{'plugin':>10}{'Tunix':>10}{'plugin/Tunix':>14}")
  ratios = {}
  for k in rows:
    ratios[k] = plugin[k] / tunix[k] if tunix[k] > 0 else None
    print(f"{k:<10}{plugin[k]:>10.3f}{tunix[k]:>10.3f}{'' if ratios[k] is None else f'{ratios[k]:>14.2f}'}")
  return {
      "bench": "step",
      "comparison": (
          "plugin trainer.train vs Tunix 0.1.7 GrpoLearner.train on the same RLCluster build (same MaxText model and "
          f"weights, same '{m['engine']}' rollout engine, rewards, loss, weight sync), warm steps (compile excluded)"
      ),
      "model": m["model"],
      "batch": m["batch"],
      "new_tokens": m["new_tokens"],
      "devices": "colocated" if args.colocated else f"{args.devices // 2}+{args.devices // 2}",
      "warm_steps": plugin["steps"],
      "plugin_s": {k: round(plugin[k], 4) for k in rows},
      "tunix_s": {k: round(tunix[k], 4) for k in rows},
      "plugin_over_tunix": {k: None if v is None else round(v, 3) for k, v in ratios.items()},
      "plugin_overhead_fraction": round(plugin["overhead"] / plugin["total"], 4),
      "tunix_overhead_fraction": round(tunix["overhead"] / tunix["total"], 4),
      "phase_medians_plugin_over_tunix": {
          k: round(m["phase_medians"]["plugin"][k] / v, 3) if v > 0 else None
          for k, v in m["phase_medians"]["tunix"].items()
      },
      "per_step_s": {  # every step of every run, compile steps included, for spotting outliers in the medians
          side: [[{k: round(v, 3) for k, v in r.items() if k != "counts"} for r in steps] for steps in runs]
          for side, runs in m["per_step"].items()
      },
      **_roofline(m),
  }


def _roofline(m: dict) -> dict:
  """Achieved FLOP/s of the compute phases of each side's warm step, and their fraction of the in-run matmul peak."""
  peak = m["peak"]["peak_flops"]
  print(f"achieved FLOP/s (fraction of the in-run peak, {peak / 1e9:.1f} GFLOP/s)")
  out = {"peak_flops": round(peak), "flops": {}, "fraction_of_peak": {}}
  for name, side in (("plugin", m["plugin"]), ("tunix", m["tunix"])):
    out["flops"][name] = {p: round(f) for p, f in side["flops"].items()}
    frac = {p: f / side[p] / peak if side[p] > 0 else None for p, f in side["flops"].items()}
    out["fraction_of_peak"][name] = {p: None if v is None else round(v, 4) for p, v in frac.items()}
    print(
        f"  {name:<8}"
        + "".join(
            f"{p} {f / side[p] / 1e9:.2f} GFLOP/s ({frac[p]:.1%})  " for p, f in side["flops"].items() if side[p] > 0
        )
    )
  return out


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  if not args.colocated and (args.devices < 2 or args.devices % 2):
    print(f"error: --devices must be an even number >= 2, got {args.devices}", file=sys.stderr)
    return 2
  common.force_host_devices(args.devices)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  with tempfile.TemporaryDirectory(prefix="bench_step_") as out:
    measured = measure(args, out)
  print(common.finite_json(report(measured, args)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
