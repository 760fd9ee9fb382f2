"""MaxText mixture-of-experts models on the embedded engine and the trainer, and router replay (moe.py).

References are independent of the code under test: the engine's KV-cached greedy decode against a full no-cache
MaxText forward of every prefix (as tests/rollout/test_rollout_embedded.py does for the dense model); the routing the
engine records against the routing the trainer's full forward records; the loss with replay against the NumPy GRPO
loss of tests/algorithms/test_algorithms.py evaluated on the *engine's* log-probs (another code path: the cached
decode, the router choosing freely). Log-prob tolerance 2e-4 nats + 2e-4 relative (float32, cached vs. full attention
summation order; the x3 weights give log-probs near -10).

One model per family, built once (module fixture), decoder weights x3 so greedy output depends on the context.
"""

from __future__ import annotations

from flax import nnx
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
from maxtext.layers import moe as maxtext_moe
import pytest
from tunix.rl.grpo import grpo_learner

from maxtext_rl_plugin.algorithms import tunix_wiring
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import dynamic_sampling
from maxtext_rl_plugin.run import experience
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import decode
from maxtext_rl_plugin.rollout import embedded_spec
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.rollout import sampling
from maxtext_rl_plugin.run import engine as run_engine
from _tiny import SMALL_VOCAB
from test_algorithms import np_policy_loss
from test_trainer_updates import _train
from test_rollout_embedded import scaled_engine

REF_WIDTH = 64
NEW = 12
CONFIG = "configs/cpu_tiny_moe.yml"  # Mixtral-shaped: 4 experts, top-2, dropless
# Tests on random token ids below 1,000 build with this vocabulary, not cpu_tiny's 151,936 (whose embedding and head
# are most of a tiny model's work); tests that encode text use the demo's tokenizer (tests/_tiny.py).
SMALL_IDS = "vocab_size=1024"
# Tiny configs of MaxText's MoE families over CONFIG (docs/moe.md says which others build and why not).
FAMILIES = {
    "mixtral": [],
    "qwen3-moe": ["model_name=qwen3-30b-a3b"],
    # gpt-oss alternates sliding-window and global layers; a window shorter than the sequence is refused by the
    # embedded engine (test_short_sliding_window_is_refused_by_the_embedded_engine), so the window covers it here.
    "gpt-oss": ["model_name=gpt-oss-20b", "sliding_window_size=160"],
    # MaxText's TPU default path: routing and top-k inside a shard_map (jax.lax.ragged_dot on CPU; megablox needs TPU).
    "mixtral-sparse": ["sparse_matmul=true", "megablox=false"],
    # (The plugin's own forcing of Qwen3-MoE on the sparse path: one layer against NumPy,
    # test_forced_experts_are_the_ones_a_qwen3_moe_layer_computes_with[sparse]; a sixth family here cost ~70 s of CI
    # for what the Mixtral sparse family and that layer check already show.)
}
# DeepSeek-V3 (MLA): the trainer's forward only (the embedded engine refuses MLA's latent KV cache, docs/moe.md).
DEEPSEEK = [
    "model_name=deepseek3-671b",
    "base_num_kv_heads=4",
    "first_num_dense_layers=1",
    "base_num_decoder_layers=3",
    "q_lora_rank=16",
    "kv_lora_rank=16",
    "qk_nope_head_dim=16",
    "qk_rope_head_dim=8",
    "v_head_dim=16",
    "n_routing_groups=-1",
    "topk_routing_group=-1",
    "shared_experts=1",
]


# One family per code path in the default tier: Qwen3-MoE (the plugin forces the routing, dense path) and Mixtral's
# sparse path (MaxText forces it). Mixtral dense and gpt-oss (sliding window; the plugin forces it) are `extended`.
EXTENDED_FAMILIES = ("mixtral", "gpt-oss")


