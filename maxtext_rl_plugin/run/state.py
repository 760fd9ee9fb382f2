"""The state of one RL run, below the rooms that fill and read it.

`build.py` fills an `RLRun` once; `step.py` and `resume.py` read it. The per-step instruments (`PhaseTimer`,
`RewardRecorder`) live here too: `build.py` creates them and `step.py` reads them every step, so neither of those two
modules imports the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Iterator

from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.run import updates


class Span:
  """The block of one `PhaseTimer.phase`: seconds it spent waiting on another side, not counted as the phase's."""

  def __init__(self):
    self.waited = 0.0


class PhaseTimer:
  """Accumulates wall seconds per named phase within a step; `with timer.phase("train"): ...` times a block (verl's
  `marked_timer`), so a step reads as its named phases."""

  def __init__(self, seconds: dict[str, float] | None = None):
    """`seconds`: a dict to add into (the async producer's per-step phases), else a new one."""
    self.seconds: dict[str, float] = {} if seconds is None else seconds

  def add(self, phase: str, seconds: float) -> None:
    self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[Span]:
    """Add the block's wall seconds to phase `name`, less what the block reports waiting (`span.waited`)."""
    span = Span()
    t = time.perf_counter()
    try:
      yield span
    finally:
      self.add(name, time.perf_counter() - t - span.waited)

  def wrap(self, phase: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def timed(*args, **kwargs):
      t = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.add(phase, time.perf_counter() - t)

    return timed

  def reset(self) -> dict[str, float]:
    out, self.seconds = self.seconds, {}
    return out


class RewardRecorder:
  """Wraps reward functions so each step's per-function rewards can be logged (time is the caller's phase)."""

  def __init__(self):
    self.values: dict[str, list[float]] = {}

  def wrap(self, fn: Callable) -> Callable:
    name = getattr(fn, "__name__", type(fn).__name__)

    def recorded(prompts, completions, **kwargs):
      out = fn(prompts, completions, **kwargs)
      self.values.setdefault(name, []).extend(float(x) for x in out)
      return out

    recorded.__name__ = name
    return recorded

  def reset(self) -> dict[str, list[float]]:
    out, self.values = self.values, {}
    return out


@dataclasses.dataclass
class RLRun:
  """Everything a step needs; built once by `build_run`."""

  config: Any
  setup: models.RunSetup
  tokenizer: Any
  train_split: Any
  eval_split: Any
  rl_cluster: Any
  learner: Any
  timer: PhaseTimer
  rewards: RewardRecorder
  reward_fns: list
  trainer_logps: Any
  plan: updates.UpdatePlan
  tee: Any
  run_dir: str
  engine_name: str
  weight_sync: Any = None
  metrics_file: str | None = None
  lock: Any = None
  # The data position after the last trained batch (prompts consumed, refills included): rl.dynamic_sampling's resume.
  data_position: int | None = None
