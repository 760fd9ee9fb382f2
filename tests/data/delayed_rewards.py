"""A reward for the multi-process tests whose rollout thread is late on one process: `alnum_share` (as in
tests/data/multiprocess_rewards.py) after sleeping MAXTEXT_RL_TEST_REWARD_DELAY_S seconds (default 1) on JAX process
MAXTEXT_RL_TEST_DELAYED_PROCESS (default 1) only. Rewards are computed where the batch is sampled, in the rollout
producer's thread when rollouts run ahead, so that thread reaches every later step behind the other process's."""

import os
import time

import jax


def alnum_share(prompts, completions, **kwargs):
  """The share of ASCII letters and digits among a completion's characters (multiprocess_rewards.py's), late."""
  del prompts, kwargs
  if jax.process_index() == int(os.environ.get("MAXTEXT_RL_TEST_DELAYED_PROCESS", "1")):
    time.sleep(float(os.environ.get("MAXTEXT_RL_TEST_REWARD_DELAY_S", "1")))
  return [sum(ch.isascii() and ch.isalnum() for ch in c) / max(1, len(c)) for c in completions]
