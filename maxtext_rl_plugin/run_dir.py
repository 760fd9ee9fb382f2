"""A run directory that nothing loses, on local disk or in a bucket: writability checked up front, one live process
per run, each output owned by one run, resume-safe records. Every read and write goes through `storage`.

* `check_writable`: the base directory and metrics_file's directory are probed before any model is built, so
  `base_output_directory=/proc/x`, `metrics_file=/dev/full` or a bucket without credentials is one `error:` line after
  a second, not a traceback after the model build. The run directory itself is created only when the run takes its
  lock, so a run refused before that leaves nothing behind.
* `RunLock`: `<run_dir>/.lock` is created exclusively (O_EXCL locally, a GCS `ifGenerationMatch=0` upload in a bucket)
  and holds the holder's host, pid, launch id and a heartbeat a background thread refreshes. A second process gets one
  line naming the holder; a lock whose holder is dead (same host, pid gone), silent for `stale_after_s` (60 s), or a
  previous attempt of the same launch (a restart on another host) is taken over by a conditional replace, so a
  crashed pod never blocks its own restart and two restarts never both take it.
* Owner marks (`claim`, `check_owner`): the run directory (`<run_dir>/.owner`) and a metrics_file outside it
  (`<file>.owner`) name the run that first wrote them. Another run is refused in one line; a rerun of the same run
  (a crash before its first checkpoint) owns them and starts clean; no output lies inside another run's directory
  (`check_not_in_other_run`: its checkpoints above all).
* `prune_jsonl`: on resume, records of steps after the restored checkpoint (trained, then lost with the process) and
  a torn last line (a full disk, a kill mid-write) are dropped, so every step appears exactly once and the next
  record never lands on a half line.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any

from absl import logging

from maxtext_rl_plugin import storage
from maxtext_rl_plugin.errors import UserError


class OutputError(UserError):
  """An output path cannot be written."""


class RunLockedError(UserError):
  """Another live process holds the run directory."""


# A file or directory name longer than this is refused by every local file system the plugin runs on (and by GCS's
# 1,024-byte object names only later, deep inside a write): said up front, naming the key that made it.
_NAME_MAX = 255


def probe_dir(path: str, key: str) -> None:
  """Create `path` and write, sync and remove a probe file in it (one `OutputError` line when any step fails); a
  bucket is first checked for credentials (storage.check_credentials), so a missing login is one line, not a
  traceback from the first upload."""
  try:
    storage.check_credentials(path)
    storage.makedirs(path)
  except storage.StorageError as e:  # no credentials, no such bucket: one line naming it
    raise OutputError(f"invalid value for '{key}'='{path}': {e.strerror}") from None
  except OSError as e:
    raise OutputError(f"invalid value for '{key}': cannot create directory {path} ({e.strerror or e})") from None
  if not storage.isdir(path) and not storage.is_remote(path):
    raise OutputError(f"invalid value for '{key}': {path} exists and is not a directory")
  probe = os.path.join(path, f".write_probe.{os.getpid()}")
  try:
    if storage.is_remote(path):
      storage.write_atomic(probe, "ok\n")
    else:
      storage.append_text(probe, "ok\n", sync=True)
  except OSError as e:
    raise OutputError(f"invalid value for '{key}': {storage.describe_error(e, path)}") from None
  finally:
    with contextlib.suppress(OSError):  # a probe that was never written
      storage.remove(probe)


def check_writable(run_dir: str, metrics_file: str | None) -> None:
  """Probe where the run will write before anything heavy starts (one `error:` line on failure): the base directory
  (created), not the run directory itself, so a run refused later leaves no empty run directory behind; and the
  metrics file's directory. Local paths and buckets alike."""
  name = os.path.basename(run_dir.rstrip("/"))
  if len(name.encode("utf-8")) > _NAME_MAX:
    raise OutputError(
        f"invalid value for 'run_name': {len(name.encode('utf-8'))} bytes, longer than the {_NAME_MAX}-byte limit of "
        "a directory name"
    )
  if storage.isdir(run_dir):
    probe_dir(run_dir, "base_output_directory")
  else:
    probe_dir(os.path.dirname(run_dir.rstrip("/")) or ".", "base_output_directory")
  if metrics_file:
    parent = os.path.dirname(storage.absolute(metrics_file)) or "."
    if not storage.within(parent, run_dir):
      probe_dir(parent, "metrics_file")
    if storage.isdir(metrics_file):
      raise OutputError(f"invalid value for 'metrics_file': {metrics_file} is a directory")
    if not storage.is_remote(metrics_file) and storage.exists(metrics_file):
      try:
        storage.append_text(metrics_file, "", sync=True)  # appending nothing: opens and syncs, records untouched
      except OSError as e:
        raise OutputError(f"invalid value for 'metrics_file': {storage.describe_error(e, metrics_file)}") from None


