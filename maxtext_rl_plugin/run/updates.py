r"""How one rollout batch becomes optimizer updates: iterations, mini-batches, micro-batches.

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
from typing import Any, Iterator

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """The update schedule of one RL step (all sizes in prompts)."""

  batch_size: int
  mini_batch_size: int
  micro_batch_size: int
  num_iterations: int
  num_generations: int
  force_on_policy_ratio: bool = False
  off_policy_steps: int = 0  # rl.off_policy_steps: batches may be sampled by weights this many RL steps old
  use_rollout_logps: bool = False

  @classmethod
  def from_config(cls, config: Any) -> "UpdatePlan":
    """The plan of `config`'s batch, mini-batch, micro-batch and iteration sizes."""
    b = int(config.batch_size)
    mini = config.rl.mini_batch_size
    mini = b if mini is None or int(mini) <= 0 else int(mini)
    micro = int(config.train_micro_batch_size)
    micro = mini if micro <= 0 else micro
    plan = cls(
        b,
        mini,
        micro,
        int(config.rl.num_iterations),
        int(config.rl.num_generations),
        bool(config.rl.force_on_policy_ratio),
        int(config.rl.off_policy_steps),
        bool(config.rl.use_rollout_logps),
    )
    plan.check()
    return plan

  def check(self) -> None:
    """Divisibility (also validated with one-line errors when the config loads); a programming error here."""
    if self.batch_size % self.mini_batch_size or self.mini_batch_size % self.micro_batch_size:
      raise ValueError(f"inconsistent update plan {self}")

  @property
  def mini_batches_per_iteration(self) -> int:
    return self.batch_size // self.mini_batch_size

  @property
  def updates_per_step(self) -> int:
    return self.num_iterations * self.mini_batches_per_iteration

  @property
  def accumulation_steps(self) -> int:
    """Micro-batches per optimizer update (MaxText's gradient_accumulation_steps), accumulated inside the update's one
    jitted step (accumulation.py)."""
    return self.mini_batch_size // self.micro_batch_size

  @property
  def micro_steps_per_step(self) -> int:
    return self.updates_per_step * self.accumulation_steps

  @property
  def trainer_calls_per_update(self) -> int:
    """Calls of Tunix's train step per optimizer update: 1, the micro-batches are accumulated inside it
    (accumulation.py; Tunix's own `gradient_accumulation_steps` stays unset, so it counts one micro-step per update)."""
    return 1

  @property
  def needs_old_logps(self) -> bool:
    """Whether the loss needs old-policy log-probs: any update after the first sees moved weights; and a stale batch
    (`off_policy_steps` > 0) whose PPO ratio is taken against the behaviour policy (`use_rollout_logps`)."""
    stale_ratio = self.off_policy_steps > 0 and self.use_rollout_logps
    return (self.updates_per_step > 1 or stale_ratio) and not self.force_on_policy_ratio

  def micro_batch_rows(self) -> Iterator[slice]:
    """Row slices (rows = prompts x G) of the micro-batches of one RL step, in training order.

    Every iteration walks the batch in the same order: rows are contiguous prompt groups, so a mini-batch holds
    whole groups and group-normalised advantages stay as computed over the full group.
    """
    rows = self.micro_batch_size * self.num_generations
    n = self.batch_size * self.num_generations
    for _ in range(self.num_iterations):
      for start in range(0, n, rows):
        yield slice(start, start + rows)


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
