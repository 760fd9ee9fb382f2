"""Orbax checkpoints of an RL run: actor params, optimizer state, data position and RNG.

Layout follows MaxText: `<base_output_directory>/<run_name>/checkpoints/<step>/{params,opt_state,meta}`.
Orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-write (SIGKILL, preemption) leaves the previous complete step as the latest one; the
incomplete temporary directory is never picked up on restore.

The storage format is MaxText's `OrbaxStorage` keys (`Storage`), with MaxText's meaning: its RL defaults
(`post_train/rl.yml`: no OCDBT, no zarr3, "for Pathways") are what every checkpoint of the plugin is written with unless
the user sets them. Restores read whatever format a step was written in (Orbax detects it per checkpoint).
"""

from __future__ import annotations

import dataclasses
import errno
import logging as std_logging
import os
import sys
import time
import traceback
from typing import Any

from absl import logging
import jax
import orbax.checkpoint as ocp

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import storage as storage_lib
from maxtext_rl_plugin.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Storage:
  """MaxText's `OrbaxStorage` keys as Orbax's PyTree handler takes them (MaxText's training_engine/checkpointing.py and
  checkpoint_context.py pass the same values). The defaults are MaxText's RL defaults (post_train/rl.yml over
  base.yml): plain (non-OCDBT) zarr2 arrays, which Pathways' persistence handler writes (pathwaysutils registers
  Orbax's CloudPathwaysArrayHandler, which refuses OCDBT) and Tunix's checkpoint manager forces under Pathways."""

  use_ocdbt: bool = False  # checkpoint_storage_use_ocdbt
  use_zarr3: bool = False  # checkpoint_storage_use_zarr3
  concurrent_gb: int | None = 96  # checkpoint_storage_concurrent_gb: write and read I/O budget
  device_host_concurrent_gb: int | None = 8  # checkpoint_storage_device_host_concurrent_gb: device->host budget
  target_data_file_size_bytes: int | None = 2 << 30  # checkpoint_storage_target_data_file_size_bytes (OCDBT files)

  @classmethod
  def from_config(cls, config) -> "Storage":
    return cls(
        use_ocdbt=bool(config.checkpoint_storage_use_ocdbt),
        use_zarr3=bool(config.checkpoint_storage_use_zarr3),
        concurrent_gb=config.checkpoint_storage_concurrent_gb,
        device_host_concurrent_gb=config.checkpoint_storage_device_host_concurrent_gb,
        target_data_file_size_bytes=config.checkpoint_storage_target_data_file_size_bytes,
    )

  def handler(self) -> ocp.PyTreeCheckpointHandler:
    """One item's handler (a fresh one per item: Orbax handlers keep per-item state)."""
    return ocp.PyTreeCheckpointHandler(
        use_ocdbt=self.use_ocdbt,
        use_zarr3=self.use_zarr3,
        save_concurrent_gb=self.concurrent_gb,
        restore_concurrent_gb=self.concurrent_gb,
        save_device_host_concurrent_gb=self.device_host_concurrent_gb,
    )


def open_manager(
    directory: str,
    item_names: tuple[str, ...],
    *,
    storage: Storage,
    max_to_keep: int | None = None,
    async_save: bool = False,
    create: bool = True,
) -> ocp.CheckpointManager:
  """The Orbax manager of every checkpoint this plugin writes or reads (the RL run's, the SFT warm start's, the
  adapters export_lora merges): numbered step directories with no prefix, MaxText's layout; `max_to_keep` None or
  <= 0 keeps every step. Array items are PyTrees written in `storage`'s format; an item named `meta` is JSON."""
  handlers = {name: ocp.JsonCheckpointHandler() if name == "meta" else storage.handler() for name in item_names}
  return ocp.CheckpointManager(
      directory,
      item_handlers=handlers,
      options=ocp.CheckpointManagerOptions(
          max_to_keep=max_to_keep if max_to_keep and max_to_keep > 0 else None,
          create=create,
          enable_async_checkpointing=async_save,  # MaxText's async_checkpointing
          step_prefix=None,
      ),
  )