def resolve_metrics_file(metrics_file: str | None, run_dir: str) -> str | None:
  """A relative `metrics_file` lives in the run directory (so two runs of one config never share a file); an
  absolute path (or `~/...`, expanded) is the user's choice."""
  if not metrics_file:
    return None
  metrics_file = storage.expand(metrics_file)
  if os.path.isabs(metrics_file) or storage.is_remote(metrics_file):
    return metrics_file
  return os.path.join(run_dir, metrics_file)


# Files every run writes in its own directory (run/summary.py, run/step.py, RunLock, the owner mark): no key may name
# one of them, in this run's directory or another's.
RUN_FILES = ("summary.json", "summary.png", "batches.jsonl", ".lock", ".owner")


def check_owners(metrics_file: str | None, run_dir: str, run_dirs: dict[str, str], inputs: dict[str, str]) -> None:
  """Every output path of a run has one owner: `metrics_file` is none of the files a run writes itself (`RUN_FILES`,
  here or in another run's directory), not inside a directory another writer manages (`run_dirs`: key -> directory,
  such as checkpoint_dir and tensorboard_dir), not one of the run's inputs (`inputs`: key -> path, such as
  train_data_path), and not claimed by another run (its owner mark); the run directory itself lies in no other run's
  directory (`base_output_directory=<a run>/checkpoints` would put a run inside another's checkpoints). Checked for
  fresh runs and resumes alike."""
  for path, key in ((run_dir, "base_output_directory"), (metrics_file, "metrics_file")):
    try:  # before the first request to a bucket: no credentials is one line, and nothing is asked of the service
      storage.check_credentials(path or "")
    except storage.StorageError as e:
      raise OutputError(f"invalid value for '{key}'='{path}': {e.strerror}") from None
  check_not_in_other_run(run_dir, "base_output_directory", run_dir)
  if not metrics_file:
    return
  name = os.path.basename(os.path.normpath(metrics_file))
  if name in RUN_FILES:
    raise OutputError(
        f"invalid value for 'metrics_file': {metrics_file} is the name of a file every run writes itself ({name}); "
        "name another file (the default lives in the run directory as metrics.jsonl)"
    )
  for key, directory in run_dirs.items():
    if directory and storage.within(metrics_file, directory):
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
    if (
        path
        and storage.is_remote(path) == storage.is_remote(metrics_file)
        and storage.real(path) == storage.real(metrics_file)
    ):
      if storage.exists(path):
        raise OutputError(
            f"invalid value for 'metrics_file': {metrics_file} is the run's input {key}; a run appends its "
            "records to metrics_file (and prunes it on resume): name another file"
        )
  check_owner(metrics_file, run_dir, "metrics_file")


# Files that mark a directory as a run's: the owner mark (RunLock.acquire writes it), and for runs written before it
# existed, run/step.py's first-step audit and run/summary.py's summary.
_RUN_MARKS = (".owner", "batches.jsonl", "summary.json")


def _is_run_dir(directory: str) -> bool:
  return any(storage.exists(os.path.join(directory, mark)) for mark in _RUN_MARKS)


def _ancestors(path: str) -> list[str]:
  """The directories above `path`, nearest first, up to the root or the bucket."""
  out, directory = [], os.path.dirname(storage.real(path).rstrip("/"))
  while True:
    if storage.is_remote(directory) and directory.count("/") < 3:  # gs://bucket itself
      return out
    out.append(directory)
    parent = os.path.dirname(directory)
    if parent == directory or not parent:
      return out
    directory = parent


def check_not_in_other_run(path: str, key: str, run_dir: str | None) -> None:
  """Refuse (one line) an output `path` that lies inside another run's directory (its checkpoints above all): that
  run would list it as a step, set it aside as corrupt, or prune it. `run_dir`: the writing run's own directory
  (None: a tool such as export_lora, which belongs to no run)."""
  for directory in _ancestors(path):
    if run_dir is not None and storage.within(directory, run_dir) and storage.real(directory) != storage.real(path):
      continue
    if run_dir is not None and storage.real(directory) == storage.real(run_dir):
      continue
    if _is_run_dir(directory):
      raise OutputError(
          f"invalid value for '{key}': {path} lies inside {directory}, another run's directory, where that run's "
          "checkpoints, records and resume live; write outside every run's directory"
      )


def _other_run_dir(metrics_file: str, run_dir: str) -> str | None:
  """The directory of another run that `metrics_file` lies in, or None: a sibling of this run under the same
  base_output_directory (`<base>/<other run>/...`, whether that run exists yet or not), or any directory above the
  file that holds a run's files."""
  if storage.within(metrics_file, run_dir):
    return None
  base = os.path.dirname(storage.real(run_dir).rstrip("/"))
  if storage.within(metrics_file, base):
    rel = storage.real(metrics_file)[len(base.rstrip("/")) + 1 :]
    first = rel.split("/")[0]
    if first != os.path.basename(storage.real(metrics_file)):
      return os.path.join(base, first)
  return next((d for d in _ancestors(metrics_file) if _is_run_dir(d)), None)


