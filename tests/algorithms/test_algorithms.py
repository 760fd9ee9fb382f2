"""Policy loss, advantages and Tunix wiring, checked against float64 NumPy re-derivations of the papers' objectives.

The references below are written per sequence and per token (loops over the valid tokens only), straight from
DeepSeekMath / DAPO clip-higher (GRPO) and the GSPO paper (sequence-level and GSPO-token), independently of the
vectorised JAX code.
"""

from __future__ import annotations

import functools
import multiprocessing.pool  # pylint: disable=unused-import  # MaxText's utils_rl needs it loaded first
import statistics
from unittest import mock

from flax import nnx
import jax
import jax.numpy as jnp
from maxtext.trainers.post_train.rl import utils_rl
import numpy as np
import optax
import pytest
from tunix.rl import function_registry
from tunix.rl import rl_learner
from tunix.rl.grpo import grpo_learner

from maxtext_rl_plugin.algorithms import advantages as advantages_lib
from maxtext_rl_plugin.algorithms import divergence
from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin.algorithms import tunix_wiring
from maxtext_rl_plugin.algorithms.settings import AlgorithmSettings
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin.run import build
from maxtext_rl_plugin.run import meta as run_meta
from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.errors import ConfigError

AGG_MODES = loss_lib.LOSS_AGG_MODES
# GSPO's sequence ratio is a geometric mean, so it uses much tighter clip ranges (the paper: 3e-4 / 4e-4).
EPS = {"grpo": (0.2, 0.28), "gspo-token": (0.03, 0.04)}
LENGTHS = (7, 1, 0, 3, 5, 6)  # includes an empty row (excluded from row counts) and a one-token row
T = 7
_STATIC = ("loss_algo", "epsilon", "epsilon_high", "beta", "kl_estimator", "loss_agg_mode")


# ----------------------------------------------------------------------------------------------------------------------
# NumPy references (float64)
# ----------------------------------------------------------------------------------------------------------------------


