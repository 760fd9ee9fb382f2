"""The target TPU, from MaxText's `compile_topology` name: its devices (without the hardware) and its published figures.

`compile_topology=v5p-128` means what it means to MaxText's `train_compile`: the name is looked up in
`maxtext/utils/accelerator_to_spec_map.py` and `jax.experimental.topologies.get_topology_desc` (libtpu, from PyPI)
returns that slice's devices on a CPU host; programs lowered on a mesh of them compile for the target, and the
compiler's memory analysis is what the target would allocate.

The figures per JAX device (a v5p chip in megacore mode is one device; an Ironwood chip is two) are Google Cloud's
published ones (docs/aot.md cites each page): HBM capacity, peak dense bf16 FLOP/s, HBM bandwidth.
"""

from __future__ import annotations

import dataclasses
import difflib
import os

from maxtext.utils import accelerator_to_spec_map

from maxtext_rl_plugin.errors import ConfigError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Published figures of one JAX device of a TPU generation."""

  generation: str
  hbm_bytes: int
  peak_flops: float  # dense bf16 FLOP/s
  hbm_bandwidth: float  # bytes/s
  devices_per_chip: int = 1


# Per chip from cloud.google.com/tpu/docs/{v5p,v6e,v5e,v4,tpu7x}; per device = per chip / devices_per_chip.
_CHIPS = {
    "v4": DeviceSpec("v4", 32 * GIB, 275e12, 1228e9),
    "v5p": DeviceSpec("v5p", 95 * GIB, 459e12, 2765e9),
    "v5e": DeviceSpec("v5e", 16 * GIB, 197e12, 819e9),
    "v6e": DeviceSpec("v6e", 32 * GIB, 918e12, 1640e9),
    "tpu7x": DeviceSpec("tpu7x", 192 * GIB, 2307e12, 7380e9, devices_per_chip=2),
}


def device_spec(topology: str) -> DeviceSpec:
  """Per-device figures for a MaxText topology name (`v5p-128` -> v5p; `v5litepod-16` -> v5e)."""
  gen = topology.split("-")[0]
  gen = {"v5litepod": "v5e", "v6litepod": "v6e", "v5": "v5p"}.get(gen, gen)
  chip = _CHIPS.get(gen)
  if chip is None:
    raise ConfigError(
        f"invalid value for 'compile_topology'='{topology}': no published figures for TPU generation '{gen}' "
        f"(known: {', '.join(sorted(_CHIPS))})"
    )
  n = chip.devices_per_chip
  return dataclasses.replace(
      chip, hbm_bytes=chip.hbm_bytes // n, peak_flops=chip.peak_flops / n, hbm_bandwidth=chip.hbm_bandwidth / n
  )


def check_name(topology: str) -> None:
  """A topology MaxText knows (accelerator_to_spec_map) of a generation with published figures, or one line naming
  the closest names: light (no JAX, no libtpu), so train_rl's first pass refuses it before the schema's seconds."""
  device_spec(topology)
  names = list(accelerator_to_spec_map.UserFacingNameToSystemCharacteristics)
  if topology not in names:
    close = difflib.get_close_matches(topology, names, n=3, cutoff=0.6)
    raise ConfigError(
        f"invalid value for 'compile_topology'='{topology}': MaxText 0.2.5 does not know this topology"
        + (f"; close: {', '.join(close)}" if close else " (e.g. v5p-128, v6e-256)")
    )


def quiet_libtpu_env() -> None:
  """libtpu on a host that is no TPU VM polls the GCE metadata server and logs errors; these say who we are."""
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # libtpu takes /tmp/libtpu_lockfile so two processes do not drive one TPU; compiling drives none, and a second
  # compile (or a test beside a compile) would otherwise fail with "Internal error when accessing libtpu lockfile".
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(topology: str, num_slices: int) -> list:
  """The target's devices, as MaxText's `train_compile.get_topology_mesh` gets them (no TPU needed)."""
  try:
    target = accelerator_to_spec_map.get_system_characteristics(topology)
  except ValueError:
    raise ConfigError(
        f"invalid value for 'compile_topology'='{topology}': not a name in MaxText's accelerator_to_spec_map "
        "(e.g. v5p-128, v6e-256, tpu7x-128)"
    ) from None
  if target.platform != "tpu":
    raise ConfigError(f"invalid value for 'compile_topology'='{topology}': only TPU topologies compile here")
  quiet_libtpu_env()
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel  # needs libtpu; AOT only

  try:
    desc = topologies.get_topology_desc(
        platform=target.platform,
        topology_name=target.topology_name,
        chip_config_name=target.chip_config_name,
        chips_per_host_bounds=target.chips_per_host_bounds,
        num_slices=num_slices,
        wrap=target.wrap,
    )
  except (RuntimeError, ValueError) as e:
    if "lockfile" in str(e):
      raise ConfigError(
          f"compile_topology='{topology}': another process holds libtpu's lockfile; set ALLOW_MULTIPLE_LIBTPU_LOAD=1"
      ) from None
    if "libtpu" in str(e).lower() or "tpu" in str(e).lower():
      raise ConfigError(
          f"invalid value for 'compile_topology'='{topology}': compiling for a TPU needs libtpu in this environment "
          f"(pip install libtpu==0.0.50.1, or the plugin's 'aot' extra): {str(e).splitlines()[0][:160]}"
      ) from None
    raise
  return list(desc.devices)
