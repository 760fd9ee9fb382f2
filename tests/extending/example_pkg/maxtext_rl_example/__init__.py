r"""An example extension of maxtext-rl-plugin, registered by entry points only (pyproject.toml).

cispo: a CISPO-style loss (MiniMax-M1, 2025): the importance weight is clipped and held constant, so every token keeps a
gradient (none is dropped by PPO's min), REINFORCE-style:
    r = exp(lp - lp_old),   w = sg(min(r, 1 + eps_hi)),   L^pg = -w * A * lp
group_median: the advantage baseline is the group's median reward, c_i = R_i - median_g R (robust to one outlier).
short_answer: a reward of 1 for a completion of at most 16 characters, else 16 / len.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_rl_plugin.algorithms.advantages import AdvantageEstimator
from maxtext_rl_plugin.algorithms.loss import LossSettings, PolicyLoss, token_mean

CALLS = {"group_median": 0}  # how often the run called the estimator (the test reads it)


def cispo_loss(logp, old_logp, advantages, mask, settings: LossSettings):
  """Per-token CISPO loss and its metrics (module docstring)."""
  ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
  weight = jax.lax.stop_gradient(jnp.minimum(ratio, 1.0 + settings.epsilon_high))
  clipped = (jax.lax.stop_gradient(ratio) > 1.0 + settings.epsilon_high).astype(jnp.float32)
  per_token = -weight * advantages * logp
  return per_token, {"cispo_weight_mean": token_mean(weight, mask), "cispo_clip_fraction": token_mean(clipped, mask)}


CISPO = PolicyLoss(fn=cispo_loss, metrics=("cispo_weight_mean", "cispo_clip_fraction"))


def group_median_baseline(rewards, num_generations):
  """R_i - median of its group (module docstring); NumPy in, NumPy out; jnp in, jnp out."""
  CALLS["group_median"] += 1
  xp = jnp if isinstance(rewards, jax.Array) else np
  groups = rewards.reshape(-1, num_generations)
  return (groups - xp.median(groups, axis=-1, keepdims=True)).reshape(-1)


GROUP_MEDIAN = AdvantageEstimator(baseline=group_median_baseline, norms=("none", "batch_std"))


def short_answer(prompts, completions, **unused_kwargs):
  """1 for a completion of at most 16 characters, else 16 / its length."""
  return [min(1.0, 16.0 / max(len(c), 1)) for c in completions]
