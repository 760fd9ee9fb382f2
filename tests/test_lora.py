"""LoRA RL (`lora.*` keys): MaxText's apply_lora_to_model on the actor, adapters-only training, sync, checkpoints.

References are independent of the code under test: the adapted model's own forward (qwix computes x @ W +
(x @ A) @ B * alpha/rank unmerged) for the engine's merged decode weights; greedy decoding by full no-cache forwards
of that model; the real Tunix optimizer / MaxText checkpoint loader for sizes and the export.
"""

import json
import os
import pathlib
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
from maxtext.configs import types
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from maxtext_rl_plugin import cli
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin import errors
from maxtext_rl_plugin import export_lora
from maxtext_rl_plugin.config import key_status
from maxtext_rl_plugin import lora
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.run import loop as trainer
from maxtext_rl_plugin.run import build
from maxtext_rl_plugin.run import models as run_models
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.run import engine as run_engine

import _in_process as in_process
from _tiny import SMALL_VOCAB

TINY = "configs/cpu_tiny.yml"
LORA = ["lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8"]
REPO = pathlib.Path(__file__).resolve().parents[1]
WIDTH = 64
NEW = 12

# A deterministic reward that varies with the text, and a sampling temperature at which the random-init model's
# completions differ: every group has a reward spread, so the adapters get a non-zero gradient (see
# tests/run/test_trainer_updates.py, where the same pair is explained).
_LENGTH_REWARD = """
def length_reward(prompts, completions, **kwargs):
  return [(sum(map(ord, c)) % 97) / 97.0 for c in completions]
"""


# ----------------------------------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------------------------------


def test_lora_keys_are_maxtexts_and_have_statuses():
  c = config_lib.load_config([TINY, *LORA, "lora.lora_module_path=decoder/layers/.*mlp/wo"])
  assert c.lora.enable_lora and c.lora.lora_rank == 4 and c.lora.lora_alpha == 8.0
  assert c.lora.lora_module_path == "decoder/layers/.*mlp/wo"
  assert set(types.LoRA.model_fields) == {k.split(".", 1)[1] for k in key_status.all_keys() if k.startswith("lora.")}
  for k in ("lora.enable_lora", "lora.lora_rank", "lora.lora_alpha", "lora.lora_module_path", "lora.lora_restore_path"):
    assert key_status.status(k).startswith("honoured (lora.py"), k
  for k in ("lora.lora_weight_qtype", "lora.lora_tile_size"):
    assert key_status.refusal(k).startswith("QLoRA")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["lora.enable_lora=true", "lora.lora_weight_qtype=nf4"], "'lora.lora_weight_qtype' is not supported"),
        (["lora.enable_lora=true", "lora.lora_tile_size=64"], "'lora.lora_tile_size' is not supported"),
        (["lora.lora_rank=8"], "'lora.lora_rank'=8 has no effect with lora.enable_lora=false"),
        (["lora.lora_restore_path=/x"], "'lora.lora_restore_path'='/x' has no effect"),
        (["lora.enable_lora=true", "lora.lora_alpha=8"], "'lora.lora_rank'=0: must be >= 1"),
        (["lora.enable_lora=true", "lora.lora_rank=4"], "'lora.lora_alpha'=0.0: must be > 0"),
        ([*LORA, "lora.lora_module_path=(("], "'lora.lora_module_path'='((': not a regular expression"),
        ([*LORA, "lora.lora_restore_path=/no/such/adapter"], "'lora.lora_restore_path'='/no/such/adapter': no such"),
        (["lora.enable_lora=true", "lora.no_such_key=1"], "unknown config key 'lora.no_such_key'"),
    ],
)
def test_bad_lora_keys_are_one_line_errors(overrides, needle):
  with pytest.raises(errors.ConfigError, match=None) as e:
    config_lib.load_config([TINY, *overrides])
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_vllm_engine_takes_lora():
  """LoRA with vLLM passes validation (adapters merged on the trainer side, tests/tpu_contract/test_forward.py)."""
  c = config_lib.load_config([TINY, *LORA, "rollout_engine=vllm", "head_dim=128"])
  assert lora.LoraSettings.from_config(c).enable and c.rollout_engine == "vllm"


