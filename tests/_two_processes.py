"""A worker script as a 2-process JAX program on this host (gloo CPU collectives, a free loopback port).

The harness tests/test_multiprocess.py, tests/resharding/test_per_host_sync.py and tests/tpu_contract/test_per_host.py
share:
each process runs `python <script> <process id> <coordinator address> <its output JSON> *args` and writes what it saw
to that JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parent


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run(
    tmp_path, script: str, *args: str, devices_per_process: int = 1, timeout: int = 240, env: dict | None = None
) -> list[dict]:
  """Run tests/`script` as two processes with `devices_per_process` CPU devices each; each process's JSON output.

  `env` adds to the processes' environment (tests/tpu_contract's TPU_ACCELERATOR_TYPE); `timeout` is per process.
  """
  addr = f"127.0.0.1:{free_port()}"
  extra = env or {}
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  env.update(extra)
  if devices_per_process > 1:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
  with contextlib.ExitStack() as stack:
    procs = [
        stack.enter_context(
            subprocess.Popen(
                [sys.executable, str(TESTS / script), str(i), addr, str(tmp_path / f"p{i}.json"), *args],
                cwd=TESTS.parent,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        for i in (0, 1)
    ]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(l[-4000:] for l in logs)
  return [json.loads((tmp_path / f"p{i}.json").read_text()) for i in (0, 1)]
