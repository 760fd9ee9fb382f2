"""The vLLM route's quantized sync (`rollout_quantization=int8|fp8`) into tpu-inference 0.32.0's real quantized model.

tpu-inference serves a float checkpoint in low precision through Qwix PTQ on its native class (rollout/vllm_quantized.py
says why that route, for int8 and FP8 alike). Here the real `LlamaForCausalLM` (tiny, float32, TP 4 on 4 forced CPU
devices, as test_forward.py builds it) is quantized by tpu-inference's own `qwix_utils.apply_qwix_quantization` with the
`additional_config` the plugin's `vllm_engine_kwargs` gives vLLM, so its state holds Qwix QArray kernels
(`kernel.array.qvalue` / `kernel.array.scale`); the plugin's `VllmRollout.update_params` then syncs a MaxText model's
float weights into it (quantized on the trainer's side, rollout/vllm_quantized.py), and the engine prefills a 100-token
prompt and decodes through its paged KV cache. Its logits must be within `REL_TOL` of MaxText's own forward at the
embedded engine's quantized weights (rollout/quantized_weights.py: the same kernels quantized in MaxText's layout and
read back), and its bytes must equal what Qwix's own PTQ makes of the float weights a float sync writes.

Substitutions, each narrow (forward.py has the attention one): the forward runs the package's reference ragged paged
attention; the PTQ pass, which tpu-inference jits over random attention metadata ("the inputs don't need to match the
actual ones, as long as the consumed weights are the same", `qwix_quantize_nnx_model`), runs with an attention that
returns zeros of the kernel's shapes (the reference validates concrete metadata and cannot run under that trace; the
attention reads no weight, so the quantized leaves are the same), and its HBM-usage log line (`utils.hbm_usage_gb`,
which asks for TPU devices) reads 0.

Tolerance: max |engine - reference| over every prefill and decode logit, relative to the largest |logit|, measured
with `QUANTIZED_SYNC_SEEDS=0,1,2` (3 init seeds; `-s` prints them; docs/low_precision.md has the table):

  Llama 3.1 int8 4.7e-4 - 5.3e-4 (LoRA, after an adapter sync: 9.0e-4), fp8 5.3e-7 - 6.1e-7;
  Qwen3 int8 2.6e-7 - 5.2e-7, fp8 2.6e-7 - 3.2e-7 (the third pass runs seed 0 and Qwen3 int8 only: its time;
  the whole file adds ~18 s to it after test_forward.py, measured here, and the bfloat16 engine's byte comparison,
  int8 and fp8, ~8 s more).

Both sides compute with `q * s` in float32; what differs is the order of summation (test_forward.py: 2.5e-7 - 1.4e-6)
and, under int8, Llama's query: MaxText holds it pre-scaled by 1/sqrt(head_dim), the export un-scales it, and a
channel's absmax element lands at exactly Qwix's bound 127.5, where the last float bit of `w / s` decides between -127
and -128 for a negative one; quantized in the engine's layout (after the rescale) 28 of a layer's 16,384 query values
differ by one step from the embedded engine's. FP8's bound 448 is representable and its clip symmetric, and Qwen3 has
no rescale. `REL_TOL`: int8 5e-3 (5x the largest measured), fp8 1e-5 (16x); a wrong scale layout (every scale's
channels reversed; per-head scales transposed) moves the logits by 1.41 - 1.64, > 100 x REL_TOL.
"""

# tpu_inference and vllm exist only in .venv-tpu; imported where used (see tpu_models.py).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import contextlib
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forward
from test_forward import CASES, PROMPT_LEN, TINY_ARGV, gap
from tpu_models import TP, build

N_DECODE = 2
REL_TOL = {"int8": 5e-3, "fp8": 1e-5}
# The third pass runs seed 0 (its time); QUANTIZED_SYNC_SEEDS=0,1,2 reproduces the docstring's measurement.
SEEDS = tuple(int(s) for s in os.environ.get("QUANTIZED_SYNC_SEEDS", "0").split(","))


