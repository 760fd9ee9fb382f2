"""Clean stops on SIGINT (Ctrl-C) and SIGTERM (what a preempted TPU VM or a Kubernetes pod receives).

Inside the step loop a signal only sets a flag: the current step finishes (its checkpoint write is never cut in
half), the loop writes a checkpoint if the step has none, prints one line saying where the run resumes, and the
process exits 128 + signal number (130 for SIGINT, 143 for SIGTERM). A second signal abandons the step at once: the
last complete checkpoint stands (Orbax writes each step to a temporary directory and renames it when complete).
The SFT warm start (sft.py) stops the same way at its own step boundaries (`stop_at_step_boundaries`): it saves its
steps and a rerun continues it. Elsewhere outside the loop (config, model build, compilation) a signal stops the
process right away with the same exit codes and one line, never a traceback, which says what is kept (`note_kept`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

from maxtext_rl_plugin.errors import UserError


class Stopped(UserError):
  """The run was stopped by a signal; `exit_code` is 128 + the signal number."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.exit_code = 128 + int(signum)


_STOP_REQUESTED = threading.Event()  # set by the first in-loop signal: long sampling (refill rounds) ends early
_STOP_SIGNAL: list[int] = []  # that signal's number
_AT_STEP_BOUNDARIES = threading.Event()  # set while work outside the RL loop stops between its steps (SFT warm start)
_KEPT: list[str] = []  # what a stop before training keeps (note_kept), instead of "nothing was written"


def requested_signal() -> int | None:
  """The number of the signal whose stop was requested (None: none)."""
  return _STOP_SIGNAL[0] if _STOP_SIGNAL else None


@contextlib.contextmanager
def stop_at_step_boundaries():
  """Inside, a first SIGTERM/SIGINT only requests a stop, as in the RL loop: the caller checks `stop_requested()`
  after each of its steps, saves what it did and raises `Stopped` (the SFT warm start: its steps were lost when the
  signal cut it at once)."""
  _AT_STEP_BOUNDARIES.set()
  try:
    yield
  finally:
    _AT_STEP_BOUNDARIES.clear()


def note_kept(what: str) -> None:
  """Say `what` (e.g. the finished SFT warm start's checkpoint) in the line of a stop before training starts."""
  _KEPT.append(what)


def stop_requested() -> bool:
  """Whether a stop was requested inside the step loop: work that can end early without losing anything (the refill
  rounds of rl.dynamic_sampling) checks it, so a stop is honoured within a round, not after 10**6 of them."""
  return _STOP_REQUESTED.is_set()


class StopSampling(Exception):
  """Raised by sampling that a stop request ends early (rl.dynamic_sampling's refill rounds): the batch is abandoned,
  the last complete step is checkpointed and the run stops; a resume samples the batch again, as an uninterrupted run
  would have."""


class GracefulStop:
  """Context manager installing the handlers; `requested` is the pending signal number (or None)."""

  def __init__(self):
    self.requested: int | None = None
    self.in_loop = False
    self._previous: dict[int, Any] = {}

  def _handle(self, signum, frame):
    """First SIGTERM/SIGINT inside the step loop: stop after the step; otherwise, or a second one: stop now."""
    del frame
    name = signal.Signals(signum).name
    at_boundary = self.in_loop or _AT_STEP_BOUNDARIES.is_set()
    if at_boundary and self.requested is None:
      self.requested = signum
      _STOP_SIGNAL[:] = [signum]
      _STOP_REQUESTED.set()
      print(
          f"{name} received: finishing the current step, then checkpointing and stopping "
          f"(send it again to stop at once)",
          flush=True,
      )
      return
    raise Stopped(
        f"stopped by {name}"
        + (
            " during the step; the last complete checkpoint stands"
            if at_boundary
            else f" before training started; {'; '.join(_KEPT) or 'nothing was written'}"
        ),
        signum,
    )

  def __enter__(self) -> "GracefulStop":
    _STOP_REQUESTED.clear()
    _STOP_SIGNAL.clear()
    _KEPT.clear()
    if threading.current_thread() is threading.main_thread():
      for s in (signal.SIGINT, signal.SIGTERM):
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    _STOP_REQUESTED.clear()
    _STOP_SIGNAL.clear()
    for s, h in self._previous.items():
      signal.signal(s, h)
    self._previous.clear()
