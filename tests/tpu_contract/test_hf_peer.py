"""`bench gpu`'s Hugging Face peer computes the MaxText model's function on the weights it is given.

`bench gpu` (bench/gpu_rollout.py) times HF `generate` on the MaxText model's weights, converted by
`gpu_rollout.hf_state_dict`, in a model `gpu_rollout.hf_model` builds from `gpu_rollout.hf_config`, and compares the
greedy tokens with the embedded engine's. A peer on mis-mapped weights (a RoPE convention, a q/k norm, an untied head)
would time the right shapes but its token agreement would mean nothing. Here a tiny float32 MaxText model of each
shape the bench runs is converted and loaded (every tensor of the HF model, nothing else) into transformers' own
`Qwen3ForCausalLM` / `LlamaForCausalLM`, and HF's logits over a 100-token prompt (long enough for llama3's RoPE scaling
to act) must equal MaxText's forward over the same tokens. Shapes: Qwen3 with a tied head (Qwen3-0.6B), Qwen3 untied
(Qwen3-8B and up), Llama 3.1 (untied, llama3 RoPE scaling, MaxText's interleaved RoPE and pre-scaled query). Norm scales
are drawn at random first: MaxText initialises them to 1, where a missing or swapped norm would not show.

Every mutation of the converted tensors (RoPE halves left interleaved, gate/up or k/v swapped, q/k norms swapped, o_proj
transposed, the untied head read as the table) and a Llama config without RoPE scaling must move the logits by far.

Tolerance: both sides compute in float32 from the same float32 weights (a tied table held at bfloat16-representable
values: MaxText's tied head multiplies by the table cast to bfloat16, see test_forward.py); what differs is the order of
summation (XLA:CPU vs PyTorch's CPU kernels, sdpa vs MaxText's dot_product attention), so the gap is float32 rounding
grown through two layers: measured 3.7e-7 to 7.1e-7 of the largest |logit| (max |dlogit| 3.1e-6 to 4.6e-5, the
larger for the tied Qwen3 whose logits reach 123). REL_TOL (1e-4 of it, as test_forward.py) leaves 140x headroom; every
mutation moves it by more than 100x REL_TOL (measured 0.047, q/k norms swapped, to 27, the head read as the table), the
missing RoPE scaling by 5.3e-3 (> 10x REL_TOL, as test_forward.py's test of it).
Runs in .venv-tpu: it has torch (.venv has none).
"""

from __future__ import annotations

import numpy as np
import pytest

from flax import nnx
import jax

import forward
from test_forward import PROMPT_LEN, REL_TOL, TINY_ARGV, gap

SHAPES = {
    "qwen3-tied": ["model_name=qwen3-0.6b", "head_dim=128"],
    "qwen3-untied": ["model_name=qwen3-0.6b", "head_dim=128", "logits_via_embedding=false"],
    "llama3.1": ["model_name=llama3.1-8b", "head_dim=32"],
}


def _build(argv):
  """A tiny float32 MaxText model with random norm scales (a bf16-exact table when tied) and its config."""
  from maxtext_rl_plugin.run import models  # pylint: disable=import-outside-toplevel  # after tpu_models' platform
  from maxtext_rl_plugin.config.load import load_config  # pylint: disable=import-outside-toplevel

  cfg = load_config(["configs/cpu_tiny.yml", *TINY_ARGV, *argv])
  actor, _ = models.build_model(cfg, jax.devices()[:1])
  rng = np.random.default_rng(3)

  def draw(path, x):
    if "scale" in [getattr(k, "key", None) for k in path]:  # norm scales (the leaf's path ends in `.value`)
      return x * jax.numpy.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
    return x

  nnx.update(actor, jax.tree_util.tree_map_with_path(draw, nnx.state(actor, nnx.Param)))
  if cfg.logits_via_embedding:
    emb = actor.base.token_embedder.embedding
    emb.set_value(emb.get_value().astype(jax.numpy.bfloat16).astype(jax.numpy.float32))
  return actor, cfg


def _layers(sd: dict):
  return sorted({k.split(".self_attn.")[0] for k in sd if ".self_attn." in k})


