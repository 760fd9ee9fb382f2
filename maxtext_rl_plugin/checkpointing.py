"""Orbax checkpoints of an RL run: actor params, optimizer state, data position and RNG.

Layout follows MaxText: `<base_output_directory>/<run_name>/checkpoints/<step>/{params,opt_state,meta}`.
Orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-write (SIGKILL, preemption) leaves the previous complete step as the latest one; the
incomplete temporary directory is never picked up on restore.
"""

from __future__ import annotations

import os
from typing import Any

from absl import logging

from maxtext_rl_plugin.errors import CheckpointError


class RunCheckpointer:
  """Save/restore the pieces of RL state needed to resume with no repeated or skipped batch."""

  def __init__(self, directory: str, *, period: int, max_to_keep: int | None = None, enabled: bool = True,
               async_save: bool = False):
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    self.directory = os.path.abspath(directory)
    self.period = max(1, int(period))
    self.enabled = enabled
    self._ocp = ocp
    self._manager = None
    if enabled:
      os.makedirs(self.directory, exist_ok=True)
      self._manager = ocp.CheckpointManager(
          self.directory,
          item_names=("params", "opt_state", "meta"),
          options=ocp.CheckpointManagerOptions(
              max_to_keep=max_to_keep if max_to_keep and max_to_keep > 0 else None,
              create=True,
              enable_async_checkpointing=async_save,  # MaxText's async_checkpointing
              step_prefix=None,
          ),
      )

  def latest_step(self) -> int | None:
    return self._manager.latest_step() if self._manager else None

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps()) if self._manager else []

  def should_save(self, step: int, last_step: int) -> bool:
    return self.enabled and (step % self.period == 0 or step == last_step)

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
    if not self._manager:
      return
    ocp = self._ocp
    self._manager.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta),
        ),
        force=True,
    )
    self._manager.wait_until_finished()
    logging.info("saved checkpoint step %d to %s", step, self.directory)

  def restore(self, step: int, params_target: Any, opt_state_target: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Restore `step` into the shardings/dtypes of the targets (abstract or concrete trees)."""
    import jax  # pylint: disable=import-outside-toplevel

    ocp = self._ocp

    def abstract(tree):
      return jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
          if hasattr(x, "shape") else x,
          tree,
      )

    try:
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(
              params=ocp.args.StandardRestore(abstract(params_target)),
              opt_state=ocp.args.StandardRestore(abstract(opt_state_target)),
              meta=ocp.args.JsonRestore(),
          ),
      )
    except (ValueError, KeyError, FileNotFoundError) as e:
      raise CheckpointError(
          f"checkpoint {self.directory}/{step} does not match this model/optimizer "
          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
      ) from None
    return restored.params, restored.opt_state, dict(restored.meta)

  def close(self) -> None:
    if self._manager:
      self._manager.close()
