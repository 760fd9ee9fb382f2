"""One RL step: take a sampled batch, score it, update the actor, install the new weights, audit, report.

batch(step) -> experience.sample     (rollout, rewards, advantages; async_rollout.RolloutProducer samples it
                                      inline, or up to rl.off_policy_steps steps ahead in its thread)
            -> experience.score      (ref and old-policy log-probs, importance weights, at the trainer)
            -> rl_cluster.update_actor (mu * batch_size / mini_batch_size optimizer updates, each over
                                      mini/micro micro-batches: run/updates.py)
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

from maxtext_rl_plugin.algorithms import packing
from maxtext_rl_plugin.algorithms import reward_aggregation
from maxtext_rl_plugin.run import dynamic_sampling
from maxtext_rl_plugin.run import experience
from maxtext_rl_plugin.run import logps
from maxtext_rl_plugin.run import parity
from maxtext_rl_plugin import metrics as metrics_lib
from maxtext_rl_plugin import rewards as rewards_lib
from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin import storage
from maxtext_rl_plugin import tunix_compat
from maxtext_rl_plugin.run import updates
from maxtext_rl_plugin.errors import UserError
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
  `sample_fn` (run/async_rollout.py; in its thread when rollouts run ahead)."""
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
    storage.append_text(path, json.dumps({"step": step, "ids": [e.id for e in batch]}) + "\n")
  except OSError as e:  # storage.StorageError in a bucket
    raise run_dir_lib.OutputError(storage.describe_error(e, path)) from None


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
  g = int(rl_run.config.rl.num_generations)
  # Each reward's mean, std and the fraction of groups in which it alone does not vary (algorithms/reward_aggregation).
  m: dict[str, float] = reward_aggregation.per_reward_metrics(values, g)
  m["reward/mean"] = float(exp.rewards.mean())
  m["reward/std"] = float(exp.rewards.std())
  # Groups of this trained batch that carry no signal (what rl.dynamic_sampling drops): all-equal weighted totals, or
  # under rl.reward_aggregation=gdpo no weighted reward varying.
  informative = reward_aggregation.kept_groups_of(rl_run.config.rl, exp.rewards, values, g)
  m["reward/zero_variance_group_fraction"] = float(1.0 - informative.mean())
  # The check_answer reward's own grading (rewards memoise the last batch): no second pass.
  graded = rewards_lib.score_batch(exp.texts, answers, rewards_lib.RewardConfig.of(rl_run.config))
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
  # run/async_rollout.py: weight versions between the batch's sampler and the trainer (<= rl.off_policy_steps), and the
  # seconds each side waited for the other.
  m["async/policy_lag"] = float(step - 1 - item.version)
  m["async/wait_rollout_s"] = item.wait_s
  m["async/wait_sync_s"] = wait_sync_s
  m["async/producer_idle_s"] = item.idle_s
  rollout_s = phases.get("rollout", 0.0)
  if rollout_s > 0:
    m["perf/tokens_per_s"] = float(lengths.sum()) / rollout_s
  return m


class NonFiniteError(UserError):
  """A step's advantages, loss or gradient norm is not finite: the run stops before the update is synced or saved."""


def check_batch(step: int, sampled: Any, num_generations: int) -> None:
  """Before the update: every reward, group statistic and advantage of the batch is finite (host arrays: no device
  sync). Rewards are float32; values within its range whose spread is not (3e38 and -3e38 in one group) overflow the
  group's standard deviation, and the advantages come out 0 (no gradient) or NaN."""
  with np.errstate(all="ignore"):
    groups = np.asarray(sampled.rewards, np.float32).reshape(-1, int(num_generations))
    std = groups.std(axis=1)
  bad = np.flatnonzero(~np.isfinite(std))
  if bad.size:
    k = int(bad[0])
    raise NonFiniteError(
        f"step {step}: the rewards of group {k} ({_few(groups[k], 0)}) spread beyond float32 (their standard deviation "
        "overflows); stopped before the update was applied or saved: keep rewards a few units wide (GRPO normalises "
        "them)"
    )
  for name, values in (("reward", sampled.rewards), ("advantage", sampled.advantages)):
    arr = np.asarray(values, np.float64)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
      i = int(bad[0])
      raise NonFiniteError(
          f"step {step}: the {name} of completion {i} is {arr[i]} (rewards {_few(sampled.rewards, i)} of its batch); "
          "stopped before the update was applied or saved: keep rewards a few units wide (GRPO normalises them)"
      )


def _few(values: Any, i: int) -> str:
  arr = np.asarray(values, np.float64).reshape(-1)
  return "[" + ", ".join(f"{v:g}" for v in arr[max(0, i - 2) : i + 3]) + "]"


_UPDATE_SCALARS = ("actor/train/loss", "actor/train/grad_norm")


