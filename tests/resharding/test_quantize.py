"""resharding/quantize.py against a NumPy derivation: the scale layout, the round trip's error bounds, which kernels
are quantized and along which axes, and the on-device chunked tree quantization (cheap: no model is built)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxtext_rl_plugin.resharding import quantize as qz

RNG = np.random.default_rng(0)


def _np_quantize(w, name, axes):
  """The module docstring's formulas in NumPy (ml_dtypes' float8_e4m3fn rounds to nearest even, as XLA's cast)."""
  w = np.asarray(w, np.float64)
  bound = 127.5 if name == "int8" else 448.0
  absmax = np.max(np.abs(w), axis=tuple(axes), keepdims=True).astype(np.float32)
  scale = np.where(absmax > 0, absmax / np.float32(bound), 1.0).astype(np.float32)
  y = w.astype(np.float32) / scale
  if name == "int8":
    return np.clip(np.round(y), -128, 127).astype(np.int8), scale
  return np.clip(y, -bound, bound).astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("shape,axes", [((64, 3, 4, 16), (0,)), ((4, 3, 16, 64), (0, 2)), ((4, 32, 48), (1,))])
def test_quantize_matches_numpy_and_scale_layout(name, shape, axes):
  w = RNG.normal(size=shape).astype(np.float32) * RNG.uniform(0.01, 3.0, size=(1,) * (len(shape) - 1) + shape[-1:])
  w[(0,) * len(shape)] = 0.0
  got = qz.quantize(jnp.asarray(w), qz.fmt(name), axes)
  want_q, want_s = _np_quantize(w, name, axes)
  assert got.scale.shape == tuple(1 if d in axes else n for d, n in enumerate(shape)) and got.scale.dtype == np.float32
  np.testing.assert_allclose(np.asarray(got.scale), want_s, rtol=1e-6)
  assert got.q.dtype == (jnp.int8 if name == "int8" else jnp.float8_e4m3fn)
  # Equal codes, but where w/s sits within float32 rounding of an int8 rounding tie (a channel's absmax lands on
  # 127.5): XLA's and NumPy's division may put it on either side (both within half a step).
  diff = np.abs(np.asarray(got.q).astype(np.float32) - want_q.astype(np.float32))
  y = w.astype(np.float64) / want_s
  tie = np.abs(np.abs(y - np.floor(y)) - 0.5) < 1e-4
  assert np.all(diff[~tie] == 0) and np.all(diff <= (1 if name == "int8" else 0))
  # Round trip: int8 is off by at most half a step (s/2); e4m3 by 2^-4 relative (3 mantissa bits, round to nearest)
  # above its smallest normal (2^-6 * s), by half a subnormal step (2^-10 * s) below it.
  back = np.asarray(qz.dequantize(got, jnp.float32), np.float64)
  err = np.abs(back - w)
  s = np.broadcast_to(want_s, w.shape).astype(np.float64)
  if name == "int8":
    assert np.all(err <= s / 2 * (1 + 1e-4))
  else:
    assert np.all(err <= np.maximum(np.abs(w) * 2.0**-4, s * 2.0**-10) * (1 + 1e-4))
  if name == "fp8":  # the largest weight maps to the bound and is represented exactly: the scale is not off by a step
    assert np.abs(back).max() == pytest.approx(np.abs(w).max(), rel=1e-6)