def test_merge_flat_merges_only_the_adapted_kernels():
  """`merge_flat` (the vLLM sync's trainer-side merge) against W + scale * A @ B written out in NumPy."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((8, 2, 4, 3)).astype(np.float32)  # [embed, layers, heads, head_dim], scan axis 1
  a = rng.standard_normal((8, 2, 5)).astype(np.float32)  # [embed, layers, rank]
  b = rng.standard_normal((5, 2, 12)).astype(np.float32)  # [rank, layers, heads*head_dim]
  base = {"q.kernel": w, "o.kernel": np.ones((3, 3), np.float32)}
  got = lora.merge_flat(base, {"q.kernel_lora_a": a, "q.kernel_lora_b": b}, 0.5, 1)
  assert set(got) == {"q.kernel"}  # the un-adapted kernel is not sent
  for layer in range(2):
    want = w[:, layer] + 0.5 * (a[:, layer] @ b[:, layer]).reshape(8, 4, 3)
    np.testing.assert_allclose(np.asarray(got["q.kernel"])[:, layer], want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="no base kernel"):
    lora.merge_flat({}, {"q.kernel_lora_a": a, "q.kernel_lora_b": b}, 0.5, 1)


def test_default_module_path_is_maxtexts_per_model_entry():
  with open(os.path.join(MAXTEXT_CONFIGS_DIR, "post_train", "lora_module_path.yml"), encoding="utf-8") as f:
    table = yaml.safe_load(f)
  c = config_lib.load_config([TINY, *LORA])  # model_name qwen3-0.6b
  assert lora.LoraSettings.from_config(c).resolved_module_path() == table["qwen3"].replace(
      "layers/", r"layers(?:_[0-9]+|/[0-9]+)?/"
  )
  given = config_lib.load_config([TINY, *LORA, "lora.lora_module_path=decoder/layers/.*mlp/wo"])
  assert lora.LoraSettings.from_config(given).resolved_module_path() == "decoder/layers/.*mlp/wo"


# ----------------------------------------------------------------------------------------------------------------------
# The adapted model and the embedded engine's merged decode weights
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(name="adapted", scope="module")
def adapted_fixture():
  """A tiny LoRA model whose adapters change greedy continuations, with its config, tokenizer and mesh."""
  rs = run_models.setup_devices(config_lib.parse([TINY, *LORA]))
  cfg = rs.trainer_config
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(cfg))
  model, mesh = run_models.build_model(cfg, rs.trainer_devices, pad_id=tok.pad_token_id)

  def scale(path, x):  # context-dependent greedy continuations (see tests/rollout/test_rollout_embedded.py)
    return x * 3.0 if "decoder" in [getattr(k, "key", None) for k in path] and x.ndim >= 2 else x

  nnx.update(model, jax.tree_util.tree_map_with_path(scale, nnx.state(model, nnx.Param)))
  actor, base = run_models.apply_lora(cfg, model, mesh, tok.pad_token_id)
  gdef, _ = nnx.split(actor)

  @jax.jit
  def next_tokens(state, toks, lens):
    m = nnx.merge(gdef, state)
    pos = jnp.broadcast_to(jnp.arange(WIDTH)[None], toks.shape)
    seg = (pos < lens[:, None]).astype(jnp.int32)
    logits, _ = m(toks, pos, None, None, decoder_segment_ids=seg)
    return jnp.argmax(jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0], -1)

  def greedy_reference(prompts, steps):
    """Greedy decoding of the adapted model (adapters unmerged), one full no-cache forward per token."""
    toks = np.full((len(prompts), WIDTH), tok.pad_token_id, np.int32)
    lens = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
      toks[i, : len(p)] = p
    out = np.zeros((len(prompts), steps), np.int32)
    for s in range(steps):
      nxt = np.asarray(next_tokens(nnx.state(actor), jnp.asarray(toks), jnp.asarray(lens)))
      out[:, s] = nxt
      toks[np.arange(len(prompts)), lens] = nxt
      lens = lens + 1
    return out

  return {"cfg": cfg, "tok": tok, "mesh": mesh, "actor": actor, "base": base, "greedy_reference": greedy_reference}


def _random_adapters(actor, seed: int, scale: float = 0.5):
  """New adapter values (B is zero at init, which would make every check below vacuous)."""
  st = nnx.state(actor, nnx.LoRAParam)
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(st))))
  return jax.tree.map(lambda x: jax.device_put(jax.random.normal(next(keys), x.shape, x.dtype) * scale, x.sharding), st)


def test_adapters_on_maxtexts_default_modules_and_base_arrays_shared(adapted):
  actor, base = adapted["actor"], adapted["base"]
  lora_state = nnx.to_pure_dict(nnx.state(actor, nnx.LoRAParam))
  layers = lora_state["base"]["decoder"]["layers"]
  adapted_modules = {f"{blk}/{m}" for blk, mods in layers.items() for m in mods}
  assert adapted_modules == {
      "self_attention/query",
      "self_attention/key",
      "self_attention/value",
      "self_attention/out",
      "mlp/wi_0",
      "mlp/wi_1",
      "mlp/wo",
  }
  # Each adapter pair is A [C, L, r], B [r, L, M] for a kernel whose leading dims multiply to C (qwix's flattening).
  kernels = nnx.to_pure_dict(nnx.state(base, nnx.Param))["base"]["decoder"]["layers"]
  for blk, mods in layers.items():
    for m, leaves in mods.items():
      w, a, b = kernels[blk][m]["kernel"], leaves["kernel_lora_a"], leaves["kernel_lora_b"]
      assert a.shape[-1] == b.shape[0] == 4 and a.shape[1] == b.shape[1] == w.shape[1] == 2
      assert a.shape[0] * b.shape[-1] == w.size // 2
  # No second copy: every non-adapter leaf of the actor (params and RNG state) is the frozen base's own array.
  mine = jax.tree.leaves(nnx.state(actor, nnx.Not(nnx.LoRAParam)))
  theirs = jax.tree.leaves(nnx.state(base))
  assert len(mine) == len(theirs) and all(x is y for x, y in zip(mine, theirs))
  assert not lora.has_adapters(base) and lora.trainable(actor) is nnx.LoRAParam and lora.trainable(base) is nnx.Param


def test_merged_weights_give_the_adapted_models_logits(adapted):
  actor, base, cfg = adapted["actor"], adapted["base"], adapted["cfg"]
  before = jax.tree.map(lambda x: x, nnx.state(actor, nnx.LoRAParam))  # a snapshot (nnx.state is live)
  nnx.update(actor, _random_adapters(actor, 1))
  try:
    toks = jnp.asarray(np.random.RandomState(0).randint(0, 5000, (2, 24)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(24)[None], toks.shape)
    want = np.asarray(actor(toks, pos, None, None)[0])
    plain = nnx.clone(base)
    nnx.update(plain.base, lora.merged_params(actor, lora.LoraSettings.from_config(cfg).scale, cfg.param_scan_axis))
    got = np.asarray(plain(toks, pos, None, None)[0])
    base_logits = np.asarray(base(toks, pos, None, None)[0])
  finally:
    nnx.update(actor, before)
  assert np.abs(want - base_logits).max() > 1.0  # the adapters change the logits: the comparison is not vacuous
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
  assert (np.argmax(got, -1) == np.argmax(want, -1)).all()


def test_engine_greedy_after_adapter_sync_equals_the_adapted_model(adapted):
  """The engine receives only adapter tensors (update_params with nnx.LoRAParam, as RLCluster.sync_weights sends
  them); its greedy output equals greedy decoding of the adapted model, token for token, before and after a sync."""
  actor, tok = adapted["actor"], adapted["tok"]
  before = jax.tree.map(lambda x: x, nnx.state(actor, nnx.LoRAParam))  # a snapshot (nnx.state is live)
  try:
    nnx.update(actor, _random_adapters(actor, 2))
    eng = embedded.EmbeddedRollout(
        rollout_actor=actor,
        tokenizer=tok,
        mesh=adapted["mesh"],
        **run_engine.embedded_arguments(actor.base.config, adapted["mesh"]),
    )
    prompts = [tok.encode("What is 12 * 7?"), tok.encode("Tom has 3 apples and buys 4 more. How many now?")]
    outs = []
    for seed in (None, 3):
      if seed is not None:
        new = _random_adapters(actor, seed)
        eng.update_params(new, (nnx.LoRAParam,))
        assert all(x is not y for x, y in zip(jax.tree.leaves(nnx.state(actor, nnx.LoRAParam)), jax.tree.leaves(before)))
      res = eng.generate_tokens(prompts, greedy=True, max_new_tokens=NEW)
      want = adapted["greedy_reference"](prompts, NEW)
      for i in range(len(prompts)):
        n = int(res.lengths[i])
        assert n > 0 and list(res.tokens[i, :n]) == list(want[i, :n]), (seed, i)
      outs.append(res.tokens.copy())
    assert (outs[0] != outs[1]).any()  # the new adapters reached the decode weights
    assert eng._lora_merger.num_merges == 2  # pylint: disable=protected-access  # once per adapter change
    eng.generate_tokens(prompts, greedy=True, max_new_tokens=2)
    assert eng._lora_merger.num_merges == 2  # pylint: disable=protected-access  # unchanged adapters: no re-merge
  finally:
    nnx.update(actor, before)


# ----------------------------------------------------------------------------------------------------------------------
# Training, reference, checkpoints, resume, export (one in-process LoRA run)
# ----------------------------------------------------------------------------------------------------------------------


def _argv(out: pathlib.Path, name: str, *extra):
  """The tiny LoRA run's argv (a length reward, so adapters learn something visible) under `out`."""
  reward = out / "length_reward.py"
  reward.write_text(_LENGTH_REWARD)
  return [
      TINY,
      *SMALL_VOCAB,
      f"base_output_directory={out}",
      f"run_name={name}",
      "reward_functions=length_reward",
      f"reward_functions_path={reward}",
      "decode_sampling_temperature=30",
      "num_batches=2",
      "checkpoint_period=1",
      "num_test_batches=0",
      "eval_before_training=false",
      "eval_after_training=false",
      "learning_rate=0.01",
      "warmup_steps_fraction=0",
      "rl.grpo_beta=0.08",
      *LORA,
      *extra,
  ]


