"""Run observability: TensorBoard scalars, MaxText's `metrics_file` JSONL and a console progress line.

One writer for every number a run produces, so TensorBoard, the JSONL file and the console agree.
Tunix's own trainer metrics (loss, grad norm, KL, clip fraction) reach us through a Tunix
`MetricsLogger` custom backend (`TunixTee`), not by reaching into Tunix internals.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping
import weakref

import jax
import numpy as np
from tensorboardX import SummaryWriter

from maxtext_rl_plugin import run_dir
from maxtext_rl_plugin import storage


def _scalar(value: Any) -> float | None:
  """The mean of a logged value; a non-finite one is kept (a NaN loss is what run/step.check_update must see: dropping
  it made `loss` and `grad_norm` vanish from the records of a run whose weights had gone bad)."""
  try:
    return float(np.asarray(value).mean())
  except (TypeError, ValueError):
    return None


def format_duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class TunixTee:
  """A Tunix/metrax `LoggingBackend` that keeps the latest value of every Tunix scalar.

  Tunix logs through `jax.monitoring` events named `<prefix>/<mode>/<name>` (e.g. `actor/train/loss`).
  The trainer drains them after each step with `drain()`.
  """

  def __init__(self, prefixes=("actor/", "rollout/", "global/", "rewards/", "completions/")):
    self._prefixes = prefixes
    self._latest: dict[str, list[float]] = {}

  def log_scalar(self, event: str, value, **kwargs):  # metrax LoggingBackend protocol
    del kwargs
    if not event.startswith(self._prefixes):
      return
    v = _scalar(value)
    if v is not None:
      self._latest.setdefault(event, []).append(v)

  def latest(self) -> dict[str, float]:
    """The values logged since the last drain (their mean), without draining them."""
    return {k: float(np.mean(v)) for k, v in self._latest.items()}

  def drain(self) -> dict[str, float]:
    out = {k: float(np.mean(v)) for k, v in self._latest.items()}
    self._latest.clear()
    return out

  def close(self):
    pass


def is_empty_extreme(key: str, value: float) -> bool:
  """`value` is the min (+inf) or max (-inf) of an empty set (`train/ratio_min` of a step whose loss saw no token):
  not a measurement, left out of the record (`RunLogger._empty_extreme`), never a non-finite metric to warn about."""
  return (key.endswith("_min") and value == math.inf) or (key.endswith("_max") and value == -math.inf)


def is_writer() -> bool:
  """Whether this process writes logs, metrics, summaries and the console line: process 0 of a multi-process JAX
  program (every process computes the same metrics), always true for one process."""
  return jax.process_index() == 0


class RunLogger:
  """Writes per-step and eval metrics to TensorBoard, `metrics_file` and the console (process 0 only)."""

  def __init__(
      self, tensorboard_dir: str, metrics_file: str | None, total_steps: int, start_step: int = 0, log_period: int = 1
  ):
    self.writer = is_writer()
    self.tensorboard_dir = tensorboard_dir
    self._tb = None
    self._metrics_file = metrics_file if self.writer else None
    if self.writer:
      storage.makedirs(tensorboard_dir)  # tensorboardX writes gs:// itself (google-cloud-storage)
      # Steps after `start_step` were trained by an attempt that died and are trained again: tensorboardX's purge_step
      # marks this file so TensorBoard drops the earlier events from `start_step + 1` on (from 0 on a fresh start,
      # like the metrics file's prune) and shows every step once.
      self._tb = SummaryWriter(logdir=tensorboard_dir, flush_secs=10, purge_step=start_step + 1 if start_step else 0)
      _OPEN.add(self)
    if self._metrics_file:
      storage.makedirs(os.path.dirname(storage.absolute(metrics_file)))
    self.total_steps = total_steps
    self._start_step = start_step
    self._t0 = time.time()
    self._log_period = max(1, int(log_period))  # MaxText's log_period: console line and TensorBoard flush cadence
    self.history: list[dict[str, Any]] = []
    self._said_empty: set[str] = set()

  def _write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Write one record (scalars only) to TensorBoard and metrics_file; returns it."""
    record: dict[str, Any] = {"step": int(step)}
    for k, v in metrics.items():
      s = _scalar(v)
      if s is None or self._empty_extreme(k, s, step):
        continue
      record[k] = s
      if self._tb is not None:
        self._tb.add_scalar(k, s, int(step))
    if self._metrics_file:
      try:
        storage.append_text(self._metrics_file, json.dumps(record) + "\n")  # a failure leaves at most a torn line
      except OSError as e:  # storage.StorageError in a bucket
        raise run_dir.OutputError(f"metrics_file: {storage.describe_error(e, self._metrics_file)}") from None
    self.history.append(record)
    return record

  def _empty_extreme(self, key: str, value: float, step: int) -> bool:
    """Whether `value` is the min (+inf) or max (-inf) of an empty set (`train/ratio_min` of a step whose loss saw no
    token, e.g. dynamic sampling with no informative group): not a measurement, and not a number JSON has. The key is
    left out of that record, and the first time it happens the run says so once."""
    empty = is_empty_extreme(key, value)
    if empty and key not in self._said_empty:
      self._said_empty.add(key)
      if self.writer:
        print(
            f"note: {key} left out of step {step}'s metrics: its min/max is over no element (no token reached the "
            "loss); every such step leaves it out, said once",
            flush=True,
        )
    return empty

  def log_step(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Log one RL step (counted from 1) and print the progress line."""
    rec = self._write(step, metrics)
    done = step - self._start_step
    elapsed = time.time() - self._t0
    eta = elapsed / done * (self.total_steps - step) if done > 0 else float("nan")
    if not self.writer or (step % self._log_period and step != self.total_steps):
      return rec
    self._tb.flush()
    parts = [f"step {step}/{self.total_steps}"]
    if "reward/mean" in rec:
      parts.append(f"reward {rec['reward/mean']:.3f}±{rec.get('reward/std', 0.0):.2f}")
    if "accuracy" in rec:
      parts.append(f"acc {100 * rec['accuracy']:.1f}%")
    if "kl" in rec:
      parts.append(f"kl {rec['kl']:.4f}")
    if "perf/tokens_per_s" in rec:
      parts.append(f"{rec['perf/tokens_per_s']:.0f} tok/s")
    if "perf/step_s" in rec:
      parts.append(f"{rec['perf/step_s']:.1f}s/step")
    parts.append(f"ETA {format_duration(eta) if math.isfinite(eta) else '?'}")
    print(" | ".join(parts), flush=True)
    return rec

  def log_eval(self, step: int, metrics: Mapping[str, Any], label: str = "eval") -> dict[str, Any]:
    rec = self._write(step, {f"eval/{k}" if not k.startswith("eval/") else k: v for k, v in metrics.items()})
    shown = ", ".join(
        f"{k.split('/', 1)[1]} {100 * v:.1f}%" if "accuracy" in k else f"{k.split('/', 1)[1]} {v:.3f}"
        for k, v in rec.items()
        if k != "step"
    )
    if self.writer:
      print(f"[{label} @ step {step}] {shown}", flush=True)
    return rec

  def note(self, message: str) -> None:
    if self.writer:
      print(message, file=sys.stdout, flush=True)

  def close(self) -> None:
    _OPEN.discard(self)
    if self._tb is not None:
      self._tb.flush()
      self._tb.close()
      self._tb = None


# RunLoggers not closed yet. A run that ends in an error leaves its SummaryWriter open, and tensorboardX's atexit
# handler closing it at interpreter shutdown starts its queue's feeder thread, which Python refuses then: a second
# traceback after the `error:` line. Entry points call `close_all` while threads can still start.
_OPEN: "weakref.WeakSet[RunLogger]" = weakref.WeakSet()


def close_all() -> None:
  """Close every RunLogger still open (an error path), so nothing is left to tensorboardX's exit handler."""
  for logger in list(_OPEN):
    try:
      logger.close()
    except Exception as e:  # pylint: disable=broad-exception-caught  # a failing flush must not hide the real error
      print(f"warning: could not close the TensorBoard writer: {e}", file=sys.stderr, flush=True)
