"""The RL loop: MaxText models on Tunix's RLCluster + GrpoLearner, driven step by step by the plugin.

Tunix owns the model plumbing (actor trainer with the plugin's policy loss, reference, rollout engine, trainer ->
sampler weight sync). The plugin drives the outer loop itself instead of calling `GrpoLearner.train()`, because a
production run needs what that loop does not give: a data position that resumes with no repeated or skipped batch,
Orbax checkpoints of params + optimizer + data position + RNG in MaxText's layout, greedy/pass@k eval on MaxText's
`eval_interval`, per-phase timings, and one metrics stream (TensorBoard, `metrics_file`, console).

The rooms of a run (docs/architecture.md): `run/build.py` builds it once, `run/resume.py` restores and saves its
state, `run/step.py` is one RL step (sample, score, update, install, audit, metrics), this module is the loop around
the steps (eval and checkpoint cadence, signals, profiling) and `run`, the entry point; `run/summary.py` the end of it.
"""

from __future__ import annotations

import functools
import os
import signal as signal_lib
from typing import Any

from absl import logging
import jax
from tunix.rl import rl_cluster as rl_cluster_lib

from maxtext_rl_plugin.run import async_rollout
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import dynamic_sampling
from maxtext_rl_plugin.run import evaluation as evaluation_lib
from maxtext_rl_plugin import metrics as metrics_lib
from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin.run import meta as run_meta
from maxtext_rl_plugin import signals
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.run import summary as summary_lib
from maxtext_rl_plugin.run import build
from maxtext_rl_plugin.run import resume
from maxtext_rl_plugin.run import state
from maxtext_rl_plugin.run import step as step_lib


class StepProfiler:
  """MaxText's `profiler=xplane`: a JAX trace of RL steps skip+1 .. skip+profiler_steps (rollout, update and sync
  together, not only Tunix's train micro-steps), written under `tensorboard_dir` for TensorBoard's profile tab."""

  def __init__(self, config):
    self.enabled = str(config.profiler) in ("xplane", "ProfilerType.XPLANE")
    self.first = int(config.skip_first_n_steps_for_profiler) + 1
    self.last = self.first + max(1, int(config.profiler_steps)) - 1
    self.log_dir = config.tensorboard_dir
    self.active = False

  def before_step(self, step: int) -> None:
    if self.enabled and step == self.first and not self.active:
      jax.profiler.start_trace(self.log_dir)
      self.active = True
      logging.info("profiling RL steps %d..%d into %s", self.first, self.last, self.log_dir)

  def after_step(self, step: int, force: bool = False) -> None:
    if self.active and (step >= self.last or force):
      jax.profiler.stop_trace()
      self.active = False