def _nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _unique_bytes(*trees) -> int:
  seen = {}
  for t in trees:
    for x in jax.tree.leaves(t):
      if isinstance(x, jax.Array):
        seen[x.unsafe_buffer_pointer()] = x.nbytes
  return sum(seen.values())


def _reference(run):
  """The reference model RLCluster holds (Tunix moves it into its inference worker)."""
  return run.rl_cluster.inference_worker.get_model("reference")


def _np(tree) -> dict:
  """Leaf path -> array; `.value` (nnx.State) and `['value']` (Orbax's restore of it) dropped so the two compare."""
  out = {}
  for k, v in jax.tree_util.tree_leaves_with_path(tree):
    out[jax.tree_util.keystr(k).removesuffix(".value").removesuffix("['value']")] = np.asarray(v)
  return out


@pytest.fixture(name="lora_run", scope="module")
def lora_run_fixture(tmp_path_factory):
  """A 2-step LoRA run: its argv, run, and the actor's base/adapter weights before and after."""
  out = tmp_path_factory.mktemp("lora_runs")
  argv = _argv(out, "lora")
  parsed = config_lib.parse(argv)
  run = build.build_run(parsed.hyperparameters(), parsed)
  actor = run.rl_cluster.actor_trainer.model
  before = {
      "base": _np(nnx.state(actor, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))),
      "adapters": _np(nnx.state(actor, nnx.LoRAParam)),
      "opt_bytes": _nbytes(nnx.state(run.rl_cluster.actor_trainer.optimizer)),
      "adapter_bytes": _nbytes(nnx.state(actor, nnx.LoRAParam)),
      "base_bytes": _nbytes(nnx.state(actor, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))),
      "held_bytes": _unique_bytes(nnx.state(actor), nnx.state(_reference(run))),
  }
  summary = trainer.train(run)
  return {"out": out, "argv": argv, "run": run, "before": before, "summary": summary}