def make_batch(seed: int, lengths=LENGTHS, t: int = T, spread: float = 0.25):
  """Random [B, T] batch; padded positions hold garbage that must not matter."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  mask = (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float64)
  lp = -rng.uniform(0.05, 3.0, size=(b, t))
  old = lp + rng.normal(0.0, spread, size=(b, t))
  ref = lp + rng.normal(0.0, 0.3, size=(b, t))
  adv = rng.normal(0.0, 1.0, size=b)
  pad = mask == 0
  lp[pad], old[pad], ref[pad] = 1e3, -1e3, 7e2
  return lp, old, ref, adv, mask


def np_kl(lp: float, ref: float, estimator: str) -> tuple[float, float]:
  """(KL estimate, d/dlp) for one token."""
  d = ref - lp
  if estimator == "k3":
    return np.exp(d) - d - 1.0, 1.0 - np.exp(d)
  return lp - ref, 1.0


def np_weights(mask: np.ndarray, agg: str) -> np.ndarray:
  """w[i, t] with loss = sum_{i,t} w[i, t] L[i, t] for each aggregation mode."""
  lengths = mask.sum(1)
  rows = int((lengths > 0).sum())
  w = np.zeros_like(mask)
  for i in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if not mask[i, t]:
        continue
      w[i, t] = {
          "token-mean": 1.0 / mask.sum(),
          "sequence-mean-token-mean": 1.0 / (rows * lengths[i]),
          "sequence-mean": 1.0 / rows,
      }[agg]
  return w


def np_policy_loss(lp, old, ref, adv, mask, *, algo, eps, eps_high, beta, kl, agg):
  """(loss, d loss / d lp, info) of GRPO or GSPO-token, derived token by token."""
  eh = eps if eps_high is None else eps_high
  w = np_weights(mask, agg)
  loss, grad = 0.0, np.zeros_like(lp)
  ratios, clipped_lo, clipped_hi = [], [], []
  for i in range(lp.shape[0]):
    idx = np.flatnonzero(mask[i])
    if idx.size == 0:
      continue
    s = np.exp(np.mean(lp[i, idx] - old[i, idx]))  # GSPO sequence ratio
    for t in idx:
      r = np.exp(lp[i, t] - old[i, t]) if algo == "grpo" else s
      unclipped, clipped = r * adv[i], np.clip(r, 1 - eps, 1 + eh) * adv[i]
      active = clipped < unclipped  # the min picks the clipped branch: no policy gradient through this token
      obj = min(unclipped, clipped)
      dobj = 0.0 if active else adv[i] * r  # d r_t / d lp_t = r_t; for GSPO-token d s_{i,t} / d lp_t = s_i
      k, dk = np_kl(lp[i, t], ref[i, t], kl) if beta else (0.0, 0.0)
      loss += w[i, t] * (-obj + beta * k)
      grad[i, t] = w[i, t] * (-dobj + beta * dk)
      ratios.append(r)
      clipped_lo.append(adv[i] < 0 and r < 1 - eps)
      clipped_hi.append(adv[i] > 0 and r > 1 + eh)
  info = {"ratios": np.array(ratios), "lo": np.mean(clipped_lo), "hi": np.mean(clipped_hi)}
  return loss, grad, info


def np_sequence_gspo(lp, old, ref, adv, mask, *, eps, eps_high, beta, kl):
  """Sequence-level GSPO (the paper's objective) plus the same KL term, -(1/B') sum_i min(s_i A_i, clip(s_i) A_i)."""
  rows = [i for i in range(lp.shape[0]) if mask[i].sum() > 0]
  total = 0.0
  for i in rows:
    idx = np.flatnonzero(mask[i])
    s = np.exp(np.mean(lp[i, idx] - old[i, idx]))
    total -= min(s * adv[i], np.clip(s, 1 - eps, 1 + eps_high) * adv[i])
    if beta:
      total += beta * np.mean([np_kl(lp[i, t], ref[i, t], kl)[0] for t in idx])
  return total / len(rows)


def finite_diff(fn, x, mask, h=1e-6):
  g = np.zeros_like(x)
  for i, t in zip(*np.nonzero(mask)):
    xp, xm = x.copy(), x.copy()
    xp[i, t] += h
    xm[i, t] -= h
    g[i, t] = (fn(xp) - fn(xm)) / (2 * h)
  return g


@functools.partial(jax.jit, static_argnames=_STATIC)
def _value_and_grad(lp, old, ref, adv, mask, **kw):
  return jax.value_and_grad(lambda x: loss_lib.policy_loss(x, old, ref, adv, mask, **kw), has_aux=True)(lp)


def jax_loss_and_grad(lp, old, ref, adv, mask, **kw):
  """(loss, d loss / d per_token_logps, aux) of the JAX implementation, one compiled program per static config."""
  (loss, aux), grad = _value_and_grad(jnp.asarray(lp, jnp.float32), old, ref, adv, mask, **kw)
  return float(loss), np.asarray(grad, np.float64), {k: float(v) for k, v in aux.items()}


def f32(*arrays):
  return [None if a is None else jnp.asarray(a, jnp.float32) for a in arrays]


# ----------------------------------------------------------------------------------------------------------------------
# Loss values and gradients
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("kl", ["k1", "k3"])
@pytest.mark.parametrize("algo", ["grpo", "gspo-token"])
def test_value_grad_and_metrics_match_numpy(algo, kl, agg):
  eps, eps_high = EPS[algo]
  lp, old, ref, adv, mask = make_batch(seed=1)
  kw = {
      "loss_algo": algo,
      "epsilon": eps,
      "epsilon_high": eps_high,
      "beta": 0.04,
      "kl_estimator": kl,
      "loss_agg_mode": agg,
  }
  want, want_grad, info = np_policy_loss(
      lp, old, ref, adv, mask, algo=algo, eps=eps, eps_high=eps_high, beta=0.04, kl=kl, agg=agg
  )
  # The data must exercise both branches of the clip (and not sit on a boundary, where the min is not smooth).
  assert 0 < info["lo"] + info["hi"] < 1
  bounds = np.array([1 - eps, 1 + eps_high])
  assert np.min(np.abs(info["ratios"][:, None] - bounds[None, :])) > 1e-4

  got, grad, aux = jax_loss_and_grad(*f32(lp, old, ref, adv, mask), **kw)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
  assert np.all(grad[mask == 0] == 0.0)

  valid = mask > 0
  np.testing.assert_allclose(aux["clip_fraction_low"], info["lo"], rtol=1e-6)
  np.testing.assert_allclose(aux["clip_fraction_high"], info["hi"], rtol=1e-6)
  np.testing.assert_allclose(aux["clip_fraction"], info["lo"] + info["hi"], rtol=1e-6)
  np.testing.assert_allclose(aux["ratio_mean"], info["ratios"].mean(), rtol=1e-5)
  np.testing.assert_allclose(aux["ratio_max"], info["ratios"].max(), rtol=1e-5)
  kls = [np_kl(lp[i, t], ref[i, t], kl)[0] for i, t in zip(*np.nonzero(valid))]
  np.testing.assert_allclose(aux["kl"], np.mean(kls), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(aux["ppo_kl"], np.mean(old[valid] - lp[valid]), rtol=1e-5, atol=1e-7)
  if algo == "gspo-token":
    seq = [np.exp(np.mean(lp[i, mask[i] > 0] - old[i, mask[i] > 0])) for i in range(len(LENGTHS)) if LENGTHS[i]]
    np.testing.assert_allclose(aux["seq_ratio_mean"], np.mean(seq), rtol=1e-5)


@pytest.mark.parametrize("kl", ["k1", "k3"])
def test_numpy_reference_gradient_matches_finite_differences(kl):
  """Guards the analytic NumPy gradient the JAX gradient is compared against."""
  lp, old, ref, adv, mask = make_batch(seed=2)
  kw = {"algo": "grpo", "eps": 0.2, "eps_high": 0.28, "beta": 0.1, "kl": kl, "agg": "sequence-mean-token-mean"}
  _, analytic, _ = np_policy_loss(lp, old, ref, adv, mask, **kw)
  numeric = finite_diff(lambda x: np_policy_loss(x, old, ref, adv, mask, **kw)[0], lp, mask)
  np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_gspo_token_gradient_equals_sequence_level_gspo(beta):
  eps, eps_high = EPS["gspo-token"]
  lp, old, ref, adv, mask = make_batch(seed=3)

  def seq_loss(x):
    return np_sequence_gspo(x, old, ref, adv, mask, eps=eps, eps_high=eps_high, beta=beta, kl="k3")

  want_grad = finite_diff(seq_loss, lp, mask)
  assert np.count_nonzero(np.abs(want_grad) > 1e-8) > 0
  got, grad, aux = jax_loss_and_grad(
      *f32(lp, old, None if beta == 0 else ref, adv, mask),
      loss_algo="gspo-token",
      epsilon=eps,
      epsilon_high=eps_high,
      beta=beta,
      kl_estimator="k3",
      loss_agg_mode="sequence-mean-token-mean",
  )
  assert 0 < aux["seq_clip_fraction"] < 1  # some sequences clipped (zero gradient), some not
  np.testing.assert_allclose(got, seq_loss(lp), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
  # Within a sequence every token gets the same policy gradient (GSPO weighs tokens equally).
  if beta == 0:
    for i, n in enumerate(LENGTHS):
      np.testing.assert_allclose(grad[i, :n], grad[i, 0], rtol=1e-6)


def test_gspo_token_differs_from_grpo_per_token():
  """Independent check that the two algorithms are really different objectives on the same batch."""
  lp, old, _, adv, mask = make_batch(seed=4)
  kw = {"epsilon": 0.2, "beta": 0.0, "loss_agg_mode": "sequence-mean-token-mean"}
  _, g_grpo, _ = jax_loss_and_grad(*f32(lp, old, None, adv, mask), loss_algo="grpo", **kw)
  _, g_gspo, _ = jax_loss_and_grad(*f32(lp, old, None, adv, mask), loss_algo="gspo-token", **kw)
  assert np.max(np.abs(g_grpo - g_gspo)) > 1e-3


@pytest.mark.parametrize("algo", ["grpo", "gspo-token"])
def test_padding_is_inert(algo):
  """Garbage (NaN, inf) in padded positions changes neither the loss nor any gradient; pads get exactly 0."""
  lp, old, ref, adv, mask = make_batch(seed=5)
  kw = {"loss_algo": algo, "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04, "kl_estimator": "k3"}
  clean = [x.copy() for x in (lp, old, ref)]
  for x in clean:
    x[mask == 0] = -1.0
  dirty = [x.copy() for x in (lp, old, ref)]
  dirty[0][mask == 0], dirty[1][mask == 0], dirty[2][mask == 0] = np.nan, -np.inf, np.inf
  l_clean, g_clean, _ = jax_loss_and_grad(*f32(*clean, adv, mask), **kw)
  l_dirty, g_dirty, aux = jax_loss_and_grad(*f32(*dirty, adv, mask), **kw)
  assert np.isfinite(l_dirty) and all(np.isfinite(v) for v in aux.values())
  assert l_dirty == l_clean
  np.testing.assert_array_equal(g_dirty, g_clean)
  assert np.all(g_dirty[mask == 0] == 0.0) and np.any(g_dirty[mask > 0] != 0.0)


def test_bool_mask_and_token_level_advantages():
  lp, old, ref, adv, mask = make_batch(seed=6)
  kw = {"loss_algo": "grpo", "epsilon": 0.2, "beta": 0.04, "loss_agg_mode": "token-mean"}
  want, _, _ = jax_loss_and_grad(*f32(lp, old, ref, adv, mask), **kw)
  adv_bt = np.repeat(adv[:, None], T, axis=1)
  got, _, _ = jax_loss_and_grad(*f32(lp, old, ref), jnp.asarray(adv_bt, jnp.float32), jnp.asarray(mask > 0), **kw)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  with pytest.raises(ValueError, match="per-sequence advantages"):
    loss_lib.policy_loss(*f32(lp, old, ref, adv_bt, mask), loss_algo="gspo-token")


def test_epsilon_high_changes_which_tokens_clip():
  # One sequence of 4 tokens; ratios 1.25 and 1.35 with A > 0, 0.75 and 0.85 with A < 0 (second row).
  log_r = np.log(np.array([[1.25, 1.35, 1.0, 1.0], [0.75, 0.85, 1.0, 1.0]]))
  lp = np.full((2, 4), -1.0)
  old = lp - log_r
  mask = np.ones((2, 4))
  adv = np.array([1.0, -1.0])
  base = {"loss_algo": "grpo", "beta": 0.0, "loss_agg_mode": "token-mean"}
  _, g_sym, a_sym = jax_loss_and_grad(*f32(lp, old, None, adv, mask), epsilon=0.2, epsilon_high=None, **base)
  _, g_hi, a_hi = jax_loss_and_grad(*f32(lp, old, None, adv, mask), epsilon=0.2, epsilon_high=0.28, **base)
  # Symmetric 0.2: 1.25 and 1.35 clip high, 0.75 clips low, 0.85 does not.
  assert a_sym["clip_fraction_high"] == pytest.approx(2 / 8) and a_sym["clip_fraction_low"] == pytest.approx(1 / 8)
  np.testing.assert_array_equal(g_sym[0, :2], [0.0, 0.0])
  # Clip-higher 0.28: 1.25 is now inside the trust region and gets gradient -A r / N; 1.35 still clips.
  assert a_hi["clip_fraction_high"] == pytest.approx(1 / 8) and a_hi["clip_fraction_low"] == pytest.approx(1 / 8)
  np.testing.assert_allclose(g_hi[0, :2], [-1.25 / 8, 0.0], rtol=1e-6)
  # The lower side is untouched by epsilon_high.
  np.testing.assert_allclose(g_hi[1], g_sym[1], rtol=1e-6)
  np.testing.assert_allclose(g_hi[1, :2], [0.0, 0.85 / 8], rtol=1e-6)


def test_beta_zero_ignores_reference():
  lp, old, ref, adv, mask = make_batch(seed=7)
  kw = {"loss_algo": "grpo", "epsilon": 0.2, "beta": 0.0, "kl_estimator": "k3"}
  l_none, g_none, aux = jax_loss_and_grad(*f32(lp, old, None, adv, mask), **kw)
  l_nan, g_nan, _ = jax_loss_and_grad(*f32(lp, old, np.full_like(ref, np.nan), adv, mask), **kw)
  want, want_grad, _ = np_policy_loss(
      lp, old, ref, adv, mask, algo="grpo", eps=0.2, eps_high=None, beta=0.0, kl="k3", agg="sequence-mean-token-mean"
  )
  assert l_none == l_nan and aux["kl"] == 0.0 and aux["kl_loss"] == 0.0
  np.testing.assert_array_equal(g_none, g_nan)
  np.testing.assert_allclose(l_none, want, rtol=1e-5)
  np.testing.assert_allclose(g_none, want_grad, rtol=1e-4, atol=1e-7)
  with pytest.raises(ValueError, match="ref_per_token_logps"):
    loss_lib.policy_loss(*f32(lp, old, None, adv, mask), beta=0.1)


@pytest.mark.parametrize("algo", ["grpo", "gspo-token"])
def test_on_policy_without_old_logps(algo):
  """old=None (num_iterations=1): ratio 1, loss = -agg(A), gradient = -A w (the REINFORCE-with-baseline step)."""
  lp, _, _, adv, mask = make_batch(seed=8)
  loss, grad, aux = jax_loss_and_grad(
      *f32(lp, None, None, adv, mask), loss_algo=algo, epsilon=0.2, loss_agg_mode="token-mean"
  )
  w = np_weights(mask, "token-mean")
  np.testing.assert_allclose(loss, -(w * adv[:, None]).sum(), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, -w * adv[:, None], rtol=1e-5, atol=1e-8)
  assert aux["ratio_mean"] == pytest.approx(1.0) and aux["clip_fraction"] == 0.0


def test_unknown_options_raise():
  lp, old, ref, adv, mask = f32(*make_batch(seed=9))
  for kw in ({"loss_algo": "ppo"}, {"kl_estimator": "k2"}, {"loss_agg_mode": "seq-mean-token-sum"}):
    with pytest.raises(ValueError):
      loss_lib.policy_loss(lp, old, ref, adv, mask, **kw)


def test_kl_estimators_are_unbiased_for_kl():
  """Monte-Carlo: E_{x~p}[k1] = E_{x~p}[k3] = KL(p || q) for two categoricals; k3 is never negative."""
  rng = np.random.default_rng(10)
  p = rng.dirichlet(np.ones(6))
  q = rng.dirichlet(np.ones(6))
  true_kl = float(np.sum(p * np.log(p / q)))
  x = rng.choice(6, size=400_000, p=p)
  lp, lq = jnp.asarray(np.log(p)[x], jnp.float32), jnp.asarray(np.log(q)[x], jnp.float32)
  k1 = np.asarray(divergence.kl_estimate(lp, lq, "k1"), np.float64)
  k3 = np.asarray(divergence.kl_estimate(lp, lq, "k3"), np.float64)
  assert np.all(k3 >= 0)
  for est in (k1, k3):
    assert abs(est.mean() - true_kl) < 4 * est.std() / np.sqrt(x.size) + 1e-4
  np.testing.assert_allclose(k3, np.exp(np.log(q / p)[x]) - np.log(q / p)[x] - 1, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Group advantages
# ----------------------------------------------------------------------------------------------------------------------


def test_group_advantages_match_ddof1_definition():
  rng = np.random.default_rng(11)
  g = 4
  rewards = rng.integers(0, 3, size=5 * g).astype(np.float64)
  rewards[:g] = 1.0  # a group with no signal
  got = advantages_lib.group_advantages(rewards, g)
  got_none = advantages_lib.group_advantages(rewards, g, norm="none")
  for k in range(5):
    grp = [float(v) for v in rewards[k * g : (k + 1) * g]]
    mu, sd = statistics.fmean(grp), statistics.stdev(grp)  # stdev is the n-1 (ddof=1) estimator
    for j, rv in enumerate(grp):
      assert got[k * g + j] == pytest.approx((rv - mu) / (sd + 1e-6), rel=1e-12, abs=1e-12)
      assert got_none[k * g + j] == pytest.approx(rv - mu, abs=1e-12)
  assert np.all(got[:g] == 0.0)
  # JAX in, JAX out (jit-able); same numbers in float32.
  got_jax = jax.jit(advantages_lib.group_advantages, static_argnums=(1, 2))(
      jnp.asarray(rewards, jnp.float32), g, "group_std"
  )
  assert isinstance(got_jax, jax.Array)
  np.testing.assert_allclose(np.asarray(got_jax), got, rtol=1e-5, atol=1e-6)
  assert advantages_lib.group_advantages([1, 0], 2).dtype == np.float32  # int rewards are promoted
  with pytest.raises(ValueError):
    advantages_lib.group_advantages(np.zeros(6), 4)


# ----------------------------------------------------------------------------------------------------------------------
# Tunix wiring
# ----------------------------------------------------------------------------------------------------------------------


class TinyLM(nnx.Module):
  """Position-wise toy LM with Tunix's model call signature; logits[p] depend only on token[p]."""

  def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.out = nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, tokens, positions=None, cache=None, attention_mask=None, **unused):
    return self.out(jnp.tanh(self.embed(tokens))), None