@pytest.fixture(
    name="fam",
    scope="module",
    params=[pytest.param(f, marks=pytest.mark.extended) if f in EXTENDED_FAMILIES else f for f in FAMILIES],
)
def family_fixture(request):
  """A family's tiny model (decoder x3), its engine, and a no-cache reference forward on the same weights."""
  rs, model, tok, _, engine, gdef = scaled_engine([CONFIG, *SMALL_VOCAB, *FAMILIES[request.param]])

  @jax.jit
  def ref_next(state, toks, lens):
    m = nnx.merge(gdef, state)
    pos = jnp.broadcast_to(jnp.arange(REF_WIDTH)[None], toks.shape)
    seg = (pos < lens[:, None]).astype(jnp.int32)
    logits, _ = m(toks, pos, None, None, decoder_segment_ids=seg)
    return jnp.argmax(jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0], -1)

  rec = moe.recording_graphdef(model)
  pad, eos = tok.pad_token_id, tok.eos_token_id
  trainer_fwd = jax.jit(lambda st, p, c, forced: moe.forward_logps(rec, st, p, c, pad, eos, forced=forced)[::2])
  return {
      "name": request.param,
      "config": rs.trainer_config,
      "model": model,
      "tok": tok,
      "engine": engine,
      "ref_next": lambda t, n: np.asarray(ref_next(nnx.state(model), jnp.asarray(t), jnp.asarray(n))),
      "trainer": lambda p, c, forced=None: tuple(
          np.asarray(x) for x in trainer_fwd(nnx.state(model), jnp.asarray(p), jnp.asarray(c), forced)
      ),
  }


def _prompts(tok):
  return [
      tok.encode("Tom has 3 apples and buys 4 more. How many apples does he have now? Think step by step."),
      tok.encode("Hi"),
      tok.encode("What is 12 * 7?"),
  ]


def test_greedy_decode_matches_no_cache_forward(fam):
  """KV-cached decode (prefill + AR steps, routing recorded) == argmax of a full forward of every prefix."""
  tok, eng = fam["tok"], fam["engine"]
  prompts = _prompts(tok)
  res = eng.generate_tokens(prompts, greedy=True, max_new_tokens=NEW)
  toks = np.full((len(prompts), REF_WIDTH), tok.pad_token_id, np.int32)
  lens = np.array([len(p) for p in prompts], np.int32)
  for i, p in enumerate(prompts):
    toks[i, : len(p)] = p
  want = np.zeros((len(prompts), NEW), np.int32)
  for s in range(NEW):
    want[:, s] = fam["ref_next"](toks, lens)
    toks[np.arange(len(prompts)), lens] = want[:, s]
    lens = lens + 1
  for i in range(len(prompts)):
    n = int(res.lengths[i])
    np.testing.assert_array_equal(res.tokens[i, :n], want[i, :n], err_msg=f"{fam['name']} row {i}")
  assert len({tuple(r) for r in want.tolist()}) == len(prompts) and len(set(want[0].tolist())) > 3  # non-trivial


@pytest.fixture(name="sampled", scope="module")
def sampled_fixture(fam):
  """G=2 samples per prompt at temperature 1, with the engine's routing, and the trainer's free forward of them."""
  tok, eng = fam["tok"], fam["engine"]
  prompts = _prompts(tok)
  width = max(len(p) for p in prompts) + 3  # some left padding on every row
  res = eng.generate_tokens(
      prompts,
      num_generations=2,
      max_new_tokens=NEW,
      rng=jax.random.PRNGKey(7),
      sampling_params=sampling.SamplingParams.create(1.0, 0, 1.0),
      prompt_pad_to=width,
  )
  lp, route = fam["trainer"](res.left_padded_prompts, res.tokens)
  return res, lp, route