def test_only_adapters_get_optimizer_state(lora_run):
  b = lora_run["before"]
  run = lora_run["run"]
  opt = nnx.state(run.rl_cluster.actor_trainer.optimizer)
  adapter_shapes = {x.shape for x in jax.tree.leaves(nnx.state(run.rl_cluster.actor_trainer.model, nnx.LoRAParam))}
  # Every non-scalar optimizer leaf is adapter-shaped (AdamW moments, Tunix's gradient-accumulation buffer): the base
  # has no optimizer state at all.
  big = [x for x in jax.tree.leaves(opt) if getattr(x, "size", 1) > 1]
  assert big and all(x.shape in adapter_shapes for x in big)
  copies = sum(x.nbytes for x in big) / b["adapter_bytes"]
  assert copies == int(copies) and copies >= 2
  # The same optimizer over every base param (what full fine-tuning allocates), from Tunix's own nnx.Optimizer.
  full = nnx.Optimizer(_reference(run), build.build_optimizer(run.config), wrt=nnx.Param)
  full_moments = sum(x.nbytes for x in jax.tree.leaves(nnx.state(full)) if getattr(x, "size", 1) > 1)
  assert full_moments == 2 * b["base_bytes"]
  full_bytes = int(copies) * b["base_bytes"]
  print(
      f"\noptimizer state: LoRA {b['opt_bytes']} B ({int(copies)} x {b['adapter_bytes']} B of adapters) vs full "
      f"fine-tuning {full_bytes} B ({int(copies)} x {b['base_bytes']} B of params): {full_bytes / b['opt_bytes']:.0f}x"
  )
  # 13x here (rank 4 on a 64-wide, 2-layer model with the 528-token vocabulary; 140x with Qwen3's 151,936 tokens,
  # whose embedding LoRA leaves alone): the ratio is the base's bytes over the adapters'.
  assert b["opt_bytes"] * 10 < full_bytes


