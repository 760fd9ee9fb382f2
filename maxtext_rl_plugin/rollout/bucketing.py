"""Shape bucketing for the embedded engine: a run compiles a handful of programs, not one per step.

A call's prompts are packed into a (prefill batch, prompt length) bucket from `rollout_batch_buckets` and
`rollout_prefill_buckets`; the prefill batch holds whole groups (every generation of a prompt shares its prefill)
and divides the data-parallel size. Rows beyond the real ones are inactive and never counted.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

import numpy as np


def next_bucket(n: int, buckets: Sequence[int]) -> int:
  """Smallest bucket >= n; beyond the largest, the next multiple of the largest."""
  buckets = sorted(int(b) for b in buckets)
  i = bisect.bisect_left(buckets, n)
  if i < len(buckets):
    return buckets[i]
  top = buckets[-1]
  return -(-n // top) * top


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def prefill_batch(rows: int, generations: int, dp: int) -> int:
  """Prompts per prefill for a bucket of `rows` decode rows: whole groups, divisible by the data-parallel size."""
  return round_up(max(1, -(-rows // generations)), dp)


def consecutive_groups(ids: list[list[int]]) -> tuple[list[list[int]], int]:
  """(unique prompts, G) when `ids` is each prompt repeated G times in a row (Tunix's GRPO layout); else (ids, 1)."""
  n = len(ids)
  g = 1
  while g < n and ids[g] == ids[0]:
    g += 1
  if g > 1 and n % g == 0 and all(ids[i] == ids[i - i % g] for i in range(n)):
    return [ids[i] for i in range(0, n, g)], g
  return ids, 1


@dataclasses.dataclass(frozen=True)
class PackedPrompts:
  """Host arrays of one call: left-padded prompt bucket, real lengths, and which decode rows are real."""

  tokens: np.ndarray  # [B, L] int32, left-padded with pad_id
  lengths: np.ndarray  # [B] int32 (1 on padding prompts, never read)
  active: np.ndarray  # [B * G] bool

  @property
  def prompts(self) -> int:
    return self.tokens.shape[0]

  @property
  def prompt_len(self) -> int:
    return self.tokens.shape[1]


def pack(
    prompts: Sequence[Sequence[int]],
    generations: int,
    *,
    prefill_buckets: Sequence[int],
    batch_buckets: Sequence[int],
    dp: int,
    pad_id: int,
) -> PackedPrompts:
  """Prompts of one call in their (prefill batch, prompt length) bucket."""
  n = len(prompts)
  length = next_bucket(max(len(p) for p in prompts), prefill_buckets)
  batch = prefill_batch(next_bucket(n * generations, batch_buckets), generations, dp)
  tokens = np.full((batch, length), pad_id, np.int32)
  lengths = np.ones((batch,), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, length - len(p) :] = np.asarray(p, np.int32)
    lengths[i] = len(p)
  active = np.zeros((batch * generations,), bool)
  active[: n * generations] = True
  return PackedPrompts(tokens, lengths, active)


def left_padded(prompts: Sequence[Sequence[int]], generations: int, width: int, pad_id: int) -> np.ndarray:
  """[len(prompts) * G, max(width, longest)] prompts left-padded, each repeated for its G rows (Tunix's layout)."""
  width = max(int(width or 0), max(len(p) for p in prompts))
  out = np.full((len(prompts) * generations, width), pad_id, np.int32)
  for i, p in enumerate(prompts):
    out[i * generations : (i + 1) * generations, width - len(p) :] = np.asarray(p, np.int32)
  return out
