r"""How one rollout batch becomes optimizer updates: iterations, mini-batches, micro-batches (the plan's sizes and
counts: `run/meta.UpdatePlan`, light, which the pre-check and the checkpoint metadata share; the rows of each here).

Sizes are counted in prompts, as MaxText's `batch_size` and Tunix's `RLTrainingConfig` count them; a prompt is
`G = rl.num_generations` contiguous rows of the rollout batch.

    B  = batch_size                 prompts sampled per RL step (one rollout batch)
    M  = rl.mini_batch_size         prompts per optimizer update (default B; verl's ppo_mini_batch_size)
    m  = train_micro_batch_size     prompts per forward/backward (default M); gradients of M/m micro-batches
                                    are averaged inside the update's one jitted step (accumulation.py)
    mu = rl.num_iterations          passes over the rollout batch (mu in the GRPO paper)

    updates per RL step = mu * B / M,   micro-steps per RL step = mu * B / m

The importance ratio pi_theta / pi_old needs the log-probs of the policy that sampled the batch. When a batch gets
exactly one update (mu = 1, M = B) they equal the current policy's and the loss uses the on-policy shortcut
(ratio == 1 in value, gradient of the surrogate unchanged); otherwise `needs_old_logps` is true and the step loop
computes them once, before the batch's first update.

Gradient accumulation equals the unsplit update when the loss aggregation is a mean of equal-sized per-row
(`sequence-mean-token-mean`, `sequence-mean`) terms: a mean of micro-batch means over
equal micro-batches is the batch mean. Under `token-mean` each micro-batch is normalised by its own token count
(as in Tunix and verl's default), which equals the unsplit loss only when micro-batches hold equal token counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from maxtext_rl_plugin.run.meta import UpdatePlan

__all__ = ["UpdatePlan", "micro_batches", "update_batches", "slice_rows", "strided_order"]


def slice_rows(example: Any, rows: slice | np.ndarray) -> Any:
  """The rows `rows` (a slice, or row indices in order) of a Tunix `TrainExample` (every array field's leading axis;
  None fields stay None)."""
  fields = {}
  for f in dataclasses.fields(example):
    v = getattr(example, f.name)
    if isinstance(v, (jax.Array, np.ndarray)) and v.ndim >= 1:
      v = v[rows]
    fields[f.name] = v
  return type(example)(**fields)


def micro_batches(example: Any, plan: UpdatePlan) -> list[Any]:
  """Every micro-batch of one RL step in training order (`plan.micro_steps_per_step` TrainExamples)."""
  return [slice_rows(example, s) for s in plan.micro_batch_rows()]


def strided_order(rows: int, steps: int) -> np.ndarray:
  """The row order of a mini-batch of `steps` contiguous micro-batches of `rows` rows each such that MaxText's strided
  split (`accumulation.split_micro_batches`: micro-batch i = rows i, i + steps, ...) gives back micro-batch i:
  position j * steps + i holds row i * rows + j."""
  return (np.arange(steps)[None, :] * rows + np.arange(rows)[:, None]).reshape(-1)


def update_batches(example: Any, plan: UpdatePlan) -> list[Any]:
  """The TrainExamples Tunix's trainer consumes for one RL step: one per optimizer update (`plan.updates_per_step`),
  each the mini-batch whose `plan.accumulation_steps` micro-batches the jitted step accumulates
  (accumulation.train_step), its rows ordered for the strided split (`strided_order`)."""
  k = plan.accumulation_steps
  micro_rows = plan.micro_batch_size * plan.num_generations
  starts = [s.start for s in plan.micro_batch_rows()][::k]
  blocks = [slice_rows(example, slice(start, start + k * micro_rows)) for start in starts]
  return blocks if k == 1 else [slice_rows(b, strided_order(micro_rows, k)) for b in blocks]
