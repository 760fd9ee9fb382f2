"""The one module that reaches into tpu-inference (and vLLM) for the vLLM rollout's AOT compile (aot/vllm_programs.py).

Compiling tpu-inference's model step for a TPU topology from a CPU host needs what a TPU VM would answer by itself;
each substitution below is narrow, says why, and tests/tpu_contract/test_aot_vllm.py checks every name it touches at
the pinned tpu-inference 0.32.0 / vllm-tpu 0.32.0:

* `quiet_env`: importing tpu_inference logs TPU facts it reads from the environment, or else from the GCE metadata
  server (`tpu_info.get_node_name/get_tpu_type/get_node_worker_id`: `TPU_NAME`, `TPU_ACCELERATOR_TYPE`,
  `TPU_WORKER_ID`); setting them stops the polling (a failed DNS lookup and an error line per key on a workstation).
* `for_target`: the Pallas ragged paged attention kernel and its block-size tables ask `get_tpu_version()` and
  `get_device_name()`, both of which read `jax.devices()[0]` (this host's CPU: `Unsupported tpu_version=-1`,
  `Expected TPU devices`). Inside the context every tpu_inference module's binding of those two functions answers
  what tpu-inference's own function answers for the target's first device, computed once by calling it with that
  device as `jax.devices()[0]`. And the kernel's `pltpu.get_tpu_info()` refuses a CPU default device unless a mesh of
  the target's devices is the abstract mesh in context (`jax.sharding.use_abstract_mesh`).
* `batch_defaults`: vLLM's `EngineArgs.get_batch_defaults` answers from `current_platform`; asked with
  tpu-inference's `TpuPlatform` in its place, it gives what an `LLM` on a TPU VM defaults `max_num_batched_tokens` /
  `max_num_seqs` to.
"""

# tpu_inference and vllm exist only in the TPU image's stack (.venv-tpu): imported where used.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from typing import Any, Iterator, Sequence

import jax

# What tpu_inference.tpu_info reads before it asks the metadata server (envs.TPU_NAME / TPU_ACCELERATOR_TYPE /
# TPU_WORKER_ID); VLLM_LOGGING_LEVEL: vLLM's and tpu-inference's warnings about a CPU host (no tpu_info package, no
# /dev/vfio, no pinned memory) say nothing about the compiled program.
_ENV = {"TPU_NAME": "aot-compile", "TPU_WORKER_ID": "0", "VLLM_LOGGING_LEVEL": "ERROR"}


def quiet_env(accelerator_type: str) -> None:
  """Set before tpu_inference is imported: who we are, so nothing polls the GCE metadata server."""
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
  for k, v in _ENV.items():
    os.environ.setdefault(k, v)


def importable() -> bool:
  """Whether the TPU image's stack (tpu_inference + vllm-tpu) imports here (its start-up chatter silenced)."""
  vllm_log = logging.getLogger("vllm")  # tpu-inference logs under vllm.tpu_inference
  vllm_log.setLevel(logging.CRITICAL)  # import-time: no tpu_info package, no /dev/vfio, no vllm._C on a CPU host
  try:
    importlib.import_module("tpu_inference")
    importlib.import_module("vllm")
  except Exception:  # pylint: disable=broad-exception-caught  # any import failure means "not this stack"
    return False
  finally:
    vllm_log.setLevel(logging.ERROR)  # and then: TpuPlatform.get_device_name's warning for every config built
  return True


@contextlib.contextmanager
def _as_first_device(device) -> Iterator[None]:
  """`jax.devices()` answers [device, ...] while tpu-inference's device-kind parsers run (never while lowering)."""
  real = jax.devices
  jax.devices = lambda *_, **__: [device]
  try:
    yield
  finally:
    jax.devices = real


def target_answers(device) -> tuple[int, str]:
  """(get_tpu_version(), get_device_name()) as tpu-inference computes them on a TPU whose first device is `device`."""
  from tpu_inference import utils
  from tpu_inference.kernels.ragged_paged_attention.v3 import util

  with _as_first_device(device):
    return util.get_tpu_version(), utils.get_device_name()


def _originals() -> dict[str, Any]:
  from tpu_inference import utils
  from tpu_inference.kernels.ragged_paged_attention.v3 import util

  return {"get_tpu_version": util.get_tpu_version, "get_device_name": utils.get_device_name}


def bindings() -> list[tuple[Any, str]]:
  """(module, name) of every loaded tpu_inference module bound to tpu-inference's two device-kind functions."""
  originals = _originals()
  out = []
  for mod_name, mod in list(sys.modules.items()):
    if not mod_name.startswith("tpu_inference") or mod is None:
      continue
    for name, fn in originals.items():
      if getattr(mod, name, None) is fn:
        out.append((mod, name))
  return out


@contextlib.contextmanager
def for_target(mesh) -> Iterator[None]:
  """Trace tpu-inference's kernels for the TPU of `mesh` (a Mesh of topology devices); see the module docstring."""
  # The kernel modules bind the functions at import: import them before collecting the bindings.
  for module in ("kernel", "kernel_hd64", "tuned_block_sizes"):
    importlib.import_module(f"tpu_inference.kernels.ragged_paged_attention.v3.{module}")

  version, name = target_answers(mesh.devices.flat[0])

  def tpu_version() -> int:
    return version

  def device_name(num_devices: int | None = None) -> str:
    return name if num_devices is None else f"{name}-{num_devices}"

  answer = {"get_tpu_version": tpu_version, "get_device_name": device_name}
  saved = [(mod, attr, getattr(mod, attr)) for mod, attr in bindings()]
  for mod, attr, _ in saved:
    setattr(mod, attr, answer[attr])
  try:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      yield
  finally:
    for mod, attr, fn in saved:
      setattr(mod, attr, fn)


def batch_defaults() -> tuple[int, int]:
  """(max_num_batched_tokens, max_num_seqs) that `vllm.LLM` on a TPU VM defaults to (vLLM's get_batch_defaults)."""
  from tpu_inference.platforms.tpu_platform import TpuPlatform
  from vllm.engine import arg_utils
  from vllm.usage.usage_lib import UsageContext

  real = arg_utils.current_platform
  arg_utils.current_platform = TpuPlatform()
  try:
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
  finally:
    arg_utils.current_platform = real
  return int(tokens[UsageContext.LLM_CLASS]), int(seqs[UsageContext.LLM_CLASS])


def kv_cache_configs(vllm_config, layer_specs: dict, available: Sequence[int]):
  """vLLM's `get_kv_cache_configs` (the engine core's sizing of the KV pool from each worker's free memory)."""
  from vllm.v1.attention.backends import utils as backend_utils
  from vllm.v1.core import kv_cache_planning
  from vllm.v1.worker import worker_base

  # EngineCore._initialize_kv_caches resolves the layout first (from the workers' WorkerBase answer), then sizes.
  backends = worker_base.get_current_attn_backends(vllm_config)
  names = [layout.name for layout in worker_base.get_supported_kv_cache_layouts(backends)]
  backend_utils.resolve_kv_cache_layout(vllm_config, [names], list(layer_specs.values()))
  return kv_cache_planning.get_kv_cache_configs(vllm_config, [layer_specs], list(available))