def test_base_frozen_adapters_trained_reference_is_the_shared_base(lora_run):
  run, b = lora_run["run"], lora_run["before"]
  actor, ref = run.rl_cluster.actor_trainer.model, _reference(run)
  base_after = _np(nnx.state(actor, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
  assert base_after.keys() == b["base"].keys()
  for k, v in base_after.items():
    np.testing.assert_array_equal(v, b["base"][k], err_msg=k)
  adapters_after = _np(nnx.state(actor, nnx.LoRAParam))
  moved = [k for k, v in adapters_after.items() if np.abs(v - b["adapters"][k]).max() > 1e-6]
  assert moved, "no adapter changed after two RL steps"
  # The KL reference is the frozen base itself: no adapters, and the actor's own base arrays (one copy in memory).
  assert not lora.has_adapters(ref)
  mine = jax.tree_util.tree_leaves_with_path(nnx.state(actor, nnx.Not(nnx.LoRAParam)))
  theirs = jax.tree.leaves(nnx.state(ref))
  held_after = _unique_bytes(nnx.state(actor), nnx.state(ref))
  assert len(mine) == len(theirs)
  # Params stay shared across updates (lora.keep_base_shared); RNG counters are the actor's own.
  unshared = [jax.tree_util.keystr(k) for (k, x), y in zip(mine, theirs) if x is not y and "rngs" not in str(k)]
  assert not unshared, unshared
  print(
      f"\nactor + reference hold {b['held_bytes']} B before and {held_after} B after training (base "
      f"{b['base_bytes']} B + adapters {b['adapter_bytes']} B); a cloned reference (full fine-tuning) would hold "
      f"{2 * b['base_bytes']} B of params"
  )
  assert b["held_bytes"] < b["base_bytes"] + b["adapter_bytes"] + 64 * 1024
  assert abs(held_after - b["held_bytes"]) < 1024  # RNG counters only


def test_kl_is_against_the_base(lora_run):
  """B starts at zero, so at step 1 the policy is exactly the base: the KL to the reference is exactly 0; after the
  first update it is not."""
  kl = {r["step"]: r["kl"] for r in lora_run["summary"]["history"] if "kl" in r}
  assert kl[1] == 0.0 and kl[2] > 0.0, kl


def test_checkpoint_holds_only_adapters(lora_run):
  step = lora_run["out"] / "lora" / "checkpoints" / "2"
  params = _np(ocp.StandardCheckpointer().restore(step / "params"))
  assert params and all("_lora_a" in k or "_lora_b" in k for k in params)
  assert sum(v.nbytes for v in params.values()) == lora_run["before"]["adapter_bytes"]
  actor = lora_run["run"].rl_cluster.actor_trainer.model
  for k, v in _np(nnx.state(actor, nnx.LoRAParam)).items():
    np.testing.assert_array_equal(params[k], v)


def test_resume_restores_adapters_and_optimizer_exactly(lora_run):
  """Step 2 of a run resumed from checkpoint 1 equals the uninterrupted run's step 2, bit for bit."""
  out = lora_run["out"]
  shutil.copytree(out / "lora", out / "resumed")
  shutil.rmtree(out / "resumed" / "checkpoints" / "2")
  argv = _argv(out, "resumed")
  parsed = config_lib.parse(argv)
  run = build.build_run(parsed.hyperparameters(), parsed)
  summary = trainer.train(run)
  assert summary["start_step"] == 1
  for item in ("params", "opt_state"):
    a = _np(ocp.StandardCheckpointer().restore(out / "lora" / "checkpoints" / "2" / item))
    b = _np(ocp.StandardCheckpointer().restore(out / "resumed" / "checkpoints" / "2" / item))
    assert a.keys() == b.keys()
    for k, v in a.items():
      np.testing.assert_array_equal(v, b[k], err_msg=f"{item}{k}")


def test_export_writes_merged_maxtext_checkpoint_with_the_adapted_logits(lora_run, tmp_path):
  p = in_process.run("export_lora", ["--output", str(tmp_path / "merged"), *lora_run["argv"]])
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
  path = tmp_path / "merged" / "0" / "items"
  assert f"load_parameters_path={path}" in p.stdout
  # MaxText's own loader reads it (from_pretrained with load_parameters_path), with no LoRA keys at all.
  rs = run_models.setup_devices(config_lib.parse([TINY, *SMALL_VOCAB, f"load_parameters_path={path}"]))
  merged, _ = run_models.build_model(rs.trainer_config, rs.trainer_devices, pad_id=0)
  actor = lora_run["run"].rl_cluster.actor_trainer.model  # the adapted model at step 2
  toks = jnp.asarray(np.random.RandomState(1).randint(0, 528, (2, 20)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(20)[None], toks.shape)
  want = np.asarray(actor(toks, pos, None, None)[0])
  got = np.asarray(merged(toks, pos, None, None)[0])
  base = np.asarray(_reference(lora_run["run"])(toks, pos, None, None)[0])
  assert np.abs(want - base).max() > 1e-5  # the trained adapters change the logits
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
  with pytest.raises(SystemExit):  # an existing output is refused, never overwritten
    export_lora.main(["--output", str(tmp_path / "merged"), *lora_run["argv"]])


def _export_error(capsys, *argv) -> str:
  with pytest.raises(SystemExit) as e:
    export_lora.main(list(argv))
  assert e.value.code == 2
  lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  return lines[0]


def test_export_reads_the_runs_lora_keys_and_refuses_a_contradiction(lora_run, tmp_path, capsys):
  argv = lora_run["argv"]
  # The adapters' scale comes from the run: another alpha (or rank, or modules) would merge the wrong update.
  line = _export_error(capsys, "--output", str(tmp_path / "a"), *argv, "lora.lora_alpha=2")
  assert "'lora.lora_alpha'=2.0" in line and "trained its adapters with lora.lora_alpha=8.0" in line
  assert not (tmp_path / "a").exists()
  # Unwritable outputs: one line before any model is built, and the command returns (it used to hang).
  (tmp_path / "afile").write_text("x")
  for output in ("/proc/x", str(tmp_path / "afile")):
    assert _export_error(capsys, "--output", output, *argv).startswith("error: invalid value for '--output'")
  # Without the lora.* keys, export_lora reads them from the run's checkpoint: the same merged weights.
  bare = [a for a in argv if a not in LORA]
  assert export_lora.main(["--output", str(tmp_path / "bare"), *bare]) == 0
  assert export_lora.main(["--output", str(tmp_path / "full"), *argv]) == 0
  got = _np(ocp.StandardCheckpointer().restore(tmp_path / "bare" / "0" / "items"))
  want = _np(ocp.StandardCheckpointer().restore(tmp_path / "full" / "0" / "items"))
  assert got.keys() == want.keys()
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.extended  # adapter-only syncs: test_vllm_rollout and tpu_contract's LoRA check
@pytest.mark.multidevice
def test_disaggregated_lora_run_syncs_only_adapters(tmp_path):
  """8 forced CPU devices split trainer 4 / sampler 4: each sync moves the adapters only (bytes = adapter bytes,
  read back from the run's checkpoint), checked bit for bit on the sampler."""
  argv = [
      *_argv(tmp_path, "dis"),
      "use_pathways=true",
      "chips_per_vm=4",
      "rl.verify_weight_sync=every_n",
      "rl.verify_weight_sync_every=1",
      "batch_size=4",
  ]
  # In this process (pass 2 forces the 8 devices at its start; in_process refuses any other XLA_FLAGS).
  p = in_process.train_rl(argv, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
  assert "devices: trainer 4, sampler 4 (disaggregated" in p.stdout
  assert "weight syncs: 2, verified bit-exact: 2" in p.stdout
  summary = json.loads((tmp_path / "dis" / "summary.json").read_text())
  params = _np(ocp.StandardCheckpointer().restore(tmp_path / "dis" / "checkpoints" / "2" / "params"))
  assert summary["weight_syncs"]["last_bytes"] == sum(v.nbytes for v in params.values())


def test_export_lora_cli_refuses_a_full_fine_tuning_run(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["export-lora", "--output", str(tmp_path / "x"), TINY])
  assert e.value.code == 2
  lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and lines[0].startswith("error: export_lora needs the training run's lora.enable_lora=true")
  assert not (tmp_path / "x").exists()
