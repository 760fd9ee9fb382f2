"""User-facing errors: one line, no traceback.

Anything the user can fix by changing a command line, a yml, a data file or a path raises a
subclass of `UserError`. Entry points catch it and print `error: <message>` and exit 2, so a
configuration mistake never surfaces as a traceback from deep inside JAX or pydantic.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys


class UserError(Exception):
  """A mistake the user can fix; the message is one line naming the key/file/row."""

  exit_code = 2

  def __str__(self) -> str:
    # Keep it to one line whatever the caller passed.
    return " ".join(str(self.args[0] if self.args else "").split())


class ConfigError(UserError):
  """Unknown key, wrong type, invalid value or missing yml."""


class DataError(UserError):
  """A data file is missing, unreadable or has no usable rows."""


class CheckpointError(UserError):
  """A checkpoint path is missing or not a checkpoint."""


class MissingExtraError(UserError):
  """An optional dependency (an `extras_require` group) is not installed."""

  def __init__(self, feature: str, module: str, extra: str):
    super().__init__(
        f"{feature} needs the '{module}' package, which is not installed; "
        f"install it with: pip install 'maxtext-rl-plugin[{extra}]'"
    )


# Set to 1 to see what `quiet_third_party_logs` keeps off an entry point's output.
VERBOSE_ENV = "MAXTEXT_RL_VERBOSE"
# Library log lines a user can do nothing about, by their text (after any `[process=..][thread=..] ` prefix): Orbax's
# OCDBT merge notice, logged at every save of a single-process run (it has no per-process subdirectories to merge);
# Tunix's "Skipping non-TPU device: cpu. You might be missing jax[tpu] dependency." (sft/utils: its HBM-usage metric
# on a CPU run, where there is no HBM and no jax[tpu] to install).
_UNACTIONABLE = ("Skipping merge of OCDBT checkpoints", "Skipping non-TPU device: cpu")


class _DropUnactionable(logging.Filter):
  """Drops the absl records of `_UNACTIONABLE`."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(text in message[:200] for text in _UNACTIONABLE)


def verbose() -> bool:
  return os.environ.get(VERBOSE_ENV, "").strip() not in ("", "0", "false")


def quiet_third_party_logs() -> None:
  """Keep libraries' chatter off an entry point's output (set before they are imported): transformers warns about
  PyTorch being absent and about MaxText's model configs, lines before a run's first line, or before a refusal's one
  line, that say nothing about the run; Orbax notes at every save that it has no per-process OCDBT files to merge.
  Errors still show. `MAXTEXT_RL_VERBOSE=1` keeps every line."""
  if verbose():
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ.setdefault("GRAIN_LOG_LEVEL", "error")
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
  absl_logger = logging.getLogger("absl")  # Orbax logs through absl, absl through this logger
  if not any(isinstance(f, _DropUnactionable) for f in absl_logger.filters):
    absl_logger.addFilter(_DropUnactionable())


def describe_not_a_file(path: str) -> str:
  """Why `path`, given as a data file, is not one: a directory, a FIFO/socket/device, or nothing at all."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return "file not found"
  if stat.S_ISDIR(mode):
    return "is a directory, not a data file"
  if stat.S_ISFIFO(mode):
    return "is a FIFO (named pipe), not a regular file; give a data file"
  return "is not a regular file (a socket or a device); give a data file"


@contextlib.contextmanager
def exit_on_user_error():
  """Turn a `UserError` raised inside the block into `error: ...` on stderr and exit 2."""
  try:
    yield
  except UserError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
