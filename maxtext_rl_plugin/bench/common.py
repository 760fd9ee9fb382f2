"""What several benchmarks share."""

import os
import sys


def force_host_devices(n: int) -> None:
  """Ask XLA for `n` host devices (CPU runs of the trainer/sampler split), unless JAX is already imported or the
  caller's XLA_FLAGS already choose a count: XLA reads the flag once, when the backend starts."""
  if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
