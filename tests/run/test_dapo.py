"""DAPO and kin: advantage estimators (grpo / rloo / drgrpo x group / batch / no scaling), Dr. GRPO's constant-length
aggregation, overlong handling in tokens, and dynamic sampling's group selection; each against an independent NumPy
derivation (values and gradients) and against Tunix 0.1.7's own functions where it has them."""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tunix.rl import algo_core
from tunix.rl import common as tunix_common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import dapo_learner

from maxtext_rl_plugin.algorithms import advantages as advantages_lib
from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin.algorithms import shaping
from maxtext_rl_plugin.algorithms import tunix_wiring
from maxtext_rl_plugin.algorithms.settings import AlgorithmSettings
from maxtext_rl_plugin.run import dynamic_sampling
from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.errors import ConfigError

COMBOS = [(est, norm) for est, norms in advantages_lib.ESTIMATOR_NORMS.items() for norm in norms]


def np_advantages(rewards, g, estimator, norm):
  """Loop-by-loop re-derivation of the module docstring's formulas (statistics.stdev is the ddof=1 estimator)."""
  r = [float(x) for x in rewards]
  c = []
  for k in range(0, len(r), g):
    grp = r[k : k + g]
    for i, ri in enumerate(grp):
      if estimator == "rloo":
        c.append(ri - sum(grp[j] for j in range(g) if j != i) / (g - 1))
      else:
        c.append(ri - statistics.fmean(grp))
  if norm == "group_std":
    return np.array([c[i] / (statistics.stdev(r[i // g * g : i // g * g + g]) + 1e-6) for i in range(len(r))])
  if norm == "batch_std":
    return np.array(c) / (statistics.stdev(c) + 1e-6)
  return np.array(c)


@pytest.mark.parametrize("estimator,norm", COMBOS)
def test_advantages_match_numpy_derivation(estimator, norm):
  rng = np.random.default_rng(3)
  g = 4
  rewards = rng.integers(0, 3, size=6 * g).astype(np.float64) + rng.normal(size=6 * g) * (rng.random(6 * g) < 0.3)
  rewards[:g] = 1.0  # a group with no signal
  got = advantages_lib.group_advantages(rewards, g, norm, estimator)
  np.testing.assert_allclose(got, np_advantages(rewards, g, estimator, norm), rtol=1e-10, atol=1e-12)
  assert np.all(got[:g] == 0.0)
  # JAX in, JAX out, jit-able, same numbers in float32.
  fn = jax.jit(advantages_lib.group_advantages, static_argnums=(1, 2, 3))
  got_jax = fn(jnp.asarray(rewards, jnp.float32), g, norm, estimator)
  assert isinstance(got_jax, jax.Array)
  np.testing.assert_allclose(np.asarray(got_jax), got, rtol=1e-5, atol=1e-5)


def test_advantages_equal_tunix_algo_core_estimators():
  rewards = np.random.default_rng(0).normal(size=12).astype(np.float32)
  for g in (2, 3, 4):
    np.testing.assert_allclose(
        advantages_lib.group_advantages(rewards, g, "group_std", "grpo"),
        algo_core.compute_advantages(rewards, g),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        advantages_lib.group_advantages(rewards, g, "none", "rloo"),
        np.asarray(algo_core.compute_rloo_advantages(jnp.asarray(rewards), g)),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        advantages_lib.group_advantages(rewards, g, "none", "drgrpo"),
        np.asarray(algo_core.compute_drgrpo_advantages(jnp.asarray(rewards), g)),
        rtol=1e-5,
        atol=1e-6,
    )
  # RLOO is GRPO's centred reward scaled by G/(G-1).
  np.testing.assert_allclose(
      advantages_lib.group_advantages(rewards, 4, "none", "rloo"),
      4 / 3 * advantages_lib.group_advantages(rewards, 4, "none", "grpo"),
      rtol=1e-5,
  )


def test_refused_estimator_scalings():
  with pytest.raises(ValueError, match="group_std"):
    advantages_lib.group_advantages(np.zeros(4), 2, "group_std", "rloo")
  with pytest.raises(ValueError, match="advantage_estimator"):
    advantages_lib.group_advantages(np.zeros(4), 2, "none", "ppo")


@pytest.mark.parametrize(
    "estimator,norm,agg",
    [(e, n, a) for e, n in COMBOS for a in ("sequence-mean-token-mean", "token-mean") if e != "drgrpo"]
    + [(e, n, loss_lib.TOKEN_SCALE) for e, n in COMBOS if e == "drgrpo"],
)
def test_policy_gradient_of_each_estimator_matches_numpy(estimator, norm, agg):
  """On-policy (ratio 1, nothing clipped), beta=0: dL/dlp_{i,t} = -A_i m_{i,t} / D_i with D_i the aggregation's
  normaliser: n_i B' (sequence-mean-token-mean), sum m (token-mean), T B' (drgrpo's constant length)."""
  rng = np.random.default_rng(7)
  g, b, t = 3, 4, 6
  rewards = rng.integers(0, 2, size=b * g).astype(np.float32)
  adv = advantages_lib.group_advantages(rewards, g, norm, estimator)
  lengths = rng.integers(1, t + 1, size=b * g)
  lengths[2] = 0  # an empty row leaves the row count
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
  lp = rng.normal(size=(b * g, t)).astype(np.float32)
  mode = agg  # drgrpo's only aggregation is the constant length (AdvantageSettings.resolve refuses the others)

  def loss(x):
    return loss_lib.policy_loss(x, None, None, jnp.asarray(adv), jnp.asarray(mask), loss_agg_mode=mode)[0]

  val, grad = jax.value_and_grad(loss)(jnp.asarray(lp))
  rows = (lengths > 0).sum()
  if mode == "token-mean":
    denom = np.full(b * g, mask.sum())
  elif mode == "sequence-mean-token-mean":
    denom = np.maximum(lengths, 1) * rows
  else:
    denom = np.full(b * g, t * rows)
  want_grad = -adv[:, None] * mask / denom[:, None]
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(val), float((-adv[:, None] * mask / denom[:, None]).sum()), rtol=1e-5, atol=1e-6)


def test_token_scale_aggregation_equals_tunix_aggregate_loss():
  rng = np.random.default_rng(1)
  per_token = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
  mask = jnp.asarray(rng.random((5, 7)) < 0.6, jnp.float32).at[3].set(0.0)
  ours = loss_lib.aggregate(per_token, mask, loss_lib.TOKEN_SCALE)
  theirs = tunix_common.aggregate_loss(per_token, mask, "sequence-mean-token-scale")
  np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)
  m = np.asarray(mask)
  want = (np.asarray(per_token) * m).sum() / (7 * (m.sum(-1) > 0).sum())
  np.testing.assert_allclose(float(ours), want, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Overlong handling (tokens)
# ----------------------------------------------------------------------------------------------------------------------


def np_overlong(n, max_len, buf, factor):
  """DAPO eq. 13, piecewise as written in the paper."""
  if n <= max_len - buf:
    return 0.0
  if n <= max_len:
    return ((max_len - buf) - n) / buf * factor
  return -factor


def test_overlong_penalty_matches_paper_piecewise_in_tokens():
  max_len, buf, factor = 20, 8, 0.5
  rows = [list(range(n)) for n in (0, 5, 12, 13, 16, 19, 20, 25)]
  got = shaping.overlong_penalty(rows, max_len, buf, factor)
  want = [np_overlong(len(r), max_len, buf, factor) for r in rows]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert got[-2] == pytest.approx(-factor) and got[-1] == pytest.approx(-factor)  # the budget used up; beyond it
  # Tunix's reward_shaping on *text* counts characters: the same 12-token completion written with 3-character tokens
  # is penalised by Tunix and not here (12 <= 20 - 8).
  text = "abc" * 12
  tunix = dapo_learner.reward_shaping(
      [],
      [text],
      rl_cluster_lib.Mode.TRAIN,
      overlong_buffer={"overlong_buffer_length": buf, "overlong_buffer_penalty": factor, "max_response_length": max_len},
  )[0]
  assert tunix < -factor and shaping.overlong_penalty([list(range(12))], max_len, buf, factor)[0] == 0.0
  with pytest.raises(ValueError):
    shaping.overlong_penalty(rows, max_len, 0, factor)


def test_truncated_rows_are_the_length_limit_without_a_stop_token():
  pad, eos, stop = 0, 1, 7
  ids = np.array(
      [
          [5, 6, 5, 6],  # all 4 tokens, no stop: truncated
          [5, 6, 5, eos],  # stopped on the last position
          [5, 6, 5, stop],  # an extra stop token
          [5, eos, pad, pad],  # stopped early
          [5, 6, pad, pad],  # short without a stop (an engine that drops it): not cut by the limit
      ]
  )
  np.testing.assert_array_equal(shaping.truncated_rows(ids, pad, [eos, stop]), [True, False, False, False, False])
  np.testing.assert_array_equal(shaping.completion_lengths(ids, pad), [4, 4, 4, 2, 2])


@pytest.mark.parametrize("agg", ["sequence-mean-token-mean", "token-mean", "sequence-mean", loss_lib.TOKEN_SCALE])
def test_masked_truncated_completion_contributes_no_loss(agg):
  """experience.score zeroes the mask rows of truncated completions: the loss equals the loss of the batch without
  them (NumPy subset), and their log-probs get exactly zero gradient."""
  rng = np.random.default_rng(5)
  bsz, t = 6, 5
  lp = jnp.asarray(rng.normal(size=(bsz, t)), jnp.float32)
  ref = jnp.asarray(rng.normal(size=(bsz, t)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=bsz), jnp.float32)
  mask = np.ones((bsz, t), bool)
  mask[1, 3:] = False
  truncated = np.array([False, False, True, False, True, False])
  kw = {"beta": 0.1, "loss_agg_mode": agg}

  def loss(x, m):
    return loss_lib.policy_loss(x, None, ref, adv, jnp.asarray(m), **kw)[0]

  masked = mask & ~truncated[:, None]
  keep = ~truncated
  full_grad = jax.grad(loss)(lp, masked)
  subset = loss_lib.policy_loss(lp[keep], None, ref[keep], adv[keep], jnp.asarray(mask[keep]), **kw)[0]
  np.testing.assert_allclose(float(loss(lp, masked)), float(subset), rtol=1e-6)
  assert np.all(np.asarray(full_grad)[truncated] == 0.0)
  assert np.any(np.asarray(full_grad)[keep] != 0.0)


# ----------------------------------------------------------------------------------------------------------------------
# Dynamic sampling: which groups a step trains on
# ----------------------------------------------------------------------------------------------------------------------


def test_informative_groups_are_the_nonzero_variance_ones():
  r = np.array([1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.25, 0.5], np.float32)
  np.testing.assert_array_equal(dynamic_sampling.informative_groups(r, 2), [False, True, False, False, True])
  # Exactly the groups with a nonzero advantage under every estimator.
  for est, norm in COMBOS:
    adv = advantages_lib.group_advantages(r, 2, norm, est).reshape(-1, 2)
    np.testing.assert_array_equal(np.any(adv != 0, axis=1), dynamic_sampling.informative_groups(r, 2))


def test_pick_groups_fills_in_data_order_and_tops_up_when_short():
  inf = [np.array([True, False, False, True]), np.array([False, True, True, True])]
  picks, dropped, short = dynamic_sampling.pick_groups(inf, 4)
  assert picks == [(0, 0, True), (0, 3, True), (1, 1, True), (1, 2, True)] and short == 0
  assert dropped == [(0, 1), (0, 2), (1, 0)]
  # Bound hit: two informative groups for four slots; the first dropped groups fill in, untrained.
  picks, dropped, short = dynamic_sampling.pick_groups([np.array([False, True, False, False])], 4)
  assert short == 3 and picks == [(0, 0, False), (0, 1, True), (0, 2, False), (0, 3, False)]


def test_refill_seeds_differ_per_round_and_step_and_repeat():
  seeds = {dynamic_sampling.refill_seed(0, s, r) for s in range(1, 20) for r in range(1, 4)}
  assert len(seeds) == 57 and all(0 <= x < 2**31 - 1 for x in seeds)
  assert dynamic_sampling.refill_seed(3, 5, 2) == dynamic_sampling.refill_seed(3, 5, 2)


def test_start_position_refuses_dropping_dynamic_sampling_on_resume():
  cfg = load_config(["configs/cpu_tiny.yml", "batch_size=2"])
  assert dynamic_sampling.start_position(cfg, 3, {}) == 6
  assert dynamic_sampling.start_position(cfg, 3, {"next_prompt_position": 6}) == 6
  with pytest.raises(Exception, match="rl.dynamic_sampling"):
    dynamic_sampling.start_position(cfg, 3, {"next_prompt_position": 14})
  on = load_config(["configs/cpu_tiny.yml", "batch_size=2", "rl.dynamic_sampling=true"])
  assert dynamic_sampling.start_position(on, 3, {"next_prompt_position": 14}) == 14


# ----------------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------------


def test_config_resolves_estimator_defaults_and_refuses_nonsense():
  base = ["configs/cpu_tiny.yml"]
  algo = tunix_wiring.tunix_algo_config(AlgorithmSettings.from_config(load_config(base)))
  assert algo.advantage_estimator == tunix_wiring.ADVANTAGE_ESTIMATOR_NAMES[("grpo", "group_std")]
  assert algo.loss_agg_mode == "sequence-mean-token-mean"
  algo = tunix_wiring.tunix_algo_config(
      AlgorithmSettings.from_config(load_config(base + ["rl.advantage_estimator=drgrpo"]))
  )
  assert algo.advantage_estimator == tunix_wiring.ADVANTAGE_ESTIMATOR_NAMES[("drgrpo", "none")]
  assert algo.loss_agg_mode == loss_lib.TOKEN_SCALE
  algo = tunix_wiring.tunix_algo_config(
      AlgorithmSettings.from_config(load_config(base + ["rl.advantage_estimator=rloo", "rl.advantage_norm=batch_std"]))
  )
  assert algo.advantage_estimator == tunix_wiring.ADVANTAGE_ESTIMATOR_NAMES[("rloo", "batch_std")]
  for bad, needle in (
      (["rl.advantage_estimator=rloo", "rl.advantage_norm=group_std"], "rl.advantage_norm"),
      (["rl.advantage_estimator=drgrpo", "rl.loss_agg_mode=token-mean"], "rl.loss_agg_mode"),
      (["rl.overlong_buffer_len=33"], "rl.overlong_buffer_len"),  # cpu_tiny's completion budget is 160 - 128 = 32
  ):
    with pytest.raises(ConfigError, match=needle) as e:
      load_config(base + bad)
    assert "\n" not in str(e.value)
