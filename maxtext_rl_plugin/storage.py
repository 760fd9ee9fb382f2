"""One storage layer for every path a user gives the plugin: local disk and object storage (`gs://`) alike.

Every file the plugin reads or writes at a user-given path (the run directory and all under it, `metrics_file`, data
files, the AOT report, export_lora's output) goes through this module; nothing else opens such a path
(tests/test_storage_paths.py greps for it).

Paths go through `etils.epath`, MaxText's and Orbax's own choice (MaxText's common/checkpointing.py and input
pipeline; Orbax takes epath paths and writes arrays through TensorStore's GCS driver): a bucket MaxText's checkpoints
reach is a bucket every output of the plugin reaches, with the same credentials, and `gs://` resolves the way it does
for them (tf.io.gfile in an image with TensorFlow, gcsfs elsewhere). Local paths keep their plain `os` calls (and
`~` is expanded: `base_output_directory=~/runs` means the home directory, never a literal `./~`).

What object storage lacks, and how each promise is kept there:
* No atomic rename: one object upload is atomic (a reader sees the old object or the new one, whole), so
  `write_atomic` uploads in one request where local disk writes a temporary file and renames it.
* No append: `append_text` rewrites the object with the new text (a metrics record is ~1 kB per step; a 1,000-step
  run rewrites ~1 MB per step, far below one checkpoint).
* No O_EXCL: `create_exclusive` and `replace_if` use GCS's generation preconditions (`ifGenerationMatch=0` creates only
  if absent, `ifGenerationMatch=g` replaces only the version `g` that was read) through google-cloud-storage, because
  epath exposes no precondition. The run lock and the owner marks (run_dir.py) are built on these two calls.
Tests run all of it against fake-gcs-server (tests/_gcs.py), which enforces those preconditions.
"""

# google-cloud-storage, api-core and google-auth are imported on the first gs:// path: a local run never loads them.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import contextlib
import errno
import functools
import glob as glob_lib
import hashlib
import io
import logging as std_logging
import os
import shutil
import tempfile
from typing import Iterator

from etils import epath

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"  # google-cloud-storage's and gcsfs's own variable for an emulator endpoint
TENSORSTORE_ENV = "TENSORSTORE_GCS_HTTP_URL"  # TensorStore's (Orbax's arrays) variable for the same endpoint

# gcsfs asks every bucket's layout of the storage-control API first and, without credentials (an emulator), logs one
# line per call before it falls back to plain GCS: noise, not a problem of the run.
std_logging.getLogger("gcsfs").setLevel(std_logging.ERROR)


class StorageError(OSError):
  """An object-storage call failed (credentials, a missing bucket, the service): `describe_error` says it in a line."""


def is_remote(path: str | os.PathLike | None) -> bool:
  """Whether `path` names object storage (`gs://...`, any `scheme://`) rather than the local file system."""
  return path is not None and "://" in os.fspath(path)


def bucket_of(path: str) -> str:
  """`gs://bucket/a/b` -> `gs://bucket` (the thing a missing credential or bucket is said about)."""
  scheme, rest = path.split("://", 1)
  return f"{scheme}://{rest.split('/', 1)[0]}"


def expand(path: str) -> str:
  """A local path with `~` expanded (as a shell would have); a remote one as given, without a trailing '/'."""
  if is_remote(path):
    return path.rstrip("/") if path.count("/") > 2 else path
  return os.path.expanduser(path)


def absolute(path: str) -> str:
  """A path as the run records and compares it: absolute and `~`-expanded locally, unchanged remotely."""
  return expand(path) if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def real(path: str) -> str:
  """`absolute` with local symbolic links resolved (two names for one file compare equal)."""
  return expand(path) if is_remote(path) else os.path.realpath(os.path.expanduser(path))


def within(path: str, directory: str) -> bool:
  """Whether `path` is `directory` or lies below it."""
  path, directory = real(path), real(directory)
  return path == directory or path.startswith(directory.rstrip("/") + "/")


def _p(path: str) -> epath.Path:
  return epath.Path(expand(path))


