"""The numeric contract of vLLM's MaxTextForCausalLM route: MaxText's own decoder inside vLLM, fed by the plugin's sync.

A tiny MaxText model (the trainer's, float32, scanned layers) selects the route with MaxText's own key
(`vllm_hf_overrides={"architectures": ["MaxTextForCausalLM"]}`). `VllmRollout` registers MaxText's adapter, derives the
adapter's `maxtext_config`, and its `vllm.LLM` kwargs build the real `MaxTextForCausalLM` (forward.ShimLLM's role: only
vLLM's engine around the model is a shim; tpu_models.build_adapter builds it as vLLM's loader does). The constructor's
sync (resharding/maxtext_layout.py: MaxText's MaxTextToMaxTextConverter, then the plugin's resharding) fills it; the
engine prefills a 100-token prompt and decodes twice through its paged KV cache; every row's logits must equal
MaxText's own forward over the same tokens, and the greedy tokens must agree. Then a real Adam step, the stale engine
must differ, the same sync again, and the logits must agree again. Substitutions (forward.py's docstring): the
reference paged attention, fed concrete metadata under MaxText's per-layer remat; for MoE, the grouped matmul by its
reference and no SparseCore gather.

Families: Llama 3.1 (dense; also against the native LlamaForCausalLM route on the same weights), Qwen3-MoE and Mixtral
(MoE, TP 2: experts padded 64 -> 512 and `wi` prefused per shard), Gemma 3 (local/global attention pattern). What
only a TPU shows: the Pallas kernels themselves (ragged paged attention, gmm_v2, SparseCore gathers), bfloat16
numerics, and `sparse_matmul=true` training against the fused path.

Tolerance as test_forward.py (same float32 rounding argument): REL_TOL = 1e-4 of the largest |logit|.
"""

from __future__ import annotations

import numpy as np
import pytest

from flax import nnx
import jax

from maxtext_rl_plugin.run import parity

import forward
import tpu_models
from test_forward import PROMPT_LEN, REL_TOL, TINY_ARGV, gap, pair_of

N_DECODE = 2
ADAPTER = 'vllm_hf_overrides={"architectures":["MaxTextForCausalLM"]}'
MOE = [
    "num_experts=4",
    "num_experts_per_tok=2",
    "base_moe_mlp_dim=64",
    "sparse_matmul=false",
    "megablox=false",
    "capacity_factor=-1",
]
FAMILIES = {
    # family: (MaxText argv, rollout TP)
    "llama3.1": (["model_name=llama3.1-8b", "head_dim=32"], 4),
    # rl.router_replay: the engine captures its routing (test_vllm_routing.py shares this pair); the logits must not move
    "qwen3": (["model_name=qwen3-30b-a3b", "head_dim=32", *MOE, "rl.router_replay=true"], 2),
    "mixtral": (["model_name=mixtral-8x7b", "head_dim=32", "base_mlp_dim=64", *MOE], 2),  # fully MoE: mlp = moe mlp
    "gemma3": (["model_name=gemma3-4b", "head_dim=32"], 2),
}


class AdapterShim(forward.ShimLLM):
  """`vllm.LLM` building the real MaxTextForCausalLM from the kwargs the plugin passes vLLM."""

  root = None
  family = None
  mesh = None

  def __init__(self, **kwargs):
    cls = type(self)
    forward.ShimLLM.model = tpu_models.build_adapter(cls.root, cls.family, kwargs, cls.mesh)
    super().__init__(**kwargs)


