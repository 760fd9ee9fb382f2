"""rollout/vllm_quantized.py: the vLLM sync's QArray leaves, against Qwix's own quantization (no vLLM needed).

tests/tpu_contract/test_quantized_sync.py runs the whole route into tpu-inference's real quantized model; this checks the
pieces on engine-shaped leaves (Qwix's QArray layout: `kernel.array.qvalue` the kernel's shape, `kernel.array.scale`
the kernel's shape with the contracting axes kept as 1), in a second.
"""

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.resharding import quantize as qz
from maxtext_rl_plugin.rollout import vllm_mapping as vm
from maxtext_rl_plugin.rollout import vllm_quantized as vq

QTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _engine(name, dtype=jnp.float32):
  """A quantized engine's flat weights: q_proj [hidden, heads, head_dim] (scale [1, heads, head_dim]), o_proj
  [heads, head_dim, hidden] (scale [1, 1, hidden]), a float norm; scales and norm in `dtype` (the engine's)."""
  q = QTYPE[name]
  return {
      "l.q_proj.kernel.array.qvalue": jnp.zeros((16, 2, 8), q),
      "l.q_proj.kernel.array.scale": jnp.ones((1, 2, 8), dtype),
      "l.o_proj.kernel.array.qvalue": jnp.zeros((2, 8, 16), q),
      "l.o_proj.kernel.array.scale": jnp.ones((1, 1, 16), dtype),
      "l.norm.scale": jnp.ones((16,), dtype),
  }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_the_sync_writes_qwix_s_quantization_of_each_kernel_in_the_engine_s_layout(name, dtype):
  """Bit for bit Qwix's `qarray.quantize` of the float weight a float sync writes, in the engine's dtype: for a
  bfloat16 engine Qwix rounds `w / scale` to bfloat16 before rounding it to int8 or casting it to e4m3 (a float32
  quantization whose scale is rounded to bfloat16 afterwards differs in ~9% of the int8 values here, ~3% of the e4m3
  ones), and it floors a scale below 2**-63 to 1 (the tiny channel)."""
  qarray = pytest.importorskip("qwix._src.core.qarray")
  engine = _engine(name, dtype)
  slots = vq.slots(engine)
  assert {k: s.axes for k, s in slots.items()} == {"l.q_proj.kernel": (0,), "l.o_proj.kernel": (0, 1)}
  view = vq.float_view(engine, slots)
  assert set(view) == {"l.q_proj.kernel", "l.o_proj.kernel", "l.norm.scale"}
  assert view["l.q_proj.kernel"].shape == (16, 2, 8) and view["l.q_proj.kernel"].dtype == dtype

  rng = np.random.default_rng(0)
  new = {k: rng.normal(size=view[k].shape).astype(np.float32) for k in view}
  new["l.q_proj.kernel"][:, 0, 0] *= 1e-20  # a tiny channel: absmax / bound < 2**-63
  new["l.q_proj.kernel"][:, 1, 0] = 0.0  # a zero one
  new = {k: jnp.asarray(v, dtype) for k, v in new.items()}  # what the mapping hands over: the engine's dtype
  out = vq.quantize(new, slots, engine)
  assert set(out) == set(engine) and out["l.norm.scale"] is new["l.norm.scale"]
  for base, channelwise in (("l.q_proj.kernel", (1, 2)), ("l.o_proj.kernel", (2,))):
    how = qarray.HowToQuantize(qtype=QTYPE[name], channelwise_axes=channelwise, tiled_axes={})
    want = qarray.quantize(new[base], how)  # Qwix's own, as its PTQ quantizes an einsum's weight of that dtype
    got_q, got_s = out[base + ".array.qvalue"], out[base + ".array.scale"]
    assert got_q.dtype == engine[base + ".array.qvalue"].dtype and got_s.shape == engine[base + ".array.scale"].shape
    assert got_s.dtype == want.scale.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), np.asarray(want.qvalue).view(np.uint8), base)
    np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want.scale), base)


def test_a_tiled_or_unknown_qarray_is_refused():
  engine = _engine("int8")
  engine["l.q_proj.kernel.array.scale"] = jnp.ones((4, 2, 8), jnp.float32)  # a tiled rule: 4 scales along `in`
  with pytest.raises(ValueError, match="not per channel"):
    vq.slots(engine)
  engine = _engine("int8")
  engine["l.q_proj.kernel.array.qvalue"] = jnp.zeros((16, 2, 8), jnp.int4)
  with pytest.raises(ValueError, match="int8 and float8_e4m3fn"):
    vq.slots(engine)


