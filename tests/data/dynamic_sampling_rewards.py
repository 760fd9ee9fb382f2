"""A reward for the dynamic-sampling tests on a random-init model (whose GSM8K rewards are all zero): by the prompt's
CRC, a third of the groups are all-1 (zero variance, "all correct" to the metric only if graded so), a third all-0,
and the rest score each completion by its CRC's parity, so those groups are informative about half of the time.

With DS_TEST_SIGTERM_ON_CALL=N the process sends itself SIGTERM during its N-th reward call: a stop requested
mid-training at a deterministic point (a test that waits for a metrics line and then signals races a fast run to its
end)."""

import os
import signal
import zlib

_CALLS = [0]


def prompt_bucket_reward(prompts, completions, **kwargs):
  del kwargs
  _CALLS[0] += 1
  if _CALLS[0] == int(os.environ.get("DS_TEST_SIGTERM_ON_CALL", "0")):
    os.kill(os.getpid(), signal.SIGTERM)
  out = []
  for p, c in zip(prompts, completions):
    bucket = zlib.crc32(p.encode()) % 3
    out.append(1.0 if bucket == 0 else 0.0 if bucket == 1 else float(zlib.crc32(c.encode()) % 2))
  return out