def save_items(
    manager: ocp.CheckpointManager, step: int, trees: dict[str, Any], meta: dict[str, Any], *, storage: Storage
) -> None:
  """Write `step`: each of `trees` as a PyTree item and `meta` as JSON; returns once it is on disk. `storage` is the
  one `manager` was opened with (its OCDBT file size is a save argument, not a handler option)."""
  size = storage.target_data_file_size_bytes if storage.use_ocdbt else None
  items = {name: ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=size) for name, tree in trees.items()}
  manager.save(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta)), force=True)
  manager.wait_until_finished()


def restore_args(target: Any, mesh: jax.sharding.Mesh | None) -> ocp.args.PyTreeRestore:
  """Orbax's restore arguments of one PyTree item into the layout of `target` (abstract or concrete)."""
  abstract = abstract_tree(target, mesh)
  return ocp.args.PyTreeRestore(item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


def abstract_tree(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
  """Shape/dtype/sharding of each array leaf of `tree` (other leaves as they are): the target Orbax restores into,
  so a checkpoint comes back laid out like the live model (`distributed.restore_sharding`)."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=distributed.restore_sharding(x, mesh))
      if hasattr(x, "shape")
      else x,
      tree,
  )


def restore_items(manager: ocp.CheckpointManager, step: int, targets: dict[str, Any], mesh) -> tuple[dict, dict]:
  """Restore `step`'s standard items into the layout of `targets` (abstract or concrete trees) and its JSON meta."""
  drop_abandoned_read_errors()
  items = {name: restore_args(tree, mesh) for name, tree in targets.items()}
  restored = manager.restore(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonRestore()))
  return {name: restored[name] for name in targets}, dict(restored.meta)


class RunCheckpointer:
  """Save/restore the pieces of RL state needed to resume with no repeated or skipped batch (`storage`: the run's
  OrbaxStorage keys, `Storage.from_config`; the default is MaxText's RL default)."""

  def __init__(
      self,
      directory: str,
      *,
      period: int,
      storage: Storage = Storage(),
      max_to_keep: int | None = None,
      enabled: bool = True,
      async_save: bool = False,
  ):
    self.directory = storage_lib.absolute(directory)  # a bucket path as given: Orbax writes there through TensorStore
    self.period = max(1, int(period))
    self.enabled = enabled
    self.storage = storage
    self._manager = None
    if enabled:
      storage_lib.makedirs(self.directory)
      self._manager = open_manager(
          self.directory, ("params", "opt_state", "meta"), storage=storage, max_to_keep=max_to_keep, async_save=async_save
      )

  def latest_step(self) -> int | None:
    """The newest complete step on disk (None: none, or checkpointing disabled)."""
    return self._manager.latest_step() if self._manager else None

  def all_steps(self) -> list[int]:
    """Every complete step on disk, for the fallback to an older one when the newest does not restore."""
    return list(self._manager.all_steps()) if self._manager else []

  def should_save(self, step: int, last_step: int) -> bool:
    """Every `period` steps and at the last step, so a finished run always ends on a checkpoint."""
    return self.enabled and (step % self.period == 0 or step == last_step)

  def set_aside(self, step: int) -> str:
    """Rename a checkpoint that does not restore to `<step>.corrupt-<unix time>`: kept for inspection, never
    deleted, and no longer a step Orbax lists or overwrites. Returns the new path."""
    src = os.path.join(self.directory, str(step))
    # One name for every process (process 0's clock); process 0 alone renames, the others wait for it.
    dst = f"{src}.corrupt-{distributed.agree_from_writer(int(time.time()))}"
    if distributed.is_writer_process():
      storage_lib.rename(src, dst)
    distributed.barrier(f"set_aside_{step}")
    if self._manager is not None:
      self._manager.reload()
    return dst

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
    """Write `step`; a full disk or an unwritable directory is one line naming the path and the free space (the
    previous checkpoints are untouched: Orbax writes to a temporary directory and renames it when complete)."""
    if not self._manager:
      return
    with _OrbaxErrorLogs() as orbax_logs:
      try:
        self._save(step, params, opt_state, meta)
      except Exception as e:  # pylint: disable=broad-exception-caught  # Orbax wraps OSError in several types
        cause = _os_error_in(e)
        if cause is None:
          raise
        orbax_logs.discard()  # the one line below says it all; Orbax's threads logged it with tracebacks first
        raise CheckpointError(
            f"checkpoint step {step} was not written: "
            f"{storage_lib.describe_error(cause, self.directory)}; the run can resume from "
            f"step {self.latest_step()}"
        ) from None

  def _save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
    save_items(self._manager, step, {"params": params, "opt_state": opt_state}, meta, storage=self.storage)
    logging.info("saved checkpoint step %d to %s", step, self.directory)

  def restore(self, step: int, params_target: Any, opt_state_target: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Restore `step` into the shardings/dtypes of the targets (abstract or concrete trees); a checkpoint written with
    Tunix's `optax.MultiSteps` optimizer state (before the update accumulated inside its step) restores too."""
    targets = {"params": params_target, "opt_state": opt_state_target}
    drop_abandoned_read_errors()
    try:
      legacy = multisteps_layout(self._manager, step)
      if legacy is not None:
        targets["opt_state"] = legacy_target(legacy, params_target, opt_state_target)
      restored, meta = restore_items(self._manager, step, targets, distributed.mesh_of(params_target))
      if legacy is not None:
        restored["opt_state"] = from_multisteps(restored["opt_state"], opt_state_target)
    except (ValueError, KeyError, FileNotFoundError) as e:
      raise CheckpointError(
          f"checkpoint {self.directory}/{step} does not match this model/optimizer "
          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
      ) from None
    return restored["params"], restored["opt_state"], meta

  def close(self) -> None:
    """Wait for an async save in flight and release Orbax's threads."""
    if self._manager:
      self._manager.close()


# A checkpoint's optimizer state as Tunix's `optax.MultiSteps` wrapped it (plugin checkpoints written before the actor
# update accumulated micro-batches itself, accumulation.py): `opt_state.{mini_step, gradient_step, inner_opt_state,
# acc_grads}` where the optimizer's own state is now `opt_state.*`. The accumulator is read (sharded as the params, so
# no device holds it whole) and dropped: between RL steps it is zero (every step ends on an optimizer update).
_MULTISTEPS_INNER = "inner_opt_state"
_MULTISTEPS_ACC = "acc_grads"


def _name(path: tuple) -> str:
  """A key path as Orbax names a checkpoint leaf: its keys joined by '.'."""
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _by_name(tree: Any, is_leaf=None) -> dict[str, Any]:
  return {_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def multisteps_layout(manager: ocp.CheckpointManager, step: int) -> Any:
  """The `opt_state` item's tree metadata when `step` holds MultiSteps' optimizer state, else None."""
  tree = manager.item_metadata(step)["opt_state"]
  tree = getattr(tree, "tree", tree)
  inner = tree.get("opt_state") if isinstance(tree, dict) else None
  return tree if isinstance(inner, dict) and _MULTISTEPS_INNER in inner and _MULTISTEPS_ACC in inner else None


def _is_meta(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def legacy_target(layout: Any, params_target: Any, opt_state_target: Any) -> Any:
  """The abstract MultiSteps-layout tree (`layout`: the checkpoint's metadata) to restore into: the optimizer's own
  state laid out as the live `opt_state_target`, the accumulator as the params, the counters as the live step."""
  live = _by_name(opt_state_target)
  params = _by_name(params_target)
  scalar = next(x for n, x in live.items() if n.split(".")[0] == "step")
  inner, acc = f"opt_state.{_MULTISTEPS_INNER}.", f"opt_state.{_MULTISTEPS_ACC}."

  def target(path, meta):
    n = _name(path)
    if n.startswith(inner):
      like = live["opt_state." + n[len(inner) :]]
    elif n.startswith(acc):
      like = params[n[len(acc) :]]
    else:  # step, mini_step, gradient_step: scalars
      like = scalar
    return jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype, sharding=getattr(like, "sharding", None))

  return jax.tree_util.tree_map_with_path(target, layout, is_leaf=_is_meta)


def from_multisteps(restored: Any, opt_state_target: Any) -> Any:
  """The live optimizer's state from a restored MultiSteps-layout tree: the inner optimizer's state as it is, and the
  update count (`step`) from MultiSteps' `gradient_step` (its own `step` counted micro-batches)."""
  old = _by_name(restored)
  inner = f"opt_state.{_MULTISTEPS_INNER}."

  def value(path, like):
    n = _name(path)
    if n.startswith("opt_state."):
      src = old[inner + n[len("opt_state.") :]]
    else:  # step[.value]
      src = old["opt_state.gradient_step" + n[len("step") :]]
    return src if src.dtype == like.dtype else src.astype(like.dtype)

  return jax.tree_util.tree_map_with_path(value, opt_state_target)


class _OrbaxErrorLogs(std_logging.Filter):
  """Holds the ERROR records Orbax logs while a save runs: each of its write threads logs its failure with the full
  traceback (`_SignalingThread.run`) before the save raises it, so a full disk would print two tracebacks before the
  run's one line. On leaving, the held records are logged as they were unless `discard` was called (a failure the
  caller turns into one line); a failure it does not explain keeps Orbax's own account."""

  def __init__(self):
    super().__init__()
    self._held: list[std_logging.LogRecord] = []
    self._discarded = False
    self._logger = std_logging.getLogger("absl")  # Orbax logs through absl, absl through this logger

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
      self._held.append(record)
      return False
    return True

  def discard(self) -> None:
    self._discarded = True

  def __enter__(self) -> "_OrbaxErrorLogs":
    self._logger.addFilter(self)
    return self

  def __exit__(self, *exc) -> None:
    self._logger.removeFilter(self)
    if not self._discarded:
      for record in self._held:
        self._logger.handle(record)


def _os_error_in(e: BaseException) -> OSError | None:
  """The OSError (full disk, permissions) behind an exception, following __cause__/__context__ and the message."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno is not None:
      return e
    if "No space left on device" in str(e):
      return OSError(errno.ENOSPC, "No space left on device")
    e = e.__cause__ or e.__context__
  return None


def _abandoned_read(unraisable: Any) -> bool:
  """Whether an unraisable exception is asyncio's `RuntimeError('Event loop is closed')` from `call_soon_threadsafe`:
  TensorStore completing a read of a restore that already failed (a missing array folder, a truncated file), after
  Orbax's event loop closed. Nobody waits for that read any more."""
  exc = unraisable.exc_value
  return (
      isinstance(exc, RuntimeError)
      and str(exc) == "Event loop is closed"
      and any(frame.name == "call_soon_threadsafe" for frame in traceback.extract_tb(unraisable.exc_traceback))
  )


def drop_abandoned_read_errors() -> None:
  """Keep the abandoned reads of a failed restore off the console: when one array of a step does not read, Orbax's
  restore raises at once and closes its event loop while TensorStore still reads the others; each of those reads then
  fails to call back into the closed loop, and Python printed the 9-13 `RuntimeError: Event loop is closed` tracebacks
  around the run's one "skipped checkpoint step" line. Installed (once per process, before the first restore: the
  reads may finish before the failure reaches the caller) as a `sys.unraisablehook` that drops exactly those and hands
  every other unraisable exception to the hook it replaced."""
  if getattr(sys.unraisablehook, "drops_abandoned_reads", False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _abandoned_read(unraisable):
      previous(unraisable)

  hook.drops_abandoned_reads = True
  sys.unraisablehook = hook
