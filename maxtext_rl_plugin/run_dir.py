"""A run directory that nothing loses: writability checked up front, one live process per run, resume-safe records.

* `check_writable`: every output path (run directory, metrics_file) is created and probed before any model is built,
  so `base_output_directory=/proc/x` or `metrics_file=/dev/full` is one `error:` line after a second, not a traceback
  after the model build.
* `RunLock`: `<run_dir>/.lock` is created with O_EXCL (atomic on local disks and on NFS v3+/GCS FUSE), holds the
  holder's host, pid, launch id and a heartbeat a background thread refreshes. A second process gets one line naming
  the holder; a lock whose holder is dead (same host, pid gone), silent for `stale_after_s` (60 s), or a previous
  attempt of the same launch (a restart on another host) is taken over, so a crashed pod never blocks its own restart.
* `prune_jsonl`: on resume, records of steps after the restored checkpoint (trained, then lost with the process) and
  a torn last line (a full disk, a kill mid-write) are dropped, so every step appears exactly once and the next
  record never lands on a half line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import threading
import time
from typing import Any

from absl import logging

from maxtext_rl_plugin.errors import UserError


class OutputError(UserError):
  """An output path cannot be written."""


class RunLockedError(UserError):
  """Another live process holds the run directory."""


def _free_space(path: str) -> str:
  probe = path
  while probe and not os.path.exists(probe):
    probe = os.path.dirname(probe)
  try:
    return f"{shutil.disk_usage(probe or '/').free / 2**20:.0f} MiB free"
  except OSError:
    return "free space unknown"


def describe_os_error(e: OSError, path: str) -> str:
  """One line for an OSError on `path`: no space left (with the free space), permissions, or the error itself."""
  if e.errno == errno.ENOSPC:
    return f"no space left on the device writing {path} ({_free_space(path)})"
  return f"cannot write {path}: {e.strerror or e}"


def _write_synced(path: str, mode: str, text: str) -> None:
  """Write `text` and fsync, so a full or read-only device fails here (OSError), not in a later buffered write."""
  with open(path, mode, encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def probe_dir(path: str, key: str) -> None:
  """Create `path` and write, fsync and remove a probe file in it (one `OutputError` line when any step fails)."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise OutputError(f"invalid value for '{key}': cannot create directory {path} ({e.strerror or e})") from None
  if not os.path.isdir(path):
    raise OutputError(f"invalid value for '{key}': {path} exists and is not a directory")
  probe = os.path.join(path, f".write_probe.{os.getpid()}")
  try:
    _write_synced(probe, "w", "ok\n")
  except OSError as e:
    raise OutputError(f"invalid value for '{key}': {describe_os_error(e, path)}") from None
  finally:
    try:
      os.remove(probe)
    except OSError:
      pass


def check_writable(run_dir: str, metrics_file: str | None) -> None:
  """Probe the run directory and the metrics file before anything heavy starts (one `error:` line on failure)."""
  if "://" not in run_dir:  # gs:// and other remote paths are checked by their own clients when first written
    probe_dir(run_dir, "base_output_directory")
  if metrics_file and "://" not in metrics_file:
    parent = os.path.dirname(os.path.abspath(metrics_file)) or "."
    probe_dir(parent, "metrics_file")
    if os.path.isdir(metrics_file):
      raise OutputError(f"invalid value for 'metrics_file': {metrics_file} is a directory")
    try:
      _write_synced(metrics_file, "a", "")  # appending nothing: opens and syncs without touching existing records
    except OSError as e:
      raise OutputError(f"invalid value for 'metrics_file': {describe_os_error(e, metrics_file)}") from None


def resolve_metrics_file(metrics_file: str | None, run_dir: str) -> str | None:
  """A relative `metrics_file` lives in the run directory (so two runs of one config never share a file); an
  absolute path is the user's choice."""
  if not metrics_file:
    return None
  if os.path.isabs(metrics_file) or "://" in metrics_file:
    return metrics_file
  return os.path.join(run_dir, metrics_file)


# Files every run writes in its own directory (run/summary.py, run/step.py, RunLock): no key may name one of them, in this
# run's directory or another's.
RUN_FILES = ("summary.json", "summary.png", "batches.jsonl", ".lock")


def _real(path: str) -> str:
  return os.path.realpath(os.path.expanduser(path))