def train(rl_run: state.RLRun, stop: signals.GracefulStop | None = None) -> dict[str, Any]:
  """Run (or resume) the RL loop; returns a summary dict (eval before/after, history)."""
  config = rl_run.config
  stop = stop or signals.GracefulStop()
  total = run_meta.total_steps(config)
  ckpt = resume.checkpointer(config, rl_run.run_dir)
  start, meta = resume.resume(rl_run, ckpt)
  out_logger = metrics_lib.RunLogger(
      config.tensorboard_dir, rl_run.metrics_file, total, start, log_period=max(1, int(config.log_period))
  )
  summary: dict[str, Any] = {
      "run_dir": rl_run.run_dir,
      "start_step": start,
      "total_steps": total,
      "eval_before": meta.get("eval_before"),
      "eval_after": None,
      "eval_history": [],
      "eval_sampling": f"{config.eval_sampling_strategy}, {config.num_eval_passes} pass(es)",
  }
  _announce(rl_run, out_logger, start, total)
  if start == 0 and config.eval_before_training and config.num_test_batches > 0:
    summary["eval_before"] = evaluation_lib.evaluate(rl_run, 0)
    rl_run.timer.reset()
    out_logger.log_eval(0, summary["eval_before"], "eval before RL")

  profiler = StepProfiler(config)
  # Rollouts run up to rl.off_policy_steps batches ahead of the updates (0: sampled inline, the synchronous step).
  position = dynamic_sampling.start_position(config, start, meta)  # prompts consumed so far (refills included)
  sample_fn = dynamic_sampling.sample_fn(
      rl_run, position, functools.partial(step_lib.sample_batch, rl_run), step_lib.seed_rollout
  )
  producer = async_rollout.RolloutProducer(
      sample_fn,
      off_policy_steps=int(config.rl.off_policy_steps),
      start=start,
      end=total,
      # Several processes: the producer's cross-process steps are run by this thread (run/async_rollout.py).
      hand_over=distributed.is_multiprocess(),
  )
  snapshot = producer.asynchronous and not rl_run.learner.should_sync_weights
  if snapshot:  # colocated: the producer samples a pinned version while the trainer updates the shared arrays
    rl_run.rl_cluster.rollout.snapshot_weights()
  if producer.asynchronous:
    out_logger.note(
        f"rollouts run up to rl.off_policy_steps={producer.k} step(s) ahead of the trainer "
        f"(staleness corrected by {_staleness_correction(config)})"
    )
  stop.in_loop = True
  producer.start_producing()
  signal_note = step_lib.LearningSignal(config.log_period)
  try:
    saved = True  # the start step is a checkpoint (or nothing trained yet)
    for step in range(start + 1, total + 1):
      profiler.before_step(step)
      try:
        metrics = step_lib.train_step(rl_run, producer, step, snapshot, audit=out_logger.writer)
      except signals.StopSampling:  # a stop during the batch's refill rounds: step - 1 is the last complete step
        profiler.after_step(step - 1, force=True)
        out_logger.close()
        _stop(rl_run, producer, ckpt, summary, step - 1, total, saved or step - 1 == start, stop.requested)
      profiler.after_step(step)
      out_logger.log_step(step, metrics)
      note = signal_note.note(step, metrics, int(config.batch_size))
      if note:
        out_logger.note(note)
      if evaluation_lib.should_evaluate(config, step, total):
        with producer.engine():
          ev = evaluation_lib.evaluate(rl_run, step)
        rl_run.timer.reset()
        summary["eval_history"].append({"step": step, **ev})
        out_logger.log_eval(step, ev, "eval")
      saved = ckpt.should_save(step, total)
      if saved:
        resume.save(ckpt, rl_run, step, summary)
      if stop.requested is not None and step < total:
        profiler.after_step(step, force=True)
        out_logger.close()
        _stop(rl_run, producer, ckpt, summary, step, total, saved, stop.requested)
  finally:
    producer.close()
  if snapshot:
    rl_run.rl_cluster.rollout.release_snapshot()
  stop.in_loop = False
  profiler.after_step(total, force=True)

  if config.eval_after_training and config.num_test_batches > 0 and total > start:
    summary["eval_after"] = evaluation_lib.evaluate(rl_run, total)
    out_logger.log_eval(total, summary["eval_after"], "eval after RL")
  if rl_run.weight_sync is not None:
    summary["weight_syncs"] = {
        "count": rl_run.weight_sync.num_syncs,
        "verified": rl_run.weight_sync.num_verified,
        "last_seconds": rl_run.weight_sync.last_seconds,
        "last_bytes": rl_run.weight_sync.last_bytes,
    }
    out_logger.note(
        f"weight syncs: {rl_run.weight_sync.num_syncs}, verified bit-exact: {rl_run.weight_sync.num_verified}"
    )
  out_logger.close()
  summary["history"] = summary_lib.read_history(rl_run.metrics_file) or out_logger.history
  summary["tensorboard_dir"] = out_logger.tensorboard_dir
  summary["metrics_file"] = rl_run.metrics_file
  ckpt.close()
  rl_run.rl_cluster.close()
  return summary


