"""FLOPs and bytes of a compiled program that count every loop iteration.

XLA's `compiled.cost_analysis()` (its `HloCostAnalysis`) visits a while loop's body once. MaxText scans the decoder
layers and the embedded engine decodes in a while loop, so the figure it reports is the non-loop work plus *one*
layer (one decode step). This module corrects it from the optimized (compiled) HLO module, read through
aot/hlo_text.py (the parsed text and the loops' trip counts):

    flops = XLA(module) + sum over loop bodies B of (runs(B) - 1) x own(B)
    bytes = XLA(module) + sum over loop bodies B of (runs(B) x (own(B) + slice(B)) - own(B))

* `XLA(module)` is the backend's own whole-module figure (`compiled.cost_analysis()`).
* `own(B)`: XLA's `HloCostAnalysis` of the module re-entered at B (B as the entry computation, with what it calls),
  less the loops nested in it (XLA counts a nested loop's body and condition once inside B: those are subtracted and
  counted as loops of their own).
* `runs(B)` = trip count x runs of the loop's caller (1 for the entry). Trip counts: `HloText.trip_count` (XLA's
  `known_trip_count`, else read from the loop's condition, start and step). A loop that ends early on a data-dependent
  test (the engine's decode: `step < T and not all rows done`) is counted to its bound and the figure is `bounded`.
  A loop whose count cannot be read is counted once, as XLA does (`uncounted`).
* `slice(B)` (<= 0): a layer body reads its slice of a stacked [layers, ...] weight or KV cache with a dynamic-slice,
  and writes its slice of stacked activations with a dynamic-update-slice. XLA counts a fused parameter's slice only
  when the slice reads the parameter directly; through a bitcast or a nested fusion (as TPU fusions are built) it
  counts the whole stack, 10x too much per layer for a 10-layer stack. `slice(B)` replaces those reads and writes
  by the slice's bytes (`own_bytes`).

The condition's own cost (a compare, or a reduce over the rows for the decode) is counted once per loop, as XLA
counts it. A roofline from these figures is still a lower bound (no overlap, no collective latency).

This is the one module that calls XLA's analysis (`_xla_cost`, a private JAX binding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax._src.lib import _jax  # private: see _xla_cost
from jaxlib import _hlo

from maxtext_rl_plugin.aot.hlo_text import HloText, Instr, array_bytes

# Ops that move no bytes of their own (XLA's analysis counts none for them either).
_VIEW = frozenset(("bitcast",))
_FREE = frozenset(
    ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "after-all", "partition-id", "replica-id")
)

# -- slice-aware bytes --------------------------------------------------------------------------------------------


def _read(hlo: HloText, comp: str, name: str) -> float:
  """Bytes a fused computation reads of its value `name`: through bitcasts and nested fusions, a dynamic-slice or
  slice reads its result, a dynamic-update-slice's in-place operand nothing, anything else all of it (once)."""
  full = array_bytes(hlo.instrs(comp)[name].shape)
  total = 0.0
  for user, k in hlo.users(comp).get(name, []):
    if user.opcode in ("dynamic-slice", "slice") and k == 0:
      total += array_bytes(user.shape)
    elif user.opcode == "dynamic-update-slice" and k == 0:
      pass
    elif user.opcode in _VIEW:
      total += _read(hlo, comp, user.name)
    elif user.opcode == "fusion":
      inner = user.attr("calls")
      total += _read(hlo, inner, hlo.param(inner, k).name)
    else:
      return full
  return min(total, full)


def _written(hlo: HloText, comp: str, name: str) -> float:
  """Bytes a fused computation writes for its value `name`: a dynamic-update-slice writes its update."""
  ins = hlo.instrs(comp)[name]
  if ins.opcode == "tuple":
    return sum(_written(hlo, comp, o) for o in ins.operands)
  if ins.opcode == "dynamic-update-slice":
    return array_bytes(hlo.instrs(comp)[ins.operands[1]].shape)
  if ins.opcode in _VIEW:
    return _written(hlo, comp, ins.operands[0])
  return array_bytes(ins.shape)


def own_bytes(hlo: HloText, comp: str) -> float:
  """Bytes `comp`'s own instructions read and write, slice-aware (its loops' bodies not included).

  XLA's rules (operands + result; a slice reads and writes its result, a dynamic-update-slice its update; tuples,
  get-tuple-element, bitcasts and constants nothing), except that a fusion's reads and writes are followed through
  bitcasts and nested fusions to the slices actually taken (XLA stops there and counts the whole operand)."""
  total = 0.0
  ins_of = hlo.instrs(comp)
  for ins in ins_of.values():
    op = ins.opcode
    if op in _FREE or op.endswith("-done"):
      continue
    if op == "fusion" and ins.attr("calls"):
      inner = ins.attr("calls")
      total += sum(_read(hlo, inner, hlo.param(inner, k).name) for k in range(len(ins.operands)))
      total += _written(hlo, inner, hlo.root(inner).name)
    elif op in ("dynamic-slice", "slice"):
      total += 2 * array_bytes(ins.shape) + sum(array_bytes(ins_of[o].shape) for o in ins.operands[1:])
    elif op == "dynamic-update-slice":
      total += 2 * array_bytes(ins_of[ins.operands[1]].shape)
    elif op.endswith("-start"):  # its result holds the source and destination buffers
      total += array_bytes(ins.shape)
    else:
      total += array_bytes(ins.shape) + sum(array_bytes(ins_of[o].shape) for o in ins.operands)
  return total


