"""Checkpoint storage format: MaxText's OrbaxStorage keys reach Orbax, and what they write restores bit for bit.

MaxText's RL defaults (`post_train/rl.yml`: `checkpoint_storage_use_ocdbt: false`, `checkpoint_storage_use_zarr3:
false`, "for Pathways") are what the plugin writes unless told otherwise. On Pathways with ENABLE_PATHWAYS_PERSISTENCE=1,
`pathwaysutils.initialize()` registers Orbax's `CloudPathwaysArrayHandler` for every jax.Array; the tests here register
that real handler the same way and replace only the Pathways plugin program it runs (`PluginExecutable`, which needs the
IFRT proxy backend: the hardware boundary) by one that keeps the arrays in files.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers
from orbax.checkpoint._src.serialization import cloud_pathways_array_handler
from orbax.checkpoint._src.serialization import cloud_pathways_plugin_executable
import pathwaysutils
from pathwaysutils import _initialize as pathways_init
import pytest

from maxtext_rl_plugin import checkpointing
from maxtext_rl_plugin.config import load as config_lib

FORMATS = [(False, False), (True, False), (False, True), (True, True)]


def _tree():
  """Arrays of the dtypes a run checkpoints (float32/bfloat16 weights, an int32 step count), values that differ."""
  k = jax.random.key(7)
  return {
      "w": jax.random.normal(k, (6, 10), jnp.float32),
      "b": jax.random.normal(jax.random.fold_in(k, 1), (10,), jnp.bfloat16),
      "count": jnp.array(41, jnp.int32),
  }


def _bits(tree):
  return {k: np.asarray(v).tobytes() for k, v in tree.items()}


def _save_restore(directory, storage, tree, *, read_with=None):
  mgr = checkpointing.open_manager(str(directory), ("params", "meta"), storage=storage)
  checkpointing.save_items(mgr, 3, {"params": tree}, {"step": 3}, storage=storage)
  mgr.close()
  mgr = checkpointing.open_manager(str(directory), ("params", "meta"), storage=read_with or storage, create=False)
  restored, meta = checkpointing.restore_items(mgr, 3, {"params": tree}, None)
  mgr.close()
  return restored["params"], meta


def test_storage_keys_come_from_the_config_with_maxtexts_rl_defaults():
  """No override: MaxText's RL defaults (the loaded config, not numbers copied here); overrides reach Storage."""
  rl_default = config_lib.load_config(["configs/cpu_tiny.yml"])
  assert checkpointing.Storage.from_config(rl_default) == checkpointing.Storage()
  assert checkpointing.Storage() == checkpointing.Storage(
      use_ocdbt=rl_default.checkpoint_storage_use_ocdbt,
      use_zarr3=rl_default.checkpoint_storage_use_zarr3,
      concurrent_gb=rl_default.checkpoint_storage_concurrent_gb,
      device_host_concurrent_gb=rl_default.checkpoint_storage_device_host_concurrent_gb,
      target_data_file_size_bytes=rl_default.checkpoint_storage_target_data_file_size_bytes,
  )
  assert (rl_default.checkpoint_storage_use_ocdbt, rl_default.checkpoint_storage_use_zarr3) == (False, False)
  mine = config_lib.load_config(
      [
          "configs/cpu_tiny.yml",
          "checkpoint_storage_use_ocdbt=true",
          "checkpoint_storage_use_zarr3=true",
          "checkpoint_storage_concurrent_gb=3",
          "checkpoint_storage_device_host_concurrent_gb=2",
          "checkpoint_storage_target_data_file_size_bytes=1048576",
      ]
  )
  assert checkpointing.Storage.from_config(mine) == checkpointing.Storage(True, True, 3, 2, 1 << 20)


@pytest.mark.parametrize("ocdbt,zarr3", FORMATS)
def test_each_format_is_written_as_asked_and_restores_bit_identical(tmp_path, ocdbt, zarr3):
  tree = _tree()
  storage = checkpointing.Storage(use_ocdbt=ocdbt, use_zarr3=zarr3)
  restored, meta = _save_restore(tmp_path, storage, tree)
  assert _bits(restored) == _bits(tree) and meta == {"step": 3}
  params = tmp_path / "3" / "params"
  # What is on disk, read with tensorstore's own notions: an OCDBT manifest, or one array directory per leaf whose
  # zarr metadata file names the version (zarr3: zarr.json; zarr2: .zarray).
  assert (params / "manifest.ocdbt").is_file() == ocdbt
  if not ocdbt:
    assert (params / "w" / ("zarr.json" if zarr3 else ".zarray")).is_file()
    assert not (params / "w" / (".zarray" if zarr3 else "zarr.json")).exists()
  tree_meta = json.loads((params / "_METADATA").read_text())
  assert tree_meta["use_zarr3"] is zarr3


def test_a_checkpoint_written_in_one_format_resumes_under_the_other(tmp_path):
  """Changing the keys between runs (or upgrading from the plugin's earlier OCDBT default) keeps old steps readable."""
  tree = _tree()
  restored, _ = _save_restore(
      tmp_path, checkpointing.Storage(use_ocdbt=True), tree, read_with=checkpointing.Storage(use_ocdbt=False)
  )
  assert _bits(restored) == _bits(tree)
  # Written before this change: Orbax's StandardSave with its OCDBT default, the plugin's earlier format.
  legacy = tmp_path / "legacy"
  mgr = ocp.CheckpointManager(
      str(legacy), item_names=("params", "meta"), options=ocp.CheckpointManagerOptions(step_prefix=None, create=True)
  )
  mgr.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave({"step": 3})))
  mgr.wait_until_finished()
  mgr.close()
  mgr = checkpointing.open_manager(str(legacy), ("params", "meta"), storage=checkpointing.Storage(), create=False)
  restored, meta = checkpointing.restore_items(mgr, 3, {"params": tree}, None)
  assert _bits(restored["params"]) == _bits(tree) and meta == {"step": 3}