def check_update(step: int, logged: dict[str, float]) -> None:
  """After the step's updates, before their weights are synced to the sampler, audited or saved: the loss and the
  gradient norm Tunix logged (already host floats: the step's metrics read them anyway, no extra sync) are finite."""
  bad = {k.rsplit("/", 1)[1]: v for k, v in logged.items() if k in _UPDATE_SCALARS and not math.isfinite(v)}
  if bad:
    shown = ", ".join(f"{k} {v}" for k, v in bad.items())
    raise NonFiniteError(
        f"step {step}: the update's {shown}; stopped before the step's weights were synced or saved (the last "
        "checkpoint stands): lower learning_rate or set gradient_clipping_threshold, and check the rewards"
    )


class LearningSignal:
  """One console line when a step trains on nothing (every group's rewards equal: zero advantage) or dynamic sampling
  ran out of refill rounds: the metrics say it (`reward/zero_variance_group_fraction`,
  `dynamic_sampling/short_groups`), and the console says it too: the former on its first step, then at most once per
  10 * log_period steps (a random-init model's rewards are all zero for a while: one line, not one per step)."""

  def __init__(self, log_period: int):
    self.period = 10 * max(1, int(log_period))
    self.nothing = 0  # steps that trained on nothing so far
    self._said_at = -(10**9)

  def note(self, step: int, metrics: dict[str, float], batch_size: int) -> str | None:
    """The console line for step `step`'s metrics record, or None."""
    short = int(metrics.get("dynamic_sampling/short_groups", 0))
    nothing = metrics.get("reward/zero_variance_group_fraction", 0.0) >= 1.0
    self.nothing += nothing
    if short:
      rounds = int(metrics.get("dynamic_sampling/refill_rounds", 0))
      trained = "nothing (a zero update)" if nothing else f"the {batch_size - short} it found"
      return (
          f"note: step {step}: dynamic sampling found {batch_size - short} informative group(s) of {batch_size} after "
          f"{rounds} refill round(s) (rl.max_refill_rounds is spent); {short} slot(s) are masked out and the step "
          f"trains on {trained}"
      )
    if nothing and step - self._said_at >= self.period:
      self._said_at = step
      return (
          f"note: step {step} trains on nothing: every group's completions got equal rewards (zero advantage; "
          f"{self.nothing} such step(s) so far); rl.dynamic_sampling=true samples more prompts instead"
      )
    return None


def train_step(rl_run: RLRun, producer, step: int, snapshot: bool, audit: bool) -> dict[str, float]:
  """RL step `step` (batch `step - 1`): GRPO's step as the loop sees it; returns the step's metrics record."""
  t_step = time.perf_counter()
  rl_run.timer.reset()
  item = producer.take(step - 1)  # sampled inline, or earlier in the producer's thread (rl.off_policy_steps > 0)
  batch, inputs, sampled = item.value
  check_batch(step, sampled, rl_run.config.rl.num_generations)
  rl_run.data_position = dynamic_sampling.next_position(sampled, step, rl_run.config.batch_size)
  # The parity gate (run/parity.py): the launch's first step (after a resume too) and every N-th, when the batch was
  # sampled by the trainer's current weights (policy lag 0).
  gate = step if parity.due(rl_run.config, step, producer.start) and item.version == step - 1 else None
  exp = experience.score(rl_run, sampled, rl_run.plan, rl_run.timer, parity_step=gate)
  with rl_run.timer.phase("train"):
    batches = updates.update_batches(exp.example, rl_run.plan)
    if rl_run.trainer_logps.row_tokens > 0:  # max_seq_token_per_tpu: each update's forward on packed rows
      batches, fill = packing.pack_update_batches(
          batches,
          sampled.pad_id,
          rl_run.trainer_logps.row_tokens,
          rl_run.plan.accumulation_steps,
          logps.put_rows(rl_run.rl_cluster),
          iterations=rl_run.plan.num_iterations,
      )
      exp.metrics.update(fill)
    rl_run.rl_cluster.update_actor(batches, None, skip_jit=False)
    # Tunix defers writing an update's metrics by one update (to overlap I/O); flush so this step's are this step's.
    tunix_compat.flush_train_metrics(rl_run.rl_cluster.actor_trainer)
    check_update(step, rl_run.tee.latest())
  with rl_run.timer.phase("weight_sync") as sync:
    wait_sync = sync.waited = producer.publish(step, functools.partial(_install_weights, rl_run, snapshot))
  if audit:  # after the update: the audit never names a step that did not train
    _audit_batch(rl_run.run_dir, step, batch)
  phases = rl_run.timer.reset()
  for phase, seconds in item.phases.items():  # the batch's sampling (async: overlapped with an earlier step)
    phases[phase] = phases.get(phase, 0.0) + seconds
  metrics = _step_metrics(rl_run, exp, item, inputs["answer"], phases, step, time.perf_counter() - t_step, wait_sync)
  bad = {k: v for k, v in metrics.items() if not math.isfinite(v) and not metrics_lib.is_empty_extreme(k, v)}
  if bad:  # the min/max of no token is left out of the record with a note (metrics.py), not a fault
    logging.warning("non-finite metrics at step %d: %s", step, bad)
  return metrics
