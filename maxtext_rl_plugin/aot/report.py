"""What the compiler said, as a user acts on it: one row per program, the fit verdict, the step-time estimate.

Per device (a JAX device: one v5p chip, half an Ironwood chip):
    peak      = arguments + outputs - donated aliases + temporaries          (XLA's memory analysis)
    needs     = peak + what else lives on those devices while it runs: on the trainer devices the train state
                (actor params + optimizer state, the update's arguments) and a full-fine-tuning reference copy of the
                params (rl.grpo_beta != 0); a program's own arguments are counted once
    roofline  = max(FLOPs / peak FLOP/s, bytes accessed / HBM bandwidth)    (one call)
  FLOPs and bytes count every loop iteration (aot/hlo_cost.py: scanned layers, windowed einsums, the embedded
  rollout's decode loop, counted to its bound of T steps and marked `bounded`); XLA's figures as reported, which
  count each loop body once, are kept in the row as xla_gflops / xla_gbytes.
    step      = sum over programs of calls per step x roofline per call, by phase (rollout, logps, update, sync)
A roofline is a lower bound: no overlap, no collectives' latency, no host time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from maxtext_rl_plugin.aot.compile import Compiled
from maxtext_rl_plugin.aot.topology import DeviceSpec, GIB

PHASES = ("rollout", "logps", "update", "sync")


@dataclasses.dataclass
class Row:
  """One program's line of the report."""

  name: str
  phase: str
  devices: int
  calls_per_step: int
  argument_gib: float
  output_gib: float
  temp_gib: float
  peak_gib: float
  needs_gib: float
  hbm_gib: float
  fits: bool
  gflops: float
  gbytes: float
  ms_per_call: float
  ms_per_step: float
  compile_s: float
  knob: str
  note: str = ""
  oom: str | None = None
  host_temp_gib: float = 0.0  # remat-offloaded activations in host memory (not HBM)
  xla_gflops: float = 0.0  # XLA's cost analysis as reported (each loop body once)
  xla_gbytes: float = 0.0
  bounded: bool = False  # gflops/gbytes count a data-dependent loop (the decode) to its bound
  loops: dict | None = None  # hlo_cost.summary of the program's loops


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of an abstract (sharded) tree: each leaf's shard shape."""
  import jax  # pylint: disable=import-outside-toplevel  # keep this module importable for the report alone

  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize
  return int(total)


def row(c: Compiled, spec: DeviceSpec, resident_extra: int, replaces_args: bool) -> Row:
  """The row of compiled program `c`; `resident_extra`: bytes on its devices that are not its arguments
  (`replaces_args`: its arguments are part of that resident state, so they are not counted twice)."""
  p = c.program
  if c.oom is not None:
    return Row(
        p.name,
        p.phase,
        p.mesh.size,
        p.calls_per_step,
        0,
        0,
        0,
        math.inf,
        math.inf,
        spec.hbm_bytes / GIB,
        False,
        0,
        0,
        0,
        0,
        c.seconds,
        p.knob,
        p.note,
        c.oom,
    )
  needs = c.peak_bytes + resident_extra - (c.argument_bytes if replaces_args else 0)
  t = max(c.flops / spec.peak_flops, c.bytes_accessed / spec.hbm_bandwidth)
  return Row(
      name=p.name,
      phase=p.phase,
      devices=p.mesh.size,
      calls_per_step=p.calls_per_step,
      argument_gib=c.argument_bytes / GIB,
      output_gib=c.output_bytes / GIB,
      temp_gib=c.temp_bytes / GIB,
      peak_gib=c.peak_bytes / GIB,
      needs_gib=needs / GIB,
      hbm_gib=spec.hbm_bytes / GIB,
      fits=needs <= spec.hbm_bytes,
      gflops=c.flops / 1e9,
      gbytes=c.bytes_accessed / 1e9,
      ms_per_call=t * 1e3,
      ms_per_step=t * 1e3 * p.calls_per_step,
      compile_s=c.seconds,
      knob=p.knob,
      note=p.note,
      host_temp_gib=c.host_temp_bytes / GIB,
      xla_gflops=c.xla_flops / 1e9,
      xla_gbytes=c.xla_bytes_accessed / 1e9,
      bounded=c.bounded,
      loops=c.loops,
  )


def step_estimate(rows: list[Row]) -> dict[str, float]:
  """Roofline seconds per RL step by phase, and the total."""
  by = {ph: sum(r.ms_per_step for r in rows if r.phase == ph) / 1e3 for ph in PHASES}
  by["total"] = sum(by[ph] for ph in PHASES)
  return by