@contextlib.contextmanager
def ptq_on_cpu():
  """The two substitutions tpu-inference's PTQ pass needs on CPU (module docstring)."""
  from tpu_inference.layers.common import attention_interface
  from tpu_inference.models.jax.utils.qwix import qwix_utils

  def shapes_only(mesh, q, k, v, kv_cache, *args, **kwargs):
    del mesh, k, v, args, kwargs
    return jnp.zeros_like(q), kv_cache

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(attention_interface, "sharded_ragged_paged_attention", shapes_only)
    mp.setattr(qwix_utils.utils, "hbm_usage_gb", lambda devices: 0.0)
    yield


def qwix_quantized(model, vllm_config, mesh, quantization: dict):
  """tpu-inference's real model, quantized as its loader quantizes a float checkpoint's concrete model
  (`model_loader._get_nnx_model` -> `apply_qwix_quantization(..., apply_to_abstract_model=False)`)."""
  from tpu_inference.layers.common.sharding import ShardingConfigManager
  from tpu_inference.models.jax.utils.qwix import qwix_utils

  vllm_config.additional_config = {"quantization": quantization}
  qwix_utils.update_vllm_config_for_qwix_quantization(vllm_config)  # the loader's own validation of the rules
  vllm_config.cache_config.block_size = forward.PAGE_SIZE
  vllm_config.sharding_config = ShardingConfigManager.from_vllm_config(vllm_config)
  with ptq_on_cpu(), jax.set_mesh(mesh):
    return qwix_utils.apply_qwix_quantization(vllm_config, model, jax.random.key(0), mesh, apply_to_abstract_model=False)


class QuantizedPair:
  """A float32 MaxText actor with `rollout_quantization=name` and the Qwix-quantized tpu-inference Llama its
  VllmRollout syncs into."""

  def __init__(self, model_dir, name: str, seed: int = 0, family: str = "llama3.1", lora: bool = False):
    import vllm  # .venv-tpu only
    from tunix.rl.rollout import base_rollout
    from maxtext_rl_plugin.run import models
    from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
    from maxtext_rl_plugin.config.load import load_config
    from maxtext_rl_plugin.rollout import vllm as vllm_rollout
    from maxtext_rl_plugin.rollout import vllm_config as vllm_config_lib

    argv, arch, hf = CASES[family]
    extra = [f"rollout_quantization={name}", f"init_weights_seed={seed}", "rl.verify_weight_sync=every_n"]
    extra += ["rl.verify_weight_sync_every=1"]
    extra += ["lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8"] if lora else []
    self.cfg = load_config(["configs/cpu_tiny.yml", *TINY_ARGV, *argv, *extra])
    self.actor, mt_mesh = models.build_model(self.cfg, jax.devices()[:1])
    self.lora = lora
    if lora:
      self.actor, _ = models.apply_lora(self.cfg, self.actor, mt_mesh)
    if self.cfg.logits_via_embedding:  # a tied head: the table bf16-exact, as test_forward.Pair._bf16_table says why
      emb = self.actor.base.token_embedder.embedding
      emb.value = emb.value.astype(jnp.bfloat16).astype(jnp.float32)
    settings = vllm_config_lib.VllmSettings.from_config(self.cfg)
    # The Qwix rules the plugin gives vLLM (`vllm.LLM(additional_config=...)`), as tpu-inference's loader reads them.
    self.quantization = vllm_config_lib.vllm_engine_kwargs(settings, TP)["additional_config"]["quantization"]
    # A separate float engine from test_forward's (tpu_models caches by overrides; the PTQ pass donates its model).
    float_engine, vllm_config, self.mesh = build(
        model_dir,
        arch,
        abstract=False,
        dtype="float32",
        vocab_size=1024,
        **hf,
        qwix_test=f"{name}-{seed}-{family}-{lora}",
    )
    self.engine = qwix_quantized(float_engine, vllm_config, self.mesh, self.quantization)
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(forward.ShimLLM, "model", self.engine)
      mp.setattr(vllm, "LLM", forward.ShimLLM)
      mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
      self.rollout = vllm_rollout.VllmRollout(
          rollout_actor=self.actor,
          tokenizer=tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(self.cfg)),
          mesh=self.mesh,
          rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=112),
          settings=settings,
      )
    assert self.rollout.llm.kwargs["additional_config"]["quantization"] == self.quantization  # what vLLM was given
    self.prompt = [int(t) for t in np.random.default_rng(7 + seed).integers(0, 1024, PROMPT_LEN)]

  def sync(self):
    self.rollout.update_params(nnx.state(self.actor, nnx.Param), (nnx.Param,))

  def reference_logits(self, tokens: list[int]) -> np.ndarray:
    """MaxText's forward at the embedded engine's quantized weights (rollout/quantized_weights.py: quantized in
    MaxText's layout, read back as `q * s`), on a clone of the actor. A LoRA actor's: its adapters merged in float
    first (lora.merged_params, the embedded engine's Merger), the merged kernels quantized, the clone's adapters zeroed.
    """
    from maxtext_rl_plugin import lora as lora_lib
    from maxtext_rl_plugin.rollout import quantized_weights

    weights = quantized_weights.SamplerWeights.from_config(self.cfg)
    clone = nnx.clone(self.actor)
    if self.lora:
      settings = lora_lib.LoraSettings.from_config(self.cfg)
      merged = lora_lib.merged_params(clone, settings.scale, int(self.cfg.param_scan_axis))
      nnx.update(clone.base, weights.read(weights.quantize(merged)))
      nnx.update(clone, jax.tree.map(jnp.zeros_like, nnx.state(clone, nnx.LoRAParam)))
    else:
      nnx.update(clone, weights.read(weights.quantize(nnx.state(clone, nnx.Param))))
    return forward.maxtext_logits(clone, tokens)

  def check(self, what: str) -> float:
    got, tokens = forward.engine_greedy(self.engine, self.mesh, self.prompt, N_DECODE)
    want = self.reference_logits(self.prompt + tokens[:-1])
    g = gap(got, want)
    print(f"{what}: gap {g:.2e} of max |logit| {np.max(np.abs(want)):.3g}")
    return g


