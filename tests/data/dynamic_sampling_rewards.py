"""A reward for the dynamic-sampling tests on a random-init model (whose GSM8K rewards are all zero): by the prompt's
CRC, a third of the groups are all-1 (zero variance, "all correct" to the metric only if graded so), a third all-0,
and the rest score each completion by its CRC's parity, so those groups are informative about half of the time.

With DS_TEST_SIGTERM_ON_CALL=N the process sends itself SIGTERM during its N-th reward call, with
DS_TEST_SIGTERM_AFTER_FILE=path during its first call once `path` exists: a stop requested mid-training at a
deterministic point (a test that waits for a metrics line and then signals races a fast run to its end)."""

import os
import signal
import zlib

_CALLS = [0]
_SENT = [False]


def _maybe_stop() -> None:
  """SIGTERM on the DS_TEST_SIGTERM_ON_CALL-th call, or on the first call once the file DS_TEST_SIGTERM_AFTER_FILE
  exists (the run's batches.jsonl: step 1 has trained, whatever its refill rounds were)."""
  _CALLS[0] += 1
  after = os.environ.get("DS_TEST_SIGTERM_AFTER_FILE", "")
  if _CALLS[0] == int(os.environ.get("DS_TEST_SIGTERM_ON_CALL", "0")) or (
      after and os.path.exists(after) and not _SENT[0]
  ):
    _SENT[0] = True
    os.kill(os.getpid(), signal.SIGTERM)


def prompt_bucket_reward(prompts, completions, **kwargs):
  del kwargs
  _maybe_stop()
  out = []
  for p, c in zip(prompts, completions):
    bucket = zlib.crc32(p.encode()) % 3
    out.append(1.0 if bucket == 0 else 0.0 if bucket == 1 else float(zlib.crc32(c.encode()) % 2))
  return out


def informative_once(prompts, completions, **kwargs):
  """Its first call scores completions 0, 1, 0, 1, ... (every group informative: step 1 trains at once); every later
  call 1.0 for all (every group uniform: dynamic sampling refills until its bound or a stop)."""
  del prompts, kwargs
  _maybe_stop()
  return [float(i % 2) for i in range(len(completions))] if _CALLS[0] == 1 else [1.0] * len(completions)


def spread_beyond_float32(prompts, completions, **kwargs):
  """+-3e38: each value within float32, their spread not (the group mean and std overflow): NaN advantages."""
  del prompts, kwargs
  return [3e38 if i % 2 else -3e38 for i in range(len(completions))]