def table(rows: list[Row], spec: DeviceSpec, topology: str) -> str:
  """The human table (GiB per device, GFLOP and GB per call)."""
  head = (
      f"{'program':<24} {'dev':>4} {'calls':>5} {'args':>7} {'out':>7} {'temp':>7} {'peak':>7} {'needs':>7} "
      f"{'of HBM':>7} {'fit':>4} {'GFLOP':>10} {'GB':>8} {'ms/call':>9} {'s/step':>8} {'compile':>8}"
  )
  lines = [f"AOT compile for {topology}: per device, {spec.hbm_bytes / GIB:.0f} GiB HBM ({spec.generation})", head]
  for r in rows:
    if r.oom:
      lines.append(f"{r.name:<24} {r.devices:>4} {r.calls_per_step:>5} {'compiler: out of memory':>50}  {r.oom[:80]}")
      continue
    lines.append(
        f"{r.name:<24} {r.devices:>4} {r.calls_per_step:>5} {r.argument_gib:>7.2f} {r.output_gib:>7.2f} "
        f"{r.temp_gib:>7.2f} {r.peak_gib:>7.2f} {r.needs_gib:>7.2f} {100 * r.needs_gib / r.hbm_gib:>6.0f}% "
        f"{'yes' if r.fits else 'NO':>4} {r.gflops:>10.1f} {r.gbytes:>8.2f} {r.ms_per_call:>9.1f} "
        f"{r.ms_per_step / 1e3:>8.2f} {r.compile_s:>7.0f}s{' (bounded)' if r.bounded else ''}"
    )
  est = step_estimate(rows)
  lines.append(
      "roofline step estimate: "
      + ", ".join(f"{ph} {est[ph]:.2f} s" for ph in PHASES)
      + f", total {est['total']:.2f} s (lower bound: no overlap, collectives or host time)"
  )
  lines.append(
      "GFLOP and GB count every loop iteration (scanned layers, decode steps)"
      + (
          "; (bounded): the decode loop counted to its max_new_tokens, as if no row stopped early"
          if any(r.bounded for r in rows)
          else ""
      )
  )
  errors = [f"{r.name}: {r.loops['error']}" for r in rows if r.loops and r.loops.get("error")]
  if errors:
    lines.append("loops not counted (XLA's figures, each loop body once): " + "; ".join(errors))
  return "\n".join(lines)


# A size as XLA's messages print it ("1.16T", "95.73G", "512.00M"; powers of 1024, as tsl's HumanReadableNumBytes).
_XLA_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s?([KMGTP])i?B?\b")
_UNIT = {"K": 1 / 1024**2, "M": 1 / 1024, "G": 1.0, "T": 1024.0, "P": 1024.0**2}


def oom_gib(message: str) -> tuple[float, float] | None:
  """(needed, capacity) in GiB from a compiler out-of-memory message ("Used 1.16T of 95.73G hbm", "1.16T exceeds
  95.73G"): its first two sizes; None when it does not give two."""
  sizes = [float(n) * _UNIT[u] for n, u in _XLA_SIZE.findall(message)]
  return (sizes[0], sizes[1]) if len(sizes) >= 2 else None


def _knob(r: Row, resident_gib: float | None) -> str:
  """What can move the program's memory, given what the report knows: when the state that lives on the devices
  whatever the batch (the train state, a reference copy) alone fills the HBM, only more devices (or spreading that state
  over more of them) can; otherwise the program's own knob."""
  if resident_gib is not None and resident_gib >= r.hbm_gib:
    return (
        f"the train state alone is {resident_gib:.1f} GiB per device, over the {r.hbm_gib:.1f} GiB: no batch setting "
        "moves it; use more chips (a larger compile_topology) or shard it over more of them (ici_fsdp_parallelism, "
        "trainer_devices_fraction), or LoRA"
    )
  return f"lower {r.knob}"


def verdict(rows: list[Row], topology: str, resident_gib: float | None = None) -> str | None:
  """The one line for the first program that does not fit, else None; `resident_gib`: what lives on the trainer's
  devices whatever the batch (the train state and a reference copy), per device, which decides the knob named."""
  for r in rows:
    if r.oom and "vmem" in r.oom.lower():  # a Pallas kernel's tiles (on-chip VMEM), not the program's HBM
      return (
          f"program '{r.name}' does not compile on {topology}: a kernel's tiles overflow VMEM ({r.oom}); lower its "
          "tile sizes (megablox: the wi_tile_* / wo_tile_* keys), not the batch"
      )
    if r.oom:
      sizes = oom_gib(r.oom)
      need = f"needs {sizes[0]:.1f} GiB of {sizes[1]:.1f} GiB HBM per device" if sizes else "ran out of HBM"
      resident = resident_gib if r.phase in ("update", "logps") else None
      return f"program '{r.name}' does not fit on {topology}: the compiler {need}; {_knob(r, resident)}"
    if not r.fits:
      resident = resident_gib if r.phase in ("update", "logps") else None
      return (
          f"program '{r.name}' needs {r.needs_gib:.1f} GiB of {r.hbm_gib:.1f} GiB HBM per device on {topology}; "
          f"{_knob(r, resident)}"
      )
  return None


def to_json(rows: list[Row], spec: DeviceSpec, topology: str, num_slices: int, extra: dict) -> str:
  """The machine-readable report (what the docs' tables are built from)."""
  return json.dumps(
      {
          "topology": topology,
          "num_slices": num_slices,
          "device": dataclasses.asdict(spec),
          "programs": [
              {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in dataclasses.asdict(r).items()}
              for r in rows
          ],
          "step_seconds": step_estimate(rows),
          "fits": all(r.fits for r in rows),  # `extra` (aot/run.py) narrows it to the programs that compiled
          "compiled_fit": all(r.fits for r in rows),
          **extra,
      },
      indent=1,
  )
