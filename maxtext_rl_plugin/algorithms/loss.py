r"""The policy-loss contract, the objective around every loss (aggregation, KL, importance weights) and its modes.

A policy loss is found by name (`rl.loss_algo`) in the `maxtext_rl_plugin.policy_losses` entry-point group, the
built-ins (`grpo`, `gspo-token`: policy_losses.py) like any third party's (docs/extending.md). Each is a `PolicyLoss`:
one function with one signature,
    fn(logp, old_logp, advantages, mask, settings) -> (per-token loss L^pg [B, T], {metric name: scalar})
on float32 per-token arrays whose padded positions are already 0 (`LossInputs`), and the metric names it declares
(logged as `train/<name>`). `policy_loss` below is the objective around it, the same for every loss: padding replaced
before any arithmetic, the rollout importance weights on L^pg, the aggregation, the KL term, `ppo_kl`. The forwards
that produce `logp` (padded, packed, with replayed MoE routing) are forward.py's: no loss sees them.

Notation in the package docstring (maxtext_rl_plugin/algorithms/__init__.py); KL estimators in divergence.py.

The built-in losses' formulas are in policy_losses.py. The objective of a loss L^pg_{i,t} (one row, one token):
    L_{i,t} = w_{i,t} L^pg_{i,t} + beta * KL_{i,t}      (w: rollout importance weights, 1 without; KL: divergence.py)

Aggregation of L_{i,t} (`loss_agg_mode`; rows with n_i = 0 are excluded from the row count B'):
    token-mean                  sum_{i,t} m L / sum_{i,t} m                       (DAPO)
    sequence-mean-token-mean    (1/B') sum_i (1/n_i) sum_t m L                    (GRPO / GSPO papers)
    sequence-mean               (1/B') sum_i sum_t m L                            (Tunix's "seq-mean-token-sum")
  MaxText 0.2.5 accepts `sequence-mean` in `rl.loss_agg_mode`, but Tunix 0.1.7's `aggregate_loss` has no such mode
  and raises; here it is the sum-over-tokens/mean-over-sequences reading above.

Differences from Tunix 0.1.7's `grpo_loss_fn` (tunix/rl/algo_core.py), which this objective replaces in the learner:
  * `epsilon_high` is a real config field (Tunix reads it with `hasattr`, and `GRPOConfig` has none, so the clip is
    always symmetric there); the KL estimator is chosen explicitly (Tunix's default is k1).
  * GSPO: Tunix clamps the token log-ratio to [-20, 20] *before* the sequence mean and the final log-ratio to <= 10,
    which zeroes the gradient of a sequence whose ratio exceeds e^10; policy_losses.gspo_token clamps the
    stop-gradient sequence part only, so the gradient always follows the paper.
  * beta == 0 ignores the reference entirely (no KL metric), matching the learner, which then computes no ref
    log-probs. Dual-clip (`epsilon_c`), sampler importance weights and `kl_clamp_value` are not supported (the
    +-20 clamp above already bounds k3 by e^20). Sampler importance weights (`sampler_is_weights`) multiply the
    policy-gradient term as in Tunix's `algo_core`; the plugin computes them with `divergence.rollout_is_weights`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from maxtext_rl_plugin import registry
from maxtext_rl_plugin.algorithms.common import check_choice
from maxtext_rl_plugin.algorithms.divergence import KL_ESTIMATORS, kl_estimate

# MaxText's `rl.loss_agg_mode` Literal: the only values a config can reach.
LOSS_AGG_MODES = ("token-mean", "sequence-mean-token-mean", "sequence-mean")
# Dr. GRPO's constant-length aggregation (Tunix's name); reached through `rl.advantage_estimator=drgrpo`.
TOKEN_SCALE = "sequence-mean-token-scale"
AGG_MODES = LOSS_AGG_MODES + (TOKEN_SCALE,)
# The entry-point group of the policy losses (registry.GROUPS) and MaxText's key that names one.
GROUP = "policy_losses"
KEY = "rl.loss_algo"
# Metrics the objective logs for every loss (`train/<name>`), besides each loss's own (`PolicyLoss.metrics`).
OBJECTIVE_METRICS = ("kl", "pg_loss", "kl_loss", "ppo_kl")


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The hyperparameters a loss function reads (hashable: static under jit): the clip range of the ratio,
  [1 - epsilon, 1 + epsilon_high] (`rl.grpo_epsilon`, `rl.epsilon_high`, already resolved to a number)."""

  epsilon: float = 0.2
  epsilon_high: float = 0.2


LossFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, LossSettings], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """A policy loss as the `maxtext_rl_plugin.policy_losses` entry-point group registers it (docs/extending.md).

  fn(logp, old_logp, advantages, mask, settings) -> (per_token_loss, metrics), inside the jitted, differentiated
  update; every array float32 with padded positions set to 0:
    logp        [B, T] log-probs of the sampled tokens under the policy being trained (the only differentiated input)
    old_logp    [B, T] log-probs under the sampling policy (no gradient; equal to logp in value on-policy)
    advantages  [B, 1] per-completion advantages, or [B, T] per-token ones (no gradient)
    mask        [B, T] 1 for the trained tokens (up to and including the stop token), 0 for padding
    settings    `LossSettings`
  per_token_loss is L^pg [B, T] (to minimise, before aggregation; padded positions are ignored), metrics the scalars
  named in `metrics`, each logged as `train/<name>` (a window of steps reduces names ending in `_min` / `_max` as
  such, the others by their mean). `sequence_advantages`: the loss needs [B] advantages (refuses per-token ones).
  `on_policy_note`: a warning for a run with rl.num_iterations=1 (ratios are 1 there), if the loss has one.
  """

  fn: LossFn
  metrics: tuple[str, ...] = ()
  sequence_advantages: bool = False
  on_policy_note: str = ""


def names() -> tuple[str, ...]:
  """The registered policy losses (the choices of `rl.loss_algo`), without loading any."""
  return registry.names(GROUP)


def get(name: str) -> PolicyLoss:
  """The policy loss registered as `name`; a name nobody registered is one line listing those that are."""
  return registry.load_typed(GROUP, name, PolicyLoss, KEY)


def aggregate(per_token: jax.Array, completion_mask: jax.Array, loss_agg_mode: str) -> jax.Array:
  """Reduce a masked [B, T] per-token quantity to a scalar with one of `AGG_MODES` (T = per_token.shape[-1])."""
  check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
  mask = completion_mask.astype(per_token.dtype)
  masked = jnp.where(mask > 0, per_token, 0.0)
  if loss_agg_mode == "token-mean":
    return masked.sum() / jnp.maximum(mask.sum(), 1.0)
  lengths = mask.sum(axis=-1)
  rows = jnp.maximum((lengths > 0).sum(), 1).astype(per_token.dtype)
  seq_sum = masked.sum(axis=-1)
  if loss_agg_mode == "sequence-mean-token-mean":
    return (seq_sum / jnp.maximum(lengths, 1.0)).sum() / rows
  if loss_agg_mode == TOKEN_SCALE:
    return seq_sum.sum() / (rows * per_token.shape[-1])
  return seq_sum.sum() / rows  # sequence-mean


def token_entropy(logits: jax.Array) -> jax.Array:
  """[..., V] logits -> [...] entropy of each position's distribution, float32, no gradient (a metric)."""
  log_probs = jax.nn.log_softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of `x` over the tokens where `mask` > 0 (0 for an all-masked batch)."""
  return jnp.where(mask > 0, x, 0.0).sum() / jnp.maximum(mask.sum(), 1.0)


def logged_metrics(loss: PolicyLoss) -> tuple[str, ...]:
  """The aux keys a run logs for `loss`: the objective's and the loss's own. A loss's `clip_fraction` is logged under
  the key Tunix's learner uses, `pg_clipfrac` (run/step.py names it `clip_fraction` again)."""
  own = tuple(m for m in loss.metrics if m != "clip_fraction")
  return (
      OBJECTIVE_METRICS[:1] + (("pg_clipfrac",) if "clip_fraction" in loss.metrics else ()) + OBJECTIVE_METRICS[1:] + own
  )


