"""The vLLM weight mapping against tpu-inference 0.32.0's real model state trees and its own weight loader.

Expected values come from tpu-inference itself (its loader writing the same HF tensors into a real model) or
from NumPy (repeat/zero-pad written out here), never from the mapping under test.
"""

# tpu_inference and torch are imported inside the tests that use them: they exist only in .venv-tpu and a
# collection error in the main venv would hide which test needs them.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rl_plugin.rollout import vllm_mapping as vm
from tpu_models import TP, build, hf_config, hf_tensors


def _state(model):

  return nnx.state(model)


def test_llama_state_has_rng_leaves_that_are_not_weights(model_dir):
  model, _, _ = build(model_dir, "llama")
  state = _state(model)
  everything = vm.flatten_params(state)
  assert {"rng.default.key", "rng.default.count"} <= set(everything)  # what broke the first sync
  weights = vm.engine_weights(state)
  assert not any(k.startswith("rng.") for k in weights)
  assert len(weights) == len(everything) - 2 == 21
  hf = {k: jnp.asarray(v) for k, v in hf_tensors("llama", hf_config()).items()}
  new, _ = vm.to_engine_state(hf, weights, head_dim=32, flax_layout=vm.is_flax_layout(state))
  assert set(new) == set(weights)  # every weight written; check_all_written (require_all) did not raise


def test_real_trees_have_the_padded_shapes_the_mapping_handles(model_dir):
  llama = vm.engine_weights(_state(build(model_dir, "llama")[0]))
  qwen = vm.engine_weights(_state(build(model_dir, "qwen3")[0]))
  # head_dim 32 -> 128; 2 kv heads -> TP=4; query heads stay 4.
  assert tuple(llama["model.layers.0.self_attn.q_proj.kernel"].shape) == (128, 4, 128)
  assert tuple(llama["model.layers.0.self_attn.k_proj.kernel"].shape) == (128, TP, 128)
  assert tuple(llama["model.layers.0.self_attn.o_proj.kernel"].shape) == (4, 128, 128)
  # Qwen3: HF names ending in `.weight` in flax layout, a top-level lm_head, vocab 1001 -> 1004 (multiple of TP).
  assert tuple(qwen["model.embed_tokens.weight"].shape) == (1004, 128)
  assert tuple(qwen["lm_head.weight"].shape) == (128, 1004)
  assert tuple(qwen["model.layers.0.mlp.gate_proj.weight"].shape) == (128, 256)
  assert tuple(qwen["model.layers.0.self_attn.q_norm.weight"].shape) == (128,)
  assert len(qwen) == 25 and not any(
      k.startswith("rng.") for k in vm.flatten_params(_state(build(model_dir, "qwen3")[0]))
  )
  assert vm.engine_name_candidates("lm_head.weight")[0] == "lm_head.weight"


def test_padded_kv_kernel_is_repeated_heads_with_zero_padded_head_dim(model_dir):
  """A small numeric example, derived with NumPy: HF k_proj [kv*hd, D] -> engine [D, TP, 128]."""
  weights = vm.engine_weights(_state(build(model_dir, "llama")[0]))
  dst = weights["model.layers.0.self_attn.k_proj.kernel"]
  kv, hd, d = 2, 32, 128
  hf_k = np.arange(kv * hd * d, dtype=np.float32).reshape(kv * hd, d)
  got = np.asarray(
      vm.to_engine_layout(
          jnp.asarray(hf_k), tuple(dst.shape), "model.layers.0.self_attn.k_proj.kernel", head_dim=hd, flax_layout=True
      )
  )
  per_head = hf_k.T.reshape(d, kv, hd)  # [D, kv, hd]
  for engine_head, src_head in enumerate([0, 0, 1, 1]):  # kv head k serves the same query heads as before
    np.testing.assert_array_equal(got[:, engine_head, :hd], per_head[:, src_head])
    assert (got[:, engine_head, hd:] == 0).all()
  # o_proj [D, N*hd] -> [N, 128, D]: head_dim zero-padded, no repeat (4 query heads already fill TP=4).
  hf_o = np.arange(d * 4 * hd, dtype=np.float32).reshape(d, 4 * hd)
  got_o = np.asarray(vm.to_engine_layout(jnp.asarray(hf_o), (4, 128, d), "x.o_proj.kernel", head_dim=hd))
  np.testing.assert_array_equal(got_o[:, :hd], hf_o.T.reshape(4, hd, d))
  assert (got_o[:, hd:] == 0).all()
  # Without the model's head_dim a padded shape is refused, never guessed (4 heads of 32 != 1 head of 128).
  with pytest.raises(ValueError, match="no layout"):
    vm.to_engine_layout(jnp.asarray(hf_k), tuple(dst.shape), "x.k_proj.kernel")


