"""vLLM rollout adapter, tested at the narrowest boundary: a fake `vllm` module (LLM, SamplingParams).

The trainer side is real: MaxText's own parameter trees (names, shapes, scan layout) for the tiny Qwen3 of
configs/cpu_tiny.yml and a llama3.1-8b shrunk the same way, filled with random values. The engine side is a
fake vLLM-TPU worker holding the real tpu-inference 0.32.0 state tree for those shapes (names, padded shapes,
variable types incl. Llama's RNG leaves; tests/data/tpu_inference_trees.json, recorded from the real classes and
checked against them by tests/tpu_contract), dummy-initialised, in bfloat16. Expected values are re-derived here
with NumPy (repeat heads, zero-pad head_dim), not with the mapping.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import pathlib
import sys
import types

from absl import logging as absl_logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from maxtext.utils import model_creation_utils
from transformers import AutoTokenizer
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import errors
from maxtext_rl_plugin.run import experience
from maxtext_rl_plugin import pathways
from maxtext_rl_plugin import registry
from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.resharding import per_host
from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.rollout import vllm as vllm_mod
from maxtext_rl_plugin.rollout import vllm_config
from maxtext_rl_plugin.rollout import vllm_mapping as vm
from maxtext_rl_plugin.rollout import vllm_sync
from maxtext_rl_plugin.run import engine as run_engine

DUMMY = 7.0  # the fake engine's "dummy init" value
LLAMA = ["model_name=llama3.1-8b"]


def _has_vllm() -> bool:
  try:
    import vllm  # pylint: disable=unused-import,import-outside-toplevel  # is the optional extra installed?
  except ImportError:
    return False
  return True


def _trainer_tree(cfg, seed: int = 0) -> dict:
  """MaxText's real parameter tree for `cfg` (abstract build), filled with random float32 values."""

  _, model = model_creation_utils.create_nnx_abstract_model(cfg, devices=jax.devices()[:1])
  abstract = nnx.state(model, nnx.Param).to_pure_dict()
  rng = np.random.default_rng(seed)
  filled = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape).astype(np.float32)), abstract)
  return {"base": filled}


@pytest.fixture(name="qwen", scope="module")
def qwen_fixture():
  cfg = load_config(["configs/cpu_tiny.yml"])
  return cfg, _trainer_tree(cfg, 0)


@pytest.fixture(name="llama", scope="module")
def llama_fixture():
  cfg = load_config(["configs/cpu_tiny.yml", *LLAMA])
  return cfg, _trainer_tree(cfg, 1)


def _np(tree, path):
  node = tree["base"]
  for p in path.split("."):
    node = node[p]
  return np.asarray(node)


# ------------------------------------------------------------------ independent expectations (NumPy)


def _rope_deinterleave(x: np.ndarray) -> np.ndarray:
  """MaxText Llama keeps RoPE pairs interleaved (0,1),(2,3)...; HF puts evens then odds in each head."""
  return np.concatenate([x[..., ::2], x[..., 1::2]], axis=-1)


def expected_hf(tree: dict, llama: bool) -> dict[str, np.ndarray]:
  """HF-layout tensors re-derived from the MaxText tree with NumPy (scan axis 1)."""
  q = _np(tree, "decoder.layers.self_attention.query.kernel")  # [D, L, N, H]
  k = _np(tree, "decoder.layers.self_attention.key.kernel")
  v = _np(tree, "decoder.layers.self_attention.value.kernel")
  o = _np(tree, "decoder.layers.self_attention.out.kernel")  # [N, L, H, D]
  d, n_layers, _, head_dim = q.shape
  out = {
      "model.embed_tokens.weight": _np(tree, "token_embedder.embedding"),
      "model.norm.weight": _np(tree, "decoder.decoder_norm.scale"),
  }
  if llama:
    out["lm_head.weight"] = _np(tree, "decoder.logits_dense.kernel").T
  for i in range(n_layers):
    qi, ki = q[:, i], k[:, i]
    if llama:  # undo MaxText's 1/sqrt(head_dim) query pre-scaling, de-interleave RoPE
      qi = _rope_deinterleave(qi * np.float32(math.sqrt(head_dim)))
      ki = _rope_deinterleave(ki)
    p = f"model.layers.{i}."
    out[p + "self_attn.q_proj.weight"] = qi.reshape(d, -1).T
    out[p + "self_attn.k_proj.weight"] = ki.reshape(d, -1).T
    out[p + "self_attn.v_proj.weight"] = v[:, i].reshape(d, -1).T
    out[p + "self_attn.o_proj.weight"] = o[:, i].reshape(-1, d).T
    out[p + "mlp.gate_proj.weight"] = _np(tree, "decoder.layers.mlp.wi_0.kernel")[:, i].T
    out[p + "mlp.up_proj.weight"] = _np(tree, "decoder.layers.mlp.wi_1.kernel")[:, i].T
    out[p + "mlp.down_proj.weight"] = _np(tree, "decoder.layers.mlp.wo.kernel")[:, i].T
    out[p + "input_layernorm.weight"] = _np(tree, "decoder.layers.pre_self_attention_layer_norm.scale")[:, i]
    out[p + "post_attention_layernorm.weight"] = _np(tree, "decoder.layers.post_self_attention_layer_norm.scale")[:, i]
    if not llama:
      out[p + "self_attn.q_norm.weight"] = _np(tree, "decoder.layers.self_attention.query_norm.scale")[:, i]
      out[p + "self_attn.k_norm.weight"] = _np(tree, "decoder.layers.self_attention.key_norm.scale")[:, i]
  return out


TREES = json.loads((pathlib.Path(__file__).parents[1] / "data" / "tpu_inference_trees.json").read_text())


def real_leaves(model_name: str, hc) -> dict[str, tuple[tuple[int, ...], str, str]]:
  """tpu-inference's leaves for the trainer's shapes: name -> (shape, dtype, variable type), one device."""
  entry = TREES[model_name]
  assert entry["hf_config"] == {k: hc[k] for k in entry["hf_config"]}, "tpu_inference_trees.json: other shapes"
  out = {}
  for name, desc in entry["leaves"].items():
    shape, rest = desc.rsplit(") ", 1)
    dtype, kind = rest.split()
    out[name] = (tuple(int(d) for d in shape.strip("(").split(",") if d.strip()), dtype, kind)
  return out


def tpu_inference_layout(hf_name: str, model_name: str, hc) -> tuple[str, tuple[int, ...]]:
  """The real engine's name and (padded) shape for an HF tensor."""
  leaves = real_leaves(model_name, hc)
  for cand in vm.engine_name_candidates(hf_name):
    if cand in leaves:
      return cand, leaves[cand][0]
  raise KeyError(f"{hf_name} has no leaf in tpu-inference's {model_name} tree")


