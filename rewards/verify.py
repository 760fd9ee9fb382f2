"""Answer verification: an exact numeric fast path, then math_verify in killable worker processes.

MaxText 0.2.5 sends every answer that is not string-identical to the gold through math_verify (sympy),
about 250 completions/s on one core, and its pool applies one wall-clock budget to the whole batch.
Here plainly written numbers ("1,234", "$18.00", "72.00", "3/4", "\\frac{3}{4}", "25%") are compared
as exact fractions in the trainer process, and only what remains (expressions, LaTeX) goes to a
persistent pool of math_verify workers. Each item has its own deadline; a worker that misses it is
killed and replaced, and the item scores wrong, so one pathological completion costs at most
`reward_item_timeout_seconds` and never a training step.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from absl import logging

from maxtext_rl_plugin.rewards import number_grammar as ng

DEFAULT_TIMEOUT_SECONDS = 2.0
# Worker start-up (Python + sympy + math_verify imports) is not charged to an item's deadline.
_STARTUP_TIMEOUT_SECONDS = 120.0
_CACHE_SIZE = 65536


def fast_verdict(pred: Optional[str], gold: Optional[str]) -> Optional[bool]:
  """True/False when decidable without a math parser, None when math_verify must decide.

  Two plainly written numbers are compared exactly; identical normalized strings are equal; a gold
  number against a prediction that contains no digit at all is wrong.
  """
  if pred is None or gold is None:
    return False
  if pred == gold:
    return True
  g = ng.to_number(gold)
  p = ng.to_number(pred)
  if g is not None and p is not None:
    return g == p
  if len(pred) > ng.MAX_ANSWER_CHARS:
    return False
  pn, gn = ng.normalize_answer(pred), ng.normalize_answer(gold)
  if pn is None or gn is None:
    return False
  if pn == gn:
    return True
  if g is not None and not any(c.isdigit() for c in pn):
    return False
  return None


class _Worker:
  """One math_verify subprocess speaking JSON lines on stdin/stdout."""

  def __init__(self):
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="-1", TPU_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "maxtext_rl_plugin.rewards._mv_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        close_fds=True,
    )
    self.buf = b""
    self.ready = False
    self.started = time.monotonic()
    self.item: Optional[int] = None
    self.deadline = 0.0

  def fileno(self) -> int:
    return self.proc.stdout.fileno()

  def send(self, idx: int, gold: str, pred: str, timeout: float) -> None:
    self.item = idx
    self.deadline = time.monotonic() + timeout
    self.proc.stdin.write((json.dumps({"g": gold, "p": pred}) + "\n").encode())
    self.proc.stdin.flush()

  def read_lines(self) -> list[str]:
    """Lines available now; raises EOFError when the worker died."""
    chunk = os.read(self.fileno(), 65536)
    if not chunk:
      raise EOFError
    self.buf += chunk
    *lines, self.buf = self.buf.split(b"\n")
    return [ln.decode() for ln in lines]

  def kill(self) -> None:
    """SIGKILL the worker (one stuck in sympy's C code ignores gentler signals); already gone is fine."""
    try:
      self.proc.kill()
      self.proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):  # already gone, or a zombie the OS reaps later
      pass
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:  # a broken pipe's unflushed bytes: the worker is gone
        pass


