"""Off-policy updates, mini-batches and gradient accumulation (maxtext_rl_plugin/run/updates.py + the step loop).

References: the update plan against hand-counted schedules; gradient accumulation against the unsplit update of the
same real MaxText model (parameter deltas of one step, with an optimizer made linear in the gradient so a wrong
scale, e.g. a sum instead of a mean over micro-batches, cannot hide behind Adam's scale invariance); off-policy
ratios against the on-policy identity (ratio == 1 exactly when a batch gets one update).
"""

import json
import pathlib
import shutil
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tunix.rl.grpo import grpo_learner

from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import updates

import _in_process as in_process
from _tiny import SMALL_VOCAB

REPO = pathlib.Path(__file__).resolve().parents[2]


class _Cfg:
  """The config attributes UpdatePlan reads."""

  def __init__(self, batch, mini, micro, mu, g=2, force=False, k=0, rollout_logps=False):
    self.batch_size = batch
    self.train_micro_batch_size = micro
    self.rl = type(
        "RL",
        (),
        {
            "mini_batch_size": mini,
            "num_iterations": mu,
            "num_generations": g,
            "force_on_policy_ratio": force,
            "off_policy_steps": k,
            "use_rollout_logps": rollout_logps,
        },
    )()


@pytest.mark.parametrize(
    "batch,mini,micro,mu,upd,acc,micro_steps,needs_old",
    [
        (4, None, -1, 1, 1, 1, 1, False),  # MaxText's default: one on-policy update per batch
        (4, None, 2, 1, 1, 2, 2, False),  # gradient accumulation only: still one update
        (4, 2, -1, 1, 2, 1, 2, True),  # two mini-batches: the second update is off-policy
        (4, None, -1, 3, 3, 1, 3, True),  # mu = 3 passes over the batch
        (8, 4, 2, 2, 4, 2, 8, True),
    ],
)
def test_update_plan_counts(batch, mini, micro, mu, upd, acc, micro_steps, needs_old):
  plan = updates.UpdatePlan.from_config(_Cfg(batch, mini, micro, mu))
  assert (plan.updates_per_step, plan.accumulation_steps, plan.micro_steps_per_step, plan.needs_old_logps) == (
      upd,
      acc,
      micro_steps,
      needs_old,
  )
  rows = list(plan.micro_batch_rows())
  assert len(rows) == micro_steps
  # Each iteration covers every row exactly once, in whole prompt groups of G rows.
  per_iter = micro_steps // mu
  for it in range(mu):
    covered = np.concatenate([np.arange(s.start, s.stop) for s in rows[it * per_iter : (it + 1) * per_iter]])
    np.testing.assert_array_equal(covered, np.arange(batch * 2))
  assert all(s.start % 2 == 0 and (s.stop - s.start) % 2 == 0 for s in rows)


def test_force_on_policy_ratio_needs_no_old_logps():
  assert not updates.UpdatePlan.from_config(_Cfg(4, 2, -1, 1, force=True)).needs_old_logps


@pytest.mark.parametrize(
    "k,rollout_logps,needs_old",
    [
        (0, True, False),  # on-policy single update: the ratio is 1 whatever the source
        (1, False, False),  # stale, corrected by importance weights (pi_old = the trainer's weights, ratio 1 at update 1)
        (1, True, True),  # stale, PPO ratio against the behaviour policy: the sampler's log-probs are the old policy
    ],
)
def test_stale_batches_need_old_logps_only_for_a_behaviour_ratio(k, rollout_logps, needs_old):
  assert (
      updates.UpdatePlan.from_config(_Cfg(4, None, -1, 1, k=k, rollout_logps=rollout_logps)).needs_old_logps == needs_old
  )


