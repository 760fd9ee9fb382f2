"""The trainer's MaxText tree in the layout of MaxText's own model inside vLLM (`MaxTextForCausalLM`), on device.

When vLLM runs MaxText's decoder itself (rollout/vllm_maxtext.py), no name translation is needed: the trainer and the
sampler hold the same MaxText module tree. What differs is structure, decided by MaxText's vLLM adapter:

* layers: the trainer scans them (`decoder.layers.*`, stacked on `param_scan_axis`), the adapter forces
  `scan_layers=false` (`decoder.layers_<i>.*`);
* MoE: the adapter pads the expert MLP width for tpu-inference's GMM kernel (`padded_base_moe_mlp_dim`) and, with
  `prefuse_moe_weights`, holds one `wi` whose every tensor-parallel shard is `[its gate chunk | its up chunk]`;
* attention: kv heads repeated up to the tensor-parallel size (`base_num_kv_heads` raised by the adapter).

All three are MaxText 0.2.5's own `integration/vllm/weight_converter.MaxTextToMaxTextConverter` (what MaxText's
`use_weight_converter=true` selects): its plan is built from the *target* tree, so the engine's shapes and shardings
decide padding and fusion, and it fails when any engine weight would keep vLLM's dummy values or any trainer weight
is left over. The plugin reuses it unchanged. Where it is not enough: Gemma 3's scanned attention-pattern blocks
(`decoder.layers.layers_<k>`, `layers_remainder`) are not in its candidate paths, so they are first unrolled by MaxText's
`maxtext_vllm_rollout.unroll_gemma_scanned_weights` (what MaxText's own sampler does for Gemma). Moving the converted
arrays onto the engine's shardings is the plugin's resharding (`move.reshard`, Pathways-aware, chunked).
"""

# maxtext_vllm_rollout imports vLLM (through Tunix's vllm_sampler): only a Gemma sync, which runs with vLLM
# installed, imports it.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from flax import traverse_util
import jax
from maxtext.integration.vllm import weight_converter

from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.resharding import per_host

_GEMMA_BLOCK = re.compile(r"(^|\.)layers\.(layers_\d+|layers_remainder)\.|(^|\.)layers_remainder\.")


def _nested(flat: Mapping[str, Any]) -> dict:
  """`{dotted.path: array}` -> the nested dict MaxText's converter reads (numeric parts stay strings)."""
  return traverse_util.unflatten_dict({tuple(k.split(".")): v for k, v in flat.items()})


def _flat(tree: Mapping) -> dict[str, Any]:
  return {".".join(map(str, k)): getattr(v, "value", v) for k, v in traverse_util.flatten_dict(dict(tree)).items()}


def unroll_gemma_blocks(flat: Mapping[str, Any]) -> dict[str, Any]:
  """Gemma 3's scanned pattern blocks unrolled by MaxText's own function; other trees are returned unchanged."""
  if not any(_GEMMA_BLOCK.search(k) for k in flat):
    return dict(flat)
  from maxtext.integration.vllm import maxtext_vllm_rollout

  return _flat(maxtext_vllm_rollout.unroll_gemma_scanned_weights(_nested(flat)))