def _within(path: str, directory: str) -> bool:
  path, directory = _real(path), _real(directory)
  return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_owners(metrics_file: str | None, run_dir: str, run_dirs: dict[str, str], inputs: dict[str, str]) -> None:
  """Every output path of a run has one owner: `metrics_file` is none of the files a run writes itself (`RUN_FILES`,
  here or in another run's directory), not inside a directory another writer manages (`run_dirs`: key -> directory,
  such as checkpoint_dir and tensorboard_dir), and not one of the run's inputs (`inputs`: key -> local path, such as
  train_data_path): a resume prunes it and every step appends to it. Checked for fresh runs and resumes alike."""
  if not metrics_file or "://" in metrics_file:
    return
  name = os.path.basename(os.path.normpath(metrics_file))
  if name in RUN_FILES:
    raise OutputError(
        f"invalid value for 'metrics_file': {metrics_file} is the name of a file every run writes itself ({name}); "
        "name another file (the default lives in the run directory as metrics.jsonl)"
    )
  for key, directory in run_dirs.items():
    if directory and "://" not in directory and _within(metrics_file, directory):
      raise OutputError(
          f"invalid value for 'metrics_file': {metrics_file} lies inside {key}={directory}, which another "
          "writer of the run manages; name a file outside it"
      )
  other = _other_run_dir(metrics_file, run_dir)
  if other:
    raise OutputError(
        f"invalid value for 'metrics_file': {metrics_file} lies in {other}, another run's directory; that run "
        "prunes its records on resume and takes them for its own on a fresh start: name a file in this run's "
        f"directory ({run_dir}) or outside any run's"
    )
  for key, path in inputs.items():
    if path and "://" not in path and os.path.exists(path) and _real(path) == _real(metrics_file):
      raise OutputError(
          f"invalid value for 'metrics_file': {metrics_file} is the run's input {key}; a run appends its "
          "records to metrics_file (and prunes it on resume): name another file"
      )


# Files that mark a directory as a run's (run/step.py writes the first at its first step, run/summary.py the second).
_RUN_MARKS = ("batches.jsonl", "summary.json")


def _other_run_dir(metrics_file: str, run_dir: str) -> str | None:
  """The directory of another run that `metrics_file` lies in, or None: a sibling of this run under the same
  base_output_directory (`<base>/<other run>/...`, whether that run exists yet or not), or any directory above the
  file that holds a run's files."""
  if _within(metrics_file, run_dir):
    return None
  base = os.path.dirname(_real(run_dir))
  if _within(metrics_file, base):
    first = os.path.relpath(_real(metrics_file), base).split(os.sep)[0]
    if first != os.path.basename(_real(metrics_file)):
      return os.path.join(base, first)
  directory = os.path.dirname(_real(metrics_file))
  while True:
    if any(os.path.exists(os.path.join(directory, mark)) for mark in _RUN_MARKS):
      return directory
    parent = os.path.dirname(directory)
    if parent == directory:
      return None
    directory = parent


def _record_count(path: str) -> int:
  """Non-empty lines of a JSONL file: the records a metrics_file holds."""
  with open(path, "rb") as f:
    return sum(1 for line in f if line.strip())


def check_resumed_metrics_file(metrics_file: str | None, run_dir: str, recorded: str | None, step: int) -> None:
  """A resume never adopts another run's records: a `metrics_file` outside the run directory that holds records and
  is not the file the checkpoint's steps wrote to (`recorded`, from the checkpoint's metadata; None for checkpoints
  written before it was recorded: not compared) is refused, as a fresh run refuses one."""
  if not metrics_file or "://" in metrics_file or recorded is None or not os.path.isfile(metrics_file):
    return
  if _real(metrics_file) == _real(recorded) or _within(metrics_file, run_dir):
    return
  n = _record_count(metrics_file)
  if n:
    raise OutputError(
        f"invalid value for 'metrics_file': {metrics_file} holds {n} record(s) of another run; this run ({run_dir}) "
        f"resumes from step {step}, whose records went to {recorded}: resume with that metrics_file or name a new file"
    )


def check_fresh_metrics_file(metrics_file: str | None, run_dir: str) -> None:
  """A run starting from scratch never appends to (or prunes) another run's metrics: a metrics_file outside the run
  directory that already holds records is refused. One inside the run directory is this run's own (an attempt that
  stopped before its first checkpoint), and its stale records are dropped."""
  if not metrics_file or "://" in metrics_file or not os.path.isfile(metrics_file):
    return
  if _within(metrics_file, run_dir):
    return
  n = _record_count(metrics_file)
  if n:
    raise OutputError(
        f"invalid value for 'metrics_file': {metrics_file} already holds {n} record(s) of another run "
        f"and this run ({run_dir}) starts from scratch; name another metrics_file or move that one"
    )


LAUNCH_ID_ENV = "MAXTEXT_RL_LAUNCH_ID"