def engine_value(ref: np.ndarray, hf_name: str, shape: tuple[int, ...], hc) -> np.ndarray:
  """NumPy: HF tensor -> tpu-inference's flax layout, heads repeated in place and head_dim/vocab zero-padded."""
  n_q, n_kv, h, d = hc["num_attention_heads"], hc["num_key_value_heads"], hc["head_dim"], hc["hidden_size"]
  if ref.ndim == 1:
    return np.pad(ref, (0, shape[0] - ref.shape[0]))
  if "embed" in hf_name:
    return np.pad(ref, ((0, shape[0] - ref.shape[0]), (0, 0)))
  if any(p in hf_name for p in ("q_proj", "k_proj", "v_proj")):
    n = n_q if "q_proj" in hf_name else n_kv
    w = np.repeat(ref.T.reshape(d, n, h), shape[1] // n, axis=1)
    return np.pad(w, ((0, 0), (0, 0), (0, shape[2] - h)))
  if "o_proj" in hf_name:
    w = np.repeat(ref.T.reshape(n_q, h, d), shape[0] // n_q, axis=0)
    return np.pad(w, ((0, 0), (0, shape[1] - h), (0, 0)))
  w = ref.T  # [in, out]; lm_head [hidden, vocab]
  return np.pad(w, [(0, t - s) for s, t in zip(w.shape, shape)])


def fake_engine_state(model_name: str, hc):
  """The worker's `get_weights_state()`: an nnx.State of tpu-inference's real leaves, weights dummy-initialised."""

  state: dict = {}
  for name, (shape, dtype, kind) in real_leaves(model_name, hc).items():
    if kind == "RngKey":
      var = nnx.RngKey(jax.random.key(0))
    elif kind == "RngCount":
      var = nnx.RngCount(jnp.zeros(shape, dtype))
    else:
      var = getattr(nnx, kind)(jnp.full(shape, DUMMY, dtype=jnp.dtype(dtype)))
    node = state
    parts = name.split(".")
    for p in parts[:-1]:
      node = node.setdefault(int(p) if p.isdigit() else p, {})
    node[parts[-1]] = var
  return nnx.State(state)


# ------------------------------------------------------------------ the fake vllm module


class _Logprob:

  def __init__(self, logprob: float):
    self.logprob = logprob


class _Completion:

  def __init__(self, token_ids, logprobs):
    self.token_ids = token_ids
    self.logprobs = logprobs
    self.text = "ignored: the adapter decodes token ids itself"


class _RequestOutput:

  def __init__(self, completion):
    self.outputs = [completion]


class FakeSamplingParams:

  def __init__(self, **kwargs):
    self.kwargs = kwargs


class FakeWorker:
  """tpu-inference's in-process worker as far as the adapter touches it: a weight state it writes in place."""

  def __init__(self, state, log):
    self.state = state
    self.log = log

  def get_weights_state(self):
    self.log.append(("get_weights_state",))
    return self.state

  def refresh_model_state_leaves(self):
    self.log.append(("refresh_model_state_leaves",))


def canned_completion(prompt_ids: list[int], eos: int) -> tuple[list[int], list[float]]:
  """Deterministic per-prompt completion ending in EOS, with distinct log-probs."""
  first = 100 + len(prompt_ids)
  ids = [first, first + 1, first + 2, eos][: 2 + len(prompt_ids) % 3]
  return ids, [-0.25 * (j + 1) - 0.01 * len(prompt_ids) for j in range(len(ids))]


def make_fake_vllm(engine_state: dict, eos: int):
  """A `vllm` module whose LLM records every call the adapter makes (the boundary the TPU image provides)."""
  log: list = []

  class FakeLLM:
    """vllm.LLM: generate, reset_prefix_cache, collective_rpc and the weight-update session."""

    instances: list = []

    def __init__(self, **kwargs):
      self.kwargs = kwargs
      self.env_multiprocessing = __import__("os").environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
      self.worker = FakeWorker(engine_state, log)
      self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=self.worker))
      self.session_active = False
      self.generate_calls: list = []
      log.append(("LLM",))
      FakeLLM.instances.append(self)

    def reset_prefix_cache(self):
      log.append(("reset_prefix_cache",))
      return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
      log.append(("collective_rpc", method, dict(kwargs or {})))
      if method == "start_weight_update":
        assert not self.session_active
        self.session_active = True
      elif method == "finish_weight_update":
        self.session_active = False
      return [None]

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
      """Deterministic completions of each prompt, ending with EOS, with per-token log-probs."""
      assert not self.session_active, "generate during a weight update"
      flat = vm.engine_weights(self.worker.state)
      names = ("model.embed.embedding", "model.embed_tokens.weight", "model.token_embedder.embedding")
      emb = np.asarray(next(flat[n] for n in names if n in flat), dtype=np.float32)
      self.generate_calls.append({"prompts": prompts, "params": sampling_params, "embed_00": float(emb[0, 0])})
      log.append(("generate",))
      outs = []
      for p in prompts:
        ids, lps = canned_completion(p["prompt_token_ids"], eos)
        outs.append(_RequestOutput(_Completion(ids, [{t: _Logprob(lp)} for t, lp in zip(ids, lps)])))
      return outs

  module = types.ModuleType("vllm")
  module.LLM = FakeLLM
  module.SamplingParams = FakeSamplingParams
  return module, log


@pytest.fixture(name="tokenizer", scope="module")
def tokenizer_fixture(qwen):

  return AutoTokenizer.from_pretrained(qwen[0].tokenizer_path)


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))


def _rollout_config(cfg, **kw):
  base = dict(  # pylint: disable=use-dict-literal  # keyword arguments of RolloutConfig
      max_tokens_to_generate=int(cfg.max_target_length - cfg.max_prefill_predict_length),
      max_prompt_length=int(cfg.max_prefill_predict_length),
      temperature=0.9,
      top_p=0.95,
      top_k=20,
  )
  base.update(kw)
  return base_rollout.RolloutConfig(**base)


def _settings(cfg) -> vllm_config.VllmSettings:
  """The engine's settings as the run builds them (run/build.py: the spec's `bind`)."""
  return vllm_config.VllmSettings.from_config(cfg)


def _build(monkeypatch, cfg, tree, tokenizer, engine_state=None):
  """A VllmRollout over the fake vllm module, with the engine state shaped like tpu-inference's real tree."""
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  state = fake_engine_state(cfg.model_name, hc) if engine_state is None else engine_state
  module, log = make_fake_vllm(state, tokenizer.eos_token_id)
  monkeypatch.setitem(sys.modules, "vllm", module)
  monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
  monkeypatch.setenv("TPU_BACKEND_TYPE", "jax")
  reshard_calls = []

  def fake_reshard(new, shardings):
    assert set(new) == set(shardings)
    reshard_calls.append(sorted(new))
    return jax.device_put(new, shardings)

  monkeypatch.setattr(vllm_sync, "_reshard", fake_reshard)
  rollout = vllm_mod.VllmRollout(
      rollout_actor=tree, tokenizer=tokenizer, mesh=_mesh(), rollout_config=_rollout_config(cfg), settings=_settings(cfg)
  )
  return rollout, module, log, state, reshard_calls


# ------------------------------------------------------------------ tests: missing extra


@pytest.mark.skipif(_has_vllm(), reason="vllm is installed here; the missing-extra path needs a machine without it")
def test_missing_vllm_fails_at_construction_with_one_line(qwen, tokenizer, capsys):

  cls = registry.load("rollout_engines", "vllm").load_engine()
  assert cls is vllm_mod.VllmRollout
  with pytest.raises(errors.MissingExtraError) as ei:
    cls(rollout_actor=qwen[1], tokenizer=tokenizer, mesh=_mesh(), rollout_config=_rollout_config(qwen[0]), settings=None)
  msg = str(ei.value)
  assert "\n" not in msg and "rollout_engine=vllm" in msg and "pip install 'maxtext-rl-plugin[tpu]'" in msg
  # The trainer resolves rollout_engine=vllm before any model is built, inside the entry points' handler:
  # exit 2, one line.

  with pytest.raises(SystemExit) as exit_info, errors.exit_on_user_error():
    run_engine.rollout_engine_factory("vllm", qwen[0])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: rollout_engine=vllm needs the 'vllm' package") and err.count("\n") == 1


# ------------------------------------------------------------------ tests: config -> vLLM


