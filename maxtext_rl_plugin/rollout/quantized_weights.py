"""The weights a quantized sampler holds (`rollout_quantization`): one quantized version per trainer weight version.

The embedded engine samples with MaxText's own model code and reads quantized kernels back in its decode program
(dequantize-on-read, resharding/quantize.py has the format). Why not MaxText's quantized model code (`quantization=int8`
/ `fp8` through AQT or Qwix): that quantizes in the forward pass of a float model (the float weights stay in memory and
each forward re-quantizes them; with `int8` its activations too), so it needs a second decode model built from another
config, and its numbers are not those of the weight-only formats a vLLM-TPU sampler computes with. Dequantize-on-read
keeps one decode program per shape bucket whatever the precision, computes exactly `q * s` in the compute dtype, and
lets XLA fuse the convert and the multiply into the matmul's operand read (what makes the quantized kernel the bytes the
decode loop reads on an accelerator; on the CPU it emulates the numbers, not the speed).

Two ways the quantized version is made, both on device and in chunks (`quantize.quantize_tree`):

* colocated (the sampler reads the trainer's own arrays, no sync): `of(state)` quantizes them when they changed since
  the last call (the same test of array identity as `lora.Merger`), i.e. once per optimizer step, never per decode step;
* disaggregated (a `WeightSync`): `quantize(params)` quantizes the trainer's weights on the trainer's devices; the sync
  moves the quantized bytes and the scales (a quarter of float32's bytes, half of bfloat16's), its guard compares their
  checksums on both sides, and `install` keeps what arrived as the version the engine samples with.

A LoRA actor's adapters are synced and merged in float (lora.Merger), and the merged kernels are quantized once per
adapter change: the trainer's LoRA stays in float, the sampler reads the merged weights in the chosen format.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.resharding import quantize

PyTree = Any


class SamplerWeights:
  """Quantized copies of a param State for one format (see the module docstring)."""

  def __init__(self, name: str, *, scan_axis: int | None, dtype: Any, chunk_bytes: int | None = None):
    self.form = quantize.fmt(name)
    self.scan_axis = scan_axis
    self.dtype = jnp.dtype(dtype)
    self.chunk_bytes = move.DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    self._plans: dict = {}
    self._key: list | None = None
    self._cached: Any = None
    self.held: Any = None  # the version a quantized sync installed (disaggregated runs)
    self.num_quantized = 0

  @classmethod
  def from_config(cls, config: Any) -> "SamplerWeights | None":
    """The config's quantizer (`rollout_quantization`), or None for a float sampler."""
    name = str(getattr(config, "rollout_quantization", "") or "")
    if name in ("", quantize.NONE):
      return None
    scan = int(getattr(config, "param_scan_axis", 1)) if bool(getattr(config, "scan_layers", True)) else None
    return cls(name, scan_axis=scan, dtype=config.weight_dtype)

  def _plan(self, pure: dict) -> dict:
    key = jax.tree.structure(pure)
    if key not in self._plans:
      self._plans[key] = quantize.plan(pure, self.scan_axis)
    return self._plans[key]

  def quantize(self, state: Any) -> Any:
    """A new State like `state` whose planned kernels hold `quantize.Quantized` values, computed on their devices."""
    pure = nnx.to_pure_dict(state)
    quantized = quantize.quantize_tree(pure, self.form, self._plan(pure), chunk_bytes=self.chunk_bytes)
    out = jax.tree.map(lambda x: x, state)  # a fresh State: the source's Variables are never touched
    nnx.replace_by_pure_dict(out, quantized)
    self.num_quantized += 1
    return out

  def of(self, state: Any) -> Any:
    """The quantized version of `state`, made again only when its arrays changed (colocated and LoRA samplers)."""
    leaves = jax.tree.leaves(state)
    if self._key is not None and len(leaves) == len(self._key) and all(a is b for a, b in zip(leaves, self._key)):
      return self._cached
    self._key, self._cached = leaves, self.quantize(state)
    return self._cached

  def install(self, new: Any) -> Any:
    """Keep a synced quantized version as the one the engine samples with; returns it (what the guard reads)."""
    self.held = new
    return new

  def read(self, params: PyTree) -> PyTree:
    """The weights as the sampler computes with them: every quantized kernel read back in the weight dtype."""
    return quantize.dequantize_tree(params, self.dtype)

  def bytes_held(self, state: Any) -> int:
    """Bytes of a quantized State (kernels, scales and the float leaves)."""
    return quantize.nbytes(state)
