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

  def __init__(
      self, directory: str, *, period: int, max_to_keep: int | None = None, enabled: bool = True, async_save: bool = False
  ):
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

  def set_aside(self, step: int) -> str:
    """Rename a checkpoint that does not restore to `<step>.corrupt-<unix time>`: kept for inspection, never
    deleted, and no longer a step Orbax lists or overwrites. Returns the new path."""
    import time  # pylint: disable=import-outside-toplevel

    from maxtext_rl_plugin import distributed  # pylint: disable=import-outside-toplevel

    src = os.path.join(self.directory, str(step))
    # One name for every process (process 0's clock); process 0 alone renames, the others wait for it.
    dst = f"{src}.corrupt-{distributed.agree_from_writer(int(time.time()))}"
    if distributed.is_writer_process():
      os.rename(src, dst)
    distributed.barrier(f"set_aside_{step}")
    if self._manager is not None:
      self._manager.reload()
    return dst

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
    """Write `step`; a full disk or an unwritable directory is one line naming the path and the free space (the
    previous checkpoints are untouched: Orbax writes to a temporary directory and renames it when complete)."""
    if not self._manager:
      return
    try:
      self._save(step, params, opt_state, meta)
    except Exception as e:  # pylint: disable=broad-exception-caught  (Orbax wraps OSError in several types)
      cause = _os_error_in(e)
      if cause is None:
        raise
      from maxtext_rl_plugin import run_dir  # pylint: disable=import-outside-toplevel

      raise CheckpointError(
          f"checkpoint step {step} was not written: "
          f"{run_dir.describe_os_error(cause, self.directory)}; the run can resume from "
          f"step {self.latest_step()}"
      ) from None

  def _save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
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

    from maxtext_rl_plugin import distributed  # pylint: disable=import-outside-toplevel

    mesh = distributed.mesh_of(params_target)

    def abstract(tree):
      return jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=distributed.restore_sharding(x, mesh))
          if hasattr(x, "shape")
          else x,
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


def _os_error_in(e: BaseException) -> OSError | None:
  """The OSError (full disk, permissions) behind an exception, following __cause__/__context__ and the message."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno is not None:
      return e
    if "No space left on device" in str(e):
      import errno  # pylint: disable=import-outside-toplevel

      return OSError(errno.ENOSPC, "No space left on device")
    e = e.__cause__ or e.__context__
  return None
