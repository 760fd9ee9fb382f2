r"""Several rewards combined into one advantage: `rl.reward_aggregation` (sum | gdpo) with `rl.reward_weights`.

Rows come in contiguous groups g of G = num_generations completions of one prompt; r_k is reward k's value for each row
(one per `reward_functions` entry, then the reward model, then DAPO's overlong penalty), w_k its weight
(`rl.reward_weights`, one per `reward_functions` entry, default 1; `rl.reward_model_weight`; 1 for the penalty).

    sum:   R_i = sum_k w_k r_k,i                          then the run's estimator on R (algorithms/advantages.py)
    gdpo:  z_k,i = (r_k,i - mean_g r_k) / (std_g(r_k, ddof=1) + 1e-6)       (0 in a group where r_k does not vary)
           S_i = sum_k w_k z_k,i                          then the run's estimator on S

`sum` with every weight 1 is the plugin's behaviour before these keys, bit for bit (the same float64 accumulation in
the same order, cast to float32 once: w * r is r exactly when w = 1). Summed, the reward with the widest spread sets
the advantages: a format bonus of +-0.1 beside a correctness reward of 0/1 moves them by a tenth of what correctness
does, and completions that differ only in format get nearly the same advantage. GDPO (Liu et al. 2026, "Group reward-
Decoupled normalization Policy Optimization", arXiv 2601.05242) standardises each reward within its group first, so each
objective contributes on the same unit scale and `w_k` alone says how much it counts.

Where this follows NeMo-RL's `GDPOAdvantageEstimator` (nemo_rl/algorithms/advantage_estimator.py, with its
`examples/configs/gdpo_math_1B.yaml`: `use_leave_one_out_baseline: false`, `normalize_rewards: true`) and where not:
  * the per-reward step is NeMo-RL's with that example config: the group mean as baseline and the group's sample std
    (ddof=1, `calculate_baseline_and_std_per_prompt`'s `num_valid / (num_valid - 1)` correction), +1e-6, no division
    where the std is 0 (the centred value is 0 there: we write 0 exactly, so a constant reward adds no rounding
    residue); NeMo-RL's default leave-one-out baseline (mean and std of the other G - 1) is not offered;
  * weights: NeMo-RL orders `reward_weights` by the sorted reward-component names; here they follow `reward_functions`
    as written (MaxText's key), and a wrong count is refused in one line at start-up, not at the first batch;
  * the last step differs: NeMo-RL standardises sum_k w_k A_k over the whole batch ((A - mean_B) / std_B, ddof=1);
    here the run's own estimator runs on S (grpo with `group_std` by default: (S - mean_g S) / (std_g(S, ddof=1) +
    1e-6)), so rloo, drgrpo and `rl.advantage_norm` keep their meaning. `rl.advantage_norm=batch_std` reproduces
    NeMo-RL's last step up to its epsilon: S already has group mean 0, so S - mean_g S = S and mean_B S = 0;
  * NeMo-RL refuses GDPO with fewer than two reward components; one component here is GRPO on its z-score.

A group in which the weighted z-scores cancel exactly (two equally weighted objectives that trade off perfectly within
the group) has S = 0 up to rounding; `gdpo_signal` sets such a group's S to 0 exactly (its range within 1e-6 of the
weights' scale), else a group-std estimator would blow the rounding residue up to unit advantages.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from maxtext_rl_plugin.errors import ConfigError

AGGREGATIONS = ("sum", "gdpo")
OVERLONG = "overlong_penalty"  # DAPO's soft overlong penalty, a reward component of weight 1 (algorithms/shaping.py)
REWARD_MODEL = "reward_model"  # the reward model's component (rl.reward_model_path), weight rl.reward_model_weight
_STD_EPS = 1e-6
_CANCEL_TOL = 1e-6


def configured_weights(rl: Any, names: Sequence[str]) -> list[float]:
  """One weight per `reward_functions` entry (`names`, as resolved, default stack included): `rl.reward_weights`, or 1
  each when it is empty. A count that differs from the functions' is one line naming both keys."""
  weights = list(rl.reward_weights or [])
  if not weights:
    return [1.0] * len(names)
  if len(weights) != len(names):
    raise ConfigError(
        f"invalid value for 'rl.reward_weights'={weights}: {len(weights)} weights for {len(names)} reward functions "
        f"(reward_functions: {', '.join(names)}); give one weight per reward_functions entry, in its order"
    )
  return [float(w) for w in weights]


def weights_of(rl: Any, names: Sequence[str]) -> list[float]:
  """The weight of each reward component `names` (in recording order: the configured functions, then the reward
  model, then the overlong penalty): `rl.reward_weights`, `rl.reward_model_weight`, 1."""
  configured = [n for n in names if n not in (REWARD_MODEL, OVERLONG)]
  fn_weights = iter(configured_weights(rl, configured))
  weights = []
  for name in names:
    if name == REWARD_MODEL:
      weights.append(float(rl.reward_model_weight))
    elif name == OVERLONG:
      weights.append(1.0)
    else:
      weights.append(next(fn_weights))
  return weights


def components(rl: Any, reward_values: Mapping[str, Any]) -> tuple[list, list[float]]:
  """The recorded reward components (`reward_values`: name -> [rows], in recording order) as (values, weights)."""
  names = list(reward_values)
  return [reward_values[n] for n in names], weights_of(rl, names)