def np_tiny_logps(model: TinyLM, prompt, completion, temperature):
  emb = np.asarray(model.embed.embedding.value, np.float64)
  kern, bias = np.asarray(model.out.kernel.value, np.float64), np.asarray(model.out.bias.value, np.float64)
  seq = np.concatenate([prompt, completion], axis=1)
  p, c = prompt.shape[1], completion.shape[1]
  logits = (np.tanh(emb[seq[:, p - 1 : p + c - 1]]) @ kern + bias) / temperature  # position p-1+t predicts token t
  logz = np.log(np.exp(logits).sum(-1))
  return np.take_along_axis(logits, completion[..., None], -1)[..., 0] - logz


def test_register_with_tunix_is_idempotent():
  tunix_wiring.register_with_tunix()
  tunix_wiring.register_with_tunix()
  assert function_registry.get_policy_loss_fn(tunix_wiring.POLICY_LOSS_FN_NAME) is tunix_wiring.tunix_policy_loss_fn
  for (estimator, norm), name in tunix_wiring.ADVANTAGE_ESTIMATOR_NAMES.items():
    est = function_registry.get_advantage_estimator(name)
    np.testing.assert_array_equal(
        est(rewards=np.array([1.0, 0.0, 0.0, 0.0]), num_generations=2),
        advantages_lib.group_advantages(np.array([1.0, 0.0, 0.0, 0.0]), 2, norm, estimator),
    )
  # Tunix's own GRPO loss stays registered under its name.
  assert function_registry.get_policy_loss_fn("grpo") is not tunix_wiring.tunix_policy_loss_fn