# -- loop-aware figures -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Loop:
  """One while loop: per-run figures exclusive of the loops nested in it, and how often its body runs."""

  body: str
  trips: int | None  # per entry into the loop; None: not read (counted once)
  runs: int  # trips x runs of the computation that holds it
  bounded: bool
  flops: float  # XLA's analysis of the body, less its nested loops
  bytes_accessed: float  # slice-aware (own_bytes)
  xla_bytes_accessed: float  # XLA's analysis of the body, less its nested loops (counts whole stacks)


@dataclasses.dataclass
class LoopCost:
  """A program's loop-aware FLOPs and bytes, beside XLA's as reported."""

  flops: float
  bytes_accessed: float
  xla_flops: float
  xla_bytes_accessed: float
  loops: list[Loop]
  error: str | None = None  # the module could not be read: the figures are XLA's as reported

  @property
  def bounded(self) -> bool:
    """Some loop ends early on a data-dependent test and was counted to its bound."""
    return any(lp.bounded for lp in self.loops)

  @property
  def uncounted(self) -> int:
    """Loops whose trip count could not be read (counted once)."""
    return sum(lp.trips is None for lp in self.loops)


def _xla_cost(module_text: str) -> dict:
  """XLA's HloCostAnalysis of a module text, with the CPU backend's shape sizes.

  Private: `jax._src.lib._jax.hlo_module_cost_analysis` is the binding JAX's own `Lowered.cost_analysis` calls
  (jax/_src/interpreters/pxla.py); no public API analyses an HLO module that is not a compiled executable's whole
  program, and a loop body re-entered as a module is not. The analysis is target-independent (it reads the module's
  ops and shapes), so the CPU client serves TPU modules: tests/aot/test_hlo_cost.py checks it equals
  `compiled.cost_analysis()` on loop-free programs for CPU and for v5p at the pinned JAX.
  """
  client = jax.local_devices(backend="cpu")[0].client
  return _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(module_text))


def module_cost(text: str, whole: dict | None = None) -> LoopCost:
  """Loop-aware figures of an optimized module's text; `whole`: the backend's own whole-module cost analysis
  (XLA's analysis of the text when None)."""
  hlo = HloText(text)
  whole = whole if whole is not None else _xla_cost(text)
  xla_flops, xla_bytes = float(whole.get("flops", 0.0)), float(whole.get("bytes accessed", 0.0))

  @functools.cache
  def xla(comp: str) -> tuple[float, float]:
    c = _xla_cost(hlo.module_at(comp))
    return float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))

  # Runs of each computation, callers first (the text lists callees first); loops found on the way.
  runs = {hlo.entry: 1}
  found = []  # (caller, while instruction, trips, bounded)
  for comp in reversed(list(hlo.spans)):
    if not runs.get(comp):
      continue
    for ins in hlo.instrs(comp).values():
      if ins.opcode == "fusion":
        continue  # fused computations are costed as part of their fusion
      if ins.opcode == "while":
        trips, bounded = hlo.trip_count(comp, ins)
        found.append((comp, ins, trips, bounded))
        n = runs[comp] * (1 if trips is None else trips)
        runs[ins.attr("body")] = runs.get(ins.attr("body"), 0) + n
        runs[ins.attr("condition")] = runs.get(ins.attr("condition"), 0) + runs[comp]
      else:  # call, conditional branches, async computations (a reduce's to_apply holds no loop: harmless)
        for c in ins.called():
          runs[c] = runs.get(c, 0) + runs[comp]

  def nested(body: str) -> list[Instr]:
    """The while loops XLA's analysis of `body` counts once inside it: in it or what it calls, not in its loops."""
    out, seen, todo = [], set(), [body]
    while todo:
      c = todo.pop()
      if c in seen or c not in hlo.spans:
        continue
      seen.add(c)
      for ins in hlo.instrs(c).values():
        if ins.opcode == "while":
          out.append(ins)
        elif ins.opcode != "fusion":
          todo += ins.called()
    return out

  loops, flops, nbytes = [], xla_flops, xla_bytes
  for _, ins, trips, bounded in found:
    body = ins.attr("body")
    f, b = xla(body)
    for w in nested(body):
      for part in (w.attr("body"), w.attr("condition")):
        f, b = f - xla(part)[0], b - xla(part)[1]
    r = runs.get(body, 1)
    own = own_bytes(hlo, body)
    loops.append(Loop(body, trips, r, bounded, f, own, b))
    flops += (r - 1) * f
    nbytes += r * own - b
  return LoopCost(flops, nbytes, xla_flops, xla_bytes, loops)


def summary(cost: LoopCost) -> dict:
  """The JSON-friendly account of the loops (largest contribution first)."""
  loops = sorted(cost.loops, key=lambda lp: -(lp.runs - 1) * lp.flops)
  return {
      "xla_flops": cost.xla_flops,
      "xla_bytes_accessed": cost.xla_bytes_accessed,
      "bounded": cost.bounded,
      "uncounted_loops": cost.uncounted,
      "error": cost.error,
      "loops": [dataclasses.asdict(lp) for lp in loops],
  }