def test_engine_routing_is_the_trainers_routing(fam, sampled):
  """The routing the decode loop records (prefill for the prompt, decode step t for completion token t-1) is what the
  trainer's full forward routes the same tokens to; unrouted positions are -1, in the trainer's input layout."""
  res, lp, route = sampled
  cfg, pad = fam["config"], fam["tok"].pad_token_id
  p = res.left_padded_prompts.shape[1]
  assert res.routing.shape == (6, p + NEW, cfg.num_decoder_layers, cfg.num_experts_per_tok) == route.shape
  mask = moe.routed_mask(res.left_padded_prompts != pad, res.mask)
  assert moe.mismatch_fraction(res.routing, route, mask) == 0.0
  assert ((res.routing >= 0) & (res.routing < cfg.num_experts))[mask].all()
  assert (res.routing[~mask] == moe.UNSET).all()  # prompt padding, the last completion token, after the end
  assert len(np.unique(res.routing[mask])) == cfg.num_experts  # every expert gets tokens: a real routing
  np.testing.assert_allclose(lp[res.mask], res.logps[res.mask], atol=2e-4, rtol=2e-4)
  load = moe.expert_load(res.routing, mask, cfg.num_experts)
  counts = np.stack([np.bincount(res.routing[mask][:, j].ravel(), minlength=cfg.num_experts) for j in range(2)])
  assert load["load_max"] == pytest.approx((counts / counts.mean(1, keepdims=True)).max())


def test_replay_forces_the_recorded_experts(fam, sampled):
  """Replaying the sampler's routing reproduces its log-probs; replaying another routing changes them, and the
  trainer's layers then report the forced experts (MaxText's forced_routed_experts, or the plugin's forcing at the
  MoE modules for the decoder blocks MaxText does not pass it to, reaches every layer)."""
  res, _, _ = sampled
  e = fam["config"].num_experts
  lp, route = fam["trainer"](res.left_padded_prompts, res.tokens, jnp.asarray(res.routing))
  np.testing.assert_allclose(lp[res.mask], res.logps[res.mask], atol=2e-4, rtol=2e-4)
  np.testing.assert_array_equal(route, res.routing)
  other = np.where(res.routing >= 0, (res.routing + 1) % e, moe.UNSET)
  lp2, route2 = fam["trainer"](res.left_padded_prompts, res.tokens, jnp.asarray(other))
  np.testing.assert_array_equal(route2, other)
  assert np.abs(lp2 - res.logps)[res.mask].max() > 1e-2


def test_loss_with_replay_matches_numpy(fam, sampled):
  """The plugin's Tunix loss on a RoutedTrainExample == NumPy's GRPO loss on the engine's log-probs (independent
  path); with another routing forced it does not, so the replayed routing is the one the loss uses."""
  res, _, _ = sampled
  tok, model = fam["tok"], fam["model"]
  rng = np.random.default_rng(3)
  lp = np.where(res.mask, res.logps, 0.0).astype(np.float64)
  old = lp + rng.normal(0.0, 0.05, lp.shape)
  ref = lp + rng.normal(0.0, 0.3, lp.shape)
  adv = np.array([1.0, -1.0, 0.5, -0.5, 0.8, -0.8])
  cfg = tunix_wiring.PluginGrpoConfig(num_generations=2, beta=0.05, epsilon=0.2, loss_algo="grpo")

  def example(routing):
    return moe.RoutedTrainExample(
        prompt_ids=jnp.asarray(res.left_padded_prompts),
        prompt_mask=jnp.asarray(res.left_padded_prompts != tok.pad_token_id),
        completion_ids=jnp.asarray(res.tokens),
        completion_mask=jnp.asarray(res.mask),
        advantages=jnp.asarray(adv, jnp.float32),
        ref_per_token_logps=jnp.asarray(ref, jnp.float32),
        old_per_token_logps=jnp.asarray(old, jnp.float32),
        routed_experts=jnp.asarray(routing),
    )

  def loss(routing):
    value, _ = tunix_wiring.tunix_policy_loss_fn(model, example(routing), cfg, tok.pad_token_id, tok.eos_token_id)
    return float(value)

  want, _, _ = np_policy_loss(
      lp,
      old,
      ref,
      adv,
      res.mask.astype(np.float64),
      algo="grpo",
      eps=0.2,
      eps_high=0.2,
      beta=0.05,
      kl="k3",
      agg="sequence-mean-token-mean",
  )
  assert loss(res.routing) == pytest.approx(want, rel=1e-3, abs=1e-4)
  other = np.where(res.routing >= 0, (res.routing + 1) % fam["config"].num_experts, moe.UNSET)
  assert abs(loss(other) - want) > 1e-2