@pytest.mark.parametrize("algo,kl,agg", [("grpo", "k3", "sequence-mean-token-mean"), ("gspo-token", "k1", "token-mean")])
def test_grpo_learner_uses_plugin_loss(algo, kl, agg):
  """Build Tunix's GRPOLearner with the plugin config; the loss it hands the trainer is ours, on a real model."""
  pad, eos, vocab = 0, 1, 11
  eps, eps_high = EPS[algo]
  cfg = tunix_wiring.PluginGrpoConfig(
      num_generations=2, beta=0.05, epsilon=eps, epsilon_high=eps_high, loss_algo=algo, kl_estimator=kl, loss_agg_mode=agg
  )
  cluster = mock.MagicMock()
  cluster.rollout.pad_id.return_value = pad
  cluster.rollout.eos_id.return_value = eos
  cluster.get_rollout_config.return_value.temperature = 0.7
  with mock.patch.object(rl_learner.rl_utils, "is_sharing_weights", return_value=True):
    grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=cfg, reward_fns=[lambda prompts, completions, **kw: []])
  (loss_fn,), kwargs = cluster.actor_trainer.with_loss_fn.call_args
  assert kwargs == {"has_aux": True}
  advantage_fn = function_registry.get_advantage_estimator(cfg.advantage_estimator)  # what the learner calls
  a = 1.0 / (np.sqrt(2.0) + 1e-6)  # rewards (2, 0): mean 1, ddof=1 std sqrt(2)
  np.testing.assert_allclose(advantage_fn(rewards=np.array([2.0, 0.0]), num_generations=2), [a, -a], rtol=1e-12)

  rng = np.random.default_rng(12)
  b, p, c = 4, 3, 5
  prompt = rng.integers(2, vocab, size=(b, p))
  prompt[:, 0] = pad  # left padding
  completion = rng.integers(2, vocab, size=(b, c))
  lengths = np.array([5, 2, 3, 1])
  for i, n in enumerate(lengths):  # EOS is the last trained token, then padding
    completion[i, n - 1], completion[i, n:] = eos, pad
  mask = completion != pad
  model = TinyLM(vocab, 8, nnx.Rngs(0))
  lp = np_tiny_logps(model, prompt, completion, temperature=0.7)
  old = lp + rng.normal(0.0, 0.05, size=lp.shape)
  ref = lp + rng.normal(0.0, 0.3, size=lp.shape)
  adv = np.array([1.0, -1.0, 0.5, -0.5])
  example = grpo_learner.TrainExample(
      prompt_ids=jnp.asarray(prompt),
      prompt_mask=jnp.asarray(prompt != pad),
      completion_ids=jnp.asarray(completion),
      completion_mask=jnp.asarray(mask),
      advantages=jnp.asarray(adv, jnp.float32),
      ref_per_token_logps=jnp.asarray(ref, jnp.float32),
      old_per_token_logps=jnp.asarray(old, jnp.float32),
  )

  (loss, aux), grads = nnx.value_and_grad(lambda m: loss_fn(m, example, cfg), has_aux=True)(model)
  want, _, info = np_policy_loss(
      lp, old, ref, adv, mask.astype(np.float64), algo=algo, eps=eps, eps_high=eps_high, beta=0.05, kl=kl, agg=agg
  )
  np.testing.assert_allclose(float(loss), want, rtol=1e-4, atol=1e-6)
  assert float(aux["pg_clipfrac"]) == pytest.approx(info["lo"] + info["hi"])
  assert set(tunix_wiring.rl_metrics_to_log(cfg)) <= set(aux)
  # Gradients reach the model's parameters and are finite.
  leaves = jax.tree.leaves(nnx.state(grads))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
  assert max(float(jnp.max(jnp.abs(g))) for g in leaves) > 0


