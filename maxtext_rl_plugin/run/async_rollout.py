r"""Rollouts that run ahead of the trainer, with bounded staleness (`rl.off_policy_steps`).

A synchronous GRPO step is `rollout -> update -> weight sync`: the sampler idles while the trainer updates and the
trainer idles while the sampler generates. With `rl.off_policy_steps = k > 0` a producer thread samples the next
batches while the current one trains, so a step costs about `max(rollout, train) + sync` instead of
`rollout + train + sync` (on disaggregated meshes the two really run side by side; colocated, they share devices).

Weight versions and the schedule (this function is the one place that decides which weights sampled which batch):

    version v       the weights after v RL steps (v optimizer-update groups); step s trains with version s - 1
    batch b         0-based, trained at step b + 1 (batch b is a pure function of (seed, b): data/splits.py)
    behaviour_version(b) = max(start, b - k)          start = the step the run (re)started from
    policy lag of the batch trained at step s = (s - 1) - behaviour_version(s - 1) = min(s - 1 - start, k) <= k

so a batch is sampled by weights at most `k` RL steps (syncs) older than the weights it trains, never more, and the
schedule is deterministic: the same config samples every batch with the same weights on every run, whatever the
relative speed of the two threads. The producer waits until version `behaviour_version(b)` is in the sampler before
sampling batch b; the trainer, before installing version v, waits until every batch that version v - 1 must sample
(b <= v - 1 + k) is produced. The queue is therefore bounded by k + 1 batches.

k = 0 runs no thread: `take` samples inline, exactly the synchronous loop. On resume from step s the batches in
flight when the run stopped are gone (they are not checkpointed); they are sampled again, by version s, because
behaviour_version uses `start`: no batch is repeated or skipped, only the first k steps after a resume are less stale.

The correction for the staleness is the loss's (`rl.rollout_is`: truncated or masked importance weights
pi_old / pi_behaviour, algorithms/divergence.py) or the PPO ratio against the behaviour policy (`rl.use_rollout_logps`);
`run/build.check_runtime` refuses k > 0 with neither. Rollout engines whose weights are the trainer's own arrays
(the embedded engine, colocated) sample from a snapshot pinned at each sync (`pin_params`), since the trainer
updates the shared arrays while the producer samples.

The rollout engine is used by one thread at a time (`engine()`): sampling, weight syncs and evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator

from absl import logging

from maxtext_rl_plugin import signals


def behaviour_version(batch: int, off_policy_steps: int, start: int) -> int:
  """The weight version that samples batch `batch` (module docstring)."""
  return max(int(start), int(batch) - int(off_policy_steps))


@dataclasses.dataclass
class Produced:
  """One sampled batch and how it was made."""

  index: int  # 0-based batch index, trained at step index + 1
  version: int  # weights that sampled it (behaviour_version)
  value: Any  # what `sample_fn` returned
  phases: dict[str, float]  # seconds per phase spent producing it (rollout, reward, ...)
  idle_s: float = 0.0  # the producer waited this long for the weights it had to sample with
  wait_s: float = 0.0  # the trainer waited this long for the batch


class RolloutProducer:
  """Samples batches `start .. end - 1` in order, `off_policy_steps` ahead of the trainer at most.

  `sample_fn(index, phases) -> value` produces one batch (it adds its phase seconds to the `phases` dict). The trainer
  calls `take(b)` for the batch of each step and `publish(v, install)` after the update of step v, `install` being
  what puts version v into the sampler (a weight sync, or pinning a snapshot).
  """

  def __init__(self, sample_fn: Callable[[int, dict], Any], *, off_policy_steps: int, start: int, end: int):
    if off_policy_steps < 0:
      raise ValueError(f"off_policy_steps must be >= 0, got {off_policy_steps}")
    self.k = int(off_policy_steps)
    self.start, self.end = int(start), int(end)
    self._sample_fn = sample_fn
    self._version = self.start  # the weights the sampler holds
    self._next = self.start  # the next batch the producer samples
    self._ready: dict[int, Produced] = {}
    self._cv = threading.Condition()
    self._engine = threading.RLock()
    self._error: BaseException | None = None
    self._stop = False
    self._thread: threading.Thread | None = None

  @property
  def asynchronous(self) -> bool:
    return self.k > 0

  @property
  def producing(self) -> bool:
    """Whether the producer thread is running (never in the synchronous off_policy_steps=0 mode)."""
    return self._thread is not None

  def start_producing(self) -> None:
    if self.asynchronous and self._thread is None and self.start < self.end:
      self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
      self._thread.start()

  # ---------------------------------------------------------------------------------------------- producer thread
  def _run(self) -> None:
    """The producer thread: sample each batch once the sampler holds its weight version; errors reach take()."""
    try:
      for b in range(self.start, self.end):
        v = behaviour_version(b, self.k, self.start)
        t = time.perf_counter()
        with self._cv:
          self._cv.wait_for(lambda v=v: self._stop or self._version >= v)
          if self._stop:
            return
          if self._version != v:  # cannot happen: publish(v + 1) waits for every batch of version v
            raise RuntimeError(f"batch {b} must be sampled by weight version {v}, the sampler holds {self._version}")
        idle = time.perf_counter() - t
        item = self._produce(b, v)
        item.idle_s = idle
        with self._cv:
          self._ready[b] = item
          self._next = b + 1
          self._cv.notify_all()
    except BaseException as e:  # pylint: disable=broad-exception-caught  # re-raised in the trainer's thread by take()
      with self._cv:
        self._error = e
        self._cv.notify_all()

  def _produce(self, b: int, v: int) -> Produced:
    """Sample batch `b` with weight version `v`, holding the engine while it runs."""
    phases: dict[str, float] = {}
    with self._engine:
      value = self._sample_fn(b, phases)
    return Produced(b, v, value, phases)

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      raise self._error

  # ---------------------------------------------------------------------------------------------- trainer thread
  def take(self, b: int) -> Produced:
    """Batch `b`, sampled by `behaviour_version(b)`; blocks until it is produced (k = 0: samples it now)."""
    if not self.asynchronous:
      if self._version != behaviour_version(b, 0, self.start):
        raise RuntimeError(f"synchronous batch {b} needs weight version {b}, the sampler holds {self._version}")
      return self._produce(b, self._version)
    t = time.perf_counter()
    with self._cv:
      self._cv.wait_for(lambda: b in self._ready or self._error is not None)
      if b not in self._ready:
        self._raise_if_failed()
      item = self._ready.pop(b)
    item.wait_s = time.perf_counter() - t
    return item

  def publish(self, version: int, install: Callable[[], None]) -> float:
    """Install weight version `version` in the sampler with `install()`, once every batch the previous version must
    sample is produced; returns the seconds waited for that."""
    waited = 0.0
    if self.asynchronous:
      need = min(self.end, version + self.k)  # batches < need are sampled by versions < version
      t = time.perf_counter()
      with self._cv:
        self._cv.wait_for(lambda: self._next >= need or self._error is not None)
        if self._next < need and not isinstance(self._error, signals.StopSampling):
          self._raise_if_failed()  # a stopped producer lets this step finish: the trainer stops after it
      waited = time.perf_counter() - t
    with self._engine:
      install()
    with self._cv:
      self._version = version
      self._cv.notify_all()
    return waited

  @contextlib.contextmanager
  def engine(self) -> Iterator[None]:
    """Exclusive use of the rollout engine (evaluation), between the producer's batches."""
    with self._engine:
      yield

  def close(self, timeout: float | None = None) -> None:
    """Stop producing (a batch being sampled is finished first, then dropped) and join the thread."""
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join(timeout)
      if self._thread.is_alive():
        logging.warning("rollout producer still sampling after %.0fs; leaving it (daemon thread)", timeout or 0.0)
      self._thread = None
