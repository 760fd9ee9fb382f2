r"""KL estimators and rollout importance weights: the shared KL and importance-sampling math.

Notation in the package docstring (maxtext_rl_plugin/algorithms/__init__.py).

KL estimators (Schulman, "Approximating KL divergence"), d = lp_ref - lp:
    k1 = lp - lp_ref = -d                      (Tunix 0.1.7's default `kl_loss_mode="kl"`)
    k3 = exp(d) - d - 1  >= 0                   (DeepSeekMath's; Tunix's "low_var_kl")
  As a *loss* k1's gradient is the constant beta per token (it pushes every sampled token's log-prob down equally),
  while k3's gradient beta (1 - pi_ref/pi) pulls towards the reference; k3 is the default.

Rollout importance sampling (`rl.rollout_is`; Yao et al. 2025 "truncated importance sampling", verl's rollout_corr),
for batches whose behaviour policy mu (the sampler's log-probs lp_mu, returned by the rollout engine at sampling time)
differs from pi_old (the trainer's forward at the batch's starting weights: another engine, bf16 vs f32, stale weights):
    truncate:  w_{i,t} = min( exp(lp_old - lp_mu), C )                      (TIS, per token; C = rl.rollout_is_cap)
    mask:      W_i = exp( (1/n_i) sum_t m (lp_old - lp_mu) ),  w_{i,t} = 1[1/C <= W_i <= C]   (sequence-level MIS)
  w is a constant (no gradient) multiplying the policy-gradient term of L_{i,t} before aggregation; the KL term is not
  weighted. Metrics: `is_weight_mean` (over tokens), `is_truncated_fraction` (tokens with exp(lp_old - lp_mu) > C),
  `is_masked_fraction` (sequences dropped by `mask`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_rl_plugin.algorithms.common import LOG_RATIO_CLAMP, check_choice

KL_ESTIMATORS = ("k1", "k3")


def kl_estimate(
    per_token_logps: jax.Array, ref_per_token_logps: jax.Array, estimator: str = "k3", xp: Any = jnp
) -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (see module docstring).

  `xp=np` evaluates the same formula in NumPy at the inputs' precision (host-side diagnostics in float64)."""
  check_choice("kl_estimator", estimator, KL_ESTIMATORS)
  d = xp.clip(ref_per_token_logps - per_token_logps, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  if estimator == "k1":
    return -d
  return xp.exp(d) - d - 1.0


ROLLOUT_IS_MODES = ("off", "truncate", "mask")


def rollout_is_weights(
    old_per_token_logps: Any, behaviour_per_token_logps: Any, completion_mask: Any, mode: str, cap: float
) -> tuple[np.ndarray, dict[str, float]]:
  """Rollout importance weights w [B, T] and their metrics (formulas in the module docstring); host NumPy, float32.

  Computed once per rollout batch, outside the differentiated loss (the weights are constants there).
  """
  check_choice("rollout_is", mode, ROLLOUT_IS_MODES)
  if not cap > 1.0:
    raise ValueError(f"rollout_is_cap must be > 1; got {cap}")
  m = np.asarray(completion_mask).astype(np.float64)
  valid = m > 0
  d = np.where(
      valid, np.asarray(old_per_token_logps, np.float64) - np.asarray(behaviour_per_token_logps, np.float64), 0.0
  )
  d = np.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  ratio = np.exp(d)
  n_tok = max(m.sum(), 1.0)
  metrics = {"is_truncated_fraction": float(((ratio > cap) & valid).sum() / n_tok), "is_masked_fraction": 0.0}
  if mode == "off":
    w = np.ones_like(ratio)
  elif mode == "truncate":
    w = np.minimum(ratio, cap)
  else:
    lengths = m.sum(axis=-1)
    seq = np.exp((d * m).sum(axis=-1) / np.maximum(lengths, 1.0))
    keep = (seq >= 1.0 / cap) & (seq <= cap)
    w = np.broadcast_to(keep[:, None], ratio.shape).astype(np.float64)
    nonempty = lengths > 0
    metrics["is_masked_fraction"] = float((~keep & nonempty).sum() / max(nonempty.sum(), 1))
  w = np.where(valid, w, 0.0)
  metrics["is_weight_mean"] = float(w.sum() / n_tok)
  return w.astype(np.float32), metrics