_PAIRS: dict = {}


def pair_of(model_dir, name: str, seed: int = 0, family: str = "llama3.1", lora: bool = False) -> QuantizedPair:
  if (family, name, seed, lora) not in _PAIRS:
    _PAIRS[family, name, seed, lora] = QuantizedPair(model_dir, name, seed, family, lora)
  return _PAIRS[family, name, seed, lora]


def _engine(pair) -> dict:
  from maxtext_rl_plugin.rollout import vllm_mapping as vm

  return vm.engine_weights(nnx.state(pair.engine))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "family, name", [("llama3.1", "int8"), ("llama3.1", "fp8"), ("qwen3", "int8")]
)  # qwen3 fp8: MEASURED
def test_quantized_engine_computes_maxtexts_function_at_the_same_quantized_weights(model_dir, family, name, seed):
  pair = pair_of(model_dir, name, seed, family)
  engine = _engine(pair)
  qvalues = [k for k in engine if k.endswith(".array.qvalue")]
  assert len(qvalues) == 14 and {str(engine[k].dtype) for k in qvalues} == {
      pair.quantization["qwix"]["rules"][0]["weight_qtype"]
  }
  assert all(engine[k.replace("qvalue", "scale")].dtype == jnp.float32 for k in qvalues)
  assert pair.check(f"{family} {name} seed {seed}") < REL_TOL[name]
  # The sync moved the quantized bytes: q (1 byte) + scales for the kernels, float32 for the rest.
  assert pair.rollout.last_sync_bytes == sum(v.nbytes for v in engine.values())


def _reversed_channels(s):
  return s[..., ::-1]


def _heads_transposed(s):
  """A per-head scale `[1, heads, head_dim]` laid out as `[1, head_dim, heads]` (same shape, wrong order)."""
  return s.reshape(1, s.shape[2], s.shape[1]).swapaxes(1, 2) if s.ndim == 3 and s.shape[1] > 1 else s