def test_the_engine_gets_qwix_rules_and_one_spelling_of_the_precision():
  assert vq.with_quantization({"sharding": {}}, "") == {"sharding": {}}
  assert not vq.with_quantization({}, "none")
  got = vq.with_quantization({"sharding": {}}, "fp8")
  assert got["quantization"] == {"qwix": {"rules": [{"module_path": ".*", "weight_qtype": "float8_e4m3fn"}]}}
  assert "sharding" in got and not got["sharding"]
  with pytest.raises(ConfigError, match="^invalid value for 'vllm_additional_config': it sets 'quantization'"):
    vq.with_quantization({"quantization": {"qwix": {"rules": []}}}, "int8")


def test_vllm_rollout_syncs_quantized_kernels_into_a_qwix_quantized_engine(monkeypatch):
  """The whole wiring on the fake vLLM (tests/rollout/test_vllm_rollout.py): `rollout_quantization=int8` gives vLLM the
  Qwix rules, and the first sync writes every kernel of an engine state shaped as Qwix leaves tpu-inference's Qwen3
  (`<proj>.weight.array.qvalue` / `.scale`, bfloat16 scales) as the plugin's quantization of the float sync's value;
  the guard's re-read (verify_weight_sync=first) passes."""
  import test_vllm_rollout as tvr  # pylint: disable=import-outside-toplevel  # its fake vLLM and engine trees

  cfg = load_config(["configs/cpu_tiny.yml", "rollout_quantization=int8"])
  tree = tvr._trainer_tree(cfg, 0)  # pylint: disable=protected-access
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  float_state = tvr.fake_engine_state(cfg.model_name, hc)
  axes = {"q_proj": (0,), "k_proj": (0,), "v_proj": (0,), "o_proj": (0, 1), "gate_proj": (0,), "up_proj": (0,)}
  axes["down_proj"] = (0,)
  flat = {}
  for name, v in vm.engine_weights(float_state).items():
    proj = next((p for p in axes if f".{p}." in name), None)
    if proj is None:
      flat[name] = nnx.Param(v)
      continue
    scale_shape = tuple(1 if d in axes[proj] else n for d, n in enumerate(v.shape))
    flat[name + ".array.qvalue"] = nnx.Param(jnp.zeros(v.shape, jnp.int8))
    flat[name + ".array.scale"] = nnx.Param(jnp.ones(scale_shape, jnp.bfloat16))
  nested: dict = {}
  for name, var in flat.items():
    node = nested
    parts = name.split(".")
    for p in parts[:-1]:
      node = node.setdefault(int(p) if p.isdigit() else p, {})
    node[parts[-1]] = var
  state = nnx.State(nested)

  tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
  rollout, module, _, state, _ = tvr._build(monkeypatch, cfg, tree, tokenizer, engine_state=state)  # pylint: disable=protected-access
  assert module.LLM.instances[-1].kwargs["additional_config"]["quantization"] == vq.engine_quantization("int8")
  engine = vm.engine_weights(state)
  expected = tvr.expected_hf(tree, llama=False)
  checked = 0
  for hf_name, ref in expected.items():
    name, shape = tvr.tpu_inference_layout(hf_name, cfg.model_name, hc)
    proj = next((p for p in axes if f".{p}." in name), None)
    if proj is None:
      continue
    value = jnp.asarray(tvr.engine_value(ref, hf_name, shape, hc)).astype(jnp.bfloat16)  # the float sync's write
    want = qz.quantize(value, qz.fmt("int8"), axes[proj], jnp.bfloat16)  # Qwix's, in bfloat16 (the test above)
    np.testing.assert_array_equal(np.asarray(engine[name + ".array.qvalue"]), np.asarray(want.q), err_msg=name)
    got_scale = engine[name + ".array.scale"]
    assert got_scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got_scale), np.asarray(want.scale), err_msg=name)
    checked += 1
  assert checked == 14 and rollout.last_sync_bytes == sum(v.nbytes for v in engine.values())