def _os_errors(fn):
  """Every failure of a remote call as a `StorageError` (an OSError) with one line naming the bucket: callers catch
  OSError for local disk and buckets alike, and the clients' many exception types (gcsfs, google-auth, api-core,
  aiohttp) stay in this module."""

  @functools.wraps(fn)
  def wrapper(path, *args, **kwargs):
    try:
      return fn(path, *args, **kwargs)
    except OSError:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught  # the clients' errors, translated here once
      if not is_remote(path):
        raise
      raise StorageError(errno.EIO, describe_error(e, path)) from e

  return wrapper


# --- reading -----------------------------------------------------------------------------------------------------------


@_os_errors
def exists(path: str) -> bool:
  return _p(path).exists() if is_remote(path) else os.path.exists(expand(path))


@_os_errors
def isfile(path: str) -> bool:
  if not is_remote(path):
    return os.path.isfile(expand(path))
  p = _p(path)
  return p.exists() and not p.is_dir()


@_os_errors
def isdir(path: str) -> bool:
  return _p(path).is_dir() if is_remote(path) else os.path.isdir(expand(path))


@_os_errors
def listdir(path: str) -> list[str]:
  """Names in a directory (OSError when it is not one: a remote prefix with no object is empty, not an error)."""
  if not is_remote(path):
    return os.listdir(expand(path))
  p = _p(path)
  return [c.name for c in p.iterdir()] if p.is_dir() else []


@_os_errors
def glob(pattern: str) -> list[str]:
  """Sorted matches of a glob pattern, local or remote."""
  if not is_remote(pattern):
    return sorted(glob_lib.glob(expand(pattern)))
  scheme, rest = pattern.split("://", 1)
  bucket, _, inner = rest.partition("/")
  return sorted(os.fspath(p) for p in epath.Path(f"{scheme}://{bucket}").glob(inner))


@_os_errors
def read_bytes(path: str) -> bytes:
  return _p(path).read_bytes() if is_remote(path) else _read_local(expand(path))


def _read_local(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


@_os_errors
def read_head(path: str, n: int) -> bytes:
  """The first `n` bytes (a ranged read of an object: a digest of a large data file never downloads all of it)."""
  with _p(path).open("rb") if is_remote(path) else open(expand(path), "rb") as f:
    return f.read(n)


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


@_os_errors
def size(path: str) -> int:
  return _p(path).stat().length if is_remote(path) else os.path.getsize(expand(path))


@_os_errors
def version(path: str) -> str:
  """What changes when the file's content is replaced (a cache key): size and mtime locally, the object's stat
  remotely."""
  blob = _blob(expand(path))
  if blob is not None:  # GCS: each write of an object makes a new generation (mtime has one-second steps)
    blob = blob.bucket.get_blob(blob.name)
    if blob is None:
      raise FileNotFoundError(errno.ENOENT, "no such object", path)
    return f"{blob.size}:{blob.generation}"
  if is_remote(path):
    st = _p(path).stat()
    return f"{st.length}:{st.mtime}"
  st = os.stat(expand(path))
  return f"{st.st_size}:{st.st_mtime_ns}"


# --- writing -----------------------------------------------------------------------------------------------------------


@_os_errors
def makedirs(path: str) -> None:
  """Create a directory and its parents. In a bucket a "directory" is a name prefix and needs no object, so only the
  bucket is checked: gcsfs's mkdir would create a missing bucket in the default project, which no user asked for."""
  if is_remote(path):
    bucket = bucket_of(expand(path))
    if not _p(bucket).exists():
      raise StorageError(errno.ENOENT, f"the bucket {bucket} does not exist (or is not visible)")
  else:
    os.makedirs(expand(path), exist_ok=True)


@_os_errors
def write_atomic(path: str, data: bytes | str) -> None:
  """Replace `path` with `data` so a reader (or a crash) never sees half of it: a temporary file renamed into place
  and fsynced locally, one object upload remotely (GCS replaces an object atomically)."""
  raw = data.encode("utf-8") if isinstance(data, str) else data
  if is_remote(path):
    _p(path).write_bytes(raw)
    return
  path = expand(path)
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "wb") as f:
      f.write(raw)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    with contextlib.suppress(OSError):
      os.remove(tmp)


