"""Resuming an RL run: checkpoint metadata, the newest restorable checkpoint, and the compatibility check.

A checkpoint holds params + optimizer state (Orbax, MaxText's layout) and metadata naming the data position: batch k
is a pure function of (data_shuffle_seed, k) and sampling randomness of (rollout_seed, step), so restoring step s and
training from batch s replays nothing and skips nothing. What a resume may not change (`run/meta.resume_invariants`:
the data position, the loss, the tokenizer, the weights' dtype, ...) refuses to resume instead, by the same rule the
first pass applies before any model is built.
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import logging
from flax import nnx

from maxtext_rl_plugin import checkpointing
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin import metrics as metrics_lib
from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.run import meta as run_meta
from maxtext_rl_plugin import tunix_compat
from maxtext_rl_plugin.checkpointing import RunCheckpointer
from maxtext_rl_plugin.errors import CheckpointError
from maxtext_rl_plugin.run.state import RLRun


def _check_resume_compatible(config, meta: dict, path: str) -> None:
  """The checkpoint restored against `run/meta.resume_invariants` (the first pass's rule, on the checkpoint that
  restores rather than the newest on disk)."""
  run_meta.check_resume_invariants(config, path, meta)


def _actor_state(rl_run: RLRun):
  trainer = rl_run.rl_cluster.actor_trainer
  return nnx.state(trainer.model, lora_lib.trainable(trainer.model)), nnx.state(trainer.optimizer)


def _restore_newest(rl_run: RLRun, ckpt) -> tuple[int, dict]:
  """Restore the newest checkpoint that restores; (0, {}) when there is none.

  A checkpoint that fails to restore while an older one restores is corrupt (a truncated array file, broken
  metadata): it is renamed `<step>.corrupt-<time>` (kept for inspection, never deleted; Orbax no longer lists it) and
  the run resumes from the older one. When none restores, nothing is renamed and the newest failure is the error
  (e.g. a checkpoint of a different model).
  """
  steps = sorted(ckpt.all_steps(), reverse=True)
  failures: list[tuple[int, str]] = []
  trainer = rl_run.rl_cluster.actor_trainer
  for step in steps:
    params, opt_state = _actor_state(rl_run)
    try:
      params, opt_state, meta = ckpt.restore(step, params, opt_state)
    except Exception as e:  # pylint: disable=broad-exception-caught  # any restore failure: try the next older one
      failures.append((step, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
      logging.warning("checkpoint %s/%d does not restore: %s", ckpt.directory, step, failures[-1][1])
      continue
    _check_resume_compatible(rl_run.config, meta, f"{ckpt.directory}/{step}")
    for bad, why in failures:
      kept = ckpt.set_aside(bad)
      if metrics_lib.is_writer():
        print(f"skipped checkpoint step {bad} (does not restore: {why}); kept as {kept}", flush=True)
    nnx.update(trainer.model, params)
    nnx.update(trainer.optimizer, opt_state)
    tunix_compat.set_trainer_steps(trainer, step * rl_run.plan.updates_per_step, rl_run.plan.trainer_calls_per_update)
    rl_run.rl_cluster.global_steps = step
    if rl_run.learner.should_sync_weights:
      rl_run.rl_cluster.sync_weights()
      rl_run.rl_cluster.global_steps = step
    return step, meta
  if failures:
    step, why = failures[0]
    raise CheckpointError(
        f"no checkpoint in {ckpt.directory} restores (newest, step {step}: {why}); " "use a new run_name to start over"
    )
  return 0, {}


def checkpointer(config, run_dir: str) -> RunCheckpointer:
  """The run's Orbax checkpointer on MaxText's keys (`checkpoint_dir`, default `<run>/checkpoints`)."""
  return RunCheckpointer(
      config.checkpoint_dir or os.path.join(run_dir, "checkpoints"),
      period=config.checkpoint_period,
      storage=checkpointing.Storage.from_config(config),
      max_to_keep=config.max_num_checkpoints_to_keep,
      enabled=config.enable_checkpointing,
      async_save=bool(config.async_checkpointing),
  )


def resume(rl_run: RLRun, ckpt: RunCheckpointer) -> tuple[int, dict]:
  """The step to continue after (0: a fresh start) and its checkpoint's metadata; the run's state restored to it.

  Every process joins the restore and agrees on the step. Process 0 then drops the records of later steps (and a torn
  last line) from `metrics_file` and `batches.jsonl`: those steps were trained and lost with the process, and are
  trained again, so every step appears once. A fresh start drops a failed attempt's records likewise.
  """
  start, meta = _restore_newest(rl_run, ckpt)  # every process joins the restore
  start = distributed.agree(start, "the checkpoint step to resume from")
  if metrics_lib.is_writer():
    notes = (
        [run_meta.schedule_change(rl_run.config, meta), *run_meta.update_changes(rl_run.config, meta)] if start else []
    )
    for note in notes:
      if note:
        print(note, flush=True)
    if not start:
      run_dir_lib.check_fresh_metrics_file(rl_run.metrics_file, rl_run.run_dir)
    for path in (rl_run.metrics_file, os.path.join(rl_run.run_dir, "batches.jsonl")):
      run_dir_lib.prune_jsonl(path, start if start else -1)
  return start, meta


def save(ckpt, rl_run: RLRun, step: int, summary: dict) -> None:
  """Checkpoint step `step`: the actor's trainable params, its optimizer state and the resume metadata."""
  params, opt_state = _actor_state(rl_run)
  extra = {"eval_before": summary["eval_before"], "next_prompt_position": rl_run.data_position}
  ckpt.save(step, params, opt_state, run_meta.checkpoint_meta(rl_run.config, step, extra))


def finished_summary(config, run_dir: str) -> dict[str, Any] | None:
  """The summary of a run that already trained every step (its summary.json and final checkpoint exist), else None."""
  path = os.path.join(run_dir, "summary.json")
  final = os.path.join(config.checkpoint_dir or os.path.join(run_dir, "checkpoints"), str(run_meta.total_steps(config)))
  if not (storage.isfile(path) and storage.isdir(final)):
    return None
  try:
    summary = json.loads(storage.read_text(path))
  except (OSError, ValueError):
    return None
  return summary if summary.get("total_steps") == run_meta.total_steps(config) else None