# --- owner marks: each output belongs to the run that first wrote it ----------------------------------------------------


def owner_mark(target: str, is_dir: bool) -> str:
  """Where `target`'s owner is recorded: `<dir>/.owner` for a directory, `<file>.owner` beside a file."""
  return os.path.join(target, ".owner") if is_dir else f"{target}.owner"


def _owner_of(mark: str) -> str | None:
  """The run directory an owner mark names, or None (no mark, or unreadable)."""
  try:
    found = storage.read_versioned(mark)
  except OSError:  # unreadable: no owner to name
    return None
  if found is None:
    return None
  try:
    return str(json.loads(found[0]).get("run_dir"))
  except (ValueError, AttributeError):
    return None


def check_owner(target: str | None, run_dir: str, key: str, is_dir: bool = False) -> None:
  """Refuse (one line) when `target` is owned by another run (its owner mark names another run directory)."""
  if not target:
    return
  owner = _owner_of(owner_mark(target, is_dir))
  if owner is not None and storage.real(owner) != storage.real(run_dir):
    raise OutputError(
        f"invalid value for '{key}': {target} belongs to the run {owner} (its owner mark "
        f"{owner_mark(target, is_dir)}); another run never writes, prunes or resumes it: name another path"
    )


def claim(target: str | None, run_dir: str, key: str, is_dir: bool = False) -> bool:
  """Make this run `target`'s owner (an exclusive create of its owner mark), or refuse as `check_owner` when another
  run got there first: of two runs started together on one metrics_file, exactly one claims it. Returns whether this
  run owned it already (a rerun of the same run)."""
  if not target:
    return False
  mark = owner_mark(target, is_dir)
  text = json.dumps({"run_dir": storage.absolute(run_dir), "host": socket.gethostname(), "created": time.time()})
  if storage.create_exclusive(mark, text):
    return False
  check_owner(target, run_dir, key, is_dir)
  return True


def owned_by(target: str | None, run_dir: str, is_dir: bool = False) -> bool:
  """Whether `target`'s owner mark names `run_dir` (the run's own file, from an attempt that stopped early)."""
  if not target:
    return False
  owner = _owner_of(owner_mark(target, is_dir))
  return owner is not None and storage.real(owner) == storage.real(run_dir)


def _record_count(path: str) -> int:
  """Non-empty lines of a JSONL file: the records a metrics_file holds."""
  return sum(1 for line in storage.read_bytes(path).split(b"\n") if line.strip())


def check_resumed_metrics_file(metrics_file: str | None, run_dir: str, recorded: str | None, step: int) -> None:
  """A resume never adopts another run's records: a `metrics_file` outside the run directory that holds records and
  is not the file the checkpoint's steps wrote to (`recorded`, from the checkpoint's metadata; None for checkpoints
  written before it was recorded: not compared) is refused, as a fresh run refuses one."""
  if not metrics_file or recorded is None or not storage.isfile(metrics_file):
    return
  if storage.real(metrics_file) == storage.real(recorded) or storage.within(metrics_file, run_dir):
    return
  n = _record_count(metrics_file)
  if n:
    raise OutputError(
        f"invalid value for 'metrics_file': {metrics_file} holds {n} record(s) of another run; this run ({run_dir}) "
        f"resumes from step {step}, whose records went to {recorded}: resume with that metrics_file or name a new file"
    )


def check_fresh_metrics_file(metrics_file: str | None, run_dir: str) -> None:
  """A run starting from scratch never appends to (or prunes) another run's metrics: a metrics_file outside the run
  directory that already holds records, and that this run does not own (its owner mark), is refused. One inside the
  run directory, or owned by this run, is this run's own (an attempt that stopped before its first checkpoint), and
  its stale records are dropped."""
  if not metrics_file or not storage.isfile(metrics_file):
    return
  if storage.within(metrics_file, run_dir) or owned_by(metrics_file, run_dir):
    return
  n = _record_count(metrics_file)
  if n:
    raise OutputError(
        f"invalid value for 'metrics_file': {metrics_file} already holds {n} record(s) of another run "
        f"and this run ({run_dir}) starts from scratch; name another metrics_file or move that one"
    )


LAUNCH_ID_ENV = "MAXTEXT_RL_LAUNCH_ID"


