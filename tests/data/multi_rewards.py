"""Two rewards with a 10x difference in spread, for rl.reward_aggregation's tests on a random-init model: both are
functions of the completion's text alone (deterministic), so every group of distinct completions varies in both."""

import zlib


def wide_reward(prompts, completions, **kwargs):
  """0 or 10: the completion's CRC parity (the objective with the wide spread)."""
  del prompts, kwargs
  return [10.0 * (zlib.crc32(c.encode()) % 2) for c in completions]


def narrow_reward(prompts, completions, **kwargs):
  """0, 0.5 or 1: the completion's length mod 3, halved (the narrow one)."""
  del prompts, kwargs
  return [0.5 * (len(c) % 3) for c in completions]
