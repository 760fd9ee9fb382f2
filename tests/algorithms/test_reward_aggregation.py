"""rl.reward_aggregation / rl.reward_weights (algorithms/reward_aggregation.py) against NumPy re-derivations written
out here: per-group loops with np.std(ddof=1), GRPO's (x - mean) / (std + 1e-6), NeMo-RL's batch-wide last step."""

import types

import numpy as np
import pytest

from maxtext_rl_plugin.algorithms import reward_aggregation as agg
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.run import experience

G = 4


def _rl(**kw):
  """The `rl:` block's keys the aggregation and the GRPO estimator read, at their defaults unless given."""
  base = {
      "reward_weights": [],
      "reward_aggregation": "sum",
      "advantage_estimator": "grpo",
      "advantage_norm": None,
      "loss_agg_mode": "sequence-mean-token-mean",
      "reward_model_weight": 1.0,
  }
  base.update(kw)
  return types.SimpleNamespace(**base)


def _z_reference(r, g):
  """Each row's z-score in its group, one group at a time (0 where the group is constant)."""
  out = np.zeros(len(r))
  for k in range(len(r) // g):
    x = np.asarray(r[k * g : (k + 1) * g], np.float64)
    if x.max() == x.min():
      continue
    out[k * g : (k + 1) * g] = (x - x.mean()) / (np.std(x, ddof=1) + 1e-6)
  return out


def _grpo_reference(x, g):
  out = np.zeros(len(x))
  for k in range(len(x) // g):
    y = np.asarray(x[k * g : (k + 1) * g], np.float64)
    out[k * g : (k + 1) * g] = (y - y.mean()) / (np.std(y, ddof=1) + 1e-6)
  return out


def _advantages(rl, total, values, g):
  """The GRPO estimator (group_std, or batch_std) on the aggregation's signal, as run/experience.sample applies the
  run's estimator to it (the estimators' own tests are tests/algorithms/test_algorithms.py's); and the kept groups."""
  signal = np.asarray(agg.signal_of(rl, total, values, g), np.float64)
  if rl.advantage_norm == "batch_std":
    centred = signal - signal.reshape(-1, g).mean(axis=1).repeat(g)
    adv = centred / (centred.std(ddof=1) + 1e-6)
  else:
    adv = _grpo_reference(signal, g)
  return adv, agg.kept_groups_of(rl, total, values, g)


def _batch(seed=0, groups=6):
  rng = np.random.default_rng(seed)
  correct = rng.integers(0, 2, groups * G).astype(float) * 10.0  # the wide reward: 0 or 10
  fmt = rng.choice([0.0, 0.5, 1.0], groups * G)  # the narrow one
  correct[:G] = 10.0  # group 0: only the format reward varies
  correct[G : 2 * G], fmt[G : 2 * G] = [0.0, 10.0, 10.0, 0.0], 1.0  # group 1: only correctness varies
  correct[2 * G : 3 * G], fmt[2 * G : 3 * G] = 0.0, 0.5  # group 2: nothing varies
  return {"correct": correct.tolist(), "fmt": fmt.tolist()}


def test_gdpo_advantages_equal_a_numpy_rederivation():
  values = _batch()
  rl = _rl(reward_weights=[1.0, 0.5], reward_aggregation="gdpo")
  total = np.asarray(values["correct"]) + 0.5 * np.asarray(values["fmt"])
  adv, kept = _advantages(rl, total.astype(np.float32), values, G)
  s = 1.0 * _z_reference(values["correct"], G) + 0.5 * _z_reference(values["fmt"], G)
  np.testing.assert_allclose(adv, _grpo_reference(s, G), rtol=1e-5, atol=1e-5)
  # The narrow reward counts: in group 0 (only fmt varies) the advantages are its z-scores, unit scale, not 1/10 of it.
  np.testing.assert_allclose(adv[:G], _grpo_reference(values["fmt"][:G], G), rtol=1e-5, atol=1e-5)
  assert kept.tolist()[:3] == [True, True, False]
  # Under sum the same group-0 advantages are the weighted total's, the narrow reward's spread only.
  adv_sum, _ = _advantages(_rl(reward_weights=[1.0, 0.5]), total.astype(np.float32), values, G)
  np.testing.assert_allclose(adv_sum, _grpo_reference(total, G), rtol=1e-5, atol=1e-5)


def test_gdpo_with_batch_std_is_nemo_rls_last_step():
  """NeMo-RL's GDPOAdvantageEstimator (use_leave_one_out_baseline=false): sum_k w_k A_k, then (A - mean_B) / std_B."""
  values = _batch(seed=3)
  w = [1.0, 0.5]
  adv, _ = _advantages(
      _rl(reward_weights=w, reward_aggregation="gdpo", advantage_norm="batch_std"), np.zeros(24, np.float32), values, G
  )
  a = w[0] * _z_reference(values["correct"], G) + w[1] * _z_reference(values["fmt"], G)
  nemo = (a - a.mean()) / a.std(ddof=1)
  np.testing.assert_allclose(adv, nemo, rtol=1e-4, atol=1e-5)


def test_sum_with_unit_weights_is_todays_sum_bit_for_bit():
  values = _batch(seed=1)

  def fa(prompts, completions, **kw):
    del prompts, kw
    return values["correct"][: len(completions)]

  def fb(prompts, completions, **kw):
    del prompts, kw
    return [v * 0.1 + 1e-9 for v in values["fmt"][: len(completions)]]

  n = len(values["correct"])
  total = np.zeros(n)
  for f in (fa, fb):  # the plugin's sum before rl.reward_weights: float64 in order, one cast
    total += np.asarray(f(None, [""] * n), np.float64)
  old = total.astype(np.float32)
  new = experience.sum_rewards([fa, fb], [""] * n, [""] * n)
  assert new.dtype == np.float32 and np.array_equal(new, old)
  assert np.array_equal(experience.sum_rewards([fa, fb], [""] * n, [""] * n, [1.0, 1.0]), old)
  weighted = experience.sum_rewards([fa, fb], [""] * n, [""] * n, [2.0, -0.5])
  np.testing.assert_allclose(weighted, 2.0 * np.asarray(values["correct"]) - 0.5 * np.asarray(fb(None, [""] * n)))
  adv, kept = _advantages(_rl(), old, {"fa": fa(None, [""] * n), "fb": fb(None, [""] * n)}, G)
  np.testing.assert_allclose(adv, _grpo_reference(old, G), rtol=1e-5, atol=1e-5)
  assert kept.tolist() == [bool(np.ptp(old[k * G : (k + 1) * G]) > 0) for k in range(n // G)]


def test_dynamic_sampling_keeps_a_group_when_a_weighted_reward_varies():
  # group 0: a and b trade off exactly (a + b constant); group 1: only the weight-0 reward c varies; group 2: only b.
  a = [1, 0, 1, 0] + [1, 1, 1, 1] + [0, 0, 0, 0]
  b = [0, 1, 0, 1] + [0, 0, 0, 0] + [0, 1, 1, 0]
  c = [0, 0, 0, 0] + [0, 3, 0, 3] + [0, 0, 0, 0]
  values = {"a": a, "b": b, "c": c}
  total = np.asarray(a, np.float64) + np.asarray(b, np.float64)
  rl_sum = _rl(reward_weights=[1.0, 1.0, 0.0])
  assert agg.kept_groups_of(rl_sum, total, values, G).tolist() == [False, False, True]
  rl_gdpo = _rl(reward_weights=[1.0, 1.0, 0.0], reward_aggregation="gdpo")
  assert agg.kept_groups_of(rl_gdpo, total, values, G).tolist() == [True, False, True]
  adv, _ = _advantages(rl_gdpo, total, values, G)
  assert np.all(adv[:G] == 0.0)  # the cancelled group: exactly zero, no rounding residue blown up to unit scale
  assert np.all(adv[G : 2 * G] == 0.0) and np.ptp(adv[2 * G :]) > 1.0


def test_overlong_penalty_and_reward_model_components_take_their_weights():
  rl = _rl(reward_weights=[0.5, 2.0], reward_model_weight=3.0)
  names = ["a", "b", agg.REWARD_MODEL, agg.OVERLONG]
  assert agg.weights_of(rl, names) == [0.5, 2.0, 3.0, 1.0]
  assert agg.weights_of(_rl(), ["a", agg.OVERLONG]) == [1.0, 1.0]


def test_a_wrong_number_of_weights_is_one_line_naming_both_keys():
  with pytest.raises(ConfigError) as e:
    agg.configured_weights(_rl(reward_weights=[1.0, 0.5, 2.0]), ["a", "b"])
  msg = str(e.value)
  assert "rl.reward_weights" in msg and "reward_functions" in msg and "\n" not in msg


def test_per_reward_metrics_count_groups_where_that_reward_alone_is_flat():
  values = _batch(seed=2)
  m = agg.per_reward_metrics(values, G)
  fmt = np.asarray(values["fmt"]).reshape(-1, G)
  assert m["reward/fmt/zero_spread_fraction"] == pytest.approx(np.mean([np.ptp(x) == 0 for x in fmt]))
  assert m["reward/correct/mean"] == pytest.approx(np.mean(values["correct"]))
  assert m["reward/correct/std"] == pytest.approx(np.std(values["correct"]))
