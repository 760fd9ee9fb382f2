"""The vLLM rollout's weight sync into the engine's state: MaxText weights mapped to a native tpu-inference class
(`write_weights`) or to MaxText's decoder inside vLLM (`write_adapter_weights`), moved onto the engine's shardings and
written into the worker's `get_weights_state()` (whose leaves alias the runner's). rollout/vllm.py runs them inside
tpu-inference's weight-update session.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from maxtext_rl_plugin.resharding import maxtext_layout
from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.resharding import per_host
from maxtext_rl_plugin.rollout import vllm_mapping
from maxtext_rl_plugin.rollout import vllm_quantized


def _reshard(tree: dict, shardings: dict) -> dict:
  """Move mapped weights onto the engine's shardings through the plugin's resharding (Pathways-aware, chunk-ready)."""
  # donate=False: identity-layout leaves can alias the trainer's own buffers. Chunking happens upstream.
  return move.reshard(tree, shardings, chunk_size=None, donate=False)


def write_weights(
    state: Any,
    flat: Mapping[str, jax.Array],
    model_name: str,
    hf_config: Mapping[str, Any],
    *,
    param_scan_axis: int = 1,
    chunk_size: int | None = None,
    donate: bool = False,
    require_all: bool = True,
    source_checksums: dict[str, int] | None = None,
) -> dict[str, jax.Array]:
  """Map MaxText weights `{path: array}` to vLLM's and write them into the engine's weight `state`; returns them.

  The whole sync apart from vLLM's update session: MaxText's export tables (`map_maxtext_to_vllm`), tpu-inference's
  layout and padding (`to_engine_state`), the engine's shardings, writes into `state` (tpu-inference's
  `get_weights_state()`: its leaves alias the runner's). `chunk_size` MaxText tensors at a time bound the HF-layout
  copies. `require_all`: every engine weight must be written (a full sync); an adapter-only sync writes a subset.
  `source_checksums` (a per-host sync's guard): filled with the engine-layout arrays' trainer-side checksums.
  An engine Qwix quantized (`rollout_quantization`) holds QArray kernels: each is mapped as a float kernel, then
  quantized on the trainer's devices into its qvalue and scale leaves (rollout/vllm_quantized.py), before the move.
  tests/tpu_contract/test_forward.py runs this path into the real tpu-inference classes and checks their logits
  (test_quantized_sync.py into their Qwix-quantized forms).
  """
  engine_flat = vllm_mapping.engine_weights(state)  # weights only: tpu-inference's Llama also holds RNG state
  kernels = vllm_quantized.slots(engine_flat)  # {} unless the engine holds Qwix QArray kernels
  targets = vllm_quantized.float_view(engine_flat, kernels) if kernels else engine_flat
  flax_layout = vllm_mapping.is_flax_layout(state)
  set_leaves = vllm_mapping.engine_state_setter(state)
  trainer_buffers = set().union(*(move.buffer_ids(v) for v in flat.values()))
  keys = sorted(flat)
  step = int(chunk_size or len(keys) or 1)
  written: dict[str, jax.Array] = {}
  for i in range(0, len(keys), step):
    chunk = {k: flat[k] for k in keys[i : i + step]}
    # Tunix's sync_weights disallows explicit host-to-device transfers on CPU backends; MaxText's export hooks and the
    # layout's padding (`adjust_rope`'s strided slices, `jnp.pad`) put host scalars beside global arrays, which a
    # multi-process mesh transfers explicitly. The weights themselves stay on device.
    with jax.transfer_guard("allow"):
      hf = vllm_mapping.map_maxtext_to_vllm(chunk, model_name, hf_config, param_scan_axis=param_scan_axis)
      new, _ = vllm_mapping.to_engine_state(
          hf, targets, require_all=False, head_dim=hf_config["head_dim"], flax_layout=flax_layout
      )
    if kernels:
      new = vllm_quantized.quantize(new, kernels, engine_flat)
    if source_checksums is not None:
      source_checksums.update(per_host.source_checksums(new))
    new = _reshard(new, {k: engine_flat[k].sharding for k in new})
    new = _unaliased(new, trainer_buffers)
    set_leaves(new)
    if donate:
      keep = set(trainer_buffers).union(*(move.buffer_ids(v) for v in new.values()))
      move.release_buffers([engine_flat[k] for k in new], keep)
    written.update(new)
    del hf, new
  if require_all:
    vllm_mapping.check_all_written(engine_flat, written)
  return written


def write_adapter_weights(
    state: Any,
    flat: Mapping[str, jax.Array],
    layout: maxtext_layout.AdapterLayout,
    *,
    chunk_size: int | None = None,
    require_all: bool = True,
    source_checksums: dict[str, int] | None = None,
) -> dict[str, jax.Array]:
  """The MaxTextForCausalLM route's sync: MaxText weights `{path: array}` in the adapter's layout
  (resharding/maxtext_layout.py), moved onto the engine's shardings and written into its weight `state`
  (`source_checksums`: as in `write_weights`).

  tests/tpu_contract/test_forward_maxtext.py runs this path into the real adapter and checks its logits.
  """
  engine_flat = vllm_mapping.engine_weights(state)
  trainer_buffers = set().union(*(move.buffer_ids(v) for v in flat.values()))
  # Identity-layout leaves (embedding, norms) can come back as the trainer's own arrays: copied, as on the native route.
  moved = maxtext_layout.convert_and_move(layout, flat, engine_flat, chunk_size=chunk_size, checksums=source_checksums)
  written = _unaliased(moved, trainer_buffers)
  vllm_mapping.engine_state_setter(state)(written)
  if require_all:
    vllm_mapping.check_all_written(engine_flat, written)
  return written


def _unaliased(new: dict, trainer_buffers: set) -> dict:
  """Copy leaves backed by the trainer's own buffers (same layout, dtype and sharding, e.g. a colocated bf16
  norm): the train step donates its parameters, which would delete the engine's weight under it."""
  return {k: (jnp.copy(v) if move.buffer_ids(v) & trainer_buffers else v) for k, v in new.items()}


def verify_engine_holds(worker: Any, written: Mapping[str, jax.Array]) -> None:
  """Re-read the worker's weights and check every written leaf holds what was written (`rl.verify_weight_sync`).

  Catches a write path that updated a copy (e.g. a tpu-inference version whose `get_weights_state()` no
  longer aliases the runner's arrays): the sampler would otherwise keep its dummy weights silently.
  """
  now = vllm_mapping.engine_weights(worker.get_weights_state())
  for name in sorted(written):
    got, want = now.get(name), written[name]
    same = got is want or (got is not None and bool(jnp.array_equal(jnp.asarray(got), want)))
    if not same:
      raise RuntimeError(f"vLLM weight sync did not take effect: engine parameter {name} differs from the trainer's")
