"""The numeric contract: the real tpu-inference classes, fed by the plugin's own sync, compute MaxText's function.

A tiny MaxText model (the trainer's, float32) is synced into tpu-inference 0.32.0's real `LlamaForCausalLM` /
`Qwen3ForCausalLM` by `VllmRollout.update_params` (the sync the trainer runs; only vLLM's engine around the model is a
shim, see forward.py). The engine then prefills a ~100-token prompt and decodes greedily through its paged KV cache;
every prefill row and every decode step's logits must equal MaxText's own forward over the same tokens, and the greedy
tokens must be identical. Then one optimizer step changes the MaxText weights, the same path syncs again, and the new
logits must equal the new MaxText forward. Same-shape mapping bugs (q/k swapped, kv heads tiled, o_proj transposed,
layers out of order) must fail the check.

Tolerance: both sides compute in float32 from the same float32 weights; what differs is the order of summation
(MaxText's dot_product attention vs. the kernel's reference over paged k/v; XLA:CPU's matmul blocking; TP=4 sharded
contractions), so the gap is float32 rounding grown through two layers: measured 2.5e-7 to 1.4e-6 of the largest
|logit|. `REL_TOL` (1e-4 of it) leaves 70x headroom and is 4000x below what every mutation moves (0.42-0.62); a wrong
mapping is asserted to move it by > 100 x REL_TOL (RoPE scaling, a smaller effect on a 100-token prompt: > 10x).
"""

from __future__ import annotations

import numpy as np
import pytest

from flax import nnx
import jax

from maxtext_rl_plugin.run import parity

import forward
from tpu_models import build

REL_TOL = 1e-4
N_DECODE = 2
PROMPT_LEN = 100  # llama3 RoPE scaling only acts on positions long enough for its low frequencies to turn

TINY_ARGV = [
    "base_emb_dim=128",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "base_mlp_dim=256",
    "base_num_decoder_layers=2",
    "vocab_size=1024",
    "max_prefill_predict_length=112",
    "max_target_length=128",
]
# MaxText 0.2.5's llama3.1 RoPE (LLaMARotaryEmbedding._apply_scaling_factor), as HF's config.json spells it.
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
CASES = {
    # name: (MaxText argv, tpu-inference arch, its config.json overrides)
    "llama3.1": (
        ["model_name=llama3.1-8b", "head_dim=32"],
        "llama",
        {"head_dim": 32, "rope_scaling": LLAMA31_ROPE, "tie_word_embeddings": False},
    ),
    "qwen3": (["model_name=qwen3-0.6b", "head_dim=128"], "qwen3", {"head_dim": 128, "tie_word_embeddings": True}),
}


def gap(engine: np.ndarray, reference: np.ndarray) -> float:
  """Largest |difference| relative to the reference's largest |logit|."""
  return float(np.max(np.abs(engine - reference)) / np.max(np.abs(reference)))


