"""One RL step: take a sampled batch, score it, update the actor, install the new weights, audit, report.

batch(step) -> experience.sample     (rollout, rewards, advantages; async_rollout.RolloutProducer samples it
                                      inline, or up to rl.off_policy_steps steps ahead in its thread)
            -> experience.score      (ref and old-policy log-probs, importance weights, at the trainer)
            -> rl_cluster.update_actor (mu * batch_size / mini_batch_size optimizer updates, each over
                                      mini/micro micro-batches: updates.py)
            -> producer.publish      (the new weights reach the sampler: rl_cluster.sync_weights when
                                      disaggregated; the rollout engine reshards)
            -> batches.jsonl audit, the step's metrics record
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any

from absl import logging
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib

from maxtext_rl_plugin import dynamic_sampling
from maxtext_rl_plugin import experience
from maxtext_rl_plugin import rewards as rewards_lib
from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin import tunix_compat
from maxtext_rl_plugin import updates
from maxtext_rl_plugin.run.state import PhaseTimer, RLRun


def _step_inputs(rl_run: RLRun, step: int) -> tuple[dict, list]:
  """Batch `step - 1` as Tunix inputs: each prompt, answer and question repeated num_generations times."""
  config = rl_run.config
  # Batch k (0-based) is a pure function of (seed, k): resuming at step s replays nothing and skips nothing.
  batch = rl_run.train_split.batch(step - 1, config.batch_size)
  return dynamic_sampling.inputs_of(batch, config.rl.num_generations), batch


def seed_rollout(rl_run: RLRun, step: int) -> None:
  """Sampling randomness is a function of (rollout_seed, step), so a resumed run samples what an
  uninterrupted one would have (the RNG part of the resume state)."""
  rc = rl_run.rl_cluster.cluster_config.rollout_config[rl_cluster_lib.Mode.TRAIN]
  rc.seed = (int(rl_run.config.rollout_seed) * 1_000_003 + step) % (2**31 - 1)


def sample_batch(rl_run: RLRun, index: int, phases: dict[str, float]) -> tuple[list, dict, Any]:
  """Batch `index` (trained at step index + 1) sampled by the sampler's current weights: the rollout producer's
  `sample_fn` (async_rollout.py; in its thread when rollouts run ahead)."""
  step = index + 1
  seed_rollout(rl_run, step)
  inputs, batch = _step_inputs(rl_run, step)
  timer = PhaseTimer()
  sampled = experience.sample(rl_run, inputs, rl_run.plan, timer)
  phases.update(timer.reset())
  return batch, inputs, sampled


def _install_weights(rl_run: RLRun, snapshot: bool) -> None:
  """The trainer's current weights become the sampler's (after a step's updates): a weight sync when the engine has
  its own copy, else (shared arrays) a snapshot when rollouts run ahead."""
  if rl_run.learner.should_sync_weights:
    rl_run.rl_cluster.sync_weights()
  else:
    rl_run.rl_cluster.global_steps += 1
    if snapshot:
      rl_run.rl_cluster.rollout.snapshot_weights()


def _audit_batch(run_dir: str, step: int, batch) -> None:
  """Append which examples step `step` trained on to `<run>/batches.jsonl` (resume audit trail)."""
  path = os.path.join(run_dir, "batches.jsonl")
  try:
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"step": step, "ids": [e.id for e in batch]}) + "\n")
  except OSError as e:
    raise run_dir_lib.OutputError(run_dir_lib.describe_os_error(e, path)) from None


# Tunix trainer scalars (mean over the step's optimizer updates) -> the plugin's metric names.
_TUNIX_RENAMES = {
    "loss": "loss",
    "kl": "kl",
    "pg_clipfrac": "clip_fraction",
    "grad_norm": "grad_norm",
    "entropy": "entropy",
    "ratio_mean": "ratio_mean",
}


def _step_metrics(
    rl_run: RLRun, exp, item, answers: list, phases: dict[str, float], step: int, step_seconds: float, wait_sync_s: float
) -> dict[str, float]:
  """One step's record: rewards per function, accuracy, completion lengths, Tunix's loss metrics, phase timings."""
  values = item.value[2].reward_values
  m: dict[str, float] = {}
  for name, vals in values.items():
    arr = np.asarray(vals, dtype=np.float64)
    m[f"reward/{name}/mean"] = float(arr.mean())
    m[f"reward/{name}/std"] = float(arr.std())
  m["reward/mean"] = float(exp.rewards.mean())
  m["reward/std"] = float(exp.rewards.std())
  # Groups of this trained batch with all-equal rewards: zero advantage, no gradient (what rl.dynamic_sampling drops).
  informative = dynamic_sampling.informative_groups(exp.rewards, int(rl_run.config.rl.num_generations))
  m["reward/zero_variance_group_fraction"] = float(1.0 - informative.mean())
  # The check_answer reward's own grading (rewards memoise the last batch): no second pass.
  graded = rewards_lib.score_batch(exp.texts, answers, rl_run.config)
  m["accuracy"] = float(np.mean([r.correct for r in graded]))
  m["strict_accuracy"] = float(np.mean([r.correct and r.format_ok for r in graded]))
  mask = item.value[2].completion_ids != item.value[2].pad_id  # every completion (the loss mask may drop some)
  lengths = mask.sum(axis=-1)
  m["completion/length_mean"] = float(lengths.mean())
  m["completion/length_max"] = float(lengths.max())
  m["completion/stopped_fraction"] = float(np.mean(lengths < mask.shape[-1]))
  tunix = rl_run.tee.drain()
  for k, v in tunix.items():
    if not k.startswith("actor/train/"):
      continue
    name = k.split("/")[-1]
    m[_TUNIX_RENAMES.get(name, "train/" + name)] = v
  m.update(exp.metrics)
  updates_done, _ = tunix_compat.trainer_steps(rl_run.rl_cluster.actor_trainer)
  m["opt/updates"] = float(updates_done)
  for phase in ("rollout", "reward", "logps", "train", "weight_sync"):
    m[f"time/{phase}_s"] = phases.get(phase, 0.0)
  m["perf/step_s"] = step_seconds
  # async_rollout.py: weight versions between the batch's sampler and the trainer (<= rl.off_policy_steps), and the
  # seconds each side waited for the other.
  m["async/policy_lag"] = float(step - 1 - item.version)
  m["async/wait_rollout_s"] = item.wait_s
  m["async/wait_sync_s"] = wait_sync_s
  m["async/producer_idle_s"] = item.idle_s
  rollout_s = phases.get("rollout", 0.0)
  if rollout_s > 0:
    m["perf/tokens_per_s"] = float(lengths.sum()) / rollout_s
  return m


def train_step(rl_run: RLRun, producer, step: int, snapshot: bool, audit: bool) -> dict[str, float]:
  """RL step `step` (batch `step - 1`): GRPO's step as the loop sees it; returns the step's metrics record."""
  t_step = time.perf_counter()
  rl_run.timer.reset()
  item = producer.take(step - 1)  # sampled inline, or earlier in the producer's thread (rl.off_policy_steps > 0)
  batch, inputs, sampled = item.value
  rl_run.data_position = dynamic_sampling.next_position(sampled, step, rl_run.config.batch_size)
  exp = experience.score(rl_run, sampled, rl_run.plan, rl_run.timer)
  t = time.perf_counter()
  rl_run.rl_cluster.update_actor(updates.micro_batches(exp.example, rl_run.plan), None, skip_jit=False)
  # Tunix defers writing an update's metrics by one update (to overlap I/O); flush so this step's are this step's.
  tunix_compat.flush_train_metrics(rl_run.rl_cluster.actor_trainer)
  rl_run.timer.add("train", time.perf_counter() - t)
  t = time.perf_counter()
  wait_sync = producer.publish(step, functools.partial(_install_weights, rl_run, snapshot))
  rl_run.timer.add("weight_sync", time.perf_counter() - t - wait_sync)
  if audit:  # after the update: the audit never names a step that did not train
    _audit_batch(rl_run.run_dir, step, batch)
  phases = rl_run.timer.reset()
  for phase, seconds in item.phases.items():  # the batch's sampling (async: overlapped with an earlier step)
    phases[phase] = phases.get(phase, 0.0) + seconds
  metrics = _step_metrics(rl_run, exp, item, inputs["answer"], phases, step, time.perf_counter() - t_step, wait_sync)
  if not all(math.isfinite(v) for v in metrics.values()):
    logging.warning("non-finite metrics at step %d: %s", step, {k: v for k, v in metrics.items() if not math.isfinite(v)})
  return metrics
