"""Lower and compile each program for the target, and read what the compiler says it costs per device.

FLOPs and bytes count every iteration of the program's loops (scanned layers, the decode loop): aot/hlo_cost.py
corrects XLA's cost analysis, which counts a loop body once; XLA's own figures are kept beside them.

A compile that runs out of HBM is a result, not a crash: XLA's `RESOURCE_EXHAUSTED` (as MaxText's
`train_compile.is_oom` recognises it) becomes a `Compiled` with `oom` set to the compiler's own first line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time

from flax.core.spmd import logical_axis_rules
import jax

from maxtext_rl_plugin.aot import hlo_cost
from maxtext_rl_plugin.aot.programs import Program
from maxtext_rl_plugin.rollout import decode


@dataclasses.dataclass
class Compiled:
  """Per-device memory and cost of one compiled program (bytes, FLOPs), or the compiler's OOM line."""

  program: Program
  seconds: float
  argument_bytes: int = 0
  output_bytes: int = 0
  temp_bytes: int = 0
  alias_bytes: int = 0
  code_bytes: int = 0
  host_temp_bytes: int = 0  # host-offloaded temporaries (remat offload), not in HBM
  peak_bytes: int = 0
  flops: float = 0.0  # every loop iteration counted (hlo_cost)
  bytes_accessed: float = 0.0  # the same, slice-aware
  oom: str | None = None
  xla_flops: float = 0.0  # XLA's cost analysis as reported: each loop body once
  xla_bytes_accessed: float = 0.0
  bounded: bool = False  # a loop that may end early (the decode's all-rows-done test) is counted to its bound
  loops: dict | None = None  # hlo_cost.summary: each loop's trip count, runs and per-run figures


def _oom_line(message: str) -> str | None:
  low = message.lower()
  if "resource_exhausted" not in low and "hbm" not in low and "out of memory" not in low:
    return None
  for line in message.splitlines():
    if "RESOURCE_EXHAUSTED" in line or "memory" in line.lower():
      return re.sub(r"\s+", " ", line.strip())[:300]
  return message.splitlines()[0][:300]


def lower(program: Program):
  """jax.jit(...).lower(...) of the program on its mesh under its logical-axis rules."""
  kwargs = {}
  if program.in_shardings is not None:
    kwargs["in_shardings"] = program.in_shardings
  if program.out_shardings is not None:
    kwargs["out_shardings"] = program.out_shardings
  mesh = jax.set_mesh(program.mesh) if program.context_mesh else contextlib.nullcontext()
  with decode.warnings_off(), mesh, logical_axis_rules(program.rules):
    return jax.jit(program.fn, donate_argnums=program.donate_argnums, **kwargs).lower(*program.args)


def compile_program(program: Program) -> Compiled:
  """Compile `program`; memory and cost analysis per device, or the OOM verdict."""
  t0 = time.perf_counter()
  try:
    compiled = lower(program).compile()
  except Exception as e:  # pylint: disable=broad-exception-caught  # XLA raises JaxRuntimeError/XlaRuntimeError/...
    line = _oom_line(str(e))
    if line is None:
      raise
    return Compiled(program, time.perf_counter() - t0, oom=line)
  seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older JAX: one dict per computation
    cost = cost[0] if cost else {}
  xla_flops, xla_bytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  try:
    loops = hlo_cost.module_cost(compiled.as_text(), cost)
  except Exception as e:  # pylint: disable=broad-exception-caught  # a module the parser misreads: XLA's figures, said
    loops = hlo_cost.LoopCost(xla_flops, xla_bytes, xla_flops, xla_bytes, [], error=f"{type(e).__name__}: {e}"[:300])
  out = Compiled(
      program,
      seconds,
      argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes),
      temp_bytes=int(mem.temp_size_in_bytes),
      alias_bytes=int(mem.alias_size_in_bytes),
      code_bytes=int(mem.generated_code_size_in_bytes),
      host_temp_bytes=int(getattr(mem, "host_temp_size_in_bytes", 0) or 0),
      flops=loops.flops,
      bytes_accessed=loops.bytes_accessed,
      xla_flops=xla_flops,
      xla_bytes_accessed=xla_bytes,
      bounded=loops.bounded,
      loops=hlo_cost.summary(loops),
  )
  peak = getattr(mem, "peak_memory_in_bytes", 0) or 0
  # Live at once: inputs, outputs not aliased to (donated) inputs, scratch; XLA's own peak when it reports one.
  out.peak_bytes = int(max(peak, out.argument_bytes + out.output_bytes - out.alias_bytes + out.temp_bytes))
  return out
