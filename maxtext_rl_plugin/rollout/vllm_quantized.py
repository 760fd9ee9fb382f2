"""The vLLM rollout's quantized sync (`rollout_quantization=int8|fp8` on the native route): Qwix QArray leaves.

Which route tpu-inference 0.32.0 takes for a float checkpoint sampled in low precision, and why this one:

* Qwix PTQ (`additional_config.quantization.qwix.rules`, `models/jax/utils/qwix/qwix_utils.py`), int8 and FP8 alike.
  `model_loader._get_nnx_model` applies it to every native JAX class once the weights exist (a dummy load included:
  `apply_qwix_quantization(..., apply_to_abstract_model=False)`): Qwix traces one forward step and replaces each weight
  a matmul reads by a `QArray`, so the engine's state holds `<proj>.kernel.array.qvalue` (the kernel's shape, int8 or
  float8_e4m3fn) and `<proj>.kernel.array.scale` (float, the kernel's shape with its contracting axes kept as 1: one
  scale per output channel, `[1, heads, head_dim]` for q/k/v, `[1, 1, hidden]` for o, `[1, out]` for the MLP).
  The embedding (a lookup) and the output head (`compute_logits`, outside the traced forward) stay float, as in
  resharding/quantize.py's plan. Weight-only (no `act_qtype`): the engine reads `q * s` into a float matmul, the
  function the embedded engine's dequantize-on-read computes.
* Not vLLM's `quantization="fp8"` (`layers/jax/quantization/fp8.py`): Llama 3.1's native class builds its projections
  from `nnx.Linear` / `nnx.Einsum`, which take no quantization config (its weights would stay float, silently), and
  where it applies (Qwen3's `JaxEinsum`), `Fp8TensorwiseLinearMethod` also quantizes the activations per token (W8A8):
  another function than the embedded sampler's (tests/tpu_contract/test_quantized_layers.py measures that gap).
* `use_abstract_model` stays off: its dummy load (`load_random_weights_into_qwix_abstract_model`) needs an
  FP8-serialized checkpoint's `weight_block_size` and a model `weight_loader`, which a float checkpoint has not.

The sync (rollout/vllm_sync.write_weights) then writes what Qwix would have made of the float weights a float sync
writes: each MaxText kernel goes through the same export tables and engine layout as a float one (`float_view` offers
the mapping a float target of the QArray's shape), then `quantize` quantizes it on the trainer's devices, chunk by chunk
(resharding/quantize.py: Qwix's bounds and rounding, bit for bit), over the contracting axes the engine's own scale leaf
shows (its size-1 axes), and the pair is moved onto the engine leaves' shardings. The checksum guard
(`rl.verify_weight_sync`) compares the written leaves, so it covers the quantized bytes and the scales.

Per-output-channel quantization commutes with what the mapping does to a kernel (transposes, per-head reshapes, kv
heads repeated, head_dim zero-padded: a padded channel gets scale 1, q 0), so on a float32 engine quantizing in the
engine's layout gives the embedded engine's bytes, except where an export hook rescales a kernel (Llama's query,
pre-scaled by 1/sqrt(head_dim) in MaxText): there the scales differ by float32 rounding and a value on a rounding tie
may land one step away (tests/tpu_contract/test_quantized_sync.py measures the logits against MaxText's forward at the
embedded engine's quantized weights). A bfloat16 engine holds bfloat16 scales: Qwix quantizes a weight in the weight's own
dtype (`qarray.quantize`: the absmax, the scale and `w / scale` each rounded to bfloat16 before `w / scale` is rounded
to int8 or cast to e4m3), so the sync computes each pair in the engine scale's dtype the same way (`quantize`'s
`dtype`) and writes Qwix's own bytes and scales, bit for bit (tests/rollout/test_vllm_quantized.py; against
tpu-inference's own PTQ of a bfloat16 engine: tests/tpu_contract/test_quantized_sync.py). Rounding a
float32 computation's scale to bfloat16 afterwards would not: `w / scale` rounded to bfloat16 first moves about 9% of
int8 values and 3% of e4m3 ones by one step (a normal weight), and those steps are also what separates a bfloat16
vLLM sampler's bytes from the embedded engine's float32 quantization (rollout/quantized_weights.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.resharding import quantize as qz

QTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}  # rollout_quantization -> Qwix's weight_qtype
QVALUE, SCALE = ".array.qvalue", ".array.scale"


def engine_quantization(name: str) -> dict:
  """`additional_config["quantization"]` of a quantized sampler: Qwix PTQ rules for every matmul weight of the
  forward (`module_path` '.*', the spelling tpu-inference's own rule lookups expect), weight-only, per output channel
  (Qwix's default for a weight: channelwise over every non-contracting axis)."""
  return {"qwix": {"rules": [{"module_path": ".*", "weight_qtype": QTYPES[name]}]}}


def with_quantization(additional: Mapping[str, Any], value: Any) -> dict:
  """vLLM's `additional_config` for a sampler precision (`rollout_quantization` = `value`): with `engine_quantization`'s
  Qwix rules for int8 / fp8, unchanged for a float sampler. The precision has one spelling: a `quantization` entry of
  the user's own in `vllm_additional_config` beside it is one ConfigError line."""
  name = "" if value in (None, False, "none", "None") else str(value)
  if not name:
    return dict(additional)
  if "quantization" in additional:
    raise ConfigError(
        f"invalid value for 'vllm_additional_config': it sets 'quantization' and rollout_quantization={name} sets the "
        "engine's Qwix rules (rollout/vllm_quantized.py); give one of the two"
    )
  return {**additional, "quantization": engine_quantization(name)}


@dataclasses.dataclass(frozen=True)
class Slot:
  """One quantized engine kernel: its QArray leaves, the format and the contracting axes its scale shows."""

  qvalue: str
  scale: str
  form: qz.Format
  axes: tuple[int, ...]


def _format(dtype: Any) -> qz.Format:
  for form in qz.FORMATS.values():
    if jnp.dtype(form.dtype) == jnp.dtype(dtype):
      return form
  raise ValueError(f"a quantized vLLM kernel of dtype {jnp.dtype(dtype).name}: the sync writes int8 and float8_e4m3fn")


def slots(engine_flat: Mapping[str, Any]) -> dict[str, Slot]:
  """`{kernel name: Slot}` of the engine's QArray kernels (empty for a float engine). A scale that is not one per
  output channel (a tiled Qwix rule: a scale axis neither 1 nor the kernel's) is refused: the sync writes no tiles."""
  out = {}
  for name, q in engine_flat.items():
    if not name.endswith(QVALUE):
      continue
    base = name[: -len(QVALUE)]
    s = engine_flat.get(base + SCALE)
    if s is None or len(s.shape) != len(q.shape) or any(b not in (1, a) for a, b in zip(q.shape, s.shape)):
      raise ValueError(f"vLLM parameter {base}: a QArray whose scale {getattr(s, 'shape', None)} is not per channel")
    out[base] = Slot(name, base + SCALE, _format(q.dtype), tuple(d for d, b in enumerate(s.shape) if b == 1))
  return out


def float_view(engine_flat: Mapping[str, Any], kernels: Mapping[str, Slot]) -> dict[str, Any]:
  """The engine's weights as the mapping targets them: each QArray pair seen as the float kernel it holds (the
  qvalue's shape and sharding, the scale's dtype), every other leaf as it is."""
  out = {k: v for k, v in engine_flat.items() if not k.endswith((QVALUE, SCALE))}
  for base, slot in kernels.items():
    q, s = engine_flat[slot.qvalue], engine_flat[slot.scale]
    out[base] = jax.ShapeDtypeStruct(q.shape, s.dtype, sharding=getattr(q, "sharding", None))
  return out


def _key(name: str) -> str:
  """`quantize_tree`'s name of a top-level dict entry (`jax.tree_util.keystr`)."""
  return jax.tree_util.keystr((jax.tree_util.DictKey(name),))


def quantize(new: Mapping[str, jax.Array], kernels: Mapping[str, Slot], engine_flat: Mapping[str, Any]) -> dict:
  """The mapped float kernels among `new` replaced by their QArray leaves (`{qvalue name: q, scale name: scale}`),
  quantized where they are (the trainer's devices), one jitted call per format and chunk (`quantize.quantize_tree`);
  other leaves unchanged. Each is computed in the engine scale's dtype, the dtype Qwix quantized the engine's float
  weight in (the scale is that weight's dtype), so the pair is Qwix's own, bit for bit, bfloat16 included."""
  out = {k: v for k, v in new.items() if k not in kernels}
  dtype = {k: jnp.dtype(engine_flat[kernels[k].scale].dtype) for k in new if k in kernels}
  for form, dt in {(kernels[k].form.name, d) for k, d in dtype.items()}:
    names = [k for k, d in dtype.items() if kernels[k].form.name == form and d == dt]
    axes_of = {_key(k): kernels[k].axes for k in names}
    done = qz.quantize_tree({k: new[k] for k in names}, qz.fmt(form), axes_of, dtype=dt)
    for k in names:
      out[kernels[k].qvalue], out[kernels[k].scale] = done[k].q, done[k].scale
  return out