@_os_errors
def append_text(path: str, text: str, *, sync: bool = False) -> None:
  """Append `text` (one or more whole lines): one `write` locally, so a failure leaves at most a torn last line;
  remotely the object is rewritten with the text added (objects are immutable; see the module docstring)."""
  if is_remote(path):
    p = _p(path)
    old = p.read_bytes() if p.exists() else b""
    p.write_bytes(old + text.encode("utf-8"))
    return
  with open(expand(path), "a", encoding="utf-8") as f:
    f.write(text)
    if sync:
      f.flush()
      os.fsync(f.fileno())


@_os_errors
def remove(path: str) -> None:
  """Remove a file (missing is not an error)."""
  with contextlib.suppress(FileNotFoundError):
    if is_remote(path):
      p = _p(path)
      if p.exists():
        p.unlink()
    else:
      os.remove(expand(path))


@_os_errors
def rmtree(path: str) -> None:
  if is_remote(path):
    p = _p(path)
    if p.exists():
      p.rmtree()
  else:
    shutil.rmtree(expand(path), ignore_errors=True)


@_os_errors
def rename(src: str, dst: str) -> None:
  """Move a file or directory (remote: gcsfs copies each object and deletes the source: not atomic, which is why the
  plugin renames only what it sets aside, never a live checkpoint)."""
  if is_remote(src):
    _p(src).rename(_p(dst))
  else:
    os.rename(expand(src), expand(dst))


def local_copy(path: str) -> str:
  """A local file holding `path`'s content, for what only opens local files (Python's import of
  reward_functions_path): the path itself locally; for an object, a copy under the temporary directory named by its
  content digest (each process of a run, and each rerun, finds the same file)."""
  if not is_remote(path):
    return expand(path)
  data = read_bytes(path)
  directory = os.path.join(tempfile.gettempdir(), "maxtext_rl_plugin", hashlib.sha256(data).hexdigest()[:16])
  target = os.path.join(directory, os.path.basename(path))
  if not os.path.isfile(target):
    os.makedirs(directory, exist_ok=True)
    write_atomic(target, data)
  return target


@contextlib.contextmanager
def open_write_bytes(path: str) -> Iterator[io.BytesIO]:
  """A buffer whose content becomes `path` (atomically) when the block ends without error: for writers that want a
  file object (matplotlib's savefig, json.dump)."""
  buf = io.BytesIO()
  yield buf
  write_atomic(path, buf.getvalue())


# --- exclusive creation and conditional replacement (the run lock, owner marks) ----------------------------------------


@functools.lru_cache(maxsize=1)
def _gcs_client():
  """google-cloud-storage's client: anonymous against an emulator (`STORAGE_EMULATOR_HOST`, which the client reads
  itself), the environment's credentials otherwise."""
  from google.cloud import storage as gcs

  if os.environ.get(EMULATOR_ENV):
    return gcs.Client.create_anonymous_client()
  return gcs.Client()


def _blob(path: str):
  if not path.startswith("gs://"):
    return None
  bucket, _, name = path[len("gs://") :].partition("/")
  return _gcs_client().bucket(bucket).blob(name)


def _precondition_failed() -> type[Exception]:
  """GCS's 412 (a generation precondition not met), imported with the client."""
  from google.api_core import exceptions

  return exceptions.PreconditionFailed


