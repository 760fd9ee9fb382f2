"""The run's reward functions, built from the whole config: the configured ones (rewards/loader) and the reward model.

A builder in `run/`, where the whole config may go, because two of its parts hand the config to an API that needs it:

* MaxText's reward contract gives a user's function written for `utils_rl` the run's config as `tmvp_config` (as
  MaxText's train_rl does), so `configured_reward_fns` binds it; rewards/ itself reads only `RewardSelection` and
  `gsm8k.RewardConfig`;
* the reward model's backbone is MaxText's model of the run's family, built by MaxText's own code from its
  HyperParameters (`run/models.build_model`), so `build_reward_model` takes the config; reward_model.py reads only
  `RewardModelSettings`.

In RL the reward model comes last (`reward_fns`), wrapped like every reward (rewards/loader.RewardFn:
reward_call_timeout_seconds, one finite number per completion).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from absl import logging
from flax import nnx
import jax

from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin import reward_model as rm_lib
from maxtext_rl_plugin.rewards import gsm8k
from maxtext_rl_plugin.rewards import loader


def configured_reward_fns(config: Any) -> list[loader.RewardFn]:
  """The functions `reward_functions` names (the GSM8K stack by default), each wrapped in a checked `RewardFn`; a
  user's function that takes `tmvp_config` receives `config`, as in MaxText's train_rl."""
  return loader.reward_fns(
      loader.RewardSelection.of(config),
      gsm8k.RewardConfig.of(config),
      float(config.reward_call_timeout_seconds),
      tmvp_config=config,
  )


def build_reward_model(config: Any, devices: Sequence[Any], pad_id: int, seed: int = 0) -> tuple[rm_lib.RewardModel, Any]:
  """A reward model of the run's model family and size on `devices` (backbone from load_parameters_path or random)."""
  adapter, mesh = models.build_model(config, list(devices), pad_id=pad_id)
  with mesh:
    rm = rm_lib.RewardModel(adapter.base, int(config.emb_dim), nnx.Rngs(seed))
  return rm, mesh


def reward_model_reward(
    config: Any, devices: Sequence[Any] | None = None, settings: rm_lib.RewardModelSettings | None = None
) -> rm_lib.RewardModelReward:
  """The `reward_model` reward of `rl.reward_model_path`: its meta checked against the run's model and tokenizer
  (before any model is built), then built like the run's model on `devices` (the trainer's; None: every device) and
  restored. `settings`: `RewardModelSettings.of(config)` when the caller has it."""
  settings = settings or rm_lib.RewardModelSettings.of(config)
  tokenizer = tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config))
  manager, step, meta = rm_lib.read_meta(settings.path)
  rm_lib.check_meta(settings.path, meta, rm_lib.meta_of(settings.model, tokenizer))
  rm, mesh = build_reward_model(config, jax.devices() if devices is None else devices, int(tokenizer.pad_token_id))
  rm_lib.restore(manager, step, rm, mesh)
  manager.close()
  logging.info("reward model %s (step %d): %s", settings.path, step, json.dumps(meta))
  return rm_lib.RewardModelReward(rm_lib.Scorer(rm, mesh, tokenizer, settings.batch_size, settings.max_len))


def reward_model_fns(config: Any, devices: Sequence[Any] | None = None) -> list[loader.RewardFn]:
  """[the reward model as a checked reward function] with `rl.reward_model_path`, else []. Why not Tunix's
  `Role.REWARD` (RLCluster.get_rewards): in Tunix 0.1.7 only the PPO learner calls it, on the policy's token ids with a
  per-token score head, outside the reward-function contract; here the reward model is scored like every other reward
  (the same timeout and non-finite rules, weights, aggregation and metrics) on the trainer's devices, where its weights
  need no mesh of their own."""
  if not config.rl.reward_model_path:
    return []
  settings = rm_lib.RewardModelSettings.of(config)
  fn = reward_model_reward(config, devices, settings)
  return [loader.RewardFn(fn, source=f"rl.reward_model_path='{settings.path}'", timeout_s=settings.timeout_s)]


def reward_fns(config: Any, devices: Sequence[Any] | None = None) -> list[loader.RewardFn]:
  """Every reward of the run, in recording order: the configured functions, then the reward model (on `devices`)."""
  return configured_reward_fns(config) + reward_model_fns(config, devices)