def test_engine_kwargs_map_every_rollout_key():
  cfg = load_config(
      [
          "configs/cpu_tiny.yml",
          "rollout_tensor_parallelism=2",
          "rollout_data_parallelism=-1",
          "hbm_utilization_vllm=0.55",
          "max_num_seqs=64",
          "max_num_batched_tokens=2048",
          "async_scheduling=false",
          "enable_prefix_caching=true",
          "vllm_block_size=32",
          "free_kv_cache_during_weight_sync=false",
          "enable_dp_attention=true",
          "weight_dtype=bfloat16",
      ]
  )
  kw = vllm_config.vllm_engine_kwargs(_settings(cfg), 8, device_ids=range(8, 16))
  assert (kw["tensor_parallel_size"], kw["data_parallel_size"], kw["enable_expert_parallel"]) == (2, 4, False)
  assert kw["gpu_memory_utilization"] == pytest.approx(0.55)
  assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["block_size"]) == (64, 2048, 32)
  assert kw["async_scheduling"] is False and kw["enable_prefix_caching"] is True
  assert kw["load_format"] == "dummy" and kw["dtype"] == "bfloat16"
  assert kw["max_model_len"] == cfg.max_target_length + cfg.kv_cache_buffer
  assert kw["model"] == cfg.tokenizer_path and kw["max_logprobs"] == 1
  strategy = kw["additional_config"]["sharding"]["sharding_strategy"]
  assert strategy == {"expert_parallelism": 1, "enable_dp_attention": True, "device_indexes": list(range(8, 16))}
  # A shrunk model: vLLM must build the trainer's shapes, not the hub config's.
  assert kw["hf_overrides"]["num_hidden_layers"] == 2 and kw["hf_overrides"]["hidden_size"] == 64
  assert kw["hf_overrides"]["tie_word_embeddings"] is True

  ep = load_config(
      [
          "configs/cpu_tiny.yml",
          "rollout_tensor_parallelism=1",
          "rollout_data_parallelism=2",
          "rollout_expert_parallelism=-1",
      ]
  )
  kw = vllm_config.vllm_engine_kwargs(_settings(ep), 8)
  assert (kw["tensor_parallel_size"], kw["data_parallel_size"], kw["enable_expert_parallel"]) == (1, 2, True)
  assert kw["additional_config"]["sharding"]["sharding_strategy"]["expert_parallelism"] == 4
  assert "max_num_seqs" not in kw and "block_size" not in kw


class _Override:
  """A config with some attributes replaced (vllm_engine_kwargs only reads attributes)."""

  def __init__(self, cfg, **kw):
    self._cfg, self._kw = cfg, kw

  def __getattr__(self, name):
    return self._kw[name] if name in self._kw else getattr(self._cfg, name)


@pytest.mark.parametrize(
    "tp, dp, ep",
    [
        (3, -1, 1),  # 8 devices not divisible by tp
        (-1, -1, 1),  # two auto-derived sizes
        (2, 2, 1),
    ],  # product != device count
)
def test_engine_kwargs_bad_parallelism_is_one_line_config_error(qwen, tp, dp, ep):
  settings = dataclasses.replace(_settings(qwen[0]), parallelism=vllm_config.Parallelism(tp, dp, ep))
  with pytest.raises(errors.ConfigError) as ei:
    vllm_config.vllm_engine_kwargs(settings, 8)
  assert "\n" not in str(ei.value) and "rollout" in str(ei.value)


def test_sampling_kwargs_from_config():
  # Real CLI parsing of the list-valued keys, then the mapping.
  cfg = load_config(
      [
          "configs/cpu_tiny.yml",
          "decode_sampling_temperature=0.7",
          "decode_sampling_top_k=40",
          "decode_sampling_nucleus_p=0.9",
          "stop_strings=['</answer>']",
          "stop_token_ids=[11,12]",
      ]
  )
  sampling = _settings(cfg).sampling
  kw = vllm_config.sampling_params_kwargs(sampling)
  assert (kw["temperature"], kw["top_k"], kw["top_p"]) == (0.7, 40, 0.9)
  assert kw["max_tokens"] == cfg.max_target_length - cfg.max_prefill_predict_length
  assert kw["stop"] == ["</answer>"] and kw["include_stop_str_in_output"] and kw["detokenize"]
  assert kw["stop_token_ids"] == [11, 12] and kw["logprobs"] == 0 and kw["n"] == 1
  greedy = vllm_config.sampling_params_kwargs(sampling, greedy=True)
  assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, 0, 1.0)
  plain = vllm_config.sampling_params_kwargs(_settings(_Override(cfg, stop_strings=None)).sampling)
  assert plain["stop"] is None and plain["detokenize"] is False


def test_capture_is_wanted_for_replay_or_the_maxtext_key_on_moe_models_only(qwen):
  """Routing capture (rollout/vllm_routing.py): `rl.router_replay` replays it, MaxText's `return_routed_experts` asks
  for it; only MoE models route."""

  def wanted(experts, replay, key):
    cfg = _Override(
        qwen[0], num_experts=experts, return_routed_experts=key, rl=_Override(qwen[0].rl, router_replay=replay)
    )
    return _settings(cfg).capture_routing

  assert wanted(4, True, False) and wanted(4, False, True)
  assert not wanted(4, False, False) and not wanted(1, True, True)