def test_tunix_algo_config_maps_rl_keys():
  cfg = load_config(
      [
          "configs/cpu_tiny.yml",
          "rl.loss_algo=gspo-token",
          "rl.epsilon_high=0.28",
          "rl.grpo_beta=0.0",
          "rl.kl_estimator=k1",
          "rl.loss_agg_mode=token-mean",
          "rl.advantage_norm=none",
          "rl.num_generations=4",
          "rl.num_iterations=2",
          "rl.grpo_epsilon=0.1",
      ]
  )
  algo = tunix_wiring.tunix_algo_config(AlgorithmSettings.from_config(cfg))
  assert isinstance(algo, grpo_learner.GRPOConfig)
  assert (algo.loss_algo, algo.epsilon, algo.epsilon_high, algo.beta) == ("gspo-token", 0.1, 0.28, 0.0)
  assert (algo.kl_estimator, algo.kl_loss_mode, algo.loss_agg_mode) == ("k1", "kl", "token-mean")
  assert (algo.num_generations, algo.num_iterations) == (4, 2)
  assert algo.policy_loss_fn == tunix_wiring.POLICY_LOSS_FN_NAME
  assert algo.advantage_estimator == tunix_wiring.ADVANTAGE_ESTIMATOR_NAMES[("grpo", "none")]

  default_cfg = load_config(["configs/cpu_tiny.yml"])
  default = tunix_wiring.tunix_algo_config(AlgorithmSettings.from_config(default_cfg))
  assert default.epsilon_high == default.epsilon and default.kl_estimator == "k3"
  assert default.kl_loss_mode == "low_var_kl"
  # Values the loss cannot use never reach it: validation's RANGES table refuses them when the config loads, in the
  # first pass (the config as written) and the second (the typed config) alike.
  for key, value in (("grpo_beta", -0.1), ("grpo_epsilon", 1.5), ("epsilon_high", -0.2)):
    argv = ["configs/cpu_tiny.yml", f"rl.{key}={value}"]
    for load in (config_precheck.precheck, load_config):
      with pytest.raises(ConfigError, match=f"'rl.{key}'={value}: must be >= 0"):
        load(argv)