@functools.partial(
    jax.jit, static_argnames=("loss_algo", "epsilon", "epsilon_high", "beta", "kl_estimator", "loss_agg_mode")
)
def policy_loss(
    per_token_logps: jax.Array,
    old_per_token_logps: jax.Array | None,
    ref_per_token_logps: jax.Array | None,
    advantages: jax.Array,
    completion_mask: jax.Array,
    *,
    loss_algo: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg_mode: str = "sequence-mean-token-mean",
    is_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The objective of the registered loss `loss_algo` (to minimise) and its diagnostics; module docstring.

  Args:
    per_token_logps: [B, T] log-probs of the sampled tokens under the policy being trained (differentiated).
    old_per_token_logps: [B, T] log-probs under the sampling policy, or None for on-policy (ratio == 1 in value,
      as Tunix does when num_iterations == 1).
    ref_per_token_logps: [B, T] reference log-probs; unused (may be None) when beta == 0.
    advantages: [B] per-completion advantages ([B, T] per-token advantages are accepted by a loss without
      `sequence_advantages`).
    completion_mask: [B, T] 1 for trained tokens (up to and including EOS), 0 for padding.
    loss_algo, epsilon, epsilon_high, beta, kl_estimator, loss_agg_mode: static hyperparameters;
      epsilon_high=None means epsilon (symmetric clip).
    is_weights: [B, T] rollout importance weights (`rollout_is_weights`) multiplying the policy-gradient term, or None.

  Returns:
    (loss, aux): scalar float32 loss and float32 scalars `pg_loss`, `kl_loss`, `kl` (token mean of the KL
    estimate), `ppo_kl` (token mean of lp_old - lp) and the loss's own `PolicyLoss.metrics` (the built-ins:
    `ratio_mean/min/max`, `clip_fraction_low/high`, `clip_fraction` (tokens whose clipped branch is active, i.e. that
    get no policy gradient), and, for gspo-token, `seq_ratio_mean` and `seq_clip_fraction` over non-empty sequences),
    with `pg_clipfrac` = `clip_fraction` (the key Tunix's learner logs) where the loss has one.
  """
  spec = get(loss_algo)
  check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
  check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
  settings = LossSettings(float(epsilon), float(epsilon) if epsilon_high is None else float(epsilon_high))

  mask = completion_mask.astype(jnp.float32)
  valid = mask > 0
  # Padded positions may hold garbage: replace them *before* any arithmetic so neither values nor gradients see it.
  logp = jnp.where(valid, per_token_logps.astype(jnp.float32), 0.0)
  if old_per_token_logps is None:
    old = jax.lax.stop_gradient(logp)
  else:
    old = jnp.where(valid, jax.lax.stop_gradient(old_per_token_logps).astype(jnp.float32), 0.0)
  adv = jax.lax.stop_gradient(advantages).astype(jnp.float32)
  if adv.ndim == 1:
    adv = adv[:, None]
  elif spec.sequence_advantages:
    raise ValueError(f"{loss_algo} needs per-sequence advantages of shape [B]; got per-token advantages")

  aux: dict[str, jax.Array] = {"ppo_kl": token_mean(-(logp - old), mask)}
  per_token_loss, own = spec.fn(logp, old, adv, mask, settings)
  if is_weights is not None:
    per_token_loss = per_token_loss * jnp.where(valid, jax.lax.stop_gradient(is_weights).astype(jnp.float32), 0.0)
  pg_loss = aggregate(per_token_loss, mask, loss_agg_mode)

  kl_loss = jnp.float32(0.0)
  kl_mean = jnp.float32(0.0)
  if beta != 0.0:
    if ref_per_token_logps is None:
      raise ValueError("beta != 0 needs ref_per_token_logps")
    ref = jnp.where(valid, jax.lax.stop_gradient(ref_per_token_logps).astype(jnp.float32), 0.0)
    kl = kl_estimate(logp, ref, kl_estimator)
    kl_loss = aggregate(kl, mask, loss_agg_mode)
    kl_mean = token_mean(kl, mask)
    per_token_loss = per_token_loss + beta * kl
  loss = aggregate(per_token_loss, mask, loss_agg_mode)

  missing = sorted(set(spec.metrics) - set(own))
  if missing:
    raise ValueError(f"policy loss {loss_algo} declares metrics it did not return: {', '.join(missing)}")
  aux.update({"pg_loss": pg_loss, "kl_loss": kl_loss, "kl": kl_mean})
  aux.update({k: own[k] for k in spec.metrics})
  if "clip_fraction" in aux:
    aux["pg_clipfrac"] = aux["clip_fraction"]
  aux = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in aux.items()}
  return loss.astype(jnp.float32), aux