class AdapterPair:
  """A MaxText actor and the real MaxTextForCausalLM its VllmRollout (adapter route) syncs into."""

  def __init__(self, model_dir, family: str, *, extra_argv=()):
    import vllm  # pylint: disable=import-outside-toplevel  # .venv-tpu only
    from tunix.rl.rollout import base_rollout  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.run import models  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.config.load import load_config  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.rollout import vllm as vllm_rollout  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.rollout import vllm_config  # pylint: disable=import-outside-toplevel

    argv, tp = FAMILIES[family]
    parallel = [f"rollout_tensor_parallelism={tp}", "rollout_data_parallelism=1"]
    self.cfg = load_config(["configs/cpu_tiny.yml", *TINY_ARGV, *argv, ADAPTER, *parallel, *extra_argv])
    self.actor, _ = models.build_model(self.cfg, jax.devices()[:1])
    self.mesh = tpu_models.adapter_mesh(tp)
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(AdapterShim, "root", model_dir)
      mp.setattr(AdapterShim, "family", family)
      mp.setattr(AdapterShim, "mesh", self.mesh)
      mp.setattr(vllm, "LLM", AdapterShim)
      mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
      self.rollout = vllm_rollout.VllmRollout(
          rollout_actor=self.actor,
          tokenizer=tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(self.cfg)),
          mesh=self.mesh,
          rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=112),
          settings=vllm_config.VllmSettings.from_config(self.cfg),
      )
    self.engine = forward.ShimLLM.model
    self.prompt = [int(t) for t in np.random.default_rng(7).integers(0, 1024, PROMPT_LEN)]
    self.greedy_agrees = False

  def sync(self):
    self.rollout.update_params(nnx.state(self.actor, nnx.Param), (nnx.Param,))

  def engine_logits(self) -> tuple[np.ndarray, list[int]]:
    return forward.engine_greedy(self.engine, self.mesh, self.prompt, N_DECODE, pad_to=16)

  def check(self, what: str) -> float:
    got, tokens = self.engine_logits()
    want = forward.maxtext_logits(self.actor, self.prompt + tokens[:-1])
    g = gap(got, want)
    self.parity = forward.parity_figures(got, want, len(self.prompt), tokens)  # the gate's view of the same tokens
    print(f"{what}: gap {g:.2e} of max |logit| {np.max(np.abs(want)):.3g}; parity {self.parity}")
    self.greedy_agrees = [int(t) for t in np.argmax(want[len(self.prompt) - 1 :], axis=-1)] == tokens
    return g


_PAIRS: dict = {}


def adapter_pair(model_dir, family: str) -> AdapterPair:
  if family not in _PAIRS:
    _PAIRS[family] = AdapterPair(model_dir, family)
  return _PAIRS[family]


# The default tier: Qwen3-MoE (the route's MoE layout and expert mapping). Llama 3.1 (also checked on the native route,
# test_forward.py, and against it by test_llama_adapter_and_native_class_agree_on_the_same_weights), Mixtral (MoE
# again) and Gemma 3 are `extended` (~150 s of pass 3).
EXTENDED_FAMILIES = ("gemma3", "llama3.1", "mixtral")


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.extended) if f in EXTENDED_FAMILIES else f for f in sorted(FAMILIES)]
)
def test_adapter_computes_maxtexts_function_before_and_after_a_train_step(model_dir, family):
  pair = adapter_pair(model_dir, family)
  assert pair.rollout.adapter_route and "MaxTextForCausalLM" in pair.rollout.route
  assert pair.check(f"{family} (MaxTextForCausalLM) initial sync") < REL_TOL and pair.greedy_agrees
  forward.train_step(pair.actor, pair.prompt)
  assert pair.check(f"{family} (MaxTextForCausalLM) after a train step, before the sync") > 100 * REL_TOL
  pair.sync()
  assert pair.check(f"{family} (MaxTextForCausalLM) after the sync") < REL_TOL and pair.greedy_agrees
  assert parity.exceeded(pair.parity, parity.tolerance(pair.cfg, "vllm")) is None, pair.parity  # the gate lets it run


@pytest.mark.extended  # ~35 s (builds the Llama adapter pair): each route is checked against MaxText's forward
def test_llama_adapter_and_native_class_agree_on_the_same_weights(model_dir):
  """The two vLLM routes for Llama 3.1 compute the same function: the native LlamaForCausalLM synced from the adapter
  pair's actor gives the adapter engine's logits."""
  adapter = adapter_pair(model_dir, "llama3.1")
  native = pair_of(model_dir, "llama3.1", "llama3.1")
  native.rollout.update_params(nnx.state(adapter.actor, nnx.Param), (nnx.Param,))
  got_adapter, tokens_adapter = adapter.engine_logits()
  got_native, tokens_native = forward.engine_greedy(native.engine, native.mesh, adapter.prompt, N_DECODE)
  g = gap(got_adapter, got_native)
  print(f"llama3.1 adapter vs native class: gap {g:.2e}")
  assert g < REL_TOL and tokens_adapter == tokens_native
  native.sync()  # the native pair's own actor again, for the tests sharing it


def _moe_leaves(new: dict, name: str) -> list[str]:
  return sorted(k for k in new if ".moe_block." in k and k.endswith(name))


