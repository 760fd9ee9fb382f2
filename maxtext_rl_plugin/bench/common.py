"""What several benchmarks share: their command lines (bounded numeric flags, one-line mistakes), their JSON output
(finite numbers only), forcing host devices, and one timing loop (medians, optional peak memory)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

from absl import logging

from maxtext_rl_plugin.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
  """Every benchmark's command line: a mistake is a `ConfigError` (one `error:` line and exit 2 through
  `bench/__main__.py`), never argparse's usage block; a value outside a flag's bound reads as the config loader's
  (`invalid value for '--n'=-5: must be >= 1`)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, exit_on_error=False, **kwargs)

  def error(self, message: str):
    raise ConfigError(f"{self.prog}: {message}")

  def parse_known_args(self, args=None, namespace=None):
    try:
      return super().parse_known_args(args, namespace)
    except argparse.ArgumentError as e:
      if e.message.startswith("="):  # a bound's message (`_number`): the flag and its value, as the config loader says
        raise ConfigError(f"invalid value for '{e.argument_name}'{e.message}") from None
      raise ConfigError(f"{self.prog}: {e}") from None


def _number(kind: type, low: float, strict: bool) -> Callable[[str], Any]:
  """An argparse `type`: `kind` (int or float), finite, >= low (> low when strict)."""
  expected = f"must be {'>' if strict else '>='} {low}"

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"={text!r}: expected {'an integer' if kind is int else 'a number'}") from None
    if not (math.isfinite(value) and (value > low if strict else value >= low)):
      raise argparse.ArgumentTypeError(f"={value}: {expected}")
    return value

  parse.__name__ = f"{kind.__name__} {expected}"
  parse.bound = (kind, low, strict)  # tests/bench/test_bench.py: every numeric flag has one
  return parse


def _numbers(kind: type, low: float, strict: bool) -> Callable[[str], list]:
  """An argparse `type` for a comma-separated list (`--batch-sizes 1,8,32`): one or more `_number`s."""
  one = _number(kind, low, strict)

  def parse(text: str) -> list:
    try:
      values = [one(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
      raise argparse.ArgumentTypeError(f"={text!r}: expected comma-separated numbers, each {one.__name__}") from e
    if not values:
      raise argparse.ArgumentTypeError(f"={text!r}: expected comma-separated numbers, each {one.__name__}")
    return values

  parse.__name__ = f"list of {one.__name__}"
  parse.bound = one.bound
  return parse


# The bounds of every numeric flag of every benchmark (counts, sizes, repeats and seeds are never negative; a count of
# timed runs is never 0: the best or median of no run is Infinity or an error).
positive_int = _number(int, 1, False)
non_negative_int = _number(int, 0, False)
positive_float = _number(float, 0, True)
positive_ints = _numbers(int, 1, False)
positive_floats = _numbers(float, 0, True)


def finite_json(obj: Any, **kwargs) -> str:
  """`json.dumps` of a benchmark's result with every non-finite float written as null and named in one `warning:`
  line: JSON has no NaN or Infinity (Python writes them, most parsers refuse them), and a result line is read by
  other programs."""
  bad: list[str] = []

  def clean(x: Any, path: str) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
      bad.append(path or "<result>")
      return None
    if isinstance(x, dict):
      return {k: clean(v, f"{path}.{k}" if path else str(k)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v, f"{path}[{i}]") for i, v in enumerate(x)]
    return x

  text = json.dumps(clean(obj, ""), allow_nan=False, **kwargs)
  if bad:
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    print(f"warning: not a finite number, written as null: {', '.join(bad[:8])}{more}", file=sys.stderr, flush=True)
  return text


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