# ------------------------------------------------------------------ tests: weight mapping


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_every_trainer_parameter_lands_in_exactly_one_vllm_parameter(which, request):
  cfg, tree = request.getfixturevalue(which)
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  # The shapes read off the tree agree with the config's view of the model.
  assert {k: hc[k] for k in vm.HfShape.from_config(cfg).as_dict()} == vm.HfShape.from_config(cfg).as_dict()
  out = vm.map_maxtext_to_vllm(tree, cfg.model_name)
  spec = vm.vllm_param_shapes(cfg.model_name, hc)
  assert set(out) == set(spec), set(out) ^ set(spec)
  assert ("lm_head.weight" in out) == (which == "llama")  # Qwen3-0.6B ties embeddings
  # Each MaxText leaf fans out into exactly its layers' worth of HF tensors: counts add up, nothing unmapped.
  flat = vm.flatten_params(tree)
  fan_out = sum(cfg.num_decoder_layers if ".layers." in k else 1 for k in flat)
  assert fan_out == len(out)
  expected = expected_hf(tree, llama=which == "llama")
  assert set(expected) == set(out)
  for name, arr in out.items():
    assert tuple(arr.shape) == spec[name] and arr.dtype == jnp.float32, name
    np.testing.assert_allclose(np.asarray(arr), expected[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_unscanned_trees_map_to_the_same_names(qwen):
  cfg = load_config(["configs/cpu_tiny.yml", "scan_layers=false"])
  tree = _trainer_tree(cfg, 3)
  assert any("layers_1" in k for k in vm.flatten_params(tree))
  out = vm.map_maxtext_to_vllm(tree, cfg.model_name)
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  assert hc["scan_layers"] is False
  assert set(out) == set(vm.vllm_param_shapes(cfg.model_name, hc))
  np.testing.assert_array_equal(
      np.asarray(out["model.layers.1.mlp.down_proj.weight"]), _np(tree, "decoder.layers_1.mlp.wo.kernel").T
  )


def test_mapping_error_paths(qwen):
  cfg, tree = qwen
  with pytest.raises(errors.ConfigError, match="model_name"):
    vm.map_maxtext_to_vllm(tree, "gemma3-4b")
  with pytest.raises(errors.ConfigError, match="no JAX Qwen3-MoE class .* expert-stacked") as e:
    vm.check_supported("qwen3-30b-a3b")  # MoE: refused with what is missing
  assert "\n" not in str(e.value)
  with pytest.raises(errors.ConfigError, match="only Gemma JAX class is Gemma4ForCausalLM"):
    vm.check_supported("gemma3-4b")
  extra = {"base": {**tree["base"], "mystery": {"kernel": jnp.zeros((2, 2))}}}
  with pytest.raises(ValueError, match="no vLLM mapping"):
    vm.map_maxtext_to_vllm(extra, cfg.model_name)
  hf = vm.map_maxtext_to_vllm(tree, cfg.model_name)
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  engine = vm.engine_weights(fake_engine_state(cfg.model_name, hc))
  kw = {"head_dim": hc["head_dim"], "flax_layout": True}
  vm.to_engine_state(hf, engine, **kw)  # the real tree is complete
  with pytest.raises(ValueError, match="no parameter in the vLLM model"):
    vm.to_engine_state(hf, {k: v for k, v in engine.items() if "q_norm" not in k}, **kw)
  with pytest.raises(ValueError, match="dummy initialisation"):
    vm.to_engine_state(hf, {**engine, "model.layers.0.extra.kernel": jnp.zeros((2,))}, **kw)
  bad = dict(engine)
  bad["model.layers.0.mlp.gate_proj.weight"] = jnp.zeros((3, 5))
  with pytest.raises(ValueError, match="shape"):
    vm.to_engine_state(hf, bad, **kw)
  with pytest.raises(ValueError, match="shape"):  # padded head_dim without the model's head_dim: refused
    vm.to_engine_state(hf, engine, flax_layout=True)


def test_engine_layout_is_decided_by_shape_and_never_guessed():
  rng = np.random.default_rng(5)
  d, n, h = 6, 2, 3
  q_hf = jnp.asarray(rng.standard_normal((n * h, d)), jnp.float32)  # HF [out, in]
  np.testing.assert_array_equal(
      vm.to_engine_layout(q_hf, (d, n, h), "x.q_proj.kernel"), np.asarray(q_hf).T.reshape(d, n, h)
  )
  o_hf = jnp.asarray(rng.standard_normal((d, n * h)), jnp.float32)
  np.testing.assert_array_equal(
      vm.to_engine_layout(o_hf, (n, h, d), "x.o_proj.kernel"), np.asarray(o_hf).T.reshape(n, h, d)
  )
  with pytest.raises(ValueError, match="no layout"):  # tpu-inference's optional NDH q layout: refuse, don't guess
    vm.to_engine_layout(q_hf, (n, d, h), "x.q_proj.kernel")
  sq = jnp.asarray(rng.standard_normal((d, d)), jnp.float32)
  np.testing.assert_array_equal(vm.to_engine_layout(sq, (d, d), "x.o_proj.kernel"), np.asarray(sq).T)
  np.testing.assert_array_equal(vm.to_engine_layout(sq, (d, d), "x.o_proj.weight"), np.asarray(sq))
  gate = jnp.asarray(rng.standard_normal((8, d)), jnp.float32)  # HF [intermediate, hidden]
  np.testing.assert_array_equal(vm.to_engine_layout(gate, (d, 8), "x.gate_proj.weight"), np.asarray(gate).T)
  np.testing.assert_array_equal(vm.to_engine_layout(gate, (8, d), "x.gate_proj.weight"), np.asarray(gate))
  with pytest.raises(ValueError, match="no layout"):
    vm.to_engine_layout(gate, (4, 12), "x.gate_proj.kernel")


def test_engine_with_hf_named_flax_kernels(llama):
  """tpu-inference's JaxModule layers (Qwen3 in 0.32.0) name flax kernels `.weight`: HF names, flax shapes."""
  cfg, tree = llama
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  flax_engine = vm.engine_weights(fake_engine_state(cfg.model_name, hc))
  aliased = {(k[: -len("kernel")] + "weight" if k.endswith(".kernel") else k): v for k, v in flax_engine.items()}
  hf = vm.map_maxtext_to_vllm(tree, cfg.model_name)
  kw = {"head_dim": hc["head_dim"], "flax_layout": True}
  by_kernel, _ = vm.to_engine_state(hf, flax_engine, **kw)
  by_weight, names = vm.to_engine_state(hf, aliased, **kw)
  assert names["model.layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"
  for k, v in by_kernel.items():
    alias = k[: -len("kernel")] + "weight" if k.endswith(".kernel") else k
    np.testing.assert_array_equal(np.asarray(by_weight[alias]), np.asarray(v), err_msg=k)
  # Both names listed for one array (kernel aliased as weight): written once, counted for both.
  both = {**flax_engine, **{k[: -len("kernel")] + "weight": v for k, v in flax_engine.items() if k.endswith(".kernel")}}
  new, _ = vm.to_engine_state(hf, both, **kw)
  assert len(new) == len(flax_engine)


# ------------------------------------------------------------------ tests: the adapter on a fake engine


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_step0_syncs_trainer_weights_into_every_engine_parameter(which, request, monkeypatch, tokenizer):
  cfg, tree = request.getfixturevalue(which)
  rollout, module, log, state, reshard_calls = _build(monkeypatch, cfg, tree, tokenizer)
  llm = module.LLM.instances[-1]
  assert llm.kwargs == vllm_config.vllm_engine_kwargs(_settings(cfg), 1, device_ids=[int(jax.devices()[0].id)])
  assert llm.env_multiprocessing == "0"
  names = [e[0] if e[0] != "collective_rpc" else e[1] for e in log]
  # ... and the re-read of verify_weight_sync=first (the default) before the session closes.
  assert names == [
      "LLM",
      "reset_prefix_cache",
      "start_weight_update",
      "get_weights_state",
      "refresh_model_state_leaves",
      "get_weights_state",
      "finish_weight_update",
  ]
  assert log[2][2] == {"free_kv_cache": True}
  # Every engine leaf now holds the trainer's value in tpu-inference layout and the engine's dtype.
  expected = expected_hf(tree, llama=which == "llama")
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  engine = vm.engine_weights(state)
  if which == "llama":  # tpu-inference's Llama holds RNG state beside its weights; untouched, not a weight
    assert {"rng.default.key", "rng.default.count"} <= set(vm.flatten_params(state)) - set(engine)
  assert len(reshard_calls) == 1 and reshard_calls[0] == sorted(engine)  # one chunk: the whole model
  for hf_name, ref in expected.items():
    name, shape = tpu_inference_layout(hf_name, cfg.model_name, hc)
    got = engine[name]
    assert got.dtype == jnp.bfloat16 and tuple(got.shape) == shape, name
    want = engine_value(ref, hf_name, shape, hc)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(want).astype(jnp.bfloat16)), err_msg=name)
  # In tpu-inference layout, a Qwen3 query kernel is the MaxText layer slice (no hooks for Qwen3), head_dim
  # zero-padded 16 -> 128.
  if which == "qwen":
    q = np.asarray(engine["model.layers.1.self_attn.q_proj.weight"])
    assert q.shape == (64, 4, 128) and (q[..., 16:] == 0).all()
    np.testing.assert_array_equal(
        q[..., :16],
        np.asarray(jnp.asarray(_np(tree, "decoder.layers.self_attention.query.kernel")[:, 1]).astype(jnp.bfloat16)),
    )

  # Step 0 samples these weights, not the dummy init.
  rollout.generate(["Q: 1+1?"], _rollout_config(cfg))
  want = float(expected["model.embed_tokens.weight"][0, 0])
  assert llm.generate_calls[0]["embed_00"] == pytest.approx(want, rel=1e-2)
  assert llm.generate_calls[0]["embed_00"] != DUMMY


def test_generate_sampling_params_tokens_and_logprobs(monkeypatch, qwen, tokenizer):
  cfg = load_config(["configs/cpu_tiny.yml", "stop_token_ids=[13]", "stop_strings=['</answer>']"])
  tree = qwen[1]
  rollout, module, _, _, _ = _build(monkeypatch, cfg, tree, tokenizer)
  llm = module.LLM.instances[-1]
  prompts = ["What is 2+3?", "A much longer question about apples and oranges, please answer."]
  out = rollout.generate(prompts, _rollout_config(cfg, temperature=0.8, top_p=0.9, top_k=7))
  sp = llm.generate_calls[-1]["params"].kwargs
  eos = tokenizer.eos_token_id
  assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (0.8, 0.9, 7)
  assert sp["max_tokens"] == cfg.max_target_length - cfg.max_prefill_predict_length
  pad = tokenizer.pad_token_id  # Qwen3's <|endoftext|>, not its EOS: a sampled pad ends the row (stops.pad_stops)
  assert pad != eos and sp["stop_token_ids"] == sorted({eos, 13, pad})
  assert sp["stop"] == ["</answer>"] and sp["logprobs"] == 0
  sent = [p["prompt_token_ids"] for p in llm.generate_calls[-1]["prompts"]]
  assert sent == [tokenizer.encode(p) for p in prompts]
  for i, ids in enumerate(sent):
    want_ids, want_lp = canned_completion(ids, eos)
    np.testing.assert_array_equal(out.tokens[i], want_ids)  # EOS kept at the end when vLLM stopped on it
    np.testing.assert_allclose(out.logprobs[i], want_lp, rtol=1e-6)
    assert out.text[i] == tokenizer.decode(want_ids, skip_special_tokens=True)
    row = out.left_padded_prompt_tokens[i]
    assert row.shape == (cfg.max_prefill_predict_length,)
    np.testing.assert_array_equal(row[-len(ids) :], ids)
    assert (row[: -len(ids)] == rollout.pad_id()).all()
  assert rollout.eos_id() == eos and rollout.model() is None

  # Log-prob plumbing: [B, T] aligned with the right-padded completions, 0 past each completion; rows are found
  # by (prompt, completion), so Tunix's micro-batched and reordered calls work.
  width = max(len(t) for t in out.tokens) + 2
  comp = np.full((len(prompts), width), rollout.pad_id(), dtype=np.int32)
  for i, t in enumerate(out.tokens):
    comp[i, : len(t)] = t
  prompt_rows = np.asarray(out.left_padded_prompt_tokens)
  lp = np.asarray(rollout.get_per_token_logps(jnp.asarray(prompt_rows), jnp.asarray(comp)))
  assert lp.shape == comp.shape
  for i, t in enumerate(out.tokens):
    np.testing.assert_allclose(lp[i, : len(t)], out.logprobs[i], rtol=1e-6)
    assert (lp[i, len(t) :] == 0).all()
  flipped = np.asarray(rollout.get_per_token_logps(jnp.asarray(prompt_rows[::-1]), jnp.asarray(comp[::-1])))
  np.testing.assert_array_equal(flipped, lp[::-1])
  one = np.asarray(rollout.get_per_token_logps(jnp.asarray(prompt_rows[1:]), jnp.asarray(comp[1:])))
  np.testing.assert_array_equal(one, lp[1:])
  bad = comp.copy()
  bad[1, 0] += 1
  with pytest.raises(ValueError, match="row 1"):
    rollout.get_per_token_logps(jnp.asarray(prompt_rows), jnp.asarray(bad))
  with pytest.raises(ValueError, match="row 0"):  # right completion, other prompt
    rollout.get_per_token_logps(jnp.asarray(prompt_rows[::-1][:1]), jnp.asarray(comp[:1]))

  # Greedy (eval) decoding and over-long prompts.
  rollout.generate(prompts[:1], _rollout_config(cfg, temperature=0.0))
  sp = llm.generate_calls[-1]["params"].kwargs
  assert (sp["temperature"], sp["top_k"], sp["top_p"]) == (0.0, 0, 1.0)
  with pytest.raises(errors.DataError, match="max_prefill_predict_length"):
    rollout.generate(["word " * 400], _rollout_config(cfg))


def test_generate_turn_runs_a_multi_turn_episode_through_generate(monkeypatch, qwen, tokenizer):
  """rl.use_agentic_rollout on vLLM, by contract: each turn is one `LLM.generate` of token-id contexts (the transcript
  after the first), the tool call's closing tag a kept stop string, finish reasons read from vLLM's CompletionOutput."""
  from maxtext_rl_plugin.agentic import episode  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.agentic import parse  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.agentic import tools  # pylint: disable=import-outside-toplevel

  cfg = load_config(["configs/cpu_tiny.yml", "stop_strings=['</answer>']"])
  rollout, module, _, _, _ = _build(monkeypatch, cfg, qwen[1], tokenizer)
  llm = module.LLM.instances[-1]
  eos = tokenizer.eos_token_id
  call = '<tool_call>{"name": "calculator", "arguments": {"a": 37, "b": 48, "op": "*"}}</tool_call>'
  call_ids = tokenizer.encode(call, add_special_tokens=False)
  answer_ids = tokenizer.encode("<answer>1776</answer>", add_special_tokens=False)
  obs_ids = tokenizer.encode("<tool_response>1776</tool_response>\n", add_special_tokens=False)
  seen = []

  def generate(prompts, sampling_params=None, *, use_tqdm=True):
    del use_tqdm
    seen.append(([p["prompt_token_ids"] for p in prompts], sampling_params.kwargs))
    outs = []
    for p in prompts:  # a policy that calls the calculator first, then answers from the tool's result
      ids = p["prompt_token_ids"]
      done = ids[-len(obs_ids) :] == obs_ids
      toks = answer_ids + [eos] if done else call_ids
      comp = _Completion(toks, [{t: _Logprob(-0.5)} for t in toks])
      comp.finish_reason, comp.stop_reason = "stop", (None if done else "</tool_call>")
      outs.append(_RequestOutput(comp))
    return outs

  llm.generate = generate
  parser = parse.CallParser("qwen")
  rc = _rollout_config(cfg, temperature=0.7)

  def turn_fn(contexts, gens, max_new, turn):
    return rollout.generate_turn(
        contexts, num_generations=gens, max_new_tokens=max_new, rollout_config=rc, rng=turn, stop_strings=[parser.end]
    )

  prompt = tokenizer.encode("What is 37 * 48?")
  limits = episode.Limits(max_turns=3, turn_tokens=64, total_tokens=128)
  eps = episode.run_episodes(turn_fn, tokenizer, [prompt], 2, limits, tools.Toolbox(["calculator"], 1.0), parser, [eos])
  assert len(seen) == 2, seen  # two turns: the call, then the answer
  (first, kw1), (second, kw2) = seen[0], seen[1]
  assert first == [prompt, prompt] and kw1["max_tokens"] == 64 and kw1["temperature"] == 0.7
  assert kw1["stop"] == ["</answer>", "</tool_call>"] and kw1["include_stop_str_in_output"] and kw1["detokenize"]
  assert second == [prompt + call_ids + obs_ids] * 2 and kw2 == kw1  # the transcript, token for token
  for e in eps:
    assert e.tokens == call_ids + obs_ids + answer_ids + [eos]
    assert e.loss_mask == [1] * len(call_ids) + [0] * len(obs_ids) + [1] * (len(answer_ids) + 1)
    assert e.logps == [-0.5] * len(call_ids) + [0.0] * len(obs_ids) + [-0.5] * (len(answer_ids) + 1)
    assert (e.turns, e.tool_calls, e.tool_errors, e.finish) == (2, 1, 0, "answer")
  # vLLM's finish reasons: a length cut and a stop token other than EOS.
  llm.generate = lambda prompts, sampling_params=None, use_tqdm=True: [
      _RequestOutput(
          types.SimpleNamespace(
              token_ids=[5, 6], logprobs=[{5: _Logprob(-1.0)}, {6: _Logprob(-1.0)}], finish_reason=f, stop_reason=r
          )
      )
      for f, r in (("length", None), ("stop", 6))
  ]
  turn = rollout.generate_turn([[1], [2]], num_generations=1, max_new_tokens=2, rollout_config=rc, rng=None)
  assert [x[2] for x in turn] == [
      "length",
      "stop_token",
  ]


def test_chunked_sync_keeps_kv_cache_when_configured_and_reaches_new_weights(monkeypatch, qwen, tokenizer):
  cfg = load_config(["configs/cpu_tiny.yml", "free_kv_cache_during_weight_sync=false", "reshard_chunk_size=4"])
  rollout, _, log, state, reshard_calls = _build(monkeypatch, cfg, qwen[1], tokenizer)
  assert [e for e in log if e[:2] == ("collective_rpc", "start_weight_update")][0][2] == {"free_kv_cache": False}
  n_leaves = len(vm.flatten_params(qwen[1]))
  assert len(reshard_calls) == math.ceil(n_leaves / 4) > 1
  flat_calls = [k for call in reshard_calls for k in call]
  assert sorted(flat_calls) == sorted(vm.engine_weights(state))  # each engine tensor written exactly once
  newer = jax.tree.map(lambda x: x + 1.0, qwen[1])
  rollout.update_params(newer)
  engine = vm.engine_weights(state)
  hc = vm.hf_config_from_params(newer, cfg.model_name)
  for hf_name, ref in expected_hf(newer, llama=False).items():
    if ref.ndim == 1:
      name, shape = tpu_inference_layout(hf_name, cfg.model_name, hc)
      np.testing.assert_allclose(
          np.asarray(engine[name], dtype=np.float32), engine_value(ref, hf_name, shape, hc), rtol=1e-2, err_msg=name
      )

  # An adapter-only sync (Tunix's LoRA sync) merges into the base kernels kept from a full sync of a LoRA actor;
  # this actor had no adapters, so there is nothing to merge into (tests/tpu_contract/test_forward.py runs LoRA).
  with pytest.raises(RuntimeError, match="adapter-only vLLM sync needs a full sync of the LoRA actor"):
    rollout.update_params(newer, (nnx.LoRAParam,))


def test_logprobs_of_old_weights_are_dropped_at_a_sync(monkeypatch, qwen, tokenizer):
  cfg, tree = qwen
  rollout, _, _, _, _ = _build(monkeypatch, cfg, tree, tokenizer)
  out = rollout.generate(["What is 2+3?"], _rollout_config(cfg))
  prompt, comp = jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(out.tokens[0])[None, :]
  np.testing.assert_allclose(np.asarray(rollout.get_per_token_logps(prompt, comp))[0], out.logprobs[0])
  rollout.update_params(tree)
  with pytest.raises(ValueError, match="since the last weight sync"):
    rollout.get_per_token_logps(prompt, comp)


def test_sync_that_writes_a_copy_is_caught_and_blocks_sampling(monkeypatch, qwen, tokenizer):
  """A worker whose get_weights_state() hands out copies: the write never reaches the engine."""
  cfg, tree = qwen
  rollout, module, _, _, _ = _build(monkeypatch, cfg, tree, tokenizer)
  llm = module.LLM.instances[-1]
  llm.worker.get_weights_state = lambda: jax.tree.map(
      lambda x: x, fake_engine_state(cfg.model_name, vm.hf_config_from_params(tree, cfg.model_name))
  )
  rollout._syncs = 0  # pylint: disable=protected-access  # verify_weight_sync=first checks the next sync
  with pytest.raises(RuntimeError, match="did not take effect"):
    rollout.update_params(tree)
  assert llm.session_active is False  # the update session is closed even on failure
  with pytest.raises(RuntimeError, match="refusing to sample"):
    rollout.generate(["hi"], _rollout_config(cfg))


def test_failed_initial_sync_raises_and_closes_the_update_session(monkeypatch, qwen, tokenizer):
  cfg, tree = qwen
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  state = fake_engine_state(cfg.model_name, hc)
  state["model"]["layers"][0]["self_attn"]["sinks"] = jnp.zeros((4,), jnp.bfloat16)  # a param we cannot fill
  with pytest.raises(ValueError, match="dummy initialisation"):
    _build(monkeypatch, cfg, tree, tokenizer, engine_state=state)
  llm = sys.modules["vllm"].LLM.instances[-1]
  assert llm.session_active is False and llm.generate_calls == []


def test_unregistrable_adapter_fails_before_starting_vllm(monkeypatch, tokenizer):
  cfg = load_config(["configs/cpu_tiny.yml", "model_name=gemma3-4b"])
  module, _ = make_fake_vllm({}, 0)
  monkeypatch.setitem(sys.modules, "vllm", module)
  with pytest.raises(errors.ConfigError, match="rollout_engine=vllm runs this model through MaxTextForCausalLM") as e:
    vllm_mod.VllmRollout(  # no tpu_inference in this venv: MaxText's adapter cannot be registered
        rollout_actor={}, tokenizer=tokenizer, mesh=_mesh(), rollout_config=_rollout_config(cfg), settings=_settings(cfg)
    )
  assert module.LLM.instances == [] and "\n" not in str(e.value)


def test_engine_never_aliases_trainer_buffers(monkeypatch, qwen, tokenizer):
  """An HF-layout engine in the trainer's dtype on the same device (colocated torchax-style): the mapped
  norm/embedding would be the trainer's own arrays; after the trainer donates (deletes) its buffers the
  engine must still hold valid weights."""
  cfg, _ = qwen
  tree = jax.tree.map(lambda x: x + 0.0, qwen[1])  # private copy: this test deletes it
  hc = vm.hf_config_from_params(tree, cfg.model_name)
  state: dict = {}
  for name, shape in vm.vllm_param_shapes(cfg.model_name, hc).items():
    node = state
    parts = name.split(".")
    for p in parts[:-1]:
      node = node.setdefault(int(p) if p.isdigit() else p, {})
    node[parts[-1]] = jnp.full(shape, DUMMY, dtype=jnp.float32)
  state["model"]["embed"] = {"embedding": state["model"].pop("embed_tokens")["weight"]}  # fake reads embed
  state["model"]["embed_tokens"] = {}
  rollout, module, _, state, _ = _build(monkeypatch, cfg, tree, tokenizer, engine_state=state)
  trainer_ids = {id(v) for v in vm.flatten_params(tree).values()}
  assert not trainer_ids & {id(v) for v in vm.flatten_params(state).values()}
  want = float(np.asarray(vm.flatten_params(tree)["base.token_embedder.embedding"])[0, 0])
  for leaf in vm.flatten_params(tree).values():
    leaf.delete()  # what a donating train step does
  rollout.generate(["hi"], _rollout_config(cfg))
  assert module.LLM.instances[-1].generate_calls[-1]["embed_00"] == pytest.approx(want)


# ------------------------------------------------------------------ multi-controller (Ray without Pathways)


def test_multi_controller_run_gets_one_vllm_engine_per_host(monkeypatch, qwen, tokenizer):
  """2 JAX processes without Pathways (Ray workers, TPU VMs): auto picks vLLM on TPU as on Pathways; the engine is
  this process's own (its devices of the rollout mesh as tpu-inference's device_indexes, looked up in
  jax.local_devices()), tensor parallelism within the host and rollout_data_parallelism split over the hosts; the
  first sync is checked by the per-host guard; the run samples per host."""
  cfg, tree = qwen
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a))
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # a TPU host of the Ray image (vLLM installed)
  logged = []
  monkeypatch.setattr(absl_logging, "info", lambda msg, *a: logged.append(msg % a))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(pathways, "requested", lambda: False)
  auto = _Override(cfg, rollout_engine="auto", head_dim=128)
  assert run_engine.resolve_name(auto) == "vllm"
  assert "one engine per host on 2 JAX processes" in logged[-1]
  assert run_engine.resolve_name(_Override(cfg, rollout_engine="vllm")) == "vllm"

  # Process 1 of 2; the rollout mesh spans both hosts' 4 devices (ids as multi-process CPU JAX numbers them).
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(distributed, "gather_rows", np.asarray)  # this host's part of the guard's gather
  checked = []
  real_check = per_host.check_hosts
  monkeypatch.setattr(per_host, "check_hosts", lambda src, got: checked.append(sorted(src)) or real_check(src, got))
  devices = [types.SimpleNamespace(id=2048 * p + i, process_index=p) for p in (0, 1) for i in range(4)]
  mesh = types.SimpleNamespace(devices=np.asarray(devices, dtype=object).reshape(2, 4))
  module, _ = make_fake_vllm(fake_engine_state(cfg.model_name, vm.hf_config_from_params(tree, cfg.model_name)), 0)
  monkeypatch.setitem(sys.modules, "vllm", module)
  split = _Override(cfg, rollout_tensor_parallelism=2, rollout_data_parallelism=4, rollout_expert_parallelism=1)
  rollout = vllm_mod.VllmRollout(
      rollout_actor=tree, tokenizer=tokenizer, mesh=mesh, rollout_config=_rollout_config(cfg), settings=_settings(split)
  )
  kw = module.LLM.instances[-1].kwargs
  assert kw["additional_config"]["sharding"]["sharding_strategy"]["device_indexes"] == [2048, 2049, 2050, 2051]
  assert (kw["tensor_parallel_size"], kw["data_parallel_size"]) == (2, 2)  # 2 hosts x 2 replicas = 4, MaxText's dp
  assert rollout.per_host and checked == [sorted(vm.engine_weights(module.LLM.instances[-1].worker.state))]
  run = types.SimpleNamespace(
      rl_cluster=types.SimpleNamespace(rollout=rollout), setup=types.SimpleNamespace(disaggregated=False)
  )
  assert experience.samples_per_host(run)  # each process samples its share, then the rows are gathered

  # Impossible splits are one line, before vLLM starts.
  for bad, match in (
      (_Override(split, rollout_data_parallelism=3), r"'rollout_data_parallelism'=3: .* multiple of its 2 hosts"),
      (_Override(split, rollout_tensor_parallelism=8, rollout_data_parallelism=-1), r"per host: 2 hosts x 4 devices"),
  ):
    with pytest.raises(errors.ConfigError, match=match) as ei:
      vllm_mod.VllmRollout(
          rollout_actor=tree, tokenizer=tokenizer, mesh=mesh, rollout_config=_rollout_config(cfg), settings=_settings(bad)
      )
    assert "\n" not in str(ei.value)
  assert len(module.LLM.instances) == 1