def _adamw_reference(grads, params, lrs, b1, b2, eps, wd, clip):
  """Two-line NumPy AdamW (optax's definition) with global-norm clipping, float64."""
  m = [np.zeros_like(p) for p in params]
  v = [np.zeros_like(p) for p in params]
  out = [p.astype(np.float64).copy() for p in params]
  for t, (g_step, lr) in enumerate(zip(grads, lrs), start=1):
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in g_step))
    scale = min(1.0, clip / norm)
    for i, g in enumerate(g_step):
      g = g.astype(np.float64) * scale
      m[i] = b1 * m[i] + (1 - b1) * g
      v[i] = b2 * v[i] + (1 - b2) * g * g
      mh, vh = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
      out[i] = out[i] - lr * (mh / (np.sqrt(vh) + eps) + wd * out[i])
  return out


def _run_optimizer(tx, params, grads):
  state = tx.init(params)
  p = list(params)
  for g in grads:
    upd, state = tx.update(g, state, p)
    p = optax.apply_updates(p, upd)
  return p


@pytest.mark.parametrize("eps", [1e-8, 1e-3])
def test_optimizer_is_maxtexts_and_honours_adam_eps(eps):
  """The plugin's optimizer is MaxText's chain (same outputs as utils_rl.get_optimizer at default eps), honours
  adam_eps, and its schedule counts optimizer updates; all checked against a NumPy AdamW."""
  argv = [
      "configs/cpu_tiny.yml",
      "num_batches=4",
      "learning_rate=0.01",
      f"adam_eps={eps}",
      "warmup_steps_fraction=0.25",
      "adam_weight_decay=0.1",
      "gradient_clipping_threshold=1.0",
  ]
  cfg = config_lib.load_config(argv)
  tx = build.build_optimizer(cfg)
  rng = np.random.default_rng(0)
  params = [rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(5,)).astype(np.float32)]
  grads = [[rng.normal(scale=s, size=p.shape).astype(np.float32) for p in params] for s in (1e-4, 2.0, 1e-3, 1e-4)]
  p = _run_optimizer(tx, params, grads)
  if eps == 1e-8:  # MaxText's own optimizer, same schedule length (one update per batch): identical updates
    for a, b in zip(p, _run_optimizer(utils_rl.get_optimizer(cfg), params, grads)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  lrs = [0.0, 0.01, 0.01 * 0.5 * (1 + np.cos(np.pi * 1 / 3)), 0.01 * 0.5 * (1 + np.cos(np.pi * 2 / 3))]
  ref = _adamw_reference(grads, params, lrs, cfg.adam_b1, cfg.adam_b2, eps, 0.1, 1.0)
  for a, b in zip(p, ref):
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=1e-7)
  # With 2 mini-batches per batch the same 4 updates are half a run of 8: warmup 2 updates, then cosine over 8.
  cfg2 = config_lib.load_config([*argv, "rl.mini_batch_size=1"])
  assert run_meta.total_updates(cfg2) == 8
  lrs2 = [0.0, 0.005, 0.01, 0.01 * 0.5 * (1 + np.cos(np.pi * 1 / 6))]
  ref2 = _adamw_reference(grads, params, lrs2, cfg.adam_b1, cfg.adam_b2, eps, 0.1, 1.0)
  for a, b in zip(_run_optimizer(build.build_optimizer(cfg2), params, grads), ref2):
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=1e-7)
  # The eps matters: with eps=1e-3 the tiny-gradient steps are SGD-like and far smaller than Adam's.
  other = _adamw_reference(grads, params, lrs, cfg.adam_b1, cfg.adam_b2, 1e-3 if eps == 1e-8 else 1e-8, 0.1, 1.0)
  assert max(np.abs(np.asarray(a) - b).max() for a, b in zip(p, other)) > 1e-4