@_os_errors
def create_exclusive(path: str, text: str) -> bool:
  """Create `path` holding `text` only if it does not exist (True), else leave it (False): O_EXCL locally,
  `ifGenerationMatch=0` on GCS. Other schemes have no such primitive here: an existence check, then a write."""
  blob = _blob(expand(path))
  if blob is not None:
    try:
      blob.upload_from_string(text, if_generation_match=0)
    except _precondition_failed():
      return False
    return True
  if is_remote(path):
    if exists(path):
      return False
    write_atomic(path, text)
    return True
  try:
    fd = os.open(expand(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  return True


@_os_errors
def read_versioned(path: str) -> tuple[str, object] | None:
  """(text, version) of `path`, or None when it is missing: the version `replace_if` compares (the object's
  generation on GCS, size and mtime locally)."""
  blob = _blob(expand(path))
  if blob is not None:
    blob = blob.bucket.get_blob(blob.name)
    if blob is None:
      return None
    return blob.download_as_bytes(if_generation_match=blob.generation).decode("utf-8"), blob.generation
  try:
    v = version(path)
    return read_text(path), v
  except (FileNotFoundError, NotADirectoryError):
    return None


@_os_errors
def replace_if(path: str, text: str, expected: object) -> bool:
  """Replace `path` with `text` only if it is still at version `expected` (from `read_versioned`): True when replaced.
  On GCS this is one conditional upload, so of two processes replacing the same version exactly one succeeds. Locally
  the version is compared, then the file removed and created with O_EXCL, so of two racing processes one creates it
  and the other sees it exist (False)."""
  blob = _blob(expand(path))
  if blob is not None:
    try:
      blob.upload_from_string(text, if_generation_match=expected)
    except _precondition_failed():
      return False
    return True
  try:
    if version(path) != expected:
      return False
  except FileNotFoundError:
    pass
  remove(path)
  return create_exclusive(path, text)


@_os_errors
def overwrite_if(path: str, text: str, expected: object) -> bool:
  """`replace_if` for the holder's own refresh (a heartbeat): on local disk an atomic rename (the file never goes
  missing for a reader), after comparing the version; on GCS the conditional upload."""
  if _blob(expand(path)) is not None:
    return replace_if(path, text, expected)
  try:
    if version(path) != expected:
      return False
  except FileNotFoundError:
    return False
  write_atomic(path, text)
  return True


# --- errors and reachability -------------------------------------------------------------------------------------------


def describe_error(e: BaseException, path: str) -> str:
  """One line for a failed read or write of `path`: no space left (with the free space), a credential or bucket
  problem of object storage, or the error itself."""
  if isinstance(e, OSError) and e.errno == errno.ENOSPC:
    return f"no space left on the device writing {path} ({_free_space(path)})"
  if isinstance(e, StorageError):
    return str(e.strerror)
  if is_remote(path):
    first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return f"cannot write {path} ({bucket_of(path)}): {type(e).__name__}: {first}"
  if isinstance(e, OSError):
    return f"cannot write {path}: {e.strerror or e}"
  return f"cannot write {path}: {e}"


def _free_space(path: str) -> str:
  probe = expand(path)
  while probe and not os.path.exists(probe):
    probe = os.path.dirname(probe)
  try:
    return f"{shutil.disk_usage(probe or '/').free / 2**20:.0f} MiB free"
  except OSError:
    return "free space unknown"


@functools.lru_cache(maxsize=1)
def _has_default_credentials() -> bool:
  """Whether google-auth finds application default credentials: asked once per process (on a GCE VM or GKE pod each
  look-up asks the metadata server, and a run checks every output path)."""
  import google.auth
  from google.auth import exceptions as auth_exceptions

  try:
    google.auth.default()
  except auth_exceptions.DefaultCredentialsError:
    return False
  return True


def check_credentials(path: str) -> None:
  """Before the first request to a bucket: an emulator endpoint, or Google's application default credentials, must be
  there; else a `StorageError` whose one line names the bucket and what to set (no traceback, no request to the
  service). Callers say which key named `path`."""
  if not path.startswith("gs://"):
    return
  if os.environ.get(EMULATOR_ENV):
    point_tensorstore_at_emulator()
    return
  if not _has_default_credentials():
    raise StorageError(
        errno.EACCES,
        f"no Google Cloud credentials for {bucket_of(path)} (run `gcloud auth application-default login`, set "
        "GOOGLE_APPLICATION_CREDENTIALS, or run on a GCP VM or GKE pod with a service account; for a dry run against "
        f"an emulator set {EMULATOR_ENV} and {TENSORSTORE_ENV})",
    )


def point_tensorstore_at_emulator() -> None:
  """With `STORAGE_EMULATOR_HOST` set and `TENSORSTORE_GCS_HTTP_URL` not, point TensorStore (Orbax's arrays) at the
  same emulator, so one variable sends every output of a dry run there (docs/tutorial.md)."""
  host = os.environ.get(EMULATOR_ENV)
  if host and not os.environ.get(TENSORSTORE_ENV):
    os.environ[TENSORSTORE_ENV] = host if "://" in host else f"http://{host}"
