r"""The built-in policy losses, registered in setup.cfg's `maxtext_rl_plugin.policy_losses` group as `grpo` and
`gspo-token` (MaxText's two `rl.loss_algo` names, with their meaning); loss.py states the contract and the objective
(aggregation, KL, importance weights) around them.

Notation in the package docstring (maxtext_rl_plugin/algorithms/__init__.py).

GRPO (Shao et al. 2024, DeepSeekMath; asymmetric "clip-higher" from DAPO, Yu et al. 2025):
    r_{i,t} = exp(lp - lp_old)
    L^pg_{i,t} = -min(r_{i,t} A_i, clip(r_{i,t}, 1 - eps_lo, 1 + eps_hi) A_i)

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", sequence-level and its GSPO-token variant):
    s_i       = exp( (1/n_i) sum_t m_{i,t} (lp - lp_old) )                  (length-normalised sequence ratio)
    s_{i,t}   = sg[s_i] * exp(lp_{i,t} - sg[lp_{i,t}])                       (numerically s_i; d/dlp_t = s_i)
    L^pg_{i,t} = -min(s_{i,t} A_i, clip(s_{i,t}, 1 - eps_lo, 1 + eps_hi) A_i)
  With per-sequence advantages and `sequence-mean-token-mean` aggregation, the gradient of GSPO-token equals the
  gradient of sequence-level GSPO,  -(1/B) sum_i min(s_i A_i, clip(s_i, ...) A_i): every token of sequence i
  receives -A_i s_i / (B n_i) unless the sequence is clipped. The paper's clip ranges are ~1e-4 (3e-4 / 4e-4),
  not GRPO's 0.2: the sequence ratio is a geometric mean, so set `rl.grpo_epsilon` accordingly. The +-20 clamp is on
  the stop-gradient sequence part only (Tunix clamps before the mean, which zeroes the gradient past e^10).

Metrics of both: `ratio_mean/min/max` over tokens, `clip_fraction_low/high` (tokens whose clipped branch is active on
the low / high side: they get no policy gradient) and `clip_fraction` (their sum); GSPO-token also `seq_ratio_mean`
and `seq_clip_fraction` over non-empty sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext_rl_plugin.algorithms.common import LOG_RATIO_CLAMP
from maxtext_rl_plugin.algorithms.loss import LossSettings, PolicyLoss, token_mean

_RATIO_METRICS = ("ratio_mean", "ratio_min", "ratio_max", "clip_fraction_low", "clip_fraction_high", "clip_fraction")


def clip_metrics(
    ratio: jax.Array, advantages: jax.Array, mask: jax.Array, settings: LossSettings
) -> dict[str, jax.Array]:
  """`_RATIO_METRICS` of a clipped surrogate with per-token ratio `ratio` [B, T] (no gradient)."""
  valid = mask > 0
  r = jax.lax.stop_gradient(ratio)
  a = jnp.broadcast_to(advantages, r.shape)
  clipped_low = (a < 0) & (r < 1.0 - settings.epsilon)
  clipped_high = (a > 0) & (r > 1.0 + settings.epsilon_high)
  return {
      "ratio_mean": token_mean(r, mask),
      "ratio_min": jnp.min(jnp.where(valid, r, jnp.inf)),
      "ratio_max": jnp.max(jnp.where(valid, r, -jnp.inf)),
      "clip_fraction_low": token_mean(clipped_low.astype(jnp.float32), mask),
      "clip_fraction_high": token_mean(clipped_high.astype(jnp.float32), mask),
      "clip_fraction": token_mean((clipped_low | clipped_high).astype(jnp.float32), mask),
  }


def _clipped_surrogate(ratio: jax.Array, advantages: jax.Array, settings: LossSettings) -> jax.Array:
  clipped = jnp.clip(ratio, 1.0 - settings.epsilon, 1.0 + settings.epsilon_high)
  return -jnp.minimum(ratio * advantages, clipped * advantages)


def grpo_loss(
    logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, settings: LossSettings
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GRPO's clipped per-token surrogate (module docstring)."""
  ratio = jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  return _clipped_surrogate(ratio, advantages, settings), clip_metrics(ratio, advantages, mask, settings)


def gspo_token_loss(
    logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, settings: LossSettings
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """GSPO-token: the clipped surrogate of the length-normalised sequence ratio, per token (module docstring)."""
  lengths = mask.sum(axis=-1)
  seq_log_ratio = ((logp - old_logp) * mask).sum(axis=-1) / jnp.maximum(lengths, 1.0)
  seq_log_ratio = jnp.clip(jax.lax.stop_gradient(seq_log_ratio), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  ratio = jnp.exp(seq_log_ratio[:, None] + (logp - jax.lax.stop_gradient(logp)))
  metrics = clip_metrics(ratio, advantages, mask, settings)
  nonempty = (lengths > 0).astype(jnp.float32)
  n_rows = jnp.maximum(nonempty.sum(), 1.0)
  s = jnp.exp(seq_log_ratio)
  a_seq = advantages[:, 0]
  seq_clipped = ((a_seq < 0) & (s < 1.0 - settings.epsilon)) | ((a_seq > 0) & (s > 1.0 + settings.epsilon_high))
  metrics["seq_ratio_mean"] = (s * nonempty).sum() / n_rows
  metrics["seq_clip_fraction"] = (seq_clipped.astype(jnp.float32) * nonempty).sum() / n_rows
  return _clipped_surrogate(ratio, advantages, settings), metrics


GRPO = PolicyLoss(fn=grpo_loss, metrics=_RATIO_METRICS)
GSPO_TOKEN = PolicyLoss(
    fn=gspo_token_loss,
    metrics=_RATIO_METRICS + ("seq_ratio_mean", "seq_clip_fraction"),
    sequence_advantages=True,
    on_policy_note=(
        "loss_algo=gspo-token with num_iterations=1: on-policy ratios are 1, so the gradient is exactly GRPO's under "
        "the same loss_agg_mode (GSPO differs only through its sequence-level clipping)"
    ),
)
