"""What several benchmarks share: forcing host devices, and one timing loop (medians, optional peak memory)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable

from absl import logging


def force_host_devices(n: int) -> None:
  """Ask XLA for `n` host devices (CPU runs of the trainer/sampler split), unless JAX is already imported or the
  caller's XLA_FLAGS already choose a count: XLA reads the flag once, when the backend starts."""
  if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()


def status_kb(field: str) -> int:
  """A `/proc/self/status` field in KiB (VmRSS, VmHWM); 0 where there is none (not Linux)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return 0


def _reset_peak() -> bool:
  """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
    return True
  except OSError:
    return False


@dataclasses.dataclass
class Timing:
  """Median wall seconds of the timed calls, the largest extra peak RSS one of them caused (MiB; None where it
  cannot be measured or was not asked for), and the last call's result."""

  seconds: float
  extra_mb: float | None
  result: Any


def timed(fn: Callable[[], Any], repeats: int, *, setup: Callable[[], None] | None = None, peak: bool = False) -> Timing:
  """Call `fn` `repeats` times (after an untimed `setup()` each, when given) and time each call."""
  times, extras, result = [], [], None
  for _ in range(repeats):
    if setup is not None:
      setup()
    can_peak = peak and _reset_peak()
    rss0 = status_kb("VmRSS")
    t0 = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - t0)
    if can_peak:
      extras.append((status_kb("VmHWM") - rss0) / 1024)
  return Timing(statistics.median(times), max(extras) if extras else None, result)


def start_split_bench(devices: int) -> int | None:
  """The first step of a trainer/sampler-split benchmark: `devices` forced host devices (before JAX starts), quiet
  logs; the device count, or None after an `error:` line when it cannot be split in two halves."""
  force_host_devices(devices)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import jax  # pylint: disable=import-outside-toplevel  # only now: XLA_FLAGS are read when the backend starts

  logging.set_verbosity(logging.WARNING)
  n_dev = jax.device_count()
  if n_dev < 2 or n_dev % 2:
    print(f"error: needs an even number >= 2 of devices, found {n_dev}", file=sys.stderr)
    return None
  return n_dev
