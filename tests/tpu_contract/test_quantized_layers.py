"""The quantized sampler's weights (`rollout_quantization`) in tpu-inference 0.32.0's own quantized layers, on CPU.

The layer-level pieces of the vLLM route's quantized sync (test_quantized_sync.py proves the whole route: the real
Qwix-quantized model's logits after the plugin's sync), with the real library objects:

* Qwix PTQ, which tpu-inference applies to its native JAX classes (`models/jax/utils/qwix/qwix_utils.py`:
  `qwix.quantize_model(model, qwix.PtqProvider(rules), ...)` with `additional_config.quantization.qwix.rules`), run
  here on tpu-inference's own `LlamaMLP`: the bytes and scales it makes of a float kernel equal the plugin's
  (resharding/quantize.py) bit for bit, int8 and FP8; the layout it holds (`kernel.array.qvalue` [in, out],
  `kernel.array.scale` [1, out]) is the plugin's per-output-channel layout; written into those leaves, the plugin's
  quantized weights give the module's output within float32 rounding of the embedded engine's dequantize-on-read
  (the same `q * s` multiplied in float32); scales in the wrong channel order (a layout bug in a sync) move it by far
  more than the tolerance.
* `Fp8TensorwiseLinearMethod` (`layers/jax/quantization/fp8.py`: vLLM's `quantization=fp8` on tpu-inference's
  `JaxEinsum` layers), fed the plugin's FP8 kernel transposed to its `[in, out]` weight and the scale as its `[out]`
  `weight_scale`: its output is within `W8A8_TOL` of dequantize-on-read. That method also quantizes the activations
  per token (`xla_quantized_matmul(quantize_activation=True)`), which the embedded engine does not: the tolerance is
  the measured W8A8 gap with headroom (module constants), and the wrong scale order is asserted to exceed it by 10x.

The full model's logits through a Qwix-quantized `LlamaForCausalLM` / `Qwen3ForCausalLM` are test_quantized_sync.py's
(its PTQ pass runs with a shapes-only attention: the pass traces random attention metadata, which the reference kernel
cannot validate under the trace, and reads no weight in the attention).
"""

# tpu_inference, vllm and qwix's PTQ on tpu-inference's modules exist only in .venv-tpu; imported where used.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rl_plugin.resharding import quantize as qz

FORMATS = {"int8": "int8", "fp8": "float8_e4m3fn"}
HIDDEN, MLP = 128, 256
F32_TOL = 1e-5  # float32 rounding of the same q * s products, relative to the largest |output|
W8A8_TOL = (
    0.08  # FP8 activations (per-token) on top of FP8 weights: measured 0.027-0.034 (3 seeds); wrong order 0.96-1.16
)


def _mesh():
  from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES

  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXIS_NAMES)), MESH_AXIS_NAMES)


def _maxtext_kernels(seed=0):
  """A MaxText MLP's float kernels as the trainer holds them, scanned ([in, layers, out]), 2 layers."""
  rng = np.random.default_rng(seed)
  scale = rng.uniform(0.2, 3.0, size=(1, 1, MLP)).astype(np.float32)  # channels of very different ranges
  return {
      "wi_0": (rng.normal(size=(HIDDEN, 2, MLP)) * scale * 0.05).astype(np.float32),
      "wi_1": (rng.normal(size=(HIDDEN, 2, MLP)) * scale * 0.05).astype(np.float32),
      "wo": (rng.normal(size=(MLP, 2, HIDDEN)) * 0.05).astype(np.float32),
  }


def _synced(kernels, name, layer):
  """What a quantized sync sends for one layer: the plugin's quantization of the trainer's scanned kernels, on
  MaxText's side, then that layer's slice (the engine holds one layer per module)."""
  out = {}
  for k, w in kernels.items():
    qw = qz.quantize(jnp.asarray(w), qz.fmt(name), qz.contracting_axes(["mlp", k, "kernel"], 3, 1))
    out[k] = qz.Quantized(jnp.asarray(qw.q)[:, layer], jnp.asarray(qw.scale)[:, layer])
  return out


def _dequantize_on_read(synced, x):
  """The embedded engine's MLP at the same quantized weights: q * s in float32, MaxText's silu(x W0) * (x W1) W_o."""
  w = {k: qz.dequantize(v) for k, v in synced.items()}
  return (jax.nn.silu(x @ w["wi_0"]) * (x @ w["wi_1"])) @ w["wo"]


