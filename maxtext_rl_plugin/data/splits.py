"""Splits: sized, deterministic, random-access sources of Examples, and their batching.

Batch k of a split is a pure function of (seed, k): a resumed run continues at its data position with no repeated or
skipped batch (run/resume.py).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import random
from typing import Any, Iterator, Optional, Sequence

from absl import logging

from maxtext_rl_plugin.errors import DataError

_UNSET: Any = object()


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem. `answer` is the canonical gold ("72"); `solution` the full reference text ending in
  `#### N` (GSM8K's own, or the synthetic worked solution); `prompt` the fully templated model input."""

  question: str
  answer: str
  solution: str
  prompt: str
  id: str


class DatasetSplit(abc.ABC):
  """A sized, deterministic, random-access source of Examples.

  `batch(k, batch_size)` is batch k of the split's stream: for a shuffled (train) split the stream is
  epoch 0 in the order of permutation(seed, 0), then epoch 1 in permutation(seed, 1), ...; for an
  unshuffled (eval) split it is the stored order, once. `batches(...)` iterates the same stream from
  `start_batch`, so resuming at batch k reproduces exactly what an uninterrupted run would have seen.
  """

  name: str = ""
  seed: Optional[int] = None
  repeat: bool = False
  unlimited: bool = False
  _warned_small: bool = False  # batch_size > len(self) was reported (once per split)

  @abc.abstractmethod
  def __len__(self) -> int:
    ...

  @abc.abstractmethod
  def __getitem__(self, i: int) -> Example:
    ...

  def __iter__(self) -> Iterator[Example]:
    for i in range(len(self)):
      yield self[i]

  @functools.lru_cache(maxsize=4)  # noqa: B019  (a handful of epochs in flight; splits live for the run)
  def _perm(self, seed: int, epoch: int) -> list[int]:
    order = list(range(len(self)))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order

  def position_index(self, pos: int, seed: Any = _UNSET) -> int:
    """Index of the example at stream position `pos`."""
    seed = self.seed if seed is _UNSET else seed
    n = len(self)
    if self.unlimited:
      return pos
    if pos >= n and not self.repeat:
      raise IndexError(f"position {pos} is past the end of split '{self.name}' ({n} examples)")
    epoch, off = divmod(pos, n)
    return off if seed is None else self._perm(seed, epoch)[off]

  def num_batches(self, batch_size: int) -> Optional[int]:
    """Batches in one pass (None if the stream is unbounded); a non-repeating split keeps its tail batch."""
    if self.unlimited or self.repeat:
      return None
    return -(-len(self) // batch_size)

  def batch(self, k: int, batch_size: int, seed: Any = _UNSET) -> list[Example]:
    """Batch k (0-based) of the stream."""
    if k < 0 or batch_size < 1:
      raise ValueError(f"batch index {k} / batch_size {batch_size}")
    start = k * batch_size
    stop = start + batch_size
    if self.repeat and not self.unlimited and batch_size > len(self) and not self._warned_small:
      self._warned_small = True
      logging.warning(
          "split '%s' has %d examples, fewer than batch_size=%d: every batch repeats prompts "
          "(they are drawn from consecutive shuffled epochs)",
          self.name,
          len(self),
          batch_size,
      )
    if not (self.unlimited or self.repeat):
      if start >= len(self):
        raise IndexError(f"batch {k} of size {batch_size} is past the end of split '{self.name}' ({len(self)} examples)")
      stop = min(stop, len(self))
    return [self[self.position_index(p, seed)] for p in range(start, stop)]

  def batches(
      self, batch_size: int, start_batch: int = 0, seed: Any = _UNSET, num_batches: Optional[int] = None
  ) -> Iterator[list[Example]]:
    """Batches `start_batch, start_batch+1, ...` (up to `num_batches` in total counting from 0, or the end)."""
    end = self.num_batches(batch_size)
    if num_batches is not None:
      end = num_batches if end is None else min(end, num_batches)
    k = start_batch
    while end is None or k < end:
      yield self.batch(k, batch_size, seed)
      k += 1


class ListSplit(DatasetSplit):
  """A materialized split (files, hub)."""

  def __init__(self, examples: Sequence[Example], name: str, seed: Optional[int] = None, repeat: bool = False):
    if not examples:
      raise DataError(f"split '{name}' has no examples")
    self.examples = list(examples)
    self.name, self.seed, self.repeat = name, seed, repeat

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, i: int) -> Example:
    return self.examples[i]
