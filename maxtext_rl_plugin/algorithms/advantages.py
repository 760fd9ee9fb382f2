r"""Group advantages: GRPO, RLOO and Dr. GRPO baselines, and their scalings.

Advantages (`group_advantages`; `rl.advantage_estimator`, `rl.advantage_norm`), contiguous groups g of
G = num_generations completions per prompt, R_i the completion's reward. First a baseline is subtracted:
    grpo, drgrpo:  c_i = R_i - mean_g R                                     (Tunix's `compute_drgrpo_advantages`)
    rloo:          c_i = R_i - (1/(G-1)) sum_{j in g, j != i} R_j = G/(G-1) (R_i - mean_g R)
                                                                            (leave-one-out, Ahmadian et al. 2024;
                                                                             Tunix's `compute_rloo_advantages`)
  then it is scaled (`rl.advantage_norm`; null = the estimator's own, in brackets):
    group_std:  A_i = c_i / (std_g(R, ddof=1) + 1e-6)                       [grpo]  (Tunix's `compute_advantages`)
    batch_std:  A_i = c_i / (std_B(c, ddof=1) + 1e-6)    over all B rows of the batch (Hu 2025, REINFORCE++-baseline;
                                                          Liu et al. 2025 "Lite PPO": group mean, batch scale)
    none:       A_i = c_i                                                   [rloo, drgrpo]
  rloo and drgrpo refuse group_std: a per-group scale is exactly the question-difficulty weighting that Dr. GRPO
  (Liu et al. 2025, "Understanding R1-Zero-like training") removes, and RLOO's estimator is unbiased only unscaled;
  a batch-wide scale is one constant per step and changes neither.
  Dr. GRPO also drops the 1/n_i length normalisation: `drgrpo` aggregates with
    sequence-mean-token-scale   (1/B') sum_i (1/T) sum_t m L                (T = the completion budget, constant)
  (Tunix's `DrGRPOConfig` default, `aggregate_loss(..., "sequence-mean-token-scale")` with its default norm T);
  it needs `rl.loss_agg_mode` at its default `sequence-mean-token-mean`, which it replaces (the other modes are
  other normalisations, refused in one line). A group whose rewards are all equal gets A = 0 under every estimator.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import algo_core

from maxtext_rl_plugin.algorithms.common import check_choice
from maxtext_rl_plugin.algorithms.loss import TOKEN_SCALE
from maxtext_rl_plugin.errors import ConfigError

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "drgrpo")
ADVANTAGE_NORMS = ("group_std", "batch_std", "none")
# The scalings each estimator allows; the first is its own (`rl.advantage_norm: null`).
ESTIMATOR_NORMS = {
    "grpo": ("group_std", "batch_std", "none"),
    "rloo": ("none", "batch_std"),
    "drgrpo": ("none", "batch_std"),
}
_ADV_STD_EPS = 1e-6


def group_advantages(rewards: Any, num_generations: int, norm: str = "group_std", estimator: str = "grpo") -> Any:
  """Advantages over contiguous groups of `num_generations` completions of the same prompt (module docstring).

  Works on NumPy (host rewards, as Tunix's learner passes them) and on JAX arrays (jit-able); returns the same kind.
  The baselines and GRPO's group scaling are Tunix's own `algo_core` estimators (public, registered in its function
  registry); a group with identical rewards gets all-zero advantages (it carries no learning signal).
  """
  check_choice("advantage_estimator", estimator, ADVANTAGE_ESTIMATORS)
  check_choice(f"advantage norm of {estimator}", norm, ESTIMATOR_NORMS[estimator])
  xp = jnp if isinstance(rewards, jax.Array) else np
  r = xp.asarray(rewards)
  if not xp.issubdtype(r.dtype, xp.floating):
    r = r.astype(xp.float32)
  if num_generations < 2 or r.ndim != 1 or r.shape[0] % num_generations:
    raise ValueError(
        f"rewards must be 1-D with a length divisible by num_generations >= 2; got shape {r.shape}, "
        f"num_generations={num_generations}"
    )
  if norm == "group_std":  # grpo only
    return algo_core.compute_advantages(r, num_generations)
  if estimator == "rloo":
    centered = algo_core.compute_rloo_advantages(r, num_generations)
  else:
    centered = algo_core.compute_drgrpo_advantages(r, num_generations)
  if norm == "batch_std":
    centered = centered / (centered.std(ddof=1) + _ADV_STD_EPS)
  return centered


def advantage_config(rl: Any) -> tuple[str, str, str]:
  """(estimator, scaling, loss aggregation) of the `rl:` block: `rl.advantage_norm: null` resolved to the estimator's
  own scaling and Dr. GRPO's aggregation; a combination that makes no sense is a one-line `ConfigError`."""
  estimator = rl.advantage_estimator
  if estimator not in ADVANTAGE_ESTIMATORS:
    raise ConfigError(f"rl.advantage_estimator={estimator!r}: expected one of {', '.join(ADVANTAGE_ESTIMATORS)}")
  allowed = ESTIMATOR_NORMS[estimator]
  norm = allowed[0] if rl.advantage_norm is None else rl.advantage_norm
  if norm not in allowed:
    raise ConfigError(
        f"invalid value for 'rl.advantage_norm'='{norm}' with rl.advantage_estimator={estimator}: expected one of "
        f"{', '.join(allowed)} (a per-group std scale reweights questions by difficulty, which {estimator} avoids)"
    )
  agg = rl.loss_agg_mode
  if estimator == "drgrpo":
    if agg != "sequence-mean-token-mean":
      raise ConfigError(
          f"invalid value for 'rl.loss_agg_mode'='{agg}' with rl.advantage_estimator=drgrpo: Dr. GRPO aggregates with "
          f"its constant length ({TOKEN_SCALE}); leave rl.loss_agg_mode at sequence-mean-token-mean, which it replaces"
      )
    agg = TOKEN_SCALE
  return estimator, norm, agg
