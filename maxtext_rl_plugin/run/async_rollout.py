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

Across JAX processes (multi-controller: Ray workers, multi-host slices without Pathways) a cross-process collective
completes only when every process issues it, and XLA runs each device's programs in the order they were issued: two
threads issuing collectives in a timing-dependent order would hang or mix up reductions. So, with `hand_over` (a
multi-process run), the producer thread issues none. It samples on this process's own devices only (a per-host sampler:
`distributed.check_asynchronous` refuses anything else) and hands every cross-process step it needs (the gather of
the hosts' rows, the broadcast of dynamic sampling's rewards: `cross_process`) to the trainer's thread, which runs them
at fixed points of its step and nowhere else:

    take(b)        before returning batch b: the hand-overs of batch b
    publish(v)     before installing version v (the weight sync, itself a collective of the trainer's thread): the
                   hand-overs of every batch version v - 1 samples (b < v + k)
    engine()       before evaluation: the hand-overs of every batch the installed version samples

in the order the producer made them. Each point waits for a condition on batches (not on time): batches are sampled in
order, each batch's hand-overs are the same sequence on every process (a function of the data, the seeds and values
already shared), and the producer cannot start a batch beyond the condition before the trainer installs the next
version. The trainer's collectives of a step (log-probs, update, weight sync) and the producer's (as run by the
trainer) therefore interleave identically on every process whatever the threads' speeds:
`tests/run/test_async_rollout.py` delays the producer on one side and checks the order.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator

from absl import logging

from maxtext_rl_plugin import signals

_PRODUCER = threading.local()  # .producer: the RolloutProducer whose thread this is, when it hands over collectives


def cross_process(fn: Callable[..., Any], *args: Any) -> Any:
  """`fn(*args)`, a step every process must issue in the same order (a cross-process gather or broadcast): run here,
  or, from the producer thread of a multi-process run, handed to the trainer's thread, which runs it at its next
  hand-over point (module docstring) while this thread waits for the result."""
  producer = getattr(_PRODUCER, "producer", None)
  if producer is None:
    return fn(*args)
  return producer.hand_over(fn, args)


@dataclasses.dataclass
class _HandOver:
  """A cross-process step of the producer, run by the trainer's thread."""

  fn: Callable[..., Any]
  args: tuple
  batch: int
  done: bool = False
  result: Any = None
  error: BaseException | None = None


class ProducerClosed(Exception):
  """The producer was closed while it waited for a hand-over (the run is stopping)."""


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

  def __init__(
      self,
      sample_fn: Callable[[int, dict], Any],
      *,
      off_policy_steps: int,
      start: int,
      end: int,
      hand_over: bool = False,
  ):
    if off_policy_steps < 0:
      raise ValueError(f"off_policy_steps must be >= 0, got {off_policy_steps}")
    self.k = int(off_policy_steps)
    self.start, self.end = int(start), int(end)
    # A multi-process run: the producer's cross-process steps run in the trainer's thread (module docstring).
    self.hand_overs = bool(hand_over)
    self._requests: collections.deque[_HandOver] = collections.deque()
    self._batch = self.start  # the batch the producer is sampling (its hand-overs carry it)
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
    if self.hand_overs:
      _PRODUCER.producer = self
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
        self._batch = b
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

  def hand_over(self, fn: Callable[..., Any], args: tuple) -> Any:
    """Producer thread: have the trainer's thread run `fn(*args)` at its next hand-over point; its result."""
    req = _HandOver(fn, args, self._batch)
    with self._cv:
      self._requests.append(req)
      self._cv.notify_all()
      self._cv.wait_for(lambda: req.done or self._stop)
      if not req.done:
        raise ProducerClosed(f"closed while batch {req.batch} waited for a cross-process step")
    if req.error is not None:
      raise req.error
    return req.result

  def _serve_until(self, done: Callable[[], bool]) -> None:
    """Trainer thread: run the producer's hand-overs in the order it made them until `done()` (a condition on
    produced batches) or the producer failed. `done` is checked before each one: a hand-over of a later batch is
    made only after the batches `done` waits for are produced, so it is never run here (module docstring)."""
    while True:
      with self._cv:
        self._cv.wait_for(lambda: done() or self._error is not None or bool(self._requests))
        if done() or not self._requests:
          return
        req = self._requests.popleft()
      try:
        req.result = req.fn(*req.args)
      except BaseException as e:  # pylint: disable=broad-exception-caught  # re-raised in the producer's thread
        req.error = e
      with self._cv:
        req.done = True
        self._cv.notify_all()

  # ---------------------------------------------------------------------------------------------- trainer thread
  def take(self, b: int) -> Produced:
    """Batch `b`, sampled by `behaviour_version(b)`; blocks until it is produced (k = 0: samples it now)."""
    if not self.asynchronous:
      if self._version != behaviour_version(b, 0, self.start):
        raise RuntimeError(f"synchronous batch {b} needs weight version {b}, the sampler holds {self._version}")
      return self._produce(b, self._version)
    t = time.perf_counter()
    if self.hand_overs:
      self._serve_until(lambda: b in self._ready)
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
      if self.hand_overs:
        self._serve_until(lambda: self._next >= need)
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
    """Exclusive use of the rollout engine (evaluation), between the producer's batches. With hand-overs, after
    every batch the installed version samples (its hand-overs run here first): the producer then waits for the next
    version and holds no engine, and evaluation's own collectives come at the same point on every process."""
    if self.hand_overs and self.producing:
      self._serve_until(lambda: self._next >= min(self.end, self._version + self.k + 1))
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