class _PersistenceProgram:
  """Stands in for `cloud_pathways_plugin_executable.PluginExecutable`: runs the bulk write/read request Orbax's real
  helper built (JSON with base64 location and name per array) against files instead of the Pathways workers."""

  requests: list[dict] = []

  def __init__(self, program: str):
    self.request = json.loads(program)
    type(self).requests.append(self.request)

  @staticmethod
  def _path(r):
    return os.path.join(base64.b64decode(r["b64_location"]).decode(), base64.b64decode(r["b64_name"]).decode())

  def call(self, in_arr=(), out_shardings=(), out_avals=(), out_committed=True):
    """Writes `in_arr` or reads `out_avals` into `out_shardings`; the future is already done."""
    del out_committed
    done = concurrent.futures.Future()
    out = []
    if "bulk_persistence_write_request" in self.request:
      for r, array in zip(self.request["bulk_persistence_write_request"]["write_requests"], in_arr):
        os.makedirs(os.path.dirname(self._path(r)), exist_ok=True)
        with open(self._path(r) + ".persisted", "wb") as f:
          f.write(np.asarray(array).tobytes())
    else:
      reads = self.request["bulk_persistence_read_request"]["read_requests"]
      for r, sharding, aval in zip(reads, out_shardings, out_avals):
        with open(self._path(r) + ".persisted", "rb") as f:
          data = f.read()
        assert len(data) == aval.size * aval.dtype.itemsize, (len(data), aval)  # the write's bytes, as read
        value = np.frombuffer(data, aval.dtype).reshape(aval.shape)
        out.append(jax.device_put(value, sharding))
    done.set_result(None)
    return out, done


@pytest.fixture(name="pathways_persistence")
def pathways_persistence_fixture(monkeypatch):
  """jax.Array saved and restored by the handler `pathwaysutils.initialize()` itself registers under
  JAX_PLATFORMS=proxy with ENABLE_PATHWAYS_PERSISTENCE=1 (its own code runs; only its backend detection answers yes,
  and its two proxy-backend steps, the backend factory and the profiler patch, are skipped: there is no proxy
  backend here); the ParamInfos the handler gets are recorded."""
  previous = type_handlers.get_type_handler(jax.Array)
  cache = jax.config.jax_enable_compilation_cache  # initialize() turns JAX's cache off on Pathways
  monkeypatch.setenv("ENABLE_PATHWAYS_PERSISTENCE", "1")
  monkeypatch.setattr(pathways_init, "_initialization_count", 0)
  monkeypatch.setattr(pathways_init, "is_pathways_backend_used", lambda: True)
  monkeypatch.setattr(pathways_init.proxy_backend, "register_backend_factory", lambda: None)
  monkeypatch.setattr(pathways_init.profiling, "monkey_patch_jax", lambda: None)
  monkeypatch.setattr(cloud_pathways_plugin_executable, "PluginExecutable", _PersistenceProgram)
  _PersistenceProgram.requests = []
  try:
    pathwaysutils.initialize()
    handler = type_handlers.get_type_handler(jax.Array)
    assert isinstance(handler, cloud_pathways_array_handler.CloudPathwaysArrayHandler), type(handler)
    infos = []
    real_serialize = handler.serialize

    async def serialize(values, param_infos, args=None):
      infos.extend(param_infos)
      return await real_serialize(values, param_infos, args)

    monkeypatch.setattr(handler, "serialize", serialize)
    yield infos
  finally:
    type_handlers.register_type_handler(jax.Array, previous, override=True)
    jax.config.update("jax_enable_compilation_cache", cache)


def test_pathways_persistence_handler_refuses_ocdbt_as_the_seam_this_guards():
  """The contract at the pinned Orbax: the Pathways handler writes plain arrays and is never built for OCDBT."""
  with pytest.raises(ValueError, match="OCDBT not supported for Pathways"):
    cloud_pathways_array_handler.CloudPathwaysArrayHandler(use_ocdbt=True)


@pytest.mark.parametrize("ocdbt,zarr3", [(False, False), (True, True)])
def test_pathways_persistence_gets_the_storage_keys_and_the_checkpoint_restores(
    tmp_path, pathways_persistence, ocdbt, zarr3
):
  """A plugin checkpoint written and read through the real Pathways handler: every array goes through its persistence
  requests, each with the format the keys ask (MaxText's RL default: no OCDBT, zarr2), and restores bit-identical.
  The mesh sharding is what the handler insists on (Pathways restores only into NamedSharding)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  tree = jax.device_put(_tree(), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  storage = checkpointing.Storage(use_ocdbt=ocdbt, use_zarr3=zarr3)
  restored, _ = _save_restore(tmp_path, storage, tree)
  assert _bits(restored) == _bits(tree)
  assert sorted(i.name for i in pathways_persistence) == sorted(tree)
  assert {(i.is_ocdbt_checkpoint, i.use_zarr3) for i in pathways_persistence} == {(ocdbt, zarr3)}
  kinds = [next(iter(r)) for r in _PersistenceProgram.requests]
  assert kinds == ["bulk_persistence_write_request", "bulk_persistence_read_request"]
  written = {
      base64.b64decode(w["b64_name"]).decode() for w in _PersistenceProgram.requests[0][kinds[0]]["write_requests"]
  }
  assert written == set(tree)
  # The handler's own array metadata says what it wrote: never OCDBT, never zarr3, whatever the keys.
  assert not (tmp_path / "3" / "params" / "manifest.ocdbt").exists()
