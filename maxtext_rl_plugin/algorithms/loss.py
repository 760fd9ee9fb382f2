r"""The clipped policy loss (GRPO, GSPO-token) and its aggregation modes.

Notation in the package docstring (maxtext_rl_plugin/algorithms/__init__.py); KL estimators in divergence.py.

GRPO (Shao et al. 2024, DeepSeekMath; asymmetric "clip-higher" from DAPO, Yu et al. 2025):
    r_{i,t} = exp(lp - lp_old)
    L_{i,t} = -( min(r_{i,t} A_i, clip(r_{i,t}, 1 - eps_lo, 1 + eps_hi) A_i) - beta * KL_{i,t} )

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", sequence-level and its GSPO-token variant):
    s_i       = exp( (1/n_i) sum_t m_{i,t} (lp - lp_old) )                  (length-normalised sequence ratio)
    s_{i,t}   = sg[s_i] * exp(lp_{i,t} - sg[lp_{i,t}])                       (numerically s_i; d/dlp_t = s_i)
    L_{i,t}   = -( min(s_{i,t} A_i, clip(s_{i,t}, 1 - eps_lo, 1 + eps_hi) A_i) - beta * KL_{i,t} )
  With per-sequence advantages and `sequence-mean-token-mean` aggregation, the gradient of GSPO-token equals the
  gradient of sequence-level GSPO,  -(1/B) sum_i min(s_i A_i, clip(s_i, ...) A_i): every token of sequence i
  receives -A_i s_i / (B n_i) unless the sequence is clipped. The paper's clip ranges are ~1e-4 (3e-4 / 4e-4),
  not GRPO's 0.2: the sequence ratio is a geometric mean, so set `rl.grpo_epsilon` accordingly.

Aggregation of L_{i,t} (`loss_agg_mode`; rows with n_i = 0 are excluded from the row count B'):
    token-mean                  sum_{i,t} m L / sum_{i,t} m                       (DAPO)
    sequence-mean-token-mean    (1/B') sum_i (1/n_i) sum_t m L                    (GRPO / GSPO papers)
    sequence-mean               (1/B') sum_i sum_t m L                            (Tunix's "seq-mean-token-sum")
  MaxText 0.2.5 accepts `sequence-mean` in `rl.loss_agg_mode`, but Tunix 0.1.7's `aggregate_loss` has no such mode
  and raises; here it is the sum-over-tokens/mean-over-sequences reading above.

Differences from Tunix 0.1.7's `grpo_loss_fn` (tunix/rl/algo_core.py), which this module replaces in the learner:
  * `epsilon_high` is a real config field (Tunix reads it with `hasattr`, and `GRPOConfig` has none, so the clip is
    always symmetric there); the KL estimator is chosen explicitly (Tunix's default is k1).
  * GSPO: Tunix clamps the token log-ratio to [-20, 20] *before* the sequence mean and the final log-ratio to <= 10,
    which zeroes the gradient of a sequence whose ratio exceeds e^10; here the clamp is on the stop-gradient
    sequence part only, so the gradient always follows the paper.
  * beta == 0 ignores the reference entirely (no KL metric), matching the learner, which then computes no ref
    log-probs. Dual-clip (`epsilon_c`), sampler importance weights and `kl_clamp_value` are not supported (the
    +-20 clamp above already bounds k3 by e^20). Sampler importance weights (`sampler_is_weights`) multiply the
    policy-gradient term as in Tunix's `algo_core`; the plugin computes them with `divergence.rollout_is_weights`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtext_rl_plugin.algorithms.common import LOG_RATIO_CLAMP, check_choice
from maxtext_rl_plugin.algorithms.divergence import KL_ESTIMATORS, kl_estimate

LOSS_ALGOS = ("grpo", "gspo-token")
# MaxText's `rl.loss_agg_mode` Literal: the only values a config can reach.
LOSS_AGG_MODES = ("token-mean", "sequence-mean-token-mean", "sequence-mean")
# Dr. GRPO's constant-length aggregation (Tunix's name); reached through `rl.advantage_estimator=drgrpo`.
TOKEN_SCALE = "sequence-mean-token-scale"
AGG_MODES = LOSS_AGG_MODES + (TOKEN_SCALE,)


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
  """The clipped GRPO / GSPO-token loss (to minimise) and its diagnostics; formulas in the module docstring.

  Args:
    per_token_logps: [B, T] log-probs of the sampled tokens under the policy being trained (differentiated).
    old_per_token_logps: [B, T] log-probs under the sampling policy, or None for on-policy (ratio == 1 in value,
      as Tunix does when num_iterations == 1).
    ref_per_token_logps: [B, T] reference log-probs; unused (may be None) when beta == 0.
    advantages: [B] per-completion advantages ([B, T] per-token advantages are accepted for `grpo`).
    completion_mask: [B, T] 1 for trained tokens (up to and including EOS), 0 for padding.
    loss_algo, epsilon, epsilon_high, beta, kl_estimator, loss_agg_mode: static hyperparameters;
      epsilon_high=None means epsilon (symmetric clip).
    is_weights: [B, T] rollout importance weights (`rollout_is_weights`) multiplying the policy-gradient term, or None.

  Returns:
    (loss, aux): scalar float32 loss and float32 scalars `pg_loss`, `kl_loss`, `kl` (token mean of the KL
    estimate), `ppo_kl` (token mean of lp_old - lp), `ratio_mean/min/max`, `clip_fraction_low/high`,
    `clip_fraction` (tokens whose clipped branch is active, i.e. that get no policy gradient), `pg_clipfrac` (the
    same, under the key Tunix's learner logs) and, for gspo-token, `seq_ratio_mean` and `seq_clip_fraction` over
    non-empty sequences.
  """
  check_choice("loss_algo", loss_algo, LOSS_ALGOS)
  check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
  check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
  eps_lo = float(epsilon)
  eps_hi = eps_lo if epsilon_high is None else float(epsilon_high)

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
  elif loss_algo == "gspo-token":
    raise ValueError("gspo-token needs per-sequence advantages of shape [B]; got per-token advantages")

  log_ratio = logp - old
  aux: dict[str, jax.Array] = {"ppo_kl": token_mean(-log_ratio, mask)}
  if loss_algo == "grpo":
    token_log_ratio = jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  else:
    lengths = mask.sum(axis=-1)
    seq_log_ratio = (log_ratio * mask).sum(axis=-1) / jnp.maximum(lengths, 1.0)
    seq_log_ratio = jnp.clip(jax.lax.stop_gradient(seq_log_ratio), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_ratio = seq_log_ratio[:, None] + (logp - jax.lax.stop_gradient(logp))
  ratio = jnp.exp(token_log_ratio)
  surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_lo, 1.0 + eps_hi) * adv)
  per_token_loss = -surrogate
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

  r = jax.lax.stop_gradient(ratio)
  a = jnp.broadcast_to(adv, r.shape)
  clipped_low = (a < 0) & (r < 1.0 - eps_lo)
  clipped_high = (a > 0) & (r > 1.0 + eps_hi)
  aux.update(
      {
          "pg_loss": pg_loss,
          "kl_loss": kl_loss,
          "kl": kl_mean,
          "ratio_mean": token_mean(r, mask),
          "ratio_min": jnp.min(jnp.where(valid, r, jnp.inf)),
          "ratio_max": jnp.max(jnp.where(valid, r, -jnp.inf)),
          "clip_fraction_low": token_mean(clipped_low.astype(jnp.float32), mask),
          "clip_fraction_high": token_mean(clipped_high.astype(jnp.float32), mask),
          "clip_fraction": token_mean((clipped_low | clipped_high).astype(jnp.float32), mask),
      }
  )
  aux["pg_clipfrac"] = aux["clip_fraction"]
  if loss_algo == "gspo-token":
    nonempty = (mask.sum(axis=-1) > 0).astype(jnp.float32)
    n_rows = jnp.maximum(nonempty.sum(), 1.0)
    s = jnp.exp(seq_log_ratio)
    a_seq = adv[:, 0]
    seq_clipped = ((a_seq < 0) & (s < 1.0 - eps_lo)) | ((a_seq > 0) & (s > 1.0 + eps_hi))
    aux["seq_ratio_mean"] = (s * nonempty).sum() / n_rows
    aux["seq_clip_fraction"] = (seq_clipped.astype(jnp.float32) * nonempty).sum() / n_rows
  aux = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in aux.items()}
  return loss.astype(jnp.float32), aux