class MathVerifyPool:
  """Persistent, lazily started math_verify workers with a per-item deadline.

  `verify_many([(gold, pred), ...], timeout)` returns one bool per item. Workers start on first use
  (and only as many as there are items); a worker that misses an item's deadline is SIGKILLed and
  replaced on the next item. Thread-safe (one batch at a time).
  """

  def __init__(self, num_procs: Optional[int] = None):
    self.num_procs = max(1, num_procs or min(2, os.cpu_count() or 1))
    self._workers: list[_Worker] = []
    self._lock = threading.Lock()
    self.stats = collections.Counter()
    self._broken = False
    self._failed_starts = 0

  def _new_worker(self) -> _Worker:
    self.stats["workers_started"] += 1
    return _Worker()

  def verify_many(self, items: Sequence[tuple[str, str]], timeout: float = DEFAULT_TIMEOUT_SECONDS) -> list[bool]:
    """math_verify's verdict per (prediction, gold) pair; a pair that runs past `timeout` is False."""
    results = [False] * len(items)
    if not items or self._broken:
      return results
    with self._lock:
      pending = collections.deque(range(len(items)))
      while len(self._workers) < min(self.num_procs, len(items)):
        self._workers.append(self._new_worker())
      while not self._broken:
        now = time.monotonic()
        for n, w in enumerate(self._workers):
          if w.item is not None and now > w.deadline:
            logging.warning(
                "math_verify timed out after %.1fs on an answer of %d chars; worker killed and replaced",
                timeout,
                len(items[w.item][1]),
            )
            self._replace(n, "timeout")
          elif not w.ready and now - w.started > _STARTUP_TIMEOUT_SECONDS:
            self._replace(n, "startup_timeout")
        for n, w in enumerate(self._workers):
          if w.ready and w.item is None and pending:
            i = pending.popleft()
            try:
              w.send(i, items[i][0], items[i][1], timeout)
            except OSError:
              self._replace(n, "died")
        if not pending and all(w.item is None for w in self._workers):
          break
        deadlines = [w.deadline for w in self._workers if w.item is not None]
        deadlines += [w.started + _STARTUP_TIMEOUT_SECONDS for w in self._workers if not w.ready]
        wait = min(max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.05, 1.0)
        readable, _, _ = select.select(self._workers, [], [], wait + 0.001)
        for w in readable:
          self._read(w, results)
    return results

  def _read(self, w: _Worker, results: list[bool]) -> None:
    """Record the verdicts `w` has written so far into `results`."""
    try:
      lines = w.read_lines()
    except (EOFError, OSError):
      self._replace(self._workers.index(w), "died")
      return
    for line in lines:
      if line == "ready":
        w.ready = True
        self._failed_starts = 0
      elif line == "broken":
        logging.warning("math_verify is not importable in the worker; non-numeric answers score as wrong")
        self._broken = True
      elif w.item is not None:
        results[w.item] = line == "1"
        self.stats["verified"] += 1
        w.item = None

  def _replace(self, n: int, why: str) -> None:
    """Kill worker n (its current item stays False) and start a fresh one in its place."""
    w = self._workers[n]
    w.kill()
    self.stats[f"killed_{why}"] += 1
    if not w.ready:
      self._failed_starts += 1
      if self._failed_starts >= 3:
        logging.warning("math_verify workers failed to start 3 times; non-numeric answers score as wrong")
        self._broken = True
    self._workers[n] = self._new_worker()

  def close(self) -> None:
    for w in self._workers:
      w.kill()
    self._workers = []


_POOL: Optional[MathVerifyPool] = None
_POOL_LOCK = threading.Lock()


def get_pool(num_procs: Optional[int] = None) -> MathVerifyPool:
  """The process-wide pool (created on first use; resized if `num_procs` changes)."""
  global _POOL
  with _POOL_LOCK:
    want = max(1, num_procs or min(2, os.cpu_count() or 1))
    if _POOL is None or _POOL.num_procs != want:
      if _POOL is not None:
        _POOL.close()
      _POOL = MathVerifyPool(want)
    return _POOL


def pool_stats() -> collections.Counter:
  """The process-wide pool's counters (workers_started, verified, killed_*); empty before it first starts."""
  return collections.Counter(_POOL.stats) if _POOL is not None else collections.Counter()


@atexit.register
def _close_pool() -> None:
  if _POOL is not None:
    _POOL.close()


def _forget_pool_in_child() -> None:
  """A forked child must not talk to (or kill) the parent's workers; it starts its own on demand."""
  global _POOL
  _POOL = None


os.register_at_fork(after_in_child=_forget_pool_in_child)


_VERDICTS: "collections.OrderedDict[tuple[str, str], bool]" = collections.OrderedDict()
_VERDICTS_LOCK = threading.Lock()  # rewards may be graded in the rollout producer's thread and the trainer's at once


def _remember(key: tuple[str, str], value: bool) -> None:
  with _VERDICTS_LOCK:
    _VERDICTS[key] = value
    if len(_VERDICTS) > _CACHE_SIZE:
      _VERDICTS.popitem(last=False)


def verify_batch(
    pairs: Sequence[tuple[Optional[str], Optional[str]]],
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    num_procs: Optional[int] = None,
) -> list[bool]:
  """is_correct for many (pred, gold) pairs: fast path inline, the rest in parallel in the pool."""
  out: list[bool] = [False] * len(pairs)
  slow: dict[tuple[str, str], list[int]] = {}
  for i, (pred, gold) in enumerate(pairs):
    v = fast_verdict(pred, gold)
    if v is None:
      key = (pred, gold)
      cached = _VERDICTS.get(key)
      if cached is None:
        slow.setdefault(key, []).append(i)
        continue
      v = cached
    out[i] = v
  if slow:
    keys = list(slow)
    verdicts = get_pool(num_procs).verify_many([(g, p) for p, g in keys], timeout)
    for key, v in zip(keys, verdicts):
      _remember(key, v)
      for i in slow[key]:
        out[i] = v
  return out


def is_correct(pred: Optional[str], gold: Optional[str], timeout: float = DEFAULT_TIMEOUT_SECONDS) -> bool:
  """Whether an extracted answer equals the gold answer (numbers exactly, expressions via math_verify)."""
  return verify_batch([(pred, gold)], timeout)[0]