class Pair:
  """A MaxText actor (LoRA-wrapped with `lora`) and the real tpu-inference model its VllmRollout syncs into."""

  def __init__(self, model_dir, name: str, *, extra_argv=(), engine=None, lora: bool = False):
    import vllm  # pylint: disable=import-outside-toplevel  # .venv-tpu only
    from tunix.rl.rollout import base_rollout  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.run import models as run_models  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.config.load import load_config  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.rollout import vllm as vllm_rollout  # pylint: disable=import-outside-toplevel
    from maxtext_rl_plugin.rollout import vllm_config  # pylint: disable=import-outside-toplevel

    argv, arch, hf = CASES[name]
    hf = {**hf, **(engine or {})}
    self.cfg = load_config(["configs/cpu_tiny.yml", *TINY_ARGV, *argv, *extra_argv])
    self.actor, mt_mesh = run_models.build_model(self.cfg, jax.devices()[:1])
    if lora:
      self.actor, _ = run_models.apply_lora(self.cfg, self.actor, mt_mesh)
    self.tied = bool(self.cfg.logits_via_embedding)
    self._bf16_table()
    self.engine, _, self.mesh = build(model_dir, arch, abstract=False, dtype="float32", vocab_size=1024, **hf)
    tokenizer = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(self.cfg))
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(forward.ShimLLM, "model", self.engine)
      mp.setattr(vllm, "LLM", forward.ShimLLM)
      mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
      self.rollout = vllm_rollout.VllmRollout(
          rollout_actor=self.actor,
          tokenizer=tokenizer,
          mesh=self.mesh,
          rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=112),
          settings=vllm_config.VllmSettings.from_config(self.cfg),
      )
    self.prompt = [int(t) for t in np.random.default_rng(7).integers(0, 1024, PROMPT_LEN)]
    self.greedy_agrees = False

  def _bf16_table(self):
    """A tied head: hold the embedding at bfloat16-representable values (as a bf16 checkpoint or bf16 training has it).

    MaxText 0.2.5's tied head multiplies by the table cast to bfloat16 on every call (rollout/head.py), whatever its
    dtype; a float32 engine multiplies by the table itself. With a bf16-exact table both multiply by the same numbers
    (without it the gap is the rounding, 7e-4 of the logits' scale, not the mapping's).
    """
    if self.tied:
      emb = self.actor.base.token_embedder.embedding
      emb.value = emb.value.astype(jax.numpy.bfloat16).astype(jax.numpy.float32)

  def train(self, wrt=nnx.Param, learning_rate: float = 1e-2):
    """One real optimizer step of the MaxText model (forward.train_step) on the pair's prompt."""
    forward.train_step(self.actor, self.prompt, wrt=wrt, learning_rate=learning_rate)
    if wrt is nnx.Param:
      self._bf16_table()

  def sync(self, wrt=nnx.Param):
    """What Tunix's `RLCluster.sync_weights` calls: the actor's `wrt` state (LoRAParam for a LoRA actor)."""
    self.rollout.update_params(nnx.state(self.actor, wrt), (wrt,))

  def check(self, what: str) -> float:
    """Engine prefill + decode vs MaxText's forward over the same tokens: the gap (sets `greedy_agrees`)."""
    got, tokens = forward.engine_greedy(self.engine, self.mesh, self.prompt, N_DECODE)
    want = forward.maxtext_logits(self.actor, self.prompt + tokens[:-1])
    g = gap(got, want)
    self.parity = forward.parity_figures(got, want, len(self.prompt), tokens)  # the gate's view of the same tokens
    print(f"{what}: gap {g:.2e} of max |logit| {np.max(np.abs(want)):.3g}; parity {self.parity}")
    self.greedy_agrees = [int(t) for t in np.argmax(want[len(self.prompt) - 1 :], axis=-1)] == tokens
    return g


_PAIRS: dict = {}


def pair_of(model_dir, key: str, name: str, **kw) -> Pair:
  if key not in _PAIRS:
    _PAIRS[key] = Pair(model_dir, name, **kw)
  return _PAIRS[key]


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_computes_maxtexts_function_before_and_after_a_train_step(model_dir, name):
  pair = pair_of(model_dir, name, name)
  assert pair.check(f"{name} initial sync") < REL_TOL and pair.greedy_agrees
  pair.train()
  assert pair.check(f"{name} after a train step, before the sync") > 100 * REL_TOL  # stale weights are caught
  pair.sync()
  assert pair.check(f"{name} after the sync") < REL_TOL and pair.greedy_agrees


def _swap_layers(hf: dict) -> dict:
  swap = {"layers.0.": "layers.1.", "layers.1.": "layers.0."}
  out = {}
  for name, w in hf.items():
    for a, b in swap.items():
      if a in name:
        name = name.replace(a, b)
        break
    out[name] = w
  return out


def _swap_qk(new: dict) -> dict:
  out = dict(new)
  for name in new:
    if "q_proj" in name and name.replace("q_proj", "k_proj") in new:
      out[name], out[name.replace("q_proj", "k_proj")] = new[name.replace("q_proj", "k_proj")], new[name]
  return out


def _transpose_o(new: dict) -> dict:
  return {k: (jax.numpy.swapaxes(v, 1, 2) if "o_proj" in k else v) for k, v in new.items()}


def _mutate(monkeypatch, mutation: str) -> None:
  """A same-shape bug in one step of the plugin's mapping (every result still fits the engine's shapes)."""
  from maxtext_rl_plugin.rollout import vllm_mapping as vm  # pylint: disable=import-outside-toplevel

  if mutation == "layers out of order":
    real_map = vm.map_maxtext_to_vllm
    monkeypatch.setattr(vm, "map_maxtext_to_vllm", lambda *a, **k: _swap_layers(real_map(*a, **k)))
    return
  if mutation == "kv heads tiled, not repeated":
    real_heads = vm._heads  # pylint: disable=protected-access

    def tiled(weight, n_dst, h_dst, head_axis, name):
      n = weight.shape[head_axis]
      reps = [1] * weight.ndim
      reps[head_axis] = n_dst // n
      return jax.numpy.tile(real_heads(weight, n, h_dst, head_axis, name), reps)

    monkeypatch.setattr(vm, "_heads", tiled)
    return
  post = {"q/k swapped after the kv repeat": _swap_qk, "o_proj transposed": _transpose_o}[mutation]
  real_state = vm.to_engine_state

  def mutated_state(*args, **kwargs):
    new, names = real_state(*args, **kwargs)
    return post(new), names

  monkeypatch.setattr(vm, "to_engine_state", mutated_state)


