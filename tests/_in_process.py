"""`train_rl` in the pytest worker's own process, for the end-to-end tests whose promise is not about a process.

A `python -m maxtext_rl_plugin.train_rl` subprocess pays a fixed start-up every time: the stack's imports (JAX,
MaxText's schema and layers, Tunix, transformers) and JAX's backend, ~6-7 CPU-s of a warm tiny run's ~16 (measured:
docs/DEVELOPMENT.md, "Test-suite time"). Here `train_rl.main(argv)` runs in the worker, which imported the stack
once, and the result is a `subprocess.CompletedProcess` like the subprocess's, so a test reads it the same way.

What stays process-wide is saved and restored around each run: the working directory, SIGINT/SIGTERM/SIGHUP
handlers, JAX's config, the Python and absl loggers, stdout/stderr (captured into the result). What cannot be
restored is refused rather than approximated: an environment that only a new process honours (`XLA_FLAGS` device
counts, `JAX_PLATFORMS`, the tests' signal hooks read at import) raises, and the tests about a process itself
(SIGTERM/SIGKILL, the run lock held by another process, absl flags, multi-process and Ray) start a real one.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import pathlib
import signal
import subprocess
from typing import Iterator, Mapping, Sequence

from absl import logging as absl_logging
import jax

REPO = pathlib.Path(__file__).resolve().parents[1]

# Read once at process start (XLA, JAX's backend) or by hooks imported once: a run that needs a different value needs
# a process of its own.
_PROCESS_ONLY_ENV = (
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "LIBTPU_INIT_ARGS",
    "DS_TEST_SIGTERM_AFTER_FILE",
    "DS_TEST_SIGTERM_ON_CALL",
)
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _jax_config() -> dict:
  """JAX's config values by name (JAX has no public snapshot of its config)."""
  holders = jax.config._value_holders  # pylint: disable=protected-access # see the docstring
  return {name: holder.value for name, holder in holders.items()}


@contextlib.contextmanager
def _isolated(cwd: pathlib.Path, env: Mapping[str, str]) -> Iterator[tuple[io.StringIO, io.StringIO]]:
  """The process-wide state a run may change, restored after it; yields the run's (stdout, stderr)."""
  for name in _PROCESS_ONLY_ENV:
    if env.get(name, os.environ.get(name)) != os.environ.get(name):
      raise ValueError(f"{name} is read at process start: run this train_rl as a subprocess")
  saved_env, saved_cwd = dict(os.environ), os.getcwd()
  saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
  saved_jax = _jax_config()
  root = logging.getLogger()
  saved_root = (root.level, list(root.handlers))
  saved_absl = absl_logging.get_verbosity()
  absl_handler = absl_logging.get_absl_handler().python_handler
  saved_stream = absl_handler.stream
  out, err = io.StringIO(), io.StringIO()
  os.environ.update(env)
  os.chdir(cwd)
  absl_handler.setStream(err)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      yield out, err
  finally:
    absl_handler.setStream(saved_stream)
    absl_logging.set_verbosity(saved_absl)
    root.setLevel(saved_root[0])
    root.handlers[:] = saved_root[1]
    now = _jax_config()
    for name, value in saved_jax.items():
      if now.get(name) != value:
        jax.config.update(name, value)
    for s, handler in saved_signals.items():
      signal.signal(s, handler)
    os.chdir(saved_cwd)
    os.environ.clear()
    os.environ.update(saved_env)


def run(module: str, argv: Sequence[str], *, cwd: pathlib.Path = REPO, env: Mapping[str, str] | None = None):
  """`python -m maxtext_rl_plugin.<module> ARGV` in this process: a CompletedProcess with its exit code and output."""
  argv = [str(a) for a in argv]
  main = importlib.import_module(f"maxtext_rl_plugin.{module}").main
  with _isolated(pathlib.Path(cwd), dict(env or {})) as (out, err):
    try:
      code = main(argv)
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  return subprocess.CompletedProcess([module, *argv], code, out.getvalue(), err.getvalue())


def train_rl(argv: Sequence[str], **kwargs):
  """`python -m maxtext_rl_plugin.train_rl ARGV` in this process (see `run`)."""
  return run("train_rl", argv, **kwargs)