def test_config_refusals_are_one_line():
  """rl.router_replay on a dense model, with pipeline parallelism, on an engine chosen at launch, on vLLM for a router
  whose capture is not its routing; return_routed_experts on a dense model; token dropping. Qwen3-MoE, gpt-oss and
  DeepSeek replay (the plugin forces their routing); on vLLM, Qwen3-MoE does."""
  cases = [
      ([CONFIG, "rl.router_replay=true", "ici_pipeline_parallelism=2"], "pipeline parallelism"),
      (["configs/cpu_tiny.yml", "rl.router_replay=true"], "needs a mixture-of-experts model"),
      ([CONFIG, "rl.router_replay=true", "rollout_engine=auto"], "chosen at launch"),
      # vLLM reports the top-k of the router logits; DeepSeek selects by group-limited, bias-corrected scores.
      ([CONFIG, *DEEPSEEK, "rl.router_replay=true", "rollout_engine=vllm"], "group-limited"),
      ([CONFIG, *DEEPSEEK, "return_routed_experts=true", "rollout_engine=vllm"], "group-limited"),
      (["configs/cpu_tiny.yml", "return_routed_experts=true"], "a dense model routes nothing"),
      ([CONFIG, "capacity_factor=1.25"], "use dropless routing"),
      # DeepSeek replays on the trainer side (test below), but no engine that reports routing samples MLA here.
      ([CONFIG, *DEEPSEEK, "rl.router_replay=true"], "cannot sample deepseek3-671b"),
  ]
  for argv, msg in cases:
    with pytest.raises(ConfigError, match=msg) as e:
      config_lib.load_config(argv)
    assert "\n" not in str(e.value)
  for extra in ([], ["model_name=qwen3-30b-a3b"], ["model_name=gpt-oss-20b"]):
    assert config_lib.load_config([CONFIG, *extra, "rl.router_replay=true"]).rl.router_replay
  # On vLLM, MaxText's decoder inside it captures the routing (rollout/vllm_routing.py; tests/tpu_contract).
  c = config_lib.load_config([CONFIG, "model_name=qwen3-30b-a3b", "rl.router_replay=true", "rollout_engine=vllm"])
  assert c.rl.router_replay and c.rollout_engine == "vllm"