def test_qwen3_head_dim_that_tpu_inference_pads_is_refused_at_validation():
  """tpu-inference normalises Qwen3's q/k over head_dim padded to 128 (64 excepted): another function (measured in
  tests/tpu_contract/test_forward.py::test_qwen3_head_dim_below_128), so the config is refused, one line."""
  with pytest.raises(errors.ConfigError) as e:
    load_config(["configs/cpu_tiny.yml", "rollout_engine=vllm"])  # cpu_tiny's Qwen3 has head_dim 16
  msg = str(e.value)
  assert "'head_dim'=16" in msg and "pads it to 128" in msg and "\n" not in msg
  for ok in (["head_dim=64"], ["head_dim=128"], ["head_dim=256"], ["model_name=llama3.1-8b"]):
    assert load_config(["configs/cpu_tiny.yml", "rollout_engine=vllm", *ok]).rollout_engine == "vllm"


# ------------------------------------------------------------------ MaxTextForCausalLM route (rollout/vllm_maxtext.py)

ADAPTER = 'vllm_hf_overrides={"architectures":["MaxTextForCausalLM"]}'
TINY_MOE = [
    "model_name=qwen3-30b-a3b",
    "base_emb_dim=64",
    "base_mlp_dim=32",
    "base_moe_mlp_dim=32",
    "num_experts=4",
    "num_experts_per_tok=2",
    "sparse_matmul=false",
    "megablox=false",
    "capacity_factor=-1",
    "head_dim=16",
]
PADDED_MOE = 256  # what MaxText's adapter pads a 32-wide expert MLP to at TP 1 (2 x 128 TPU lanes)


