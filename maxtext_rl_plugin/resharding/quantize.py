r"""The sampler's weight quantization (`rollout_quantization`): int8 and FP8 (e4m3) weights, per output channel.

Only the sampler is quantized; the trainer keeps its weights and its precision. At every sync the matmul kernels the
sampler receives are quantized on the trainer's devices, chunk by chunk, and moved as quantized bytes plus scales
(half the bytes of bfloat16), then read back by the sampler (the embedded engine dequantizes them in its decode program;
vLLM-TPU computes with them in its quantized layers). The format, per kernel W with contracting (input) axes K:

    s = max_K |W| / B        (float32, one scale per output channel: W's shape with the axes K kept as 1)
    int8:  q = clip(round(W / s), -128, 127)               B = 127.5
    fp8:   q = float8_e4m3fn(clip(W / s, -448, 448))        B = 448 = float8_e4m3fn's largest finite value
    W ~ q * s                (dequantize-on-read; a channel with s < 2**-63, a zero one, gets s = 1 and q = 0)

Why per output channel and not per block: it is the layout both of the pinned stack's online paths consume.
tpu-inference 0.32.0's FP8 linear method for a checkpoint that is not FP8-serialized (`Fp8TensorwiseLinearMethod`,
`layers/jax/quantization/fp8.py`) holds an `[in, out]` float8_e4m3fn weight and a float32 `weight_scale` of shape
`[out]`, and its block-wise method exists only for FP8-serialized checkpoints (`Fp8Config` refuses block sizes
otherwise); Qwix's PTQ, which tpu-inference applies to its native JAX classes (`models/jax/utils/qwix/`), scales a
weight over its contracting axes (channelwise on every other axis), the same layout. A sampler that must be re-fed
every RL step has no calibration data, so the scale is the absmax (Qwix's default `calibration_method`). Per-channel
scales cost one float per output channel: nothing beside the kernel.
The bounds and rounding are Qwix's (`qarray.compute_scale_zero_point`, `numerics.get_symmetric_bound`): int8's
127.5 lets the outermost buckets hold [126.5, 127.5) and [-128.5, -127.5) (the channel's absmax lands at 128 and
saturates to 127: still within half a step); fp8's 448 is e4m3fn's largest finite value, and the cast rounds to nearest
even. Qwix floors a scale below 2**-63 to 1. So a sync's quantized bytes equal what tpu-inference's own Qwix PTQ
makes of the same float weights, bit for bit, when computed in the weights' dtype (`quantize`'s `dtype`: float32 here,
tests/resharding/test_quantize.py; bfloat16 for a bfloat16 vLLM engine, tests/rollout/test_vllm_quantized.py).

What is quantized (`plan`): MaxText's `DenseGeneral` kernels (attention q/k/v/out, MLA's projections, the dense MLP)
and the MoE experts' `wi_0`/`wi_1`/`wo`. Not quantized, as in vLLM's FP8 online mode and Qwix's MoE defaults: the
embedding table, an untied output head (`logits_dense`), norms and the MoE router (`gate`), whose near-ties decide
routing. Contracting axes: a `DenseGeneral` kernel is `in_shape + out_shape` with the scanned layer axis inserted at
`param_scan_axis`; its input is the first axis, for attention's `out` (heads, head_dim -> embed) every axis but the
last. The MoE experts are `[experts, (layers,) in, out]`: the second axis from the end.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

NONE = "none"


@dataclasses.dataclass(frozen=True)
class Format:
  """One weight format: its storage dtype and the bound B the absmax of a channel maps to."""

  name: str
  dtype: Any
  bound: float

  @property
  def is_float(self) -> bool:
    return jnp.issubdtype(self.dtype, jnp.floating)


FORMATS = {
    "int8": Format("int8", jnp.int8, 127.5),
    "fp8": Format("fp8", jnp.float8_e4m3fn, float(jnp.finfo(jnp.float8_e4m3fn).max)),
}
CHOICES = (NONE, *FORMATS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Quantized:
  """A quantized kernel: `q` (the kernel's shape, int8 or float8_e4m3fn) and `scale` (float32, or the dtype it was
  computed in; the kernel's shape with its contracting axes kept as 1). A pytree, so it travels through jit,
  device_put and the sync's checksums."""

  q: jax.Array
  scale: jax.Array

  @property
  def shape(self):
    return self.q.shape


_TINY_SQRT = float(np.sqrt(np.finfo(np.float32).tiny))  # 2**-63, Qwix's floor under a scale (same for bfloat16)


def is_quantized(x) -> bool:
  return isinstance(x, Quantized)


def fmt(name: str) -> Format:
  return FORMATS[name]


def quantize(w: jax.Array, form: Format, axes: Sequence[int], dtype: Any = jnp.float32) -> Quantized:
  """Symmetric quantization of `w` with one scale per slice over its contracting `axes` (module docstring), computed in
  `dtype` step by step as Qwix's `qarray.quantize` computes it for a weight of that dtype: the absmax, the scale and
  `w / scale` each rounded to `dtype`, then rounded or cast to the format. In float32 (the embedded engine) that is the
  formula above; in bfloat16 (a bfloat16 vLLM engine's Qwix PTQ) `w / scale` is rounded to bfloat16 before it is
  rounded to int8 or cast to e4m3, which moves about one value in ten by one step against the float32 formula."""
  x = jnp.asarray(w, dtype)
  absmax = jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True)
  scale = absmax / form.bound
  scale = jnp.where(scale < _TINY_SQRT, jnp.ones_like(scale), scale)
  y = x / scale
  if form.is_float:
    q = jnp.clip(y, -form.bound, form.bound).astype(form.dtype)
  else:
    info = jnp.iinfo(form.dtype)
    q = jnp.clip(jnp.round(y), info.min, info.max).astype(form.dtype)
  return Quantized(q, scale)