def test_deepseek_trainer_replays_the_forced_experts():
  """DeepSeek-V3 (MLA, a dense first layer, shared experts, sigmoid scores): forcing the trainer's own routing
  reproduces its free forward exactly, another routing is what its MoE layers then report and changes the log-probs,
  and the replayed loss equals NumPy's GRPO loss on the free forward's log-probs (the forced experts are the ones
  the loss uses)."""
  rs = models.setup_devices(config_lib.parse([CONFIG, SMALL_IDS, *DEEPSEEK, "rollout_engine=auto"]))  # trainer side only
  cfg = rs.trainer_config
  assert cfg.decoder_block.value == "deepseek" and not moe.MoeSettings.from_config(cfg).replay_native
  model, _ = models.build_model(cfg, rs.trainer_devices, pad_id=0)
  rec = moe.recording_graphdef(model)
  fwd = jax.jit(lambda st, p, c, forced: moe.forward_logps(rec, st, p, c, 0, 1, forced=forced)[::2])
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(10, 1000, (2, 6)), jnp.int32)
  completion = jnp.asarray(rng.integers(10, 1000, (2, 5)), jnp.int32)
  lp, route = (np.asarray(x) for x in fwd(nnx.state(model), prompt, completion, None))
  assert route.shape == (2, 11, cfg.num_decoder_layers - cfg.first_num_dense_layers, cfg.num_experts_per_tok)
  lp_same, route_same = (np.asarray(x) for x in fwd(nnx.state(model), prompt, completion, jnp.asarray(route)))
  np.testing.assert_array_equal(route_same, route)
  np.testing.assert_allclose(lp_same, lp, atol=1e-6)
  other = np.where(route >= 0, (route + 1) % cfg.num_experts, moe.UNSET)
  lp_other, route_other = (np.asarray(x) for x in fwd(nnx.state(model), prompt, completion, jnp.asarray(other)))
  np.testing.assert_array_equal(route_other, other)
  assert np.abs(lp_other - lp).max() > 1e-2

  mask = np.ones(lp.shape, bool)
  old = lp.astype(np.float64) + rng.normal(0.0, 0.05, lp.shape)
  adv = np.array([1.0, -1.0])
  algo = tunix_wiring.PluginGrpoConfig(num_generations=2, beta=0.0, epsilon=0.2, loss_algo="grpo")

  def loss(routing):
    example = moe.RoutedTrainExample(
        prompt_ids=prompt,
        prompt_mask=jnp.ones(prompt.shape, bool),
        completion_ids=completion,
        completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(adv, jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=jnp.asarray(old, jnp.float32),
        routed_experts=jnp.asarray(routing),
    )
    return float(tunix_wiring.tunix_policy_loss_fn(model, example, algo, 0, 1)[0])

  want, _, _ = np_policy_loss(
      lp.astype(np.float64),
      old,
      np.zeros_like(old),
      adv,
      mask.astype(np.float64),
      algo="grpo",
      eps=0.2,
      eps_high=0.2,
      beta=0.0,
      kl="k3",
      agg="sequence-mean-token-mean",
  )
  assert loss(route) == pytest.approx(want, rel=1e-4, abs=1e-5)
  assert abs(loss(other) - want) > 1e-3


def test_step_metrics_and_layout_helpers():
  """Host-side helpers against hand-computed values."""
  prompt = np.array([[[[0, 1]], [[2, 3]]]])  # [1 row, 2 tokens, 1 layer, k=2]
  completion = np.array([[[[1, 2]], [[3, 0]], [[0, 1]]]])
  out = moe.pad_layout(prompt, completion, 3, 4)
  assert out.shape == (1, 7, 1, 2)
  np.testing.assert_array_equal(out[0, :, 0], [[-1, -1], [0, 1], [2, 3], [1, 2], [3, 0], [0, 1], [-1, -1]])
  np.testing.assert_array_equal(
      moe.routed_mask(np.array([[0, 1, 1]], bool), np.array([[1, 1, 1, 0]], bool)), [[0, 1, 1, 1, 1, 0, 0]]
  )
  a = np.array([[[[0, 1]], [[2, 3]]]])
  b = np.array([[[[1, 0]], [[2, 1]]]])  # same set, then a different one
  assert moe.mismatch_fraction(a, b, np.ones((1, 2), bool)) == 0.5
  m = moe.step_metrics(a, b, np.ones((1, 2), bool), 4)
  assert m["moe/rollout_load_max"] == 1.0 and m["moe/trainer_load_max"] == pytest.approx(2 / 1.0)
  assert m["moe/routing_mismatch_fraction"] == 0.5


def test_dynamic_sampling_refill_keeps_routing_aligned_with_rows():
  """rl.dynamic_sampling joins groups of several rounds (different prompt widths): every row keeps its own routing,
  its prompt part left-padded like its prompt ids."""
  cfg = config_lib.load_config([CONFIG])
  g, t = 2, 3

  def make_round(width, base):
    rows = 4  # 2 groups of 2
    prompt = np.zeros((rows, width), np.int32)
    prompt[:, -1] = base + np.arange(rows)
    comp = (base + 10 + np.arange(rows))[:, None] + np.zeros((rows, t), np.int32)
    routing = np.full((rows, width + t, 1, 2), moe.UNSET, np.int32)
    routing[:, width - 1] = prompt[:, -1, None, None]
    routing[:, width:] = comp[:, :, None, None]
    sampled = experience.Sampled(
        [f"p{base}{i}" for i in range(rows)],
        [f"c{base}{i}" for i in range(rows)],
        prompt,
        comp,
        np.array([1.0, 0.0, 0.0, 1.0], np.float32),
        np.zeros(rows, np.float32),
        None,
        {},
        0,
        1,
        truncated=np.zeros(rows, bool),
        routing=routing,
    )
    return dynamic_sampling._Round(  # pylint: disable=protected-access  # the rounds assemble() joins
        examples=[{}, {}], inputs={"prompts": sampled.prompts}, sampled=sampled, informative=np.array([True, True])
    )

  rounds = [make_round(3, 100), make_round(5, 200)]
  _, _, out = dynamic_sampling.assemble(rounds, [(0, 1, True), (1, 0, True)], g, put=lambda x: x, cfg=cfg)
  prompt_ids = np.asarray(out.prompt_ids)
  assert out.routing.shape == (4, 5 + t, 1, 2) and prompt_ids.shape == (4, 5)
  np.testing.assert_array_equal(out.routing[:, 5:, 0, 0], out.completion_ids)
  np.testing.assert_array_equal(out.routing[:, 4, 0, 0], prompt_ids[:, -1])
  assert (out.routing[:2, :4] == moe.UNSET).all()  # round 0's rows: 3-wide prompts, padded to 5
  np.testing.assert_array_equal(out.completion_ids[:, 0], [112, 113, 210, 211])


def test_train_rl_with_router_replay(tmp_path):
  """Two GRPO steps of the tiny Qwen3-MoE (the plugin forces its routing: MaxText's qwen3_moe layers take no
  forced_routed_experts) through train_rl with replay, mini-batches (2 updates per step, so the old-policy log-probs
  come from the trainer's replayed forward) and the agreement metrics: the MoE metrics are in the stream, the replayed
  trainer scores the sampled tokens as the sampler did (float32 on both sides), and the parity gate's figures are on
  the first step's record (rl.parity_check=first) and pass."""
  moe_keys = [
      "model_name=qwen3-30b-a3b",
      "vocab_size=528",  # _train's small tokenizer (tests/_tiny.py); the model's own vocabulary is 151,936
      "base_mlp_dim=32",
      "base_moe_mlp_dim=32",
      "num_experts=4",
      "num_experts_per_tok=2",
      "sparse_matmul=false",
      "megablox=false",
  ]
  _, recs = _train(
      tmp_path,
      "moe_replay",
      *moe_keys,
      "num_batches=2",
      "rl.router_replay=true",
      "rl.mini_batch_size=1",
      "rl.use_rollout_logps=false",
      "rl.log_sampler_trainer_agreement=true",
      "num_test_batches=0",
      "eval_interval=0",
      "enable_checkpointing=false",
  )
  assert len(recs) == 2
  for r in recs:
    assert r["moe/rollout_load_max"] >= 1.0 and r["moe/trainer_load_max"] >= 1.0
    assert "moe/routing_mismatch_fraction" not in r  # zero by construction under replay
    assert r["mismatch/logp_abs_diff_max"] < 1e-3
    assert np.isfinite(r["loss"])
  assert recs[0]["parity/logp_abs_diff_mean"] < 1e-4 and recs[0]["parity/tokens"] > 0
  assert "parity/routing_mismatch_fraction" not in recs[0]  # not defined under replay
  assert "parity/logp_abs_diff_mean" not in recs[1]


def test_short_sliding_window_is_refused_by_the_embedded_engine():
  """gpt-oss with a window shorter than the sequence decodes differently from MaxText's forward (measured with
  sliding_window_size=8: 11 of 12 greedy tokens differ), so the engine refuses it in one line."""
  rs = models.setup_devices(config_lib.parse([CONFIG, "model_name=gpt-oss-20b", "sliding_window_size=8"]))

  def check(cfg):
    s = embedded_spec.DecodeSettings.from_config(cfg)
    decode.check_sliding_window(s.decoder_block, s.sliding_window_size, s.max_target_length)

  with pytest.raises(ConfigError, match="sliding_window_size") as e:
    check(rs.sampler_config)
  assert "\n" not in str(e.value)
  check(
      models.setup_devices(config_lib.parse([CONFIG, "model_name=gpt-oss-20b", "sliding_window_size=160"])).sampler_config
  )


@pytest.mark.multidevice
def test_expert_parallel_mesh_decode_records_the_trainers_routing():
  """ici_expert_parallelism=2 on the host devices: the engine's decode over the expert-sharded mesh routes and scores
  the tokens as the trainer's full forward does."""
  rs = models.setup_devices(config_lib.parse([CONFIG, *SMALL_VOCAB, "ici_expert_parallelism=2"]))
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(rs.trainer_config))
  model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=tok.pad_token_id)
  assert mesh.shape["expert"] == 2
  engine = embedded.EmbeddedRollout(
      rollout_actor=model, tokenizer=tok, mesh=mesh, **run_engine.embedded_arguments(model.base.config, mesh)
  )
  prompts = _prompts(tok) + [tok.encode("x")]
  res = engine.generate_tokens(prompts, greedy=True, max_new_tokens=8, prompt_pad_to=24)
  graphdef, state = moe.recording_graphdef(model), nnx.state(model)
  with mesh:
    lp, _, route, _ = moe.forward_logps(
        graphdef,
        state,
        jnp.asarray(res.left_padded_prompts),
        jnp.asarray(res.tokens),
        tok.pad_token_id,
        tok.eos_token_id,
    )
  mask = moe.routed_mask(res.left_padded_prompts != tok.pad_token_id, res.mask)
  assert moe.mismatch_fraction(res.routing, np.asarray(route), mask) == 0.0
  np.testing.assert_allclose(np.asarray(lp)[res.mask], res.logps[res.mask], atol=2e-4, rtol=2e-4)