def adapter_engine_state(trainer_argv: list[str]) -> dict:
  """MaxTextForCausalLM's weight tree for a trainer config: MaxText's own model with the adapter's overrides (unscanned
  layers, padded and prefused experts), under `model`, filled with the dummy value (vLLM's load_format=dummy)."""
  cfg = load_config(
      [
          "configs/cpu_tiny.yml",
          *trainer_argv,
          "scan_layers=false",
          "prefuse_moe_weights=true",
          f"padded_base_moe_mlp_dim={PADDED_MOE}",
      ]
  )
  _, model = model_creation_utils.create_nnx_abstract_model(cfg, devices=jax.devices()[:1])
  abstract = nnx.state(model, nnx.Param).to_pure_dict()
  return {"model": jax.tree.map(lambda s: jnp.full(s.shape, DUMMY, jnp.float32), abstract)}


@pytest.fixture(name="moe", scope="module")
def moe_fixture():
  cfg = load_config(["configs/cpu_tiny.yml", *TINY_MOE, "rollout_engine=vllm", ADAPTER])  # print_config's checks pass
  return cfg, _trainer_tree(cfg, 2)


def _build_adapter(monkeypatch, cfg, tree, tokenizer, state):
  """A VllmRollout on the MaxTextForCausalLM route over the fake vllm module; MaxText's registration recorded."""
  from maxtext_rl_plugin.rollout import vllm_maxtext  # pylint: disable=import-outside-toplevel

  registered = []
  monkeypatch.setattr(vllm_maxtext, "register_adapter", lambda: registered.append(True))
  module, log = make_fake_vllm(state, tokenizer.eos_token_id)
  monkeypatch.setitem(sys.modules, "vllm", module)
  monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
  rollout = vllm_mod.VllmRollout(
      rollout_actor=tree, tokenizer=tokenizer, mesh=_mesh(), rollout_config=_rollout_config(cfg), settings=_settings(cfg)
  )
  return rollout, module, log, registered