@pytest.mark.parametrize(
    "name, layout",
    [("int8", _reversed_channels), ("fp8", _heads_transposed)],
    ids=["channels reversed", "heads transposed"],
)
def test_a_wrong_scale_layout_fails_the_check(model_dir, monkeypatch, name, layout):
  """Every scale the sync writes in a wrong (same-shape) layout: the logits leave the tolerance by far (measured with
  both formats: channels reversed 1.64 / 1.51, per-head scales transposed 1.45 / 1.41 of the largest |logit|, int8 /
  fp8; the third pass runs one layout per format)."""
  from maxtext_rl_plugin.rollout import vllm_quantized

  pair = pair_of(model_dir, name)
  real = vllm_quantized.quantize

  def wrong(*args, **kwargs):
    out = real(*args, **kwargs)
    return {k: (layout(v) if k.endswith(vllm_quantized.SCALE) else v) for k, v in out.items()}

  with monkeypatch.context() as mp:
    mp.setattr(vllm_quantized, "quantize", wrong)
    pair.sync()
    assert pair.check(f"{name} with scales {layout.__name__}") > 100 * REL_TOL[name]
  pair.sync()
  assert pair.check(f"{name} after the real sync again") < REL_TOL[name]


def test_the_sync_writes_what_qwix_makes_of_the_float_weights(model_dir):
  """The quantized sync's bytes and scales equal tpu-inference's own Qwix PTQ of the float weights the float sync
  writes (the same export tables and layout, then Qwix's quantization of the engine's float model), bit for bit."""
  from maxtext_rl_plugin.rollout import vllm_mapping as vm
  from maxtext_rl_plugin.rollout import vllm_sync

  pair = pair_of(model_dir, "int8")
  argv_hf = CASES["llama3.1"][2]
  float_engine, vllm_config, mesh = build(
      model_dir, "llama", abstract=False, dtype="float32", vocab_size=1024, **argv_hf, qwix_test="float-sync"
  )
  flat = vm.flatten_params(nnx.state(pair.actor, nnx.Param))
  vllm_sync.write_weights(
      nnx.state(float_engine), flat, pair.cfg.model_name, vm.hf_config_from_params(flat, pair.cfg.model_name)
  )
  own = vm.engine_weights(nnx.state(qwix_quantized(float_engine, vllm_config, mesh, pair.quantization)))
  synced = _engine(pair)
  assert sorted(own) == sorted(synced)
  for k, v in own.items():
    assert v.dtype == synced[k].dtype and v.shape == synced[k].shape, k
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8), np.asarray(synced[k]).view(np.uint8), err_msg=k)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_bfloat16_engine_gets_what_qwix_makes_of_its_bfloat16_weights(model_dir, name):
  """On a bfloat16 engine (bfloat16 scales) the sync's bytes and scales equal tpu-inference's own (jitted) Qwix PTQ of
  the bfloat16 weights a float sync writes, bit for bit: Qwix quantizes in the weight's dtype, rounding `w / s` to
  bfloat16 before int8 / e4m3, and the sync computes the same way (rollout/vllm_quantized.py)."""
  from maxtext_rl_plugin.rollout import vllm_mapping as vm
  from maxtext_rl_plugin.rollout import vllm_sync

  pair = pair_of(model_dir, name)
  flat = vm.flatten_params(nnx.state(pair.actor, nnx.Param))
  hf_config = vm.hf_config_from_params(flat, pair.cfg.model_name)
  engines = {}
  for what in ("float-sync", "quantized-sync"):
    model, vllm_config, mesh = build(
        model_dir, "llama", abstract=False, vocab_size=1024, **CASES["llama3.1"][2], qwix_test=f"bf16-{name}-{what}"
    )
    if what == "float-sync":
      vllm_sync.write_weights(nnx.state(model), flat, pair.cfg.model_name, hf_config)
    engines[what] = qwix_quantized(model, vllm_config, mesh, pair.quantization)
  vllm_sync.write_weights(nnx.state(engines["quantized-sync"]), flat, pair.cfg.model_name, hf_config)
  own, synced = (vm.engine_weights(nnx.state(engines[w])) for w in ("float-sync", "quantized-sync"))
  scales = [k for k in own if k.endswith(".array.scale")]
  assert len(scales) == 14 and {str(own[k].dtype) for k in scales} == {"bfloat16"}
  assert sorted(own) == sorted(synced)
  for k, v in own.items():
    assert v.dtype == synced[k].dtype and v.shape == synced[k].shape, k
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8), np.asarray(synced[k]).view(np.uint8), err_msg=k)