@pytest.mark.parametrize("agg", AGG_MODES)
def test_on_policy_gspo_token_has_grpos_gradient(agg):
  """With ratios at 1 (one update per rollout) the two objectives coincide under any aggregation; the CPU demo's
  GSPO runs reproduce GRPO's bit for bit. They part only once ratios leave 1 (sequence vs token clipping)."""
  lp, _, _, adv, mask = make_batch(seed=6)
  kw = {"epsilon": 0.2, "beta": 0.0, "loss_agg_mode": agg}
  _, g_grpo, _ = jax_loss_and_grad(*f32(lp, lp, None, adv, mask), loss_algo="grpo", **kw)
  _, g_gspo, _ = jax_loss_and_grad(*f32(lp, lp, None, adv, mask), loss_algo="gspo-token", **kw)
  assert np.max(np.abs(g_grpo)) > 1e-3
  np.testing.assert_allclose(g_gspo, g_grpo, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------------------------------------------------
# Rollout importance sampling (TIS / sequence masking)
# ----------------------------------------------------------------------------------------------------------------------


def np_is_weights(old, behaviour, mask, mode, cap):
  """Per-token weights, written token by token from the formulas (TIS; sequence-level masking)."""
  w = np.zeros_like(old)
  for i in range(old.shape[0]):
    idx = np.flatnonzero(mask[i])
    if idx.size == 0:
      continue
    seq = np.exp(np.mean([old[i, t] - behaviour[i, t] for t in idx]))
    for t in idx:
      if mode == "truncate":
        w[i, t] = min(np.exp(old[i, t] - behaviour[i, t]), cap)
      else:
        w[i, t] = 1.0 if 1.0 / cap <= seq <= cap else 0.0
  return w


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_is_weights_match_numpy(mode):
  lp, old, _, _, mask = make_batch(seed=11, spread=0.6)
  # Token noise plus a per-sequence shift, so that both tokens and whole sequences fall on both sides of the cap.
  row_shift = np.array([0.0, 1.2, 0.0, -1.0, 0.2, -0.9])[:, None]
  behaviour = old + np.random.default_rng(3).normal(0.0, 0.8, size=old.shape) + row_shift
  behaviour[mask == 0] = np.nan  # garbage at padding must not leak
  w, m = divergence.rollout_is_weights(old, behaviour, mask, mode, 2.0)
  ref = np_is_weights(old, behaviour, mask, mode, 2.0)
  np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-7)
  assert np.all(w[mask == 0] == 0)
  ratios = np.exp(old - behaviour)[mask > 0]
  assert m["is_truncated_fraction"] == pytest.approx(float(np.mean(ratios > 2.0)))
  assert m["is_weight_mean"] == pytest.approx(float(ref[mask > 0].mean()), rel=1e-6)
  if mode == "truncate":
    assert 0 < m["is_truncated_fraction"] < 1  # the batch exercises both branches
  else:
    assert 0 < m["is_masked_fraction"] < 1
  del lp