def _llama_mlp_ptq(qtype, x):
  """tpu-inference's own LlamaMLP, PTQ-quantized by Qwix as tpu-inference quantizes its native classes."""
  import qwix
  from tpu_inference.models.jax.llama3 import LlamaMLP
  from transformers import LlamaConfig

  config = LlamaConfig.from_dict({"hidden_size": HIDDEN, "intermediate_size": MLP, "hidden_act": "silu"})
  with jax.set_mesh(_mesh()):
    mlp = LlamaMLP(config, jnp.float32, nnx.Rngs(0))
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=qtype)]
    return mlp, qwix.quantize_model(nnx.clone(mlp), qwix.PtqProvider(rules), x)


_ENGINE_NAMES = {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}


def _write(ptq, synced):
  """The sync's writes into the PTQ module's QArray leaves (`<proj>.kernel.array.{qvalue,scale}`)."""
  for k, v in synced.items():
    arr = getattr(ptq, _ENGINE_NAMES[k]).kernel.array
    assert arr.qvalue.shape == v.q.shape and arr.qvalue.dtype == v.q.dtype, (k, arr.qvalue.shape, v.q.shape)
    assert arr.scale.shape == v.scale.shape, (k, arr.scale.shape, v.scale.shape)
    arr.qvalue.value, arr.scale.value = v.q, v.scale


def _rel(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_qwix_ptq_of_tpu_inference_llama_mlp_holds_the_plugins_bytes_and_computes_its_function(name):
  kernels = _maxtext_kernels()
  x = jnp.asarray(np.random.default_rng(1).normal(size=(5, HIDDEN)).astype(np.float32))
  synced = _synced(kernels, name, layer=1)
  float_mlp, ptq = _llama_mlp_ptq(FORMATS[name], x)

  # Qwix's own quantization of the same float kernels (loaded as tpu-inference loads float weights) is the plugin's.
  import qwix

  for k in synced:
    getattr(float_mlp, _ENGINE_NAMES[k]).kernel.value = jnp.asarray(kernels[k][:, 1])
  rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=FORMATS[name])]
  with jax.set_mesh(_mesh()):
    own = qwix.quantize_model(float_mlp, qwix.PtqProvider(rules), x)
  for k, v in synced.items():
    arr = getattr(own, _ENGINE_NAMES[k]).kernel.array
    np.testing.assert_array_equal(np.asarray(arr.qvalue.value).view(np.uint8), np.asarray(v.q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(arr.scale.value), np.asarray(v.scale))

  _write(ptq, synced)
  want = _dequantize_on_read(synced, x)
  assert _rel(ptq(x), want) < F32_TOL

  wrong = dict(synced, wi_0=qz.Quantized(synced["wi_0"].q, synced["wi_0"].scale[:, ::-1]))
  _write(ptq, wrong)
  assert _rel(ptq(x), want) > 100 * F32_TOL


def test_tpu_inference_fp8_linear_method_computes_with_the_plugins_fp8_weights():
  from tpu_inference.layers.jax.linear import JaxEinsum
  from tpu_inference.layers.jax.quantization.fp8 import Fp8Config
  from tpu_inference.layers.jax.quantization.fp8 import Fp8TensorwiseLinearMethod

  kernels = _maxtext_kernels(seed=2)
  synced = _synced(kernels, "fp8", layer=0)["wi_0"]  # q [in, out], scale [1, out]
  x = jnp.asarray(np.random.default_rng(3).normal(size=(8, HIDDEN)).astype(np.float32))
  want = x @ qz.dequantize(synced)
  config = Fp8Config({"quant_method": "fp8", "activation_scheme": "dynamic"})
  mesh = _mesh()
  with jax.set_mesh(mesh):
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    layer = JaxEinsum("TD,DF->TF", (HIDDEN, MLP), nnx.Rngs(0), quant_config=config, param_dtype=jnp.float32)
    assert isinstance(layer.quant_method, Fp8TensorwiseLinearMethod)
    assert layer.weight.shape == synced.q.shape and layer.weight_scale.shape == (MLP,)
    layer.weight.value, layer.weight_scale.value = synced.q, synced.scale.reshape(MLP)
    got = layer(x)
    gap = _rel(got, want)
    layer.weight_scale.value = synced.scale.reshape(MLP)[::-1]
    wrong = _rel(layer(x), want)
  assert gap < W8A8_TOL, gap
  assert wrong > 10 * W8A8_TOL, wrong