class RunLock:
  """Exclusive ownership of a run directory (see the module docstring).

  `launch_id` (default: `$MAXTEXT_RL_LAUNCH_ID`, which the launchers set once per launch and a restart of the same
  launch keeps) names the launch the holder belongs to: a lock held by another process of the *same* launch is its
  previous attempt (a Ray worker group restarted on another node, a JobSet pod rescheduled), dead by construction, and
  is taken over at once instead of after `stale_after_s`. `start_heartbeat` refreshes the lock from a daemon thread,
  so `stale_after_s` can be short without a long step (a big rollout, a checkpoint) looking dead.
  """

  def __init__(self, run_dir: str, stale_after_s: float = 60.0, launch_id: str | None = None, host: str | None = None):
    self.path = os.path.join(run_dir, ".lock")
    self.stale_after_s = stale_after_s
    self.launch_id = os.environ.get(LAUNCH_ID_ENV, "") if launch_id is None else launch_id
    self.host = host or socket.gethostname()  # `host` is for tests that play a process on another host
    self.held = False
    self._last_beat = 0.0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _info(self) -> dict[str, Any]:
    return {"host": self.host, "pid": os.getpid(), "launch_id": self.launch_id, "heartbeat": time.time()}

  def _read(self) -> dict[str, Any] | None:
    try:
      with open(self.path, encoding="utf-8") as f:
        return json.loads(f.read() or "{}")
    except (OSError, ValueError):
      return None

  def _is_mine(self, info: dict[str, Any] | None) -> bool:
    return bool(info) and info.get("pid") == os.getpid() and info.get("host") == self.host

  def _is_previous_attempt(self, info: dict[str, Any]) -> bool:
    return bool(self.launch_id) and info.get("launch_id") == self.launch_id and not self._is_mine(info)

  def _is_stale(self, info: dict[str, Any] | None) -> bool:
    """Whether the lock `info` may be taken over: unreadable, a previous attempt of this launch, a dead pid on this
    host, or a heartbeat older than stale_after_s."""
    if not info:
      return True  # unreadable or empty: a holder that died between create and write
    if self._is_previous_attempt(info):
      return True
    if info.get("host") == self.host and info.get("pid") and info.get("pid") != os.getpid():
      try:
        os.kill(int(info["pid"]), 0)
      except ProcessLookupError:
        return True
      except PermissionError:
        pass
    return time.time() - float(info.get("heartbeat", 0)) > self.stale_after_s

  def acquire(self) -> None:
    """Take the lock, or raise `RunLockedError` naming a live holder (one line)."""
    for _ in range(2):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        info = self._read()
        if not self._is_stale(info):
          age = time.time() - float(info.get("heartbeat", 0))
          raise RunLockedError(
              f"run directory {os.path.dirname(self.path)} is in use by pid {info.get('pid')} on host "
              f"{info.get('host')} (heartbeat {age:.0f} s ago); wait for it to finish or use another run_name "
              f"(a lock silent for {self.stale_after_s:.0f} s is taken over)"
          ) from None
        why = "a previous attempt of this launch" if self._is_previous_attempt(info) else "stale"
        logging.warning("taking over the lock %s (%s; holder %s)", self.path, why, info)
        try:
          os.remove(self.path)
        except FileNotFoundError:
          pass
        continue
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(self._info(), f)
      self.held = True
      self._last_beat = time.time()
      return
    raise RunLockedError(f"could not take the lock {self.path}: another process took it at the same time")

  def heartbeat(self, min_interval_s: float = 10.0) -> bool:
    """Refresh the lock's heartbeat (at most every `min_interval_s`); False once the lock is no longer this
    process's (a later attempt of the launch took it over): then this process stops claiming it."""
    if not self.held:
      return False
    if time.time() - self._last_beat < min_interval_s:
      return True
    if not self._is_mine(self._read()):
      logging.warning("the run lock %s was taken over by %s; no longer refreshing it", self.path, self._read())
      self.held = False
      return False
    tmp = f"{self.path}.{os.getpid()}.tmp"
    try:
      with open(tmp, "w", encoding="utf-8") as f:
        json.dump(self._info(), f)
      os.replace(tmp, self.path)
      self._last_beat = time.time()
    except OSError as e:
      logging.warning("could not refresh the run lock %s: %s", self.path, e)
    return True

  def start_heartbeat(self, interval_s: float | None = None) -> None:
    """Refresh the lock every `interval_s` (default stale_after_s / 6) from a daemon thread until `release`."""
    if not self.held or self._thread is not None:
      return
    interval = self.stale_after_s / 6 if interval_s is None else interval_s

    def beat():
      while not self._stop.wait(interval):
        if not self.heartbeat(min_interval_s=0.0):
          return

    self._thread = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
    self._thread.start()

  def release(self) -> None:
    """Stop the heartbeat and remove the lock if this process still holds it."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self.held:
      try:
        if self._is_mine(self._read()):
          os.remove(self.path)
      except OSError:
        pass
      self.held = False


def prune_jsonl(path: str | None, last_step: int) -> int:
  """Keep the records of `path` with step <= `last_step` (and records without a step); drop a torn last line.

  Rewritten through a temporary file and an atomic rename, so a crash here loses nothing. Returns the number of
  dropped lines.
  """
  if not path or "://" in path or not os.path.isfile(path):
    return 0
  with open(path, "rb") as f:
    raw = f.read()
  lines = raw.split(b"\n")
  tail = lines.pop()  # b"" when the file ends with a newline; else a torn last record
  keep, dropped = [], 1 if tail.strip() else 0
  for line in lines:
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except ValueError:
      dropped += 1
      continue
    if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)) and rec["step"] > last_step:
      dropped += 1
      continue
    keep.append(line)
  if not dropped:
    return 0
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "wb") as f:
    f.write(b"".join(line + b"\n" for line in keep))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  logging.info("resume: dropped %d record(s) after step %d (or torn) from %s", dropped, last_step, path)
  return dropped