@pytest.mark.multidevice
def test_expert_parallel_replay_forces_the_recorded_experts():
  """Qwen3-MoE (the plugin's forcing) on an expert-sharded mesh (ici_expert_parallelism=2): replaying the engine's
  routing reproduces its log-probs, and another routing is what the layers report (MaxText all-gathers the forced
  experts over the expert axis with the router's logits)."""
  rs = models.setup_devices(
      config_lib.parse([CONFIG, *SMALL_VOCAB, "model_name=qwen3-30b-a3b", "ici_expert_parallelism=2"])
  )
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(rs.trainer_config))
  cfg = rs.trainer_config
  model, mesh = models.build_model(rs.sampler_config, rs.sampler_devices, pad_id=tok.pad_token_id)
  assert mesh.shape["expert"] == 2 and not moe.MoeSettings.from_config(cfg).replay_native
  engine = embedded.EmbeddedRollout(
      rollout_actor=model, tokenizer=tok, mesh=mesh, **run_engine.embedded_arguments(model.base.config, mesh)
  )
  prompts = _prompts(tok) + [tok.encode("x")]
  res = engine.generate_tokens(
      prompts,
      num_generations=1,
      max_new_tokens=8,
      rng=jax.random.PRNGKey(3),
      sampling_params=sampling.SamplingParams.create(1.0, 0, 1.0),
      prompt_pad_to=24,
  )
  graphdef, state = moe.recording_graphdef(model), nnx.state(model)
  p, c = jnp.asarray(res.left_padded_prompts), jnp.asarray(res.tokens)
  pad, eos = tok.pad_token_id, tok.eos_token_id
  with mesh:
    fwd = jax.jit(lambda st, forced: moe.forward_logps(graphdef, st, p, c, pad, eos, forced=forced)[::2])
    lp, route = (np.asarray(x) for x in fwd(state, jnp.asarray(res.routing)))
    other = np.where(res.routing >= 0, (res.routing + 1) % cfg.num_experts, moe.UNSET)
    lp2, route2 = (np.asarray(x) for x in fwd(state, jnp.asarray(other)))
  np.testing.assert_array_equal(route, res.routing)
  np.testing.assert_allclose(lp[res.mask], res.logps[res.mask], atol=2e-4, rtol=2e-4)
  np.testing.assert_array_equal(route2, other)
  assert np.abs(lp2 - res.logps)[res.mask].max() > 1e-2