def _announce(rl_run: state.RLRun, out_logger: metrics_lib.RunLogger, start: int, total: int) -> None:
  """The run's opening lines: what it starts or resumes, its update plan, its device split."""
  config, plan = rl_run.config, rl_run.plan
  if start:
    out_logger.note(f"resuming {rl_run.run_dir} from checkpoint step {start} (next batch index {start})")
  else:
    out_logger.note(
        f"starting {rl_run.run_dir}: {total} RL steps of {config.rl.loss_algo}, batch {config.batch_size} x "
        f"{config.rl.num_generations} generations, rollout engine '{rl_run.engine_name}'"
    )
  out_logger.note(
      f"updates: {plan.updates_per_step} optimizer update(s) per RL step (rl.num_iterations={plan.num_iterations}, "
      f"mini-batch {plan.mini_batch_size} prompts), {plan.accumulation_steps} micro-batch(es) of "
      f"{plan.micro_batch_size} prompts each; old-policy log-probs: "
      + (
          "not needed (on-policy)"
          if not plan.needs_old_logps
          else ("sampler (rl.use_rollout_logps)" if config.rl.use_rollout_logps else "trainer forward")
      )
  )
  rs = rl_run.setup
  sync = rl_run.weight_sync
  out_logger.note(
      f"devices: trainer {len(rs.trainer_devices)}, sampler {len(rs.sampler_devices)} ("
      + (
          f"disaggregated; weight sync via {sync.path}, chunk_size={sync.chunk_size}, verify={sync.verify_policy})"
          if sync is not None
          else "colocated: the sampler shares the trainer's weights)"
      )
  )
  cluster = rl_run.rl_cluster.cluster_config
  rows_note = distributed.rows_note(
      plan.micro_batch_size * plan.num_generations,
      cluster.role_to_mesh[rl_cluster_lib.Role.ACTOR],
      cluster.training_config.data_sharding_axis,
  )
  if rows_note:
    out_logger.note(rows_note)


def _staleness_correction(config) -> str:
  if config.rl.rollout_is != "off":
    return f"rl.rollout_is={config.rl.rollout_is}, cap {config.rl.rollout_is_cap}"
  return "the PPO ratio against the behaviour policy (rl.use_rollout_logps)"


def _stop(rl_run, producer, ckpt, summary, step: int, total: int, saved: bool, signum: int) -> None:
  """Stop after complete step `step`: checkpoint it unless it is (or nothing trained), then one line, exit 128 + N."""
  producer.close()  # batches sampled ahead are dropped: a resume samples them again (run/async_rollout.py)
  if not saved and ckpt.enabled and step > 0:
    resume.save(ckpt, rl_run, step, summary)
  ckpt.close()
  if not ckpt.enabled:
    where = "nowhere (enable_checkpointing=false)"
  elif step > 0:
    where = f"checkpoint step {step} in {ckpt.directory}"
  else:
    where = "the start (no step was trained)"
  raise signals.Stopped(
      f"stopped by {signal_lib.Signals(signum).name} after step {step}/{total}; "
      f"resume from {where} by rerunning the same command",
      signum,
  )


def run(config, parsed: config_lib.Parsed) -> dict[str, Any]:
  """Entry point from `train_rl.main`, after its preflight (`run/meta.preflight`: inputs exist, outputs writable,
  no rerun that would rewrite a finished run or resume another model): lock the run directory, build, train (or
  resume), summarise. `parsed` is the config as parsed once (the device split derives MaxText's multislice configs)."""
  out_dir = os.path.join(config.base_output_directory, config.run_name)
  metrics_file = run_dir_lib.resolve_metrics_file(config.metrics_file, out_dir)
  writer = metrics_lib.is_writer()  # process 0 alone locks and writes the run's files
  finished = resume.finished_summary(config, out_dir)
  if finished is not None:  # a rerun of a finished run reports it and changes nothing
    if writer:
      print(
          f"{out_dir} already finished all {finished['total_steps']} RL steps; nothing to do "
          "(raise num_batches to train further, or use a new run_name)",
          flush=True,
      )
      print("\n" + summary_lib.table(finished), flush=True)
    return finished
  lock = run_dir_lib.RunLock(out_dir)
  if writer:
    lock.acquire()
    lock.start_heartbeat()  # a daemon thread: a step longer than the lock's stale_after_s never looks dead
  try:
    if writer:  # each output belongs to the run that first wrote it (run_dir.py, "Owner marks")
      run_dir_lib.claim(out_dir, out_dir, "run_name", is_dir=True)
      if metrics_file and not storage.within(metrics_file, out_dir):
        run_dir_lib.claim(metrics_file, out_dir, "metrics_file")
    with signals.GracefulStop() as stop:
      rl_run = build.build_run(config, parsed)
      rl_run.metrics_file = metrics_file
      rl_run.lock = lock
      summary = train(rl_run, stop)
    if writer:
      summary_lib.report(rl_run.config, summary)
      summary_lib.write_json(rl_run.run_dir, summary)
  finally:
    lock.release()
  return summary