def test_the_sync_guard_covers_the_quantized_bytes_and_the_scales(model_dir, monkeypatch):
  """`rl.verify_weight_sync`: a scale corrupted on its way into the engine stops the sync (VllmRollout's guard), and
  the per-host guard's trainer-side checksums name every qvalue and scale leaf and catch the corrupted one."""
  from maxtext_rl_plugin.resharding import per_host
  from maxtext_rl_plugin.resharding import trees
  from maxtext_rl_plugin.rollout import vllm_mapping as vm
  from maxtext_rl_plugin.rollout import vllm_sync

  pair = pair_of(model_dir, "fp8")
  victim = "model.layers.1.self_attn.o_proj.kernel.array.scale"
  real_setter = vm.engine_state_setter

  def corrupting(state):
    set_leaves = real_setter(state)
    return lambda values: set_leaves({k: (v.at[0, 0, 5].multiply(2.0) if k == victim else v) for k, v in values.items()})

  with monkeypatch.context() as mp:
    mp.setattr(vm, "engine_state_setter", corrupting)
    with pytest.raises(RuntimeError, match=f"did not take effect: engine parameter {victim} differs"):
      pair.sync()

  sums: dict = {}
  flat = vm.flatten_params(nnx.state(pair.actor, nnx.Param))
  state = nnx.state(pair.engine)
  vllm_sync.write_weights(
      state, flat, pair.cfg.model_name, vm.hf_config_from_params(flat, pair.cfg.model_name), source_checksums=sums
  )
  engine = vm.engine_weights(state)
  assert {k for k in engine if k.endswith((".qvalue", ".scale"))} <= set(sums) and len(sums) == len(engine)
  per_host.check_hosts(sums, engine)  # the honest write passes
  vm.engine_state_setter(state)({victim: engine[victim].at[0, 0, 5].multiply(2.0)})
  with pytest.raises(trees.WeightSyncError, match=victim):
    per_host.check_hosts(sums, vm.engine_weights(state))
  pair.sync()
  assert pair.check("fp8 after the guard's checks") < REL_TOL["fp8"]


def test_lora_adapters_merged_then_quantized(model_dir):
  """LoRA on a quantized vLLM base: the adapters are merged into their kernels on the trainer's side in float (as on the
  float route), then quantized like any kernel; an adapter-only sync re-quantizes only the adapted kernels. The engine
  computes the embedded engine's function (merged, quantized) before and after a LoRA train step."""
  from maxtext_rl_plugin.rollout import vllm_mapping as vm

  pair = pair_of(model_dir, "int8", lora=True)
  assert pair.check("int8 LoRA initial sync") < REL_TOL["int8"]
  forward.train_step(pair.actor, pair.prompt, wrt=nnx.LoRAParam, learning_rate=5e-2)
  assert pair.check("int8 LoRA after a train step, before the sync") > 10 * REL_TOL["int8"]
  pair.rollout.update_params(nnx.state(pair.actor, nnx.LoRAParam), (nnx.LoRAParam,))
  assert pair.check("int8 LoRA after the adapter sync") < REL_TOL["int8"]
  engine = vm.engine_weights(nnx.state(pair.engine))
  projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
  assert pair.rollout.last_sync_bytes == sum(v.nbytes for k, v in engine.items() if any(p in k for p in projections))