def dequantize(qw: Quantized, dtype: Any = jnp.float32) -> jax.Array:
  """`q * scale` in float32, then `dtype` (the sampler's weight dtype)."""
  return (qw.q.astype(jnp.float32) * qw.scale).astype(dtype)


def fake_quantize(w: jax.Array, form: Format, axes: Sequence[int]) -> jax.Array:
  """The weight the sampler computes with: quantized and read back, in `w`'s dtype (equal to dequantize-on-read)."""
  return dequantize(quantize(w, form, axes), w.dtype)


def _names(path) -> list[str]:
  out = []
  for k in path:
    name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
    if name is not None and name != "value":
      out.append(str(name))
  return out


_SKIP = ("gate", "logits_dense", "token_embedder", "embedding", "vision_encoder", "lora_a", "lora_b")
_MOE_EXPERTS = ("wi_0", "wi_1", "wo")


def contracting_axes(names: Sequence[str], ndim: int, scan_axis: int | None) -> tuple[int, ...] | None:
  """The contracting axes of the kernel at parameter path `names` (module docstring), or None: not quantized."""
  if ndim < 2 or any(n in _SKIP or n.endswith("_lora_a") or n.endswith("_lora_b") for n in names):
    return None
  leaf, parent = names[-1], (names[-2] if len(names) > 1 else "")
  if leaf == "kernel":
    free = [d for d in range(ndim) if d != scan_axis]
    if len(free) < 2:
      return None
    return tuple(free[:-1]) if parent == "out" else (free[0],)
  if leaf in _MOE_EXPERTS and ndim >= 3:  # [experts, (layers,) in, out]
    return (ndim - 2,)
  return None


def plan(tree: PyTree, scan_axis: int | None = 1) -> dict[str, tuple[int, ...]]:
  """{keystr path: contracting axes} of the leaves of a param tree (an nnx State or a nested dict) to quantize."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    axes = contracting_axes(_names(path), np.ndim(x), scan_axis)
    if axes is not None:
      out[jax.tree_util.keystr(path)] = axes
  return out


def scale_sharding(sharding: Any, axes: Sequence[int], ndim: int) -> Any:
  """The scale's sharding: the kernel's, with its (size-1) contracting axes unsharded."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  spec = tuple(None if d in axes else s for d, s in enumerate(spec))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


_QUANTIZE_FNS: dict = {}


def _chunk_fn(form: Format, axes: tuple, out_shardings: tuple, dtype: Any):
  """One jitted quantization of a chunk's kernels onto their own shardings, cached by layout."""
  key = (form.name, axes, out_shardings, jnp.dtype(dtype).name)
  fn = _QUANTIZE_FNS.get(key)
  if fn is None:
    placed = all(s is not None for s in out_shardings)
    fn = jax.jit(
        lambda xs: [quantize(x, form, a, dtype) for x, a in zip(xs, axes)],
        out_shardings=[Quantized(*s) for s in out_shardings] if placed else None,
    )
    _QUANTIZE_FNS[key] = fn
  return fn


def quantize_tree(
    tree: PyTree,
    form: Format,
    axes_of: Mapping[str, tuple[int, ...]],
    chunk_bytes: int | None = 64 * 2**20,
    dtype: Any = jnp.float32,
) -> PyTree:
  """`tree` with each leaf named in `axes_of` replaced by its `Quantized` form (computed in `dtype`: `quantize`), on the
  leaf's own devices (q on the kernel's sharding, the scale on `scale_sharding`), in chunks of at most `chunk_bytes` of
  source weights (one jitted call each, waited for before the next): one chunk's intermediates are all the sync adds."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in flat]
  leaves = [x for _, x in flat]
  todo = [i for i, p in enumerate(paths) if p in axes_of]
  chunks, cur, size = [], [], 0
  for i in todo:
    n = int(np.prod(np.shape(leaves[i]))) * jnp.dtype(leaves[i].dtype).itemsize
    if cur and chunk_bytes is not None and size + n > chunk_bytes:
      chunks.append(cur)
      cur, size = [], 0
    cur.append(i)
    size += n
  if cur:
    chunks.append(cur)
  out = list(leaves)
  for idx in chunks:
    xs = [leaves[i] for i in idx]
    axes = tuple(tuple(axes_of[paths[i]]) for i in idx)
    shardings = tuple(
        (x.sharding, scale_sharding(x.sharding, a, x.ndim)) if isinstance(x, jax.Array) else None
        for x, a in zip(xs, axes)
    )
    res = _chunk_fn(form, axes, shardings, dtype)(xs)
    jax.block_until_ready(res)
    for i, r in zip(idx, res):
      out[i] = r
  return jax.tree_util.tree_unflatten(treedef, out)


def dequantize_tree(tree: PyTree, dtype: Any) -> PyTree:
  """Every `Quantized` leaf read back as `dtype`; other leaves unchanged (inside the sampler's jitted program)."""
  return jax.tree.map(lambda x: dequantize(x, dtype) if is_quantized(x) else x, tree, is_leaf=is_quantized)


def nbytes(tree: PyTree) -> int:
  """Bytes of a tree's arrays (quantized leaves count their q and scale)."""
  return int(sum(int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