def test_maxtexts_key_selects_the_adapter_route_with_maxtexts_meaning(moe):
  from maxtext_rl_plugin.rollout import vllm_maxtext  # pylint: disable=import-outside-toplevel

  cfg, _ = moe
  settings = _settings(cfg)
  assert vllm_maxtext.selected(cfg.vllm_hf_overrides) and (settings.adapter_route, settings.route_reason) == (True, None)
  assert vllm_config.choose_route(cfg.model_name, cfg.vllm_hf_overrides) == (True, None)
  kw, source = vllm_maxtext.engine_kwargs(
      vllm_config.vllm_engine_kwargs(settings, 2, device_ids=[0, 1]), settings.adapter
  )
  assert source == "derived" and kw["hf_overrides"]["architectures"] == ["MaxTextForCausalLM"]
  assert kw["hf_overrides"]["moe_intermediate_size"] == 32  # the adapter pads the expert width from this field
  mc = kw["additional_config"]["maxtext_config"]
  assert mc["model_name"] == "qwen3-30b-a3b" and mc["base_moe_mlp_dim"] == 32 and mc["num_experts"] == 4
  assert (
      "prefuse_moe_weights" not in mc
  )  # TP 1 here (rollout_data_parallelism derives 2): MaxText's rule sets it at TP > 1
  assert kw["additional_config"]["sharding"]["sharding_strategy"]["device_indexes"] == [0, 1]
  tp2 = load_config(["configs/cpu_tiny.yml", *TINY_MOE, ADAPTER, "rollout_tensor_parallelism=2"])
  kw2, _ = vllm_maxtext.engine_kwargs(vllm_config.vllm_engine_kwargs(_settings(tp2), 2), _settings(tp2).adapter)
  assert kw2["tensor_parallel_size"] == 2 and kw2["additional_config"]["maxtext_config"]["prefuse_moe_weights"]
  # A given maxtext_config is MaxText's: passed on as written, its model must be the trainer's.
  given = 'vllm_additional_config={"maxtext_config":{"model_name":"qwen3-30b-a3b","model_call_mode":"inference"}}'
  gcfg = load_config(["configs/cpu_tiny.yml", *TINY_MOE, ADAPTER, given])
  kw3, source = vllm_maxtext.engine_kwargs(vllm_config.vllm_engine_kwargs(_settings(gcfg), 1), _settings(gcfg).adapter)
  assert source == "given" and kw3["additional_config"]["maxtext_config"] == {
      "model_name": "qwen3-30b-a3b",
      "model_call_mode": "inference",
  }
  wrong = given.replace('"model_name":"qwen3-30b-a3b"', '"model_name":"qwen3-0.6b"')
  with pytest.raises(errors.ConfigError, match="maxtext_config.model_name='qwen3-0.6b' is not the trainer's") as e:
    load_config(["configs/cpu_tiny.yml", *TINY_MOE, ADAPTER, wrong, "rollout_engine=vllm"])
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["prefuse_moe_weights=true"], "'prefuse_moe_weights'=True with vLLM's MaxTextForCausalLM route"),
        (["use_weight_converter=false"], "use_weight_converter.*legacy Tunix transfer_state_directly"),
    ],
)
def test_adapter_route_refusals_are_one_line(argv, match):
  with pytest.raises(errors.ConfigError, match=match) as e:
    load_config(["configs/cpu_tiny.yml", *TINY_MOE, "rollout_engine=vllm", ADAPTER, *argv])
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("model", ["gemma3-4b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek3-671b", "gpt-oss-20b"])
def test_families_without_a_native_class_take_the_adapter_route_and_say_why(model):
  cfg = load_config(["configs/cpu_tiny.yml", f"model_name={model}", "rollout_engine=auto"])  # embedded refuses MLA
  adapter, why = vllm_config.choose_route(cfg.model_name, cfg.vllm_hf_overrides)
  assert adapter and why.startswith(f"no native vLLM class for {model}: ") and "(MaxTextForCausalLM)" in why
  assert "\n" not in why
  for native in ("qwen3-0.6b", "llama3.1-8b"):
    native_cfg = load_config(["configs/cpu_tiny.yml", f"model_name={native}"])
    assert vllm_config.choose_route(native_cfg.model_name, native_cfg.vllm_hf_overrides) == (False, None)