def weighted_sum(values: Sequence[Any], weights: Sequence[float]) -> np.ndarray:
  """[rows] float64: sum_k w_k r_k, accumulated in the components' order (with every w = 1, today's sum exactly)."""
  arrays = [np.asarray(v, np.float64).reshape(-1) for v in values]
  total = np.zeros(arrays[0].shape[0] if arrays else 0, np.float64)
  for w, r in zip(weights, arrays):
    total += r if w == 1.0 else w * r
  return total


def zero_spread(values: Any, num_generations: int) -> np.ndarray:
  """[groups] bool: groups in which `values` does not vary (max == min)."""
  groups = np.asarray(values, np.float64).reshape(-1, num_generations)
  return groups.max(axis=1) <= groups.min(axis=1)


def standardise(values: Any, num_generations: int) -> np.ndarray:
  """[rows] float64: each value's z-score in its group, (r - mean_g) / (std_g(ddof=1) + 1e-6), 0 where r is constant."""
  g = np.asarray(values, np.float64).reshape(-1, num_generations)
  centred = g - g.mean(axis=1, keepdims=True)
  std = g.std(axis=1, ddof=1, keepdims=True)
  flat = (g.max(axis=1) <= g.min(axis=1))[:, None]
  z = np.where(flat, 0.0, centred / (std + _STD_EPS))
  return z.reshape(-1)


def gdpo_signal(values: Sequence[Any], weights: Sequence[float], num_generations: int) -> np.ndarray:
  """[rows] float32: S = sum_k w_k z_k (module docstring), groups whose S cancels to rounding set to 0 exactly."""
  rows = len(values[0]) if len(values) else 0
  s = np.zeros(rows, np.float64)
  for w, r in zip(weights, values):
    if w != 0.0:
      s += w * standardise(r, num_generations)
  groups = s.reshape(-1, num_generations)
  scale = max(sum(abs(float(w)) for w in weights), 1.0)
  cancelled = (groups.max(axis=1) - groups.min(axis=1)) <= _CANCEL_TOL * scale
  groups[cancelled] = 0.0
  return groups.reshape(-1).astype(np.float32)


def kept_groups(
    aggregation: str, total: Any, values: Sequence[Any], weights: Sequence[float], num_generations: int
) -> np.ndarray:
  """[groups] bool: the groups DAPO's dynamic sampling keeps (run/dynamic_sampling.py).

  sum: the weighted total varies (verl's `seq_final_reward` filter; the plugin's rule before these keys, bit for bit).
  gdpo: some reward of nonzero weight varies. Why not "S varies": under GDPO each objective is its own signal on one
  scale, and the rule is read off the rewards as scored, as the per-reward metric `reward/<name>/zero_spread_fraction`
  counts them, rather than off a float sum of z-scores; the two differ only where equally weighted z-scores cancel
  exactly (S is then set to 0, `gdpo_signal`), a group kept with zero advantage, which `reward/zero_variance_group_
  fraction` counts. A reward of weight 0 is logged but never keeps a group: it does not reach the advantage.
  """
  if aggregation != "gdpo":
    return ~zero_spread(total, num_generations)
  groups = np.asarray(total).reshape(-1, num_generations).shape[0]
  varies = np.zeros(groups, bool)
  for w, r in zip(weights, values):
    if w != 0.0:
      varies |= ~zero_spread(r, num_generations)
  return varies


def advantage_input(
    aggregation: str, total: Any, values: Sequence[Any], weights: Sequence[float], num_generations: int
) -> np.ndarray:
  """[rows] float32: what the run's advantage estimator reads: the weighted total (sum) or S (gdpo)."""
  if aggregation == "gdpo":
    return gdpo_signal(values, weights, num_generations)
  return np.asarray(total, np.float32)


def signal_of(rl: Any, total: Any, reward_values: Mapping[str, Any], num_generations: int) -> np.ndarray:
  """[rows] float32: what the run's advantage estimator reads for a batch (`advantage_input` of its recorded
  components under `rl.reward_aggregation`). `total` is the weighted total the step logs as `reward/mean`."""
  values, weights = components(rl, reward_values)
  return advantage_input(rl.reward_aggregation, total, values, weights, num_generations)


def kept_groups_of(rl: Any, total: Any, reward_values: Mapping[str, Any], num_generations: int) -> np.ndarray:
  """[groups] bool: `kept_groups` of a batch's recorded components under the run's `rl.reward_aggregation`."""
  values, weights = components(rl, reward_values)
  return kept_groups(rl.reward_aggregation, total, values, weights, num_generations)


def per_reward_metrics(values: Mapping[str, Any], num_generations: int) -> dict[str, float]:
  """`reward/<name>/mean`, `/std` (over the batch's rows) and `/zero_spread_fraction` (the groups in which that reward
  alone does not vary) of every recorded component."""
  m: dict[str, float] = {}
  for name, vals in values.items():
    arr = np.asarray(vals, dtype=np.float64)
    m[f"reward/{name}/mean"] = float(arr.mean())
    m[f"reward/{name}/std"] = float(arr.std())
    if arr.size and arr.size % num_generations == 0:
      m[f"reward/{name}/zero_spread_fraction"] = float(zero_spread(arr, num_generations).mean())
  return m