@pytest.mark.parametrize("algo", ["grpo", "gspo-token"])
def test_is_weights_scale_the_policy_gradient_not_the_kl(algo):
  """Loss with weights w: -sum w_t * obj_t + beta * KL_t (aggregated); value and gradient against NumPy."""
  lp, old, ref, adv, mask = make_batch(seed=12)
  w = np.where(mask > 0, np.random.default_rng(5).uniform(0.0, 2.0, size=lp.shape), 0.0)
  eps, eh = EPS[algo]
  kw = {
      "loss_algo": algo,
      "epsilon": eps,
      "epsilon_high": eh,
      "beta": 0.05,
      "kl_estimator": "k3",
      "loss_agg_mode": "sequence-mean-token-mean",
  }
  (loss, _), grad = jax.value_and_grad(
      lambda x: loss_lib.policy_loss(x, *f32(old, ref, adv, mask), **kw, is_weights=jnp.asarray(w, jnp.float32)),
      has_aux=True,
  )(jnp.asarray(lp, jnp.float32))
  # NumPy: split the reference loss into its policy-gradient and KL parts, weight the first per token.
  aggw = np_weights(mask, "sequence-mean-token-mean")
  _, g_pg, _ = np_policy_loss(
      lp, old, ref, adv, mask, algo=algo, eps=eps, eps_high=eh, beta=0.0, kl="k3", agg="sequence-mean-token-mean"
  )
  exp_loss, exp_grad = 0.0, np.zeros_like(lp)
  for i, t in zip(*np.nonzero(mask)):
    k, dk = np_kl(lp[i, t], ref[i, t], "k3")
    exp_loss += aggw[i, t] * 0.05 * k
    exp_grad[i, t] = w[i, t] * g_pg[i, t] + aggw[i, t] * 0.05 * dk
  # The policy-gradient value with per-token weights, from the per-token objective.
  for i in range(lp.shape[0]):
    idx = np.flatnonzero(mask[i])
    if idx.size == 0:
      continue
    s = np.exp(np.mean(lp[i, idx] - old[i, idx]))
    for t in idx:
      r = np.exp(lp[i, t] - old[i, t]) if algo == "grpo" else s
      exp_loss -= aggw[i, t] * w[i, t] * min(r * adv[i], np.clip(r, 1 - eps, 1 + eh) * adv[i])
  assert float(loss) == pytest.approx(exp_loss, rel=1e-4, abs=1e-6)
  np.testing.assert_allclose(np.asarray(grad, np.float64), exp_grad, rtol=2e-4, atol=1e-6)
  # Unit weights are the unweighted loss.
  l1, _ = loss_lib.policy_loss(*f32(lp, old, ref, adv, mask), **kw, is_weights=jnp.asarray(mask, jnp.float32))
  l0, _ = loss_lib.policy_loss(*f32(lp, old, ref, adv, mask), **kw)
  assert float(l1) == pytest.approx(float(l0), rel=1e-6)