def test_slice_rows_keeps_every_array_field_aligned():
  n, t = 6, 3
  ex = grpo_learner.TrainExample(
      prompt_ids=jnp.arange(n * 2).reshape(n, 2),
      prompt_mask=jnp.ones((n, 2), bool),
      completion_ids=jnp.arange(n * t).reshape(n, t),
      completion_mask=jnp.ones((n, t), bool),
      ref_per_token_logps=None,
      advantages=jnp.arange(n, dtype=jnp.float32),
      old_per_token_logps=-jnp.arange(n * t, dtype=jnp.float32).reshape(n, t),
  )
  part = updates.slice_rows(ex, slice(2, 4))
  np.testing.assert_array_equal(np.asarray(part.advantages), [2.0, 3.0])
  np.testing.assert_array_equal(np.asarray(part.completion_ids), np.asarray(ex.completion_ids)[2:4])
  np.testing.assert_array_equal(np.asarray(part.old_per_token_logps), np.asarray(ex.old_per_token_logps)[2:4])
  assert part.ref_per_token_logps is None


# ----------------------------------------------------------------------------------------------------------------------
# End to end on the tiny MaxText model
# ----------------------------------------------------------------------------------------------------------------------

# A deterministic reward that varies with the text: every group has a reward spread, so the policy gradient is never
# zero (the random-init model never answers correctly and always fills its token budget, so correctness or length
# rewards would make every advantage 0 and every test here vacuous).
_LENGTH_REWARD = """
def length_reward(prompts, completions, **kwargs):
  return [(sum(map(ord, c)) % 97) / 97.0 for c in completions]
"""

# One RL step whose update is linear in the gradient: no clipping, and adam_eps >> |g| makes AdamW's first step
# lr * g / (|g| + eps) ~ lr * g / eps, so a factor-of-two error in accumulation shows as a factor of two in the delta.
_LINEAR = [
    "gradient_clipping_threshold=0",
    "adam_eps=1000",
    "adam_weight_decay=0",
    "learning_rate=100",
    "warmup_steps_fraction=0",
    "rl.grpo_beta=0",
    "num_test_batches=0",
    "eval_interval=0",
]


def _train(tmp_path, name, *overrides):
  """Run train_rl (tiny config, length reward) in this process; returns its run directory and reward records."""
  reward = tmp_path / "length_reward.py"
  reward.write_text(_LENGTH_REWARD)
  out = tmp_path / "runs"
  cmd = [
      sys.executable,
      "-m",
      "maxtext_rl_plugin.train_rl",
      "configs/cpu_tiny.yml",
      *SMALL_VOCAB,
      f"base_output_directory={out}",
      f"run_name={name}",
      f"metrics_file={out / name / 'metrics.jsonl'}",
      "reward_functions=length_reward",
      f"reward_functions_path={reward}",
      "checkpoint_period=1",
      "batch_size=2",
      "rl.num_generations=2",
      # The random-init model's next-token distribution is nearly one-hot ("\n" every time): a high sampling
      # temperature (the loss and log-probs use the same one) gives distinct completions, so rewards vary.
      "decode_sampling_temperature=30",
      *overrides,
  ]
  p = in_process.train_rl(cmd[3:])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
  recs = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines() if l.strip()]
  return out / name, [r for r in recs if "reward/mean" in r]


def _params(step_dir: pathlib.Path) -> dict[str, np.ndarray]:
  tree = ocp.StandardCheckpointer().restore(step_dir / "params")
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _init_params() -> dict[str, np.ndarray]:
  """The weights `_train`'s runs start from, keyed as `_params` reads a checkpoint: the actor as run/build builds it
  (run/models.build_model on the tiny config, its init_weights_seed); a third run at learning_rate=0 gave the same."""
  rs = models.setup_devices(config_lib.parse(["configs/cpu_tiny.yml", *SMALL_VOCAB]))
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(rs.trainer_config))
  model, _ = models.build_model(rs.trainer_config, rs.trainer_devices, pad_id=tok.pad_token_id)
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return {jax.tree_util.keystr(k) + "['value']": np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state)}


