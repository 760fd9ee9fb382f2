"""Run train_rl as N plain local processes (one JAX program, gloo CPU collectives), as the Ray CPU worker does.

`python scripts/mp_run.py [--num-processes 2] [--devices-per-process 1] -- configs/cpu_tiny.yml key=value ...`
A development aid for iterating on multi-process code without Ray's start-up; the Ray launcher is the product path.
"""

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import uuid

# Function-local imports: only a child process imports jax and the plugin, under the environment its parent set.
# pylint: disable=import-outside-toplevel


def _child(pid: int, n: int, addr: str, argv: list[str]) -> int:
  """One process of the program: jax.distributed with gloo collectives, then train_rl."""
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=pid)
  from maxtext_rl_plugin import train_rl

  try:
    return train_rl.main(argv)
  finally:
    jax.distributed.shutdown()


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--num-processes", type=int, default=2)
  p.add_argument("--devices-per-process", type=int, default=1)
  p.add_argument("--child", type=int, default=None)
  p.add_argument("--addr", default=None)
  args, rest = p.parse_known_args()
  if rest and rest[0] == "--":
    rest = rest[1:]
  if args.child is not None:
    return _child(args.child, args.num_processes, args.addr, rest)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
  if args.devices_per_process > 1:
    flags.append(f"--xla_force_host_platform_device_count={args.devices_per_process}")
  env["XLA_FLAGS"] = " ".join(flags)
  env.setdefault("MAXTEXT_RL_LAUNCH_ID", f"mp_run:{uuid.uuid4().hex[:16]}")  # run_dir.LAUNCH_ID_ENV: the run lock
  with contextlib.ExitStack() as stack:
    procs = [
        stack.enter_context(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    str(i),
                    "--num-processes",
                    str(args.num_processes),
                    "--addr",
                    f"127.0.0.1:{port}",
                    "--",
                    *rest,
                ],
                env=env,
            )
        )
        for i in range(args.num_processes)
    ]
    rcs = [pr.wait() for pr in procs]
  print(f"[mp_run] exit codes {rcs}", flush=True)
  return max(rcs, key=abs)


if __name__ == "__main__":
  sys.exit(main())