def test_load_balance_loss_is_maxtexts_term_of_the_rl_loss():
  """load_balance_loss_weight > 0: the loss is the policy loss plus MaxText's moe_lb_loss (linear in the weight, as
  MaxText scales it inside each layer); the same weights and batch at w and 3w differ by exactly 2 lb(w)."""
  rng = np.random.default_rng(0)
  prompt = rng.integers(10, 1000, size=(2, 5)).astype(np.int32)
  completion = rng.integers(10, 1000, size=(2, 4)).astype(np.int32)
  cfg = tunix_wiring.PluginGrpoConfig(num_generations=2, beta=0.0, epsilon=0.2, loss_algo="grpo")
  example = grpo_learner.TrainExample(
      prompt_ids=jnp.asarray(prompt),
      prompt_mask=jnp.ones(prompt.shape, bool),
      completion_ids=jnp.asarray(completion),
      completion_mask=jnp.ones(completion.shape, bool),
      advantages=jnp.asarray([1.0, -1.0], jnp.float32),
      ref_per_token_logps=None,
      old_per_token_logps=None,
  )
  out = {}
  for w in (0.0, 0.01, 0.03):
    rs = models.setup_devices(config_lib.parse([CONFIG, SMALL_IDS, f"load_balance_loss_weight={w}"]))
    model, _ = models.build_model(rs.trainer_config, rs.trainer_devices, pad_id=0)
    out[w] = tunix_wiring.tunix_policy_loss_fn(model, example, cfg, 0, 1)
  (l0, a0), (l1, a1), (l3, a3) = out[0.0], out[0.01], out[0.03]
  assert "moe_lb_loss" not in a0
  lb1, lb3 = float(a1["moe_lb_loss"]), float(a3["moe_lb_loss"])
  assert lb1 > 0 and lb3 == pytest.approx(3 * lb1, rel=1e-5)
  assert float(l1) - float(l0) == pytest.approx(lb1, rel=1e-4, abs=1e-7)
  assert float(l3) - float(l1) == pytest.approx(2 * lb1, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("path", ["sparse_matmul=false", "sparse_matmul=true"], ids=["dense", "sparse"])
def test_forced_experts_are_the_ones_a_qwen3_moe_layer_computes_with(path):
  """One Qwen3-MoE layer (MaxText's RoutedMoE, the plugin's forcing) on random hidden states with a forced routing
  that is not its router's: its output equals NumPy's sum over the forced experts of softmax(router logits at those
  experts) * wo(silu(x wi_0) * x wi_1), and differs from the layer's free output."""
  rs = models.setup_devices(
      config_lib.parse([CONFIG, SMALL_IDS, "model_name=qwen3-30b-a3b", "scan_layers=false", path, "megablox=false"])
  )
  cfg = rs.trainer_config
  model, mesh = models.build_model(cfg, rs.trainer_devices, pad_id=0)
  node = next(n for _, n in nnx.iter_graph(model) if isinstance(n, maxtext_moe.RoutedMoE))
  moe.record_routing(model)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, cfg.emb_dim)).astype(np.float32)
  k, e = cfg.num_experts_per_tok, cfg.num_experts
  forced = np.stack([rng.integers(0, e, size=(2, 5))] * k, axis=-1)
  forced = (forced + np.arange(k)) % e  # k distinct experts per token
  moe.force_experts(node, jnp.asarray(forced, jnp.int32))
  with mesh, nn_partitioning.axis_rules(cfg.logical_axis_rules):
    y = np.asarray(node(jnp.asarray(x))[0], np.float64)
    del node.forced_experts
    free = np.asarray(node(jnp.asarray(x))[0], np.float64)
  w = {"/".join(map(str, p)): np.asarray(v.value, np.float64) for p, v in nnx.state(node, nnx.Param).flat_state()}
  logits = np.take_along_axis(x.astype(np.float64) @ w["gate/kernel"], forced, -1)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  want = np.zeros(y.shape)
  for b, s, j in np.ndindex(*forced.shape):
    ex = forced[b, s, j]
    h, u = x[b, s] @ w["wi_0"][ex], x[b, s] @ w["wi_1"][ex]
    want[b, s] += weights[b, s, j] * ((h / (1.0 + np.exp(-h))) * u) @ w["wo"][ex]
  np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-4)
  assert np.abs(free - want).max() > 1e-2
