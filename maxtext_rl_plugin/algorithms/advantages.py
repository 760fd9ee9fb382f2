r"""Group advantages: the advantage-estimator contract, the GRPO, RLOO and Dr. GRPO baselines, and their scalings.

An estimator is found by name (`rl.advantage_estimator`) in the `maxtext_rl_plugin.advantage_estimators` entry-point
group, the built-ins below like any third party's (docs/extending.md). Each is an `AdvantageEstimator`: a baseline
function `baseline(rewards [B], num_generations) -> c [B]` (NumPy in, NumPy out; jnp in, jnp out), the scalings it
allows (the first is its own) and, optionally, the loss aggregation it replaces the default one with.

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

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import algo_core

from maxtext_rl_plugin import registry
from maxtext_rl_plugin.algorithms.common import check_choice
from maxtext_rl_plugin.algorithms.loss import TOKEN_SCALE
from maxtext_rl_plugin.errors import ConfigError

ADVANTAGE_NORMS = ("group_std", "batch_std", "none")
# The entry-point group of the estimators (registry.GROUPS) and the key that names one.
GROUP = "advantage_estimators"
KEY = "rl.advantage_estimator"
_ADV_STD_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
  """An advantage estimator as the `maxtext_rl_plugin.advantage_estimators` entry-point group registers it.

  baseline(rewards, num_generations) -> c: the baseline-subtracted rewards [B] of contiguous groups of
  `num_generations` completions of one prompt, in the array kind it was given (NumPy or jnp, jit-able for jnp).
  norms: the scalings of `rl.advantage_norm` it allows, its own first (`rl.advantage_norm: null`).
  loss_agg_mode: the aggregation it replaces the default `sequence-mean-token-mean` with (refusing the other modes),
  or "" to keep the user's.
  """

  baseline: Callable[[Any, int], Any]
  norms: tuple[str, ...] = ("group_std", "batch_std", "none")
  loss_agg_mode: str = ""


GRPO = AdvantageEstimator(baseline=algo_core.compute_drgrpo_advantages, norms=("group_std", "batch_std", "none"))
RLOO = AdvantageEstimator(baseline=algo_core.compute_rloo_advantages, norms=("none", "batch_std"))
DRGRPO = AdvantageEstimator(
    baseline=algo_core.compute_drgrpo_advantages, norms=("none", "batch_std"), loss_agg_mode=TOKEN_SCALE
)

# The built-ins' scalings by name (their setup.cfg entries); `names()` lists every registered estimator.
ESTIMATOR_NORMS = {"grpo": GRPO.norms, "rloo": RLOO.norms, "drgrpo": DRGRPO.norms}


def names() -> tuple[str, ...]:
  """The registered estimators (the choices of `rl.advantage_estimator`), without loading any."""
  return registry.names(GROUP)


def get(name: str) -> AdvantageEstimator:
  """The estimator registered as `name`; a name nobody registered is one `ConfigError` line listing those that are."""
  return registry.load_typed(GROUP, name, AdvantageEstimator, KEY)


def group_advantages(rewards: Any, num_generations: int, norm: str = "group_std", estimator: str = "grpo") -> Any:
  """Advantages over contiguous groups of `num_generations` completions of the same prompt (module docstring).

  Works on NumPy (host rewards, as Tunix's learner passes them) and on JAX arrays (jit-able); returns the same kind.
  The built-in baselines are Tunix's own `algo_core` estimators (public, registered in its function registry), and
  group_std of `grpo` is Tunix's `compute_advantages` operation for operation; a group with identical rewards gets
  all-zero advantages under the built-ins (it carries no learning signal).
  """
  spec = get(estimator)
  check_choice(f"advantage norm of {estimator}", norm, spec.norms)
  xp = jnp if isinstance(rewards, jax.Array) else np
  r = xp.asarray(rewards)
  if not xp.issubdtype(r.dtype, xp.floating):
    r = r.astype(xp.float32)
  if num_generations < 2 or r.ndim != 1 or r.shape[0] % num_generations:
    raise ValueError(
        f"rewards must be 1-D with a length divisible by num_generations >= 2; got shape {r.shape}, "
        f"num_generations={num_generations}"
    )
  centered = spec.baseline(r, num_generations)
  if norm == "group_std":  # (r - mean_g) / (std_g + eps) for grpo: Tunix's compute_advantages
    std = r.reshape(-1, num_generations).std(axis=-1, ddof=1).repeat(num_generations)
    return centered / (std + _ADV_STD_EPS)
  if norm == "batch_std":
    centered = centered / (centered.std(ddof=1) + _ADV_STD_EPS)
  return centered


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
  """The estimator, its resolved scaling and the loss aggregation the run's loss uses (`settings.AlgorithmSettings`)."""

  estimator: str = "grpo"
  norm: str = "group_std"
  loss_agg_mode: str = "sequence-mean-token-mean"

  @classmethod
  def resolve(cls, estimator: str, norm: str | None, loss_agg_mode: str) -> "AdvantageSettings":
    """`rl.advantage_norm: null` resolved to the estimator's own scaling and an estimator's aggregation (Dr. GRPO's
    constant length); a name nobody registered or a combination that makes no sense is a one-line `ConfigError`."""
    spec = get(estimator)
    norm = spec.norms[0] if norm is None else norm
    if norm not in spec.norms:
      raise ConfigError(
          f"invalid value for 'rl.advantage_norm'='{norm}' with rl.advantage_estimator={estimator}: expected one of "
          f"{', '.join(spec.norms)} (a per-group std scale reweights questions by difficulty, which {estimator} "
          "avoids)"
      )
    if spec.loss_agg_mode:
      if loss_agg_mode != "sequence-mean-token-mean":
        raise ConfigError(
            f"invalid value for 'rl.loss_agg_mode'='{loss_agg_mode}' with rl.advantage_estimator={estimator}: "
            f"{estimator} aggregates with its own {spec.loss_agg_mode}; leave rl.loss_agg_mode at "
            "sequence-mean-token-mean, which it replaces"
        )
      loss_agg_mode = spec.loss_agg_mode
    return cls(estimator, norm, loss_agg_mode)

  def __call__(self, rewards: Any, num_generations: int) -> Any:
    """The advantages of `rewards` under these settings (`group_advantages`)."""
    return group_advantages(rewards, num_generations, self.norm, self.estimator)