def _permute_experts(new: dict) -> dict:
  out = dict(new)
  for k in new:
    if ".moe_block." in k and k.rsplit(".", 1)[-1] in ("wi", "wi_0", "wi_1", "wo"):
      out[k] = new[k][np.array([1, 0, 3, 2])]
  return out


def _router_transposed(new: dict) -> dict:
  out = dict(new)
  for k in _moe_leaves(new, "gate.kernel"):
    out[k] = new[k].T.reshape(new[k].shape)  # read in the other layout: same shape, wrong function
  return out


def _swap_layer_experts(new: dict) -> dict:
  out = dict(new)
  for k in new:
    if ".layers_0.moe_block." in k and k.rsplit(".", 1)[-1] in ("wi", "wi_0", "wi_1", "wo"):
      other = k.replace(".layers_0.", ".layers_1.")
      out[k], out[other] = new[other], new[k]
  return out


MUTATIONS = {
    "expert order permuted": _permute_experts,
    "router transposed": _router_transposed,
    "a layer's experts swapped": _swap_layer_experts,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_check_catches_same_shape_moe_sync_bugs(model_dir, monkeypatch, mutation):
  """Each bug keeps every shape (MaxText's converter and the coverage check pass); the logits catch it."""
  from maxtext_rl_plugin.resharding import maxtext_layout  # pylint: disable=import-outside-toplevel

  pair = adapter_pair(model_dir, "qwen3")
  real = maxtext_layout.AdapterLayout.convert
  with monkeypatch.context() as mp:
    mp.setattr(maxtext_layout.AdapterLayout, "convert", lambda self, *a: MUTATIONS[mutation](real(self, *a)))
    pair.sync()
    assert pair.check(f"qwen3-moe with {mutation}") > 100 * REL_TOL  # measured 0.14-0.17
    # The parity gate (run/parity.py), at the route's default tolerances, stops a run on it: from the log-probs alone.
    assert parity.exceeded(pair.parity, parity.tolerance(pair.cfg, "vllm")) is not None, pair.parity
  pair.sync()  # the real sync again (the unmutated pair's match is the first test's)


def test_moe_engine_holds_padded_prefused_experts(model_dir):
  """TP 2: the adapter pads the expert width 64 -> 512 (GMM kernel lanes) and holds `wi` prefused per shard; the
  engine's leaves are that layout, derived here with NumPy from the trainer's wi_0 / wi_1."""
  from maxtext_rl_plugin.rollout import vllm_mapping as vm  # pylint: disable=import-outside-toplevel

  pair = adapter_pair(model_dir, "qwen3")
  engine = vm.engine_weights(nnx.state(pair.engine))
  trainer = vm.flatten_params(nnx.state(pair.actor, nnx.Param))
  wi = np.asarray(engine["model.decoder.layers_1.moe_block.wi"])
  w0 = np.take(np.asarray(trainer["base.decoder.layers.moe_block.wi_0"]), 1, axis=pair.cfg.param_scan_axis)
  w1 = np.take(np.asarray(trainer["base.decoder.layers.moe_block.wi_1"]), 1, axis=pair.cfg.param_scan_axis)
  assert wi.shape == (4, 128, 2 * 512) and w0.shape == (4, 128, 64)
  half = 32  # per shard: 64 / TP 2 real columns, then zeros up to 512 / 2
  for s in range(2):
    shard = wi[..., s * 512 : (s + 1) * 512]
    np.testing.assert_array_equal(shard[..., :half], w0[..., s * half : (s + 1) * half])
    np.testing.assert_array_equal(shard[..., 256 : 256 + half], w1[..., s * half : (s + 1) * half])
    assert not shard[..., half:256].any() and not shard[..., 256 + half :].any()


def test_loader_names_exist_at_the_pins():
  """The private tpu-inference names tpu_models.build_adapter uses, and MaxText's adapter registration."""
  from maxtext.integration.vllm import maxtext_vllm_adapter  # pylint: disable=import-outside-toplevel
  from tpu_inference.models.common import model_loader  # pylint: disable=import-outside-toplevel

  maxtext_vllm_adapter.register()
  assert model_loader._MODEL_REGISTRY["MaxTextForCausalLM"] is maxtext_vllm_adapter.MaxTextForCausalLM  # pylint: disable=protected-access
  assert callable(model_loader._get_nnx_model)  # pylint: disable=protected-access