@dataclasses.dataclass(frozen=True)
class TrainerLayers:
  """The trainer config's values MaxText's `MaxTextToMaxTextConverter` reads (its `config` argument: the trainer's
  layer structure, duck-typed through `getattr` with defaults), under MaxText's names, so the converter gets exactly
  what the whole config would have given it. tests/resharding/test_maxtext_layout.py records what the converter reads at
  the pinned MaxText and fails when it reads a name not here."""

  num_decoder_layers: int
  inhomogeneous_layer_cycle_interval: int
  param_scan_axis: int
  base_num_kv_heads: int | None
  num_kv_heads: int | None
  weight_dtype: Any
  padded_base_moe_mlp_dim: int | None
  prefuse_moe_weights: bool
  rollout_tensor_parallelism: int

  @classmethod
  def from_config(cls, config: Any) -> "TrainerLayers":
    """The values of a typed (trainer) config, as they are: the converter applies its own defaults and casts."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


class AdapterLayout:
  """Trainer weights -> MaxTextForCausalLM weights (one instance per engine: MaxText's converter caches its plan).

  `layers` gives the trainer's layer structure (`num_decoder_layers`, `param_scan_axis`,
  `inhomogeneous_layer_cycle_interval`, `base_num_kv_heads`); `tp` the engine's tensor-parallel size (kv heads and
  MoE shards); `prefuse_moe` whether the engine holds a fused `wi` (the engine's own config decides).
  """

  def __init__(self, layers: TrainerLayers, *, tp: int, prefuse_moe: bool):
    self.tp = int(tp)
    self.prefuse_moe = bool(prefuse_moe)
    self._layers = layers
    self._converters: dict[frozenset, weight_converter.MaxTextToMaxTextConverter] = {}

  def _converter(self, targets: frozenset) -> weight_converter.MaxTextToMaxTextConverter:
    if targets not in self._converters:  # a full sync and an adapter-only sync have different plans
      self._converters[targets] = weight_converter.MaxTextToMaxTextConverter(
          config=self._layers,
          tp=self.tp,
          kv_tp_size=self.tp,
          moe_mlp_tp_size=self.tp,
          prefuse_moe_weights=self.prefuse_moe,
      )
    return self._converters[targets]

  def convert(self, flat: Mapping[str, jax.Array], engine_flat: Mapping[str, Any]) -> dict[str, jax.Array]:
    """`{trainer path: array}` (`base.decoder...`) -> `{engine path: array}` (`model.decoder.layers_<i>...`).

    A subset of the trainer's weights (an adapter-only LoRA sync) converts into the engine weights it determines.
    """
    flat = unroll_gemma_blocks(flat)
    sources = {_layer_free(k.removeprefix("base.")) for k in flat}
    wanted = {k: v for k, v in engine_flat.items() if _source_of(k) & sources}
    converter = self._converter(frozenset(wanted))
    out = converter.convert(_nested(flat), _nested(wanted))
    return _flat(out)


def _layer_free(path: str) -> str:
  """A layer-independent name: `decoder.layers_3.x` and the scanned `decoder.layers.x` both -> `decoder.layers.x`."""
  return re.sub(r"(^|\.)layers_\d+(\.|$)", r"\1layers\2", path)


def _source_of(engine_path: str) -> set[str]:
  """The trainer names (layer-free) an engine weight is made from (`wi` <- `wi_0` + `wi_1`)."""
  name = _layer_free(engine_path.removeprefix("model."))
  if name.endswith(".wi"):
    return {name + "_0", name + "_1", name}
  return {name}


# The adapter's own module tree roots MaxText's decoder at `model` (`MaxTextForCausalLM.model`), which is what
# `nnx.state(adapter)` names. tpu-inference's worker hands the same weights re-rooted at `base`, the trainer's root:
# `TPUWorker.get_weights_state` -> `rl/raiden_worker_sync.extract_weight_state` returns `{"base": state["model"]}`.
ADAPTER_ROOT = "model"
WORKER_ROOT = "base"


def state_root(engine_flat: Mapping[str, Any]) -> str:
  """The first name component every engine weight shares (`base` from the real worker, `model` from the module)."""
  roots = {k.split(".", 1)[0] for k in engine_flat}
  if len(roots) != 1 or roots.isdisjoint({ADAPTER_ROOT, WORKER_ROOT}):
    raise ValueError(
        f"MaxTextForCausalLM weights must all sit under '{WORKER_ROOT}.' (tpu-inference's worker) or "
        f"'{ADAPTER_ROOT}.' (the module's own state); got roots {sorted(roots)[:4]}"
    )
  return roots.pop()


def rerooted(flat: Mapping[str, Any], old: str, new: str) -> dict[str, Any]:
  """`{old.x: v}` -> `{new.x: v}`."""
  return {new + k[len(old) :]: v for k, v in flat.items()}


def convert_and_move(
    layout: AdapterLayout,
    flat: Mapping[str, jax.Array],
    engine_flat: Mapping[str, Any],
    *,
    chunk_size: int | None = None,
    checksums: dict[str, int] | None = None,
) -> dict[str, jax.Array]:
  """Convert, then move onto the engine's shardings (plugin resharding, `chunk_size` arrays at a time); `checksums`
  (a per-host sync's guard) is filled with the converted arrays' trainer-side checksums before they move.

  `engine_flat` is named as the engine's weight state names it (`state_root`); the result (and `checksums`) is named
  the same way.
  """
  root = state_root(engine_flat)
  engine_flat = rerooted(engine_flat, root, ADAPTER_ROOT)
  converted = layout.convert(flat, engine_flat)
  unknown = sorted(set(converted) - set(engine_flat))
  if unknown:
    raise ValueError(f"{len(unknown)} converted weights have no MaxTextForCausalLM parameter, e.g. {unknown[:3]}")
  converted = {k: v.astype(engine_flat[k].dtype) for k, v in converted.items()}
  if checksums is not None:
    checksums.update(rerooted(per_host.source_checksums(converted), ADAPTER_ROOT, root))
  moved = move.reshard(converted, {k: engine_flat[k].sharding for k in converted}, chunk_size=chunk_size, donate=False)
  return rerooted(moved, ADAPTER_ROOT, root)
