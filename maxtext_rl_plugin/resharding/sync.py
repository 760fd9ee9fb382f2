"""`WeightSync`, the trainer -> sampler weight sync of a run, and its hook into Tunix's `RLCluster`.

A `WeightSync` reshards the trainer's weights onto the sampler's shardings (move.py), installs them, and checks them
per `rl.verify_weight_sync` (verify.py); its options are a `SyncSettings`, made from the config in one place
(`SyncSettings.from_config`). `attach_to_rl_cluster` is the run's one call: per the engine's declared weight-sync route
(rollout/engines.Capabilities.weight_sync, passed in by run/build.py: this package imports no engine) it hands the sync
to the engine ('engine'), wraps an nnx engine's `update_params` ('wrapped': `install_into_rl_cluster`, whose docstring
says why it wraps that method rather than replacing `RLCluster.sync_weights`), or leaves the engine's own sync ('own').
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable
import weakref

from absl import logging
from flax import nnx
import jax
from tunix.rl import utils as rl_utils

from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.resharding import backend
from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.resharding import trees
from maxtext_rl_plugin.resharding import verify as verify_lib

PyTree = Any


@dataclasses.dataclass(frozen=True)
class SyncSettings:
  """A run's weight-sync options: `rl.reshard_chunk_size` (tensors per chunk; None: bounded by bytes), MaxText's
  `reshard_donate` (release the sampler's old buffers chunk by chunk), `rl.verify_weight_sync` and
  `rl.verify_weight_sync_every` (the guard's policy, verify.py). The defaults are the schema's."""

  chunk_size: int | None = None
  release_old: bool = True
  verify_policy: str = "first"
  verify_every: int = 10

  @classmethod
  def from_config(cls, config: Any) -> "SyncSettings":
    """The settings of a typed plugin config (the one place this package reads the config)."""
    return cls(
        chunk_size=config.rl.reshard_chunk_size,
        release_old=bool(config.reshard_donate),
        verify_policy=str(config.rl.verify_weight_sync),
        verify_every=int(config.rl.verify_weight_sync_every),
    )


# Engines whose `update_params` `install_into_rl_cluster` wrapped, with the sync the wrapper runs (a re-install
# replaces the sync, not the wrapper).
_INSTALLED: "weakref.WeakKeyDictionary[Any, WeightSync]" = weakref.WeakKeyDictionary()


def _is_nnx_module(x) -> bool:
  return isinstance(x, nnx.Module)


class WeightSync:
  """Moves trainer weights into the sampler layout after each optimizer step, and checks they arrived.

  `dst` is one of: an nnx sampler model (updated in place; its current buffers are released chunk by chunk
  when `reshard_donate`), a tree of destination Shardings (or arrays, whose shardings are used), or None
  (shardings are then derived per call from `current=` or from `mesh`+`rules` and the source's logical
  axes). The trainer's and the sampler's trees are the same (the embedded engine runs the same MaxText module;
  engines with another layout, vLLM, map and reshard in their own update_params).
  Options come from `settings` (`SyncSettings`; None: its defaults); keyword arguments override them. Without a chunk
  size, `chunk_bytes` bounds each chunk's bytes ('auto': `move.DEFAULT_CHUNK_BYTES` on the device_put path, one chunk
  on Pathways; None: one chunk).
  """

  def __init__(
      self,
      settings: SyncSettings | None = None,
      dst: Any = None,
      *,
      mesh: jax.sharding.Mesh | None = None,
      rules=None,
      chunk_size: int | None | str = "config",
      chunk_bytes: int | None | str = "auto",
      release_old: bool | None = None,
      verify_policy: str | None = None,
      verify_every: int | None = None,
  ):
    settings = settings or SyncSettings()
    self.chunk_size = settings.chunk_size if chunk_size == "config" else chunk_size
    self.release_old = bool(settings.release_old if release_old is None else release_old)
    self.verify_policy = str(verify_policy or settings.verify_policy)
    self.verify_every = int(verify_every or settings.verify_every)
    if self.verify_policy not in verify_lib.VERIFY_POLICIES:
      raise ConfigError(
          f"invalid value for 'rl.verify_weight_sync'='{self.verify_policy}': expected one of "
          + ", ".join(verify_lib.VERIFY_POLICIES)
      )
    if self.chunk_size is not None and int(self.chunk_size) < 1:
      raise ConfigError(
          f"invalid value for 'rl.reshard_chunk_size'={self.chunk_size}: expected a positive integer or null"
      )
    self.chunk_size = None if self.chunk_size is None else int(self.chunk_size)
    self.chunk_bytes = chunk_bytes  # used when chunk_size is None; 'auto': see move.reshard()
    self._model = dst if _is_nnx_module(dst) else None
    self._dst_shardings = (
        None
        if (dst is None or self._model is not None)
        else jax.tree.map(trees.as_sharding, dst, is_leaf=trees.is_sharding)
    )
    self._mesh, self._rules = mesh, rules
    self.num_syncs = 0
    self.num_verified = 0
    self.last_seconds = 0.0
    self.last_bytes = 0
    self.last_verify_seconds = 0.0
    self.last_stats: dict = {}
    self.path = backend.backend_path()

  def _verify_due(self) -> bool:
    return verify_lib.verify_due(self.verify_policy, self.verify_every, self.num_syncs)

  def _model_state(self):

    return nnx.state(self._model, nnx.Param)

  def destination(self, mapped: PyTree, current: PyTree | None = None) -> PyTree:
    """The destination shardings for `mapped` (the mapped trainer tree)."""
    if current is not None:
      return jax.tree.map(trees.as_sharding, current, is_leaf=trees.is_sharding)
    if self._model is not None:
      return jax.tree.map(trees.as_sharding, self._model_state())
    if self._dst_shardings is not None:
      return self._dst_shardings
    if self._mesh is not None:
      self._dst_shardings = trees.logical_shardings(mapped, self._mesh, self._rules or ())
      return self._dst_shardings
    raise ValueError("WeightSync needs a destination: a sampler model, shardings, current=, or mesh+rules")

  def sync(
      self,
      src_params: PyTree,
      *,
      current: PyTree | None = None,
      apply: Callable[[PyTree], PyTree] | None = None,
  ) -> PyTree:
    """Reshard `src_params` into the sampler layout, install it, check it per policy; returns the new tree.

    `current`: the sampler's current weights (their shardings are the destination; released chunk by
    chunk when `reshard_donate`). `apply(new) -> held`: installs the new tree into the sampler and returns
    what the sampler now holds, which is what the guard compares against the trainer's weights.
    """
    mapped = src_params
    if current is None and self._model is not None:
      current = self._model_state()
    dst_shardings = self.destination(mapped, current)
    stats: dict = {}
    t0 = time.perf_counter()
    new = move.reshard(
        mapped,
        dst_shardings,
        chunk_size=self.chunk_size,
        chunk_bytes=self.chunk_bytes,
        release=current if self.release_old else None,
        stats=stats,
    )
    if apply is not None:
      held = apply(new)
    elif self._model is not None:

      nnx.update(self._model, new)
      held = self._model_state()
    else:
      held = new
    self.last_seconds = time.perf_counter() - t0
    self.last_bytes = int(stats.get("bytes", 0))
    self.last_stats = stats
    self.num_syncs += 1
    if self._verify_due():
      t1 = time.perf_counter()
      verify_lib.verify(mapped, held, dst_shardings=dst_shardings)
      self.last_verify_seconds = time.perf_counter() - t1
      self.num_verified += 1
      logging.info(
          "weight sync %d verified: %d arrays, %.1f MiB bitwise equal on the sampler (%.3fs sync, %.3fs check)",
          self.num_syncs,
          len(jax.tree.leaves(mapped)),
          self.last_bytes / 2**20,
          self.last_seconds,
          self.last_verify_seconds,
      )
    else:
      logging.debug(
          "weight sync %d: %.1f MiB in %.3fs via %s",
          self.num_syncs,
          self.last_bytes / 2**20,
          self.last_seconds,
          stats.get("path"),
      )
    return held


def install_into_rl_cluster(rl_cluster, weight_sync: WeightSync) -> None:
  """Route Tunix `RLCluster.sync_weights` through `weight_sync`.

  Tunix 0.1.7's `RLCluster.sync_weights` takes the actor's `nnx.Param` state and calls
  `rl_cluster.rollout.update_params(params, filter_types)`; each rollout engine then reshards with
  `tunix.rl.reshard.reshard_pytree` (whole tree, silent device_put fallback, no chunking, no check).
  We wrap that one method on the cluster's rollout *instance*: the params are resharded by
  `weight_sync` onto the shardings the engine's model currently has (freeing its old buffers chunk by
  chunk), handed to the engine's own `update_params` with `filter_types=None` -- Tunix's convention
  (VanillaRollout, the plugin's embedded engine) for "already on my shardings, install as is", so the
  engine does not reshard a second time -- and the guard then compares the trainer's weights with what
  the engine's model holds, so a bug in the engine's own install step is caught too.
  `RLCluster.sync_weights` itself stays Tunix's (transfer guards, anchor-policy snapshot, step
  counter; Tunix's learner waits for in-flight rollouts before calling it, so the sampler is idle),
  which is why we neither subclass nor replace it. Engines whose `model()` is not the nnx module
  holding the weights (vLLM) map and reshard inside their own `update_params` instead.
  """

  rollout = rl_cluster.rollout
  if not isinstance(rollout.model(), nnx.Module):
    raise TypeError(
        f"{type(rollout).__name__}.model() is not an nnx.Module holding the sampler weights; "
        "that engine must reshard inside its own update_params (e.g. with resharding.move.reshard)"
    )
  if rollout in _INSTALLED:
    _INSTALLED[rollout] = weight_sync
    return
  original = rollout.update_params

  def update_params(params, filter_types=None):
    filt = filter_types if filter_types else (nnx.Param,)
    current = nnx.state(rollout.model(), *filt)

    def apply(new):
      original(new, None)
      return nnx.state(rollout.model(), *filt)

    _INSTALLED[rollout].sync(params, current=current, apply=apply)

  _INSTALLED[rollout] = weight_sync
  rollout.update_params = update_params
  logging.info(
      "RLCluster weight sync routed through maxtext_rl_plugin.resharding (%s, chunk_size=%s, verify=%s)",
      weight_sync.path,
      weight_sync.chunk_size,
      weight_sync.verify_policy,
  )


def attach_to_rl_cluster(rl_cluster, settings: SyncSettings, route: str = "wrapped") -> WeightSync | None:
  """The trainer's one call after building the RLCluster: a `WeightSync` with `settings`, installed, or None.

  `route` is the engine's declared weight-sync route (rollout/engines.Capabilities.weight_sync): 'engine' hands the
  sync to the engine (its `weight_sync` attribute, run inside its own `update_params`: the embedded engine); 'wrapped'
  wraps the engine's `update_params` (`install_into_rl_cluster`: any other engine holding its weights in an nnx
  module, Tunix's own included); 'own' installs nothing (vLLM maps, reshards and checks in its own update_params).

  None (and a log line saying why) when there is nothing to sync -- colocated runs where the rollout
  shares the actor's arrays (Tunix then never calls sync_weights) -- or when the engine syncs itself.
  """
  if route not in ("engine", "wrapped", "own"):
    raise ValueError(f"unknown weight-sync route {route!r}: expected engine, wrapped or own")
  if route == "own":
    logging.info(
        "weight sync: %s manages its own weights; not installing the plugin's sync", type(rl_cluster.rollout).__name__
    )
    return None
  sampler = rl_cluster.rollout.model()
  if isinstance(sampler, nnx.Module) and rl_utils.is_sharing_weights(rl_cluster.actor_trainer.model, sampler):
    logging.info("weight sync: colocated (the sampler shares the trainer's arrays); nothing to sync")
    return None
  ws = WeightSync(settings)
  if route == "engine":
    rl_cluster.rollout.weight_sync = ws  # the engine runs the guarded sync in its update_params
  else:
    install_into_rl_cluster(rl_cluster, ws)  # wrap its update_params (see that docstring)
  return ws