def test_llama_mapping_equals_tpu_inference_own_loader(model_dir):
  """The same HF tensors through tpu-inference's loader (`get_default_maps` + `_load_and_shard_weight`, what
  `LlamaForCausalLM.load_weights` runs per checkpoint tensor) and through the plugin's mapping: bit for bit."""
  from tpu_inference.models.jax.utils import weight_utils

  # Llama does not pad its vocab: a concrete build on TP=4 needs one divisible by 4 (as every real Llama's is).
  model, vllm_config, mesh = build(model_dir, "llama", abstract=False, vocab_size=1004)
  hf = hf_tensors("llama", hf_config(vocab_size=1004), seed=3)
  params = nnx.state(model)
  shardings = nnx.get_named_sharding(params, mesh)
  names = {
      "model.embed_tokens": "model.embed.embedding",
      "model.norm": "model.norm.scale",
      "lm_head": "model.lm_head",
      **{
          f"model.layers.*.{k}": f"model.layers.*.{k}.{'scale' if 'norm' in k else 'kernel'}"
          for k in (
              "input_layernorm",
              "post_attention_layernorm",
              "mlp.down_proj",
              "mlp.gate_proj",
              "mlp.up_proj",
              "self_attn.q_proj",
              "self_attn.k_proj",
              "self_attn.v_proj",
              "self_attn.o_proj",
          )
      },
  }
  metadata = weight_utils.get_default_maps(vllm_config.model_config, mesh, names)
  with jax.set_mesh(mesh):
    for hf_name, w in hf.items():
      weight_utils._load_and_shard_weight(  # pylint: disable=protected-access  # the loader under contract
          vllm_config, params, shardings, metadata, mesh, hf_name, jnp.asarray(w), keep_hf_weight_suffix_when_match=[]
      )
  theirs = vm.engine_weights(params)
  ours, _ = vm.to_engine_state(
      {k: jnp.asarray(v) for k, v in hf.items()}, vm.engine_weights(nnx.state(model)), head_dim=32, flax_layout=True
  )
  assert set(ours) == set(theirs)
  for name, got in ours.items():
    want = theirs[name]
    assert tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype, name
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)


def test_qwen3_mapping_equals_tpu_inference_own_loader(model_dir):
  """Qwen3 loads through vLLM's iterator API (`Qwen3ForCausalLM.load_weights`); its names are HF's own.
  This loader reshapes checkpoint tensors to the model's padded shapes and so refuses both head_dim padding and
  kv-head padding (kv heads < TP), which the default loader (Llama, above) handles: so head_dim 128 (every real
  Qwen3's) and TP=2 (= kv heads) here; the vocab is still padded (1001 -> 1002)."""
  import torch

  model, _, mesh = build(model_dir, "qwen3", abstract=False, tp=2, head_dim=128)
  assert tuple(vm.engine_weights(nnx.state(model))["lm_head.weight"].shape) == (128, 1002)
  hf = hf_tensors("qwen3", hf_config(head_dim=128), seed=4)
  ours, _ = vm.to_engine_state(
      {k: jnp.asarray(v) for k, v in hf.items()},
      vm.engine_weights(nnx.state(model)),
      head_dim=128,
      flax_layout=vm.is_flax_layout(nnx.state(model)),
  )
  with jax.set_mesh(mesh):
    model.load_weights((k, torch.from_numpy(v).to(torch.bfloat16)) for k, v in hf.items())
  theirs = vm.engine_weights(nnx.state(model))
  assert set(ours) == set(theirs)
  for name, got in ours.items():
    want = theirs[name]
    assert tuple(got.shape) == tuple(want.shape), name
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)


def test_written_values_land_in_the_real_state(model_dir):
  """The adapter's write path (`engine_state_setter`) on the real nnx.State: values reach the model's Variables,
  RNG state untouched, and a state missing a weight is still caught."""

  model, _, _ = build(model_dir, "llama", abstract=False, vocab_size=1004)
  state = nnx.state(model)
  rng_before = np.asarray(jax.random.key_data(vm.flatten_params(state)["rng.default.key"]))
  hf = {k: jnp.asarray(v) for k, v in hf_tensors("llama", hf_config(vocab_size=1004), seed=5).items()}
  new, _ = vm.to_engine_state(hf, vm.engine_weights(state), head_dim=32, flax_layout=True)
  vm.engine_state_setter(state)(new)
  now = vm.engine_weights(nnx.state(model))
  np.testing.assert_array_equal(np.asarray(now["model.norm.scale"], np.float32), np.asarray(hf["model.norm.weight"]))
  np.testing.assert_array_equal(
      np.asarray(jax.random.key_data(vm.flatten_params(nnx.state(model))["rng.default.key"])), rng_before
  )
  partial = dict(hf)
  partial.pop("model.layers.1.mlp.up_proj.weight")
  with pytest.raises(ValueError, match="dummy initialisation"):
    vm.to_engine_state(partial, vm.engine_weights(state), head_dim=32, flax_layout=True)


# The engine trees tests/rollout/test_vllm_rollout.py (main venv, no tpu-inference) fakes its vLLM worker with: the real
# classes' leaves for the trainer configs it uses (configs/cpu_tiny.yml's Qwen3, and Llama 3.1 shrunk alike), one
# device. Regenerate with MAXTEXT_RL_REGENERATE_TREES=1 after a tpu-inference upgrade.
TREES_FILE = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "tpu_inference_trees.json"
CPU_TINY = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
}
TRAINER_CONFIGS = {
    "qwen3-0.6b": ("qwen3", {**CPU_TINY, "tie_word_embeddings": True}),
    "llama3.1-8b": ("llama", {**CPU_TINY, "vocab_size": 128256, "tie_word_embeddings": False}),
}


def _leaves(state) -> dict:

  out = {}
  for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    name = vm.path_str(path)
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    out[name] = f"{tuple(value.shape)} {value.dtype} {type(var).__name__}"  # e.g. "(64, 4, 128) bfloat16 Param"
  return out


def test_checked_in_trees_match_the_real_classes(model_dir):

  got = {}
  for maxtext_name, (arch, hc) in TRAINER_CONFIGS.items():
    model, _, _ = build(model_dir, arch, tp=1, **dict(hc))
    got[maxtext_name] = {"hf_config": hc, "tp": 1, "leaves": _leaves(_state(model))}
  if os.environ.get("MAXTEXT_RL_REGENERATE_TREES") == "1":
    TREES_FILE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
  assert json.loads(TREES_FILE.read_text()) == got, f"{TREES_FILE} is stale: regenerate it (see above)"