@pytest.mark.extended  # the same equality per update is tests/run/test_accumulation.py's (1, 2, 4 micro-batches, LoRA)
@pytest.mark.slow
def test_gradient_accumulation_equals_the_unsplit_update(tmp_path):
  """train_micro_batch_size=1 (two micro-batches of one prompt) vs the unsplit batch of two prompts, one step."""
  run_full, recs_full = _train(tmp_path, "full", "num_batches=1", *_LINEAR)
  run_micro, recs_micro = _train(tmp_path, "micro", "num_batches=1", "train_micro_batch_size=1", *_LINEAR)
  full, micro = (_params(r / "checkpoints" / "1") for r in (run_full, run_micro))
  init = _init_params()
  assert init.keys() == full.keys()
  d_full = np.concatenate([(full[k] - init[k]).ravel() for k in sorted(init)])
  d_micro = np.concatenate([(micro[k] - init[k]).ravel() for k in sorted(init)])
  assert np.abs(d_full).max() > 1e-4  # the step moved the weights: the comparison below is not vacuous
  # ... and `init` is where the runs started: one step moves a weight by < 1e-3 here (median ~3e-5 on the 528-token
  # vocabulary, where most weights take part), another init by ~0.1 (the 64-wide kernels' scale) to O(1).
  assert np.abs(d_full).max() < 1e-2 and np.median(np.abs(d_full)) < 1e-3
  np.testing.assert_allclose(d_micro, d_full, rtol=0, atol=2e-3 * np.abs(d_full).max())
  assert recs_micro[0]["opt/updates"] == recs_full[0]["opt/updates"] == 1
  # sequence-mean-token-mean over equal micro-batches: the mean of micro-batch losses is the batch loss.
  assert recs_micro[0]["loss"] == pytest.approx(recs_full[0]["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_off_policy_updates_make_ratios_and_gspo_clipping_live(tmp_path):
  """mu=2 passes x 2 mini-batches = 4 updates per batch: ratios leave 1, clipping is measured, resume stays exact."""
  common = [
      "rl.num_iterations=2",
      "rl.mini_batch_size=1",
      "loss_algo=gspo-token",
      "rl.grpo_epsilon=0.0003",
      "rl.epsilon_high=0.0004",
      "learning_rate=1e-3",
      "num_test_batches=0",
      "eval_interval=0",
      "rl.use_rollout_logps=false",
      "rl.log_sampler_trainer_agreement=true",
      "rl.rollout_is=truncate",
  ]
  run, recs = _train(tmp_path, "offpolicy", "num_batches=2", *common)
  assert [r["opt/updates"] for r in recs] == [4, 8]
  # (Also the GSPO-token end-to-end check: its sequence-ratio metrics from step 1 on and a finite loss.)
  assert "train/seq_ratio_mean" in recs[0] and all(np.isfinite(x["loss"]) for x in recs)
  r = recs[-1]
  assert r["train/ratio_min"] < 1.0 or r["train/ratio_max"] > 1.0  # updates 2..4 see moved weights
  assert r["train/seq_ratio_mean"] != pytest.approx(1.0, abs=1e-7)
  assert r["train/seq_clip_fraction"] > 0.0  # GSPO's 3e-4 range clips once the policy moved
  assert "train/clip_fraction_low" in r and "train/clip_fraction_high" in r and "train/ppo_kl" in r
  # Colocated: the sampler's behaviour log-probs (KV-cache decode) and the trainer's forward see the same weights, so
  # they agree to float32 rounding, and the truncated IS weights are ~1 with nothing truncated.
  assert 0.0 <= r["mismatch/logp_abs_diff_mean"] < 1e-3 and r["mismatch/kl_k3"] < 1e-5
  assert r["rollout_is/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
  assert r["rollout_is/is_truncated_fraction"] == 0.0
  meta = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())
  assert meta["optimizer_updates"] == 8 and meta["updates_per_step"] == 4
  # Resume from step 1 reproduces step 2 exactly (same batch, same sampling, same optimizer-update count).

  shutil.rmtree(run / "checkpoints" / "2")
  (run / "metrics.jsonl").unlink()
  _, resumed = _train(tmp_path, "offpolicy", "num_batches=2", *common)
  assert [x["step"] for x in resumed] == [2]
  assert resumed[0]["opt/updates"] == 8
  assert resumed[0]["reward/mean"] == pytest.approx(r["reward/mean"], abs=1e-9)
  assert resumed[0]["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