def _swap(a: str, b: str):
  def mutate(sd):
    out = dict(sd)
    for p in _layers(sd):
      out[f"{p}.{a}.weight"], out[f"{p}.{b}.weight"] = sd[f"{p}.{b}.weight"], sd[f"{p}.{a}.weight"]
    return out

  return mutate


def _rope_interleaved(head_dim: int):
  """q and k rows of each head back in MaxText's interleaved RoPE order (HF rotates dimension i with i + head_dim/2)."""
  half = head_dim // 2
  order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)

  def mutate(sd):
    out = dict(sd)
    for p in _layers(sd):
      for proj in ("q_proj", "k_proj"):
        w = sd[f"{p}.self_attn.{proj}.weight"]
        out[f"{p}.self_attn.{proj}.weight"] = w.reshape(-1, head_dim, w.shape[-1])[:, order].reshape(w.shape)
    return out

  return mutate


def _transposed(name: str):
  def mutate(sd):
    return {**sd, **{f"{p}.{name}.weight": sd[f"{p}.{name}.weight"].T.copy() for p in _layers(sd)}}

  return mutate


def _head_as_table(sd):
  return {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}


class _NoRopeScaling:
  """The MaxText config with `rope_use_scale` off: what a peer without llama3's RoPE scaling would be built from."""

  def __init__(self, cfg):
    self._cfg = cfg

  rope_use_scale = False

  def __getattr__(self, name):
    return getattr(self._cfg, name)


# ~26 CPU-s for the three shapes (32-64 s wall on a loaded 2-core host). The default tier checks instead: test_forward.py
# (the same mapping into tpu-inference's classes) and tests/bench/test_bench_gpu.py (the converted projections in NumPy).
@pytest.mark.extended
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_hf_peer_computes_maxtexts_function(shape):
  import torch  # pylint: disable=import-outside-toplevel  # .venv-tpu only
  from maxtext_rl_plugin.bench import gpu_rollout  # pylint: disable=import-outside-toplevel

  actor, cfg = _build(SHAPES[shape])
  tokens = [int(t) for t in np.random.default_rng(7).integers(0, int(cfg.vocab_size), PROMPT_LEN)]
  want = forward.maxtext_logits(actor, tokens)
  sd = gpu_rollout.hf_state_dict(actor, cfg)
  assert ("lm_head.weight" in sd) == (not cfg.logits_via_embedding)

  def hf_gap(state_dict, config=cfg) -> tuple[float, float]:
    hf, _ = gpu_rollout.hf_model(config, state_dict, dtype="float32")
    with torch.inference_mode():
      got = hf(torch.tensor([tokens])).logits[0].numpy()
    return gap(got, want), float(np.max(np.abs(got - want)))

  g, d = hf_gap(sd)
  print(f"{shape}: gap {g:.2e} of max |logit| {np.max(np.abs(want)):.3g} (max |dlogit| {d:.2e})")
  assert g < REL_TOL

  mutations = {
      "gate/up swapped": _swap("mlp.gate_proj", "mlp.up_proj"),
      "k/v swapped": _swap("self_attn.k_proj", "self_attn.v_proj"),
      "RoPE halves interleaved": _rope_interleaved(int(cfg.head_dim)),
  }
  if cfg.decoder_block.value == "qwen3":
    mutations["q/k norms swapped"] = _swap("self_attn.q_norm", "self_attn.k_norm")
  else:
    mutations["o_proj transposed"] = _transposed("self_attn.o_proj")  # square here: 4 heads x 32 = emb 128
  if not cfg.logits_via_embedding:
    mutations["untied head read as the table"] = _head_as_table
  for what, mutate in mutations.items():
    g, d = hf_gap(mutate(sd))
    print(f"{shape} with {what}: gap {g:.2e} (max |dlogit| {d:.2e})")
    assert g > 100 * REL_TOL, what
  if cfg.decoder_block.value != "qwen3":
    g, d = hf_gap(sd, _NoRopeScaling(cfg))
    print(f"{shape} without llama3 RoPE scaling: gap {g:.2e} (max |dlogit| {d:.2e})")
    assert g > 10 * REL_TOL  # scaling acts on the low frequencies only: a smaller effect on a 100-token prompt