@pytest.mark.parametrize("name,qtype", [("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)])
def test_bit_equal_to_qwix_ptq(name, qtype):
  """The bytes and scales equal Qwix's own quantization of the same weight (what tpu-inference's Qwix PTQ makes of a
  float checkpoint), channelwise on the non-contracting axes."""
  qarray = pytest.importorskip("qwix._src.core.qarray")
  w = jnp.asarray(RNG.normal(size=(64, 3, 48)).astype(np.float32))
  ours = qz.quantize(w, qz.fmt(name), (0,))
  theirs = qarray.quantize_api(w, qtype, channelwise_axes=(1, 2))
  np.testing.assert_array_equal(np.asarray(ours.q).view(np.uint8), np.asarray(theirs.qvalue).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(ours.scale), np.asarray(theirs.scale))
  np.testing.assert_array_equal(np.asarray(qz.dequantize(ours)), np.asarray(qarray.dequantize(theirs)))


def test_wrong_scale_layout_is_visible():
  """Scales applied to the wrong channels (reversed: same shape, same values) read back another matrix."""
  w = RNG.normal(size=(64, 32)).astype(np.float32) * np.linspace(0.01, 2.0, 32)[None, :]
  q = qz.quantize(jnp.asarray(w), qz.fmt("fp8"), (0,))
  right = np.asarray(qz.dequantize(q))
  wrong = np.asarray(qz.dequantize(qz.Quantized(q.q, jnp.asarray(np.asarray(q.scale)[:, ::-1]))))
  assert np.abs(right - w).max() < 2.0**-4 * np.abs(w).max()
  assert np.abs(wrong - w).max() > 0.5 * np.abs(w).max()


MAXTEXT_LEAVES = {  # the tiny Qwen3's scanned params (param_scan_axis=1) and an MoE block's: path -> (shape, axes)
    ("decoder", "layers", "self_attention", "query", "kernel"): ((64, 2, 4, 16), (0,)),
    ("decoder", "layers", "self_attention", "key", "kernel"): ((64, 2, 2, 16), (0,)),
    ("decoder", "layers", "self_attention", "out", "kernel"): ((4, 2, 16, 64), (0, 2)),
    ("decoder", "layers", "mlp", "wi_0", "kernel"): ((64, 2, 128), (0,)),
    ("decoder", "layers", "mlp", "wo", "kernel"): ((128, 2, 64), (0,)),
    ("decoder", "layers", "moe_block", "MoeBlock_0", "wi_0"): ((4, 2, 64, 32), (2,)),
    ("decoder", "layers", "moe_block", "MoeBlock_0", "wo"): ((4, 2, 32, 64), (2,)),
    ("decoder", "layers", "moe_block", "MoeBlock_0", "gate", "kernel"): ((64, 2, 4), None),
    ("decoder", "decoder_norm", "scale"): ((64,), None),
    ("decoder", "layers", "pre_self_attention_layer_norm", "scale"): ((64, 2), None),
    ("decoder", "logits_dense", "kernel"): ((64, 528), None),
    ("token_embedder", "embedding"): ((528, 64), None),
}


@pytest.mark.parametrize("path", list(MAXTEXT_LEAVES), ids=lambda p: ".".join(p[-2:]))
def test_plan_quantizes_the_matmul_kernels_along_their_inputs(path):
  shape, axes = MAXTEXT_LEAVES[path]
  assert qz.contracting_axes(list(path), len(shape), 1) == axes


def test_unscanned_out_kernel():
  assert qz.contracting_axes(["layers_0", "self_attention", "out", "kernel"], 3, None) == (0, 1)
  assert qz.contracting_axes(["layers_0", "mlp", "wi_0", "kernel"], 2, None) == (0,)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantize_tree_in_chunks_on_device_keeps_shardings(name):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  tree = {
      "decoder": {
          "layers": {
              "mlp": {"wi_0": {"kernel": jax.device_put(RNG.normal(size=(64, 2, 128)).astype(np.float32), sh)}},
              "self_attention": {
                  "out": {"kernel": jax.device_put(RNG.normal(size=(4, 2, 16, 64)).astype(np.float32), sh)}
              },
          },
          "decoder_norm": {"scale": jnp.ones((64,))},
      }
  }
  axes_of = qz.plan(tree, scan_axis=1)
  assert set(axes_of) == {
      "['decoder']['layers']['mlp']['wi_0']['kernel']",
      "['decoder']['layers']['self_attention']['out']['kernel']",
  }
  one = qz.quantize_tree(tree, qz.fmt(name), axes_of, chunk_bytes=None)
  small = qz.quantize_tree(tree, qz.fmt(name), axes_of, chunk_bytes=1)  # one kernel per chunk
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(small)):
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
  wi = small["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
  assert qz.is_quantized(wi) and wi.q.sharding.is_equivalent_to(sh, 3) and wi.scale.shape == (1, 2, 128)
  assert qz.nbytes(small) < qz.nbytes(tree) / 3.5
  back = qz.dequantize_tree(small, jnp.float32)
  w = tree["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
  np.testing.assert_array_equal(
      np.asarray(back["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]), np.asarray(qz.fake_quantize(w, qz.fmt(name), (0,)))
  )