def _expected_adapter_leaf(tree: dict, name: str) -> np.ndarray:
  """The engine value of `name` re-derived with NumPy: layer i of the scanned tensor (scan axis 1), experts padded with
  zeros to PADDED_MOE, `wi` = [gate | up] (one shard at TP 1)."""
  parts = name.split(".")[1:]  # drop "model"
  layer = next((int(p[len("layers_") :]) for p in parts if p.startswith("layers_")), None)
  src = [("layers" if p.startswith("layers_") else p) for p in parts]
  if src[-1] == "wi":
    gate, up = (_np(tree, ".".join(src[:-1] + [w])) for w in ("wi_0", "wi_1"))
    gate, up = (np.take(w, layer, axis=1) for w in (gate, up))
    pad = [(0, 0), (0, 0), (0, PADDED_MOE - gate.shape[-1])]
    return np.concatenate([np.pad(gate, pad), np.pad(up, pad)], axis=-1)
  value = _np(tree, ".".join(src))
  if layer is not None:
    value = np.take(value, layer, axis=1)
  if src[-1] == "wo" and "moe_block" in src:
    value = np.pad(value, [(0, 0), (0, PADDED_MOE - value.shape[1]), (0, 0)])
  return value


def test_moe_step0_sync_writes_every_adapter_parameter(monkeypatch, moe, tokenizer, capsys):
  """The constructor's sync fills every MaxTextForCausalLM weight with the trainer's value in the adapter's layout."""
  cfg, tree = moe
  given = 'vllm_additional_config={"maxtext_config":{"model_name":"qwen3-30b-a3b","prefuse_moe_weights":true}}'
  cfg = load_config(["configs/cpu_tiny.yml", *TINY_MOE, "rollout_engine=vllm", ADAPTER, given])
  state = adapter_engine_state(TINY_MOE)
  rollout, module, log, registered = _build_adapter(monkeypatch, cfg, tree, tokenizer, state)
  assert registered == [True] and rollout.adapter_route
  assert capsys.readouterr().out.count("vLLM route: MaxTextForCausalLM") == 1
  engine = vm.engine_weights(state)
  assert {k for k in engine if "moe_block.wi" in k} == {f"model.decoder.layers_{i}.moe_block.wi" for i in (0, 1)}
  for name, value in engine.items():
    np.testing.assert_array_equal(np.asarray(value), _expected_adapter_leaf(tree, name), err_msg=name)
  assert [c[1] for c in log if c[0] == "collective_rpc"] == ["start_weight_update", "finish_weight_update"]
  trainer_buffers = set().union(*(move.buffer_ids(v) for v in vm.flatten_params(tree).values()))
  assert not any(move.buffer_ids(v) & trainer_buffers for v in engine.values())  # the train step donates those
  out = rollout.generate(["What is 2+3?"], _rollout_config(cfg))
  assert len(out.tokens) == 1
  assert module.LLM.instances[0].generate_calls[0]["embed_00"] == float(tree["base"]["token_embedder"]["embedding"][0, 0])


def test_adapter_route_lora_syncs_only_the_adapted_kernels(monkeypatch, tokenizer):
  """LoRA on the MaxTextForCausalLM route: adapters merged on the trainer side as for native classes; an adapter-only
  sync (Tunix passes the LoRAParam state) rewrites exactly the engine kernels of the adapted modules."""
  from maxtext_rl_plugin import lora as lora_lib  # pylint: disable=import-outside-toplevel

  argv = ["configs/cpu_tiny.yml", *TINY_MOE, "rollout_engine=vllm", ADAPTER]
  lora_argv = ["lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8"]
  cfg = load_config([*argv, *lora_argv])
  tree = _trainer_tree(load_config(argv), 3)
  state = adapter_engine_state(TINY_MOE)
  rollout, _, _, _ = _build_adapter(monkeypatch, cfg, tree, tokenizer, state)
  before = {k: np.asarray(v) for k, v in vm.engine_weights(state).items()}
  q = tree["base"]["decoder"]["layers"]["self_attention"]["query"]["kernel"]  # [D, L, N, H]
  rank = 4
  a = jnp.ones((q.shape[0], q.shape[1], rank), jnp.float32) * 0.1
  b = jnp.asarray(np.random.default_rng(4).standard_normal((rank, q.shape[1], q.shape[2] * q.shape[3])), jnp.float32)
  adapters = {"base": {"decoder": {"layers": {"self_attention": {"query": {"kernel_lora_a": a, "kernel_lora_b": b}}}}}}
  rollout._lora_base = {"base.decoder.layers.self_attention.query.kernel": q}  # pylint: disable=protected-access
  rollout.update_params(adapters, (nnx.LoRAParam,))
  after = {k: np.asarray(v) for k, v in vm.engine_weights(state).items()}
  changed = sorted(k for k in after if not np.array_equal(after[k], before[k]))
  assert changed == [f"model.decoder.layers_{i}.self_attention.query.kernel" for i in (0, 1)]
  merged = lora_lib.merge_flat(
      {"base.decoder.layers.self_attention.query.kernel": q},
      vm.flatten_params(adapters),
      lora_lib.LoraSettings.from_config(cfg).scale,
      int(cfg.param_scan_axis),
  )["base.decoder.layers.self_attention.query.kernel"]
  for i in (0, 1):
    np.testing.assert_allclose(after[changed[i]], np.take(np.asarray(merged), i, axis=1), rtol=1e-6)


@pytest.mark.parametrize(
    "model, engine",
    [("gemma3-4b", "vllm"), ("qwen3-30b-a3b", "vllm"), ("mixtral-8x7b", "vllm"), ("deepseek3-671b", "embedded")],
)
def test_auto_takes_a_proven_vllm_route_only(monkeypatch, model, engine):
  """rollout_engine=auto on a TPU with vLLM: a family whose vLLM route tests/tpu_contract proves gets vLLM (its route
  line is printed by the engine); one that no route proves stays embedded and says why."""
  # rollout_engine=auto as written: cpu_tiny's embedded engine refuses DeepSeek's MLA cache at config time.
  cfg = load_config(["configs/cpu_tiny.yml", f"model_name={model}", "head_dim=128", "rollout_engine=auto"])
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a))
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  logged = []
  monkeypatch.setattr(absl_logging, "info", lambda msg, *a: logged.append(msg % a))
  assert run_engine.resolve_name(_Override(cfg, rollout_engine="auto")) == engine
  if engine == "embedded":
    assert "MaxTextForCausalLM route for deepseek3-671b is not proven by tests/tpu_contract" in logged[-1]


def test_adapter_route_chunked_resync_and_a_copy_write_caught(monkeypatch, moe, tokenizer):
  """The dense path's sync contract on the MoE MaxTextForCausalLM route: a chunked re-sync (rl.reshard_chunk_size
  arrays per move) reaches every engine leaf with the new weights; a worker handing out copies is caught, the
  update session is closed and sampling is refused."""
  _, tree = moe
  given = 'vllm_additional_config={"maxtext_config":{"model_name":"qwen3-30b-a3b","prefuse_moe_weights":true}}'
  cfg = load_config(["configs/cpu_tiny.yml", *TINY_MOE, "rollout_engine=vllm", ADAPTER, given, "reshard_chunk_size=5"])
  state = adapter_engine_state(TINY_MOE)
  rollout, module, _, _ = _build_adapter(monkeypatch, cfg, tree, tokenizer, state)
  moves = []
  real_reshard = move.reshard
  monkeypatch.setattr(move, "reshard", lambda t, s, **kw: moves.append(kw["chunk_size"]) or real_reshard(t, s, **kw))
  newer = jax.tree.map(lambda x: x + 1.0, tree)
  rollout.update_params(newer)
  assert moves == [5]
  for name, value in vm.engine_weights(state).items():
    np.testing.assert_array_equal(np.asarray(value), _expected_adapter_leaf(newer, name), err_msg=name)
  llm = module.LLM.instances[-1]
  llm.worker.get_weights_state = lambda: jax.tree.map(lambda x: x, adapter_engine_state(TINY_MOE))
  rollout._syncs = 0  # pylint: disable=protected-access  # verify_weight_sync=first checks the next sync
  with pytest.raises(RuntimeError, match="did not take effect"):
    rollout.update_params(tree)
  assert llm.session_active is False
  with pytest.raises(RuntimeError, match="refusing to sample"):
    rollout.generate(["hi"], _rollout_config(cfg))
