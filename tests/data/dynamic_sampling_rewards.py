"""A reward for the dynamic-sampling tests on a random-init model (whose GSM8K rewards are all zero): by the prompt's
CRC, a third of the groups are all-1 (zero variance, "all correct" to the metric only if graded so), a third all-0,
and the rest score each completion by its CRC's parity, so those groups are informative about half of the time."""

import zlib


def prompt_bucket_reward(prompts, completions, **kwargs):
  del kwargs
  out = []
  for p, c in zip(prompts, completions):
    bucket = zlib.crc32(p.encode()) % 3
    out.append(1.0 if bucket == 0 else 0.0 if bucket == 1 else float(zlib.crc32(c.encode()) % 2))
  return out