@pytest.mark.parametrize(
    "mutation",
    ["q/k swapped after the kv repeat", "kv heads tiled, not repeated", "o_proj transposed", "layers out of order"],
)
def test_the_check_catches_same_shape_mapping_bugs(model_dir, monkeypatch, mutation):
  """Each bug passes the name/shape contract (test_engine_trees.py); the logits catch it."""
  pair = pair_of(model_dir, "llama3.1", "llama3.1")
  with monkeypatch.context() as mp:
    _mutate(mp, mutation)
    pair.sync()
    assert pair.check(f"llama3.1 with {mutation}") > 100 * REL_TOL
    # The parity gate (run/parity.py), at the route's default tolerances, stops a run on it: from the log-probs alone.
    assert parity.exceeded(pair.parity, parity.tolerance(pair.cfg, "vllm")) is not None, pair.parity
  pair.sync()  # the real mapping again: the same pair passes
  assert pair.check("llama3.1 unmutated") < REL_TOL
  assert parity.exceeded(pair.parity, parity.tolerance(pair.cfg, "vllm")) is None, pair.parity


def test_llama31_rope_scaling_is_exercised(model_dir):
  """The prompt is long enough that llama3's RoPE scaling changes the logits: an engine without it is caught."""
  pair = pair_of(model_dir, "llama3.1-unscaled-engine", "llama3.1", engine={"rope_scaling": None})
  # Measured 4e-3 of the logits' scale: 40x REL_TOL and ~10,000x the gap of the engine with it.
  assert pair.check("llama3.1 into an engine without RoPE scaling") > 10 * REL_TOL


def test_lora_adapters_merged_on_the_trainer_side(model_dir):
  """LoRA with vLLM: the first sync sends the whole model with the adapters merged, later syncs (Tunix passes only the
  LoRAParam state) only the adapted kernels; the engine then computes the adapted MaxText model's function.
  (Llama only, for the third pass's time: Qwen3 measured the same, gaps 2.5e-7 / 4.1e-7.)"""
  from maxtext_rl_plugin import lora as lora_lib  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.rollout import vllm_mapping as vm  # pylint: disable=import-outside-toplevel

  name = "llama3.1"

  pair = pair_of(
      model_dir,
      f"{name}-lora",
      name,
      lora=True,
      extra_argv=["lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8"],
  )
  full_bytes = pair.rollout.last_sync_bytes
  assert pair.check(f"{name} LoRA initial sync") < REL_TOL and pair.greedy_agrees
  pair.train(wrt=nnx.LoRAParam, learning_rate=5e-2)
  assert pair.check(f"{name} LoRA after a train step, before the sync") > 100 * REL_TOL
  pair.sync(nnx.LoRAParam)
  assert pair.check(f"{name} LoRA after the adapter sync") < REL_TOL and pair.greedy_agrees
  adapter_bytes = pair.rollout.last_sync_bytes
  adapted = {k[: -len("_lora_a")] for k in vm.flatten_params(nnx.state(pair.actor, nnx.LoRAParam)) if "_lora_a" in k}
  print(f"{name} LoRA sync: {adapter_bytes} bytes vs {full_bytes} for a full sync ({sorted(adapted)})")
  # MaxText's default module path: every attention and MLP kernel.
  assert lora_lib.LoraSettings.from_config(pair.cfg).resolved_module_path() and len(adapted) == 7
  engine = vm.engine_weights(nnx.state(pair.engine))
  projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
  assert full_bytes == sum(v.nbytes for v in engine.values())
  assert adapter_bytes == sum(v.nbytes for k, v in engine.items() if any(p in k for p in projections)) < full_bytes


@pytest.mark.parametrize("head_dim, diverges", [(32, True), (64, False)])
def test_qwen3_head_dim_below_128(model_dir, head_dim, diverges):
  """tpu-inference pads head_dim to a multiple of 128 (64 excepted) and normalises Qwen3's q/k over the padded
  width: head_dim 32 computes another function (why config validation refuses it with rollout_engine=vllm,
  `rollout/vllm_spec.py::qwen3_head_dim_reason`); head_dim 64 is not padded and matches."""
  from maxtext_rl_plugin.rollout import vllm_spec  # pylint: disable=import-outside-toplevel

  pair = pair_of(
      model_dir, f"qwen3-hd{head_dim}", "qwen3", extra_argv=[f"head_dim={head_dim}"], engine={"head_dim": head_dim}
  )
  g = pair.check(f"qwen3 head_dim {head_dim}")
  assert (g > 100 * REL_TOL) if diverges else (g < REL_TOL and pair.greedy_agrees)
  assert bool(vllm_spec.qwen3_head_dim_reason("qwen3-0.6b", head_dim)) == diverges