class RunLock:
  """Exclusive ownership of a run directory (see the module docstring), on local disk and in a bucket alike.

  `launch_id` (default: `$MAXTEXT_RL_LAUNCH_ID`, which the launchers set once per launch and a restart of the same
  launch keeps) names the launch the holder belongs to: a lock held by another process of the *same* launch is its
  previous attempt (a Ray worker group restarted on another node, a JobSet pod rescheduled), dead by construction, and
  is taken over at once instead of after `stale_after_s`. `start_heartbeat` refreshes the lock from a daemon thread,
  so `stale_after_s` can be short without a long step (a big rollout, a checkpoint) looking dead.

  Every change of the lock file is conditional on the version last read (storage.create_exclusive / replace_if:
  O_EXCL locally, GCS generation preconditions in a bucket), so of two processes taking over one stale lock exactly
  one wins, and a holder whose lock was taken over finds out at its next heartbeat instead of overwriting the new
  holder's.
  """

  def __init__(self, run_dir: str, stale_after_s: float = 60.0, launch_id: str | None = None, host: str | None = None):
    self.run_dir = run_dir
    self.path = os.path.join(run_dir, ".lock")
    self.stale_after_s = stale_after_s
    self.launch_id = os.environ.get(LAUNCH_ID_ENV, "") if launch_id is None else launch_id
    self.host = host or socket.gethostname()  # `host` is for tests that play a process on another host
    self.held = False
    self._version: object = None
    self._last_beat = 0.0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _info(self) -> str:
    return json.dumps({"host": self.host, "pid": os.getpid(), "launch_id": self.launch_id, "heartbeat": time.time()})

  def _read(self) -> tuple[dict[str, Any] | None, object] | None:
    """(holder info or None when unreadable, version), or None when there is no lock."""
    found = storage.read_versioned(self.path)
    if found is None:
      return None
    try:
      info = json.loads(found[0] or "{}")
    except ValueError:
      info = None
    return (info if isinstance(info, dict) else None), found[1]

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
    """Take the lock (creating the run directory), or raise `RunLockedError` naming a live holder (one line)."""
    try:
      storage.makedirs(self.run_dir)
    except OSError as e:
      raise OutputError(
          f"cannot create the run directory {self.run_dir}: {storage.describe_error(e, self.run_dir)}"
      ) from None
    for _ in range(2):
      if storage.create_exclusive(self.path, self._info()):
        self._took()
        return
      found = self._read()
      if found is None:
        continue  # released between our create and our read: try again
      info, version = found
      if not self._is_stale(info):
        age = time.time() - float(info.get("heartbeat", 0))
        raise RunLockedError(
            f"run directory {self.run_dir} is in use by pid {info.get('pid')} on host "
            f"{info.get('host')} (heartbeat {age:.0f} s ago); wait for it to finish or use another run_name "
            f"(a lock silent for {self.stale_after_s:.0f} s is taken over)"
        ) from None
      why = "a previous attempt of this launch" if info and self._is_previous_attempt(info) else "stale"
      logging.warning("taking over the lock %s (%s; holder %s)", self.path, why, info)
      if storage.replace_if(self.path, self._info(), version):
        self._took()
        return
    raise RunLockedError(f"could not take the lock {self.path}: another process took it at the same time")

  def _took(self) -> None:
    found = self._read()
    self._version = found[1] if found else None
    self.held = True
    self._last_beat = time.time()

  def heartbeat(self, min_interval_s: float = 10.0) -> bool:
    """Refresh the lock's heartbeat (at most every `min_interval_s`); False once the lock is no longer this
    process's (a later attempt of the launch took it over): then this process stops claiming it."""
    if not self.held:
      return False
    if time.time() - self._last_beat < min_interval_s:
      return True
    try:
      found = self._read()
      if found is None or not self._is_mine(found[0]) or not storage.overwrite_if(self.path, self._info(), found[1]):
        logging.warning("the run lock %s was taken over by %s; no longer refreshing it", self.path, found)
        self.held = False
        return False
      found = self._read()
      self._version = found[1] if found else None
      self._last_beat = time.time()
    except OSError as e:  # a failed refresh is retried at the next beat
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
        found = self._read()
        if found is not None and self._is_mine(found[0]):
          storage.remove(self.path)
      except OSError:  # a lock left behind is stale after stale_after_s
        pass
      self.held = False


def prune_jsonl(path: str | None, last_step: int) -> int:
  """Keep the records of `path` with step <= `last_step` (and records without a step); drop a torn last line.

  Rewritten atomically (a temporary file renamed locally, one object upload in a bucket), so a crash here loses
  nothing. Returns the number of dropped lines.
  """
  if not path or not storage.isfile(path):
    return 0
  lines = storage.read_bytes(path).split(b"\n")
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
  storage.write_atomic(path, b"".join(line + b"\n" for line in keep))
  logging.info("resume: dropped %d record(s) after step %d (or torn) from %s", dropped, last_step, path)
  return dropped
