"""FLOPs and bytes of a compiled program that count every loop iteration.

XLA's `compiled.cost_analysis()` (its `HloCostAnalysis`) visits a while loop's body once. MaxText scans the decoder
layers and the embedded engine decodes in a while loop, so the figure it reports is the non-loop work plus *one*
layer (one decode step). This module corrects it from the optimized (compiled) HLO module:

    flops = XLA(module) + sum over loop bodies B of (runs(B) - 1) x own(B)
    bytes = XLA(module) + sum over loop bodies B of (runs(B) x (own(B) + slice(B)) - own(B))

* `XLA(module)` is the backend's own whole-module figure (`compiled.cost_analysis()`).
* `own(B)`: XLA's `HloCostAnalysis` of the module re-entered at B (B as the entry computation, with what it calls),
  less the loops nested in it (XLA counts a nested loop's body and condition once inside B: those are subtracted and
  counted as loops of their own).
* `runs(B)` = trip count x runs of the loop's caller (1 for the entry). Trip counts: XLA's `known_trip_count`
  (CPU records it); TPU modules do not, so from the loop itself: the condition `counter < N` (or `<=`), the counter's
  constant start in the caller's tuple and the step the body adds (windowed einsums step by 2). A condition that
  ands the bound with another test (the engine's decode: `step < T and not all rows done`) gives a bound: the loop
  is counted to it and the figure is `bounded`. A loop whose count cannot be read is counted once, as XLA does
  (`uncounted`).
* `slice(B)` (<= 0): a layer body reads its slice of a stacked [layers, ...] weight or KV cache with a dynamic-slice,
  and writes its slice of stacked activations with a dynamic-update-slice. XLA counts a fused parameter's slice only
  when the slice reads the parameter directly; through a bitcast or a nested fusion (as TPU fusions are built) it
  counts the whole stack, 10x too much per layer for a 10-layer stack. `slice(B)` replaces those reads and writes
  by the slice's bytes.

The condition's own cost (a compare, or a reduce over the rows for the decode) is counted once per loop, as XLA
counts it. A roofline from these figures is still a lower bound (no overlap, no collective latency).

The text is parsed once (`HloText`: each computation's instruction table built on first use and cached): a 70B
update's module is ~40 MB of text with a dozen loops.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
from jax._src.lib import _jax  # private: see _xla_cost
from jaxlib import _hlo

# Ops a value passes through unchanged for the loop-counter analysis (the counter is often copied, and CPU wraps
# scalar ops in fusions, which _origin steps into).
_PASS = frozenset(("copy", "bitcast", "convert", "reshape", "copy-start", "copy-done", "optimization-barrier"))
# Ops that move no bytes of their own (XLA's analysis counts none for them either).
_VIEW = frozenset(("bitcast",))
_FREE = frozenset(
    ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "after-all", "partition-id", "replica-id")
)
_DTYPE_BYTES = {
    "pred": 1,
    "s2": 0.25,
    "u2": 0.25,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"^\s+(ROOT )?%?([^\s=]+) = ")
_HEADER = re.compile(r"^(ENTRY )?%?([^\s(]+) ")
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations|called_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_COMPARE_DIR = re.compile(r"direction=(\w+)")


def array_bytes(shape: str) -> float:
  """Bytes of an HLO shape's text (a tuple: its elements), padded to its layout's tile as XLA's shape size is
  (a TPU `{1,0:T(8,128)}` pads the two minor dimensions to 8 x 128); dynamic dimensions at their bound."""
  total = 0.0
  for dtype, dims, layout in _ARRAY.findall(shape):
    if dtype not in _DTYPE_BYTES:
      continue
    sizes = [int(d) for d in dims.replace("<=", "").split(",") if d.strip()]
    tile = re.search(r":.*?T\(([\d,]+)\)", layout)
    if tile and sizes:
      minor_to_major = [int(d) for d in layout.strip("{}").split(":")[0].split(",") if d.strip()]
      physical = [sizes[d] for d in reversed(minor_to_major)] if len(minor_to_major) == len(sizes) else sizes
      t = [int(x) for x in tile.group(1).split(",")]
      for j in range(1, min(len(t), len(physical)) + 1):
        physical[-j] = -(-physical[-j] // t[-j]) * t[-j]
      sizes = physical
    total += math.prod(sizes) * _DTYPE_BYTES[dtype]
  return total


def _memo(fn):
  """Cache a method's results on its object (functools.cache would keep every parsed module alive)."""

  @functools.wraps(fn)
  def wrapper(self, *args):
    memo = self.__dict__.setdefault("_memo", {})
    key = (fn.__name__, *args)
    if key not in memo:
      memo[key] = fn(self, *args)
    return memo[key]

  return wrapper


def _balanced(s: str, i: int) -> int:
  """Index just past the bracket group that opens at s[i]."""
  depth = 0
  for j in range(i, len(s)):
    if s[j] in "([{":
      depth += 1
    elif s[j] in ")]}":
      depth -= 1
      if depth == 0:
        return j + 1
  return len(s)


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction: its name, result shape text, opcode, operand names and attribute text."""

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  args: str  # the text inside the opcode's parentheses (a constant's value)
  attrs: str
  root: bool

  def called(self) -> list[str]:
    """Computations this instruction calls (fusion, while body and condition, reduce's to_apply, branches)."""
    out = []
    for _, ref in _CALLED.findall(self.attrs):
      out += [n.strip().lstrip("%") for n in ref.strip("{}").split(",") if n.strip()]
    return out

  def attr(self, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
    return m.group(1) if m else None


def _parse_instr(text: str) -> Instr:
  m = _INSTR.match(text)
  rest = text[m.end() :]
  end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  close = _balanced(rest, op.end() - 1)
  args = rest[op.end() : close - 1]
  return Instr(
      m.group(2), shape, op.group(1), tuple(re.findall(r"%([\w.\-]+)", args)), args, rest[close:], bool(m.group(1))
  )


class HloText:
  """An optimized HLO module's text, split into computations once; instruction tables are built on first use."""

  def __init__(self, text: str):
    self.lines = text.splitlines()
    self.spans: dict[str, tuple[int, int]] = {}  # name -> (header line, closing line)
    self.entry = ""
    self.prologue_end = 0  # module header and the metadata tables before the first computation
    start = name = None
    for i, line in enumerate(self.lines):
      if start is None:
        m = _HEADER.match(line) if line.endswith("{") and not line.startswith(("HloModule", " ")) else None
        if m:
          start, name = i, m.group(2)
          if m.group(1):
            self.entry = name
          if not self.spans:
            self.prologue_end = i
      elif line == "}":  # only a lone brace ends it: attributes may span lines that start with '}'
        self.spans[name] = (start, i)
        start = None

  @_memo
  def instrs(self, comp: str) -> dict[str, Instr]:
    """`comp`'s instructions by name, in order (parsed on first use)."""
    start, end = self.spans[comp]
    out, cur = {}, []
    for line in self.lines[start + 1 : end]:
      if _INSTR.match(line) and cur:
        ins = _parse_instr(" ".join(cur))
        out[ins.name] = ins
        cur = []
      cur.append(line)
    if cur:
      ins = _parse_instr(" ".join(cur))
      out[ins.name] = ins
    return out

  @_memo
  def root(self, comp: str) -> Instr:
    """`comp`'s ROOT instruction."""
    return next(i for i in self.instrs(comp).values() if i.root)

  @_memo
  def param(self, comp: str, index: int) -> Instr:
    """`comp`'s parameter `index`."""
    return next(i for i in self.instrs(comp).values() if i.opcode == "parameter" and int(i.args) == index)

  @_memo
  def users(self, comp: str) -> dict[str, list[tuple[Instr, int]]]:
    """name -> [(user, operand position)] within `comp`."""
    out: dict[str, list[tuple[Instr, int]]] = {}
    for ins in self.instrs(comp).values():
      for k, o in enumerate(ins.operands):
        out.setdefault(o, []).append((ins, k))
    return out

  @_memo
  def reachable(self, comp: str) -> tuple[str, ...]:
    """`comp` and every computation it calls, transitively, in the module's order (callees first)."""
    seen, todo = set(), [comp]
    while todo:
      c = todo.pop()
      if c in seen or c not in self.spans:
        continue
      seen.add(c)
      for ins in self.instrs(c).values():
        todo += ins.called()
    return tuple(n for n in self.spans if n in seen)

  def module_at(self, comp: str) -> str:
    """A module text whose entry computation is `comp` (for XLA's analysis of one loop body or condition)."""
    body = []
    for name in self.reachable(comp):
      start, end = self.spans[name]
      header = self.lines[start]
      header = header[6:] if header.startswith("ENTRY ") else header
      body += (["ENTRY " + header] if name == comp else [header]) + self.lines[start + 1 : end + 1]
    return "\n".join(["HloModule loop_body", *self.lines[1 : self.prologue_end], *body, ""])

  def whiles(self, comp: str) -> list[Instr]:
    return [i for i in self.instrs(comp).values() if i.opcode == "while"]

  # -- following a value to where it comes from ------------------------------------------------------------------

  def _origin(self, comp: str, name: str, stack: tuple = ()) -> tuple[str, Instr, tuple]:
    """The instruction a value comes from: through copies and bitcasts, into fusions (CPU wraps a scalar add or
    compare in one) and back out of a fused computation's parameters."""
    while True:
      ins = self.instrs(comp)[name]
      if ins.opcode in _PASS and ins.operands:
        name = ins.operands[0]
      elif ins.opcode == "parameter" and stack:
        (comp, fusion), stack = stack[-1], stack[:-1]
        name = fusion.operands[int(ins.args)]
      elif ins.opcode == "fusion" and ins.attr("calls") and not ins.shape.startswith("("):
        stack = (*stack, (comp, ins))
        comp = ins.attr("calls")
        name = self.root(comp).name
      else:
        return comp, ins, stack

  def _gte_index(self, comp: str, name: str, stack: tuple = ()) -> int | None:
    """k when the value is element k of `comp`'s tuple parameter."""
    c, ins, st = self._origin(comp, name, stack)
    if ins.opcode != "get-tuple-element" or st:
      return None
    _, tup, st = self._origin(c, ins.operands[0], st)
    return int(ins.attr("index")) if tup.opcode == "parameter" and not st else None

  def _const(self, comp: str, name: str, stack: tuple = ()) -> int | None:
    _, ins, _ = self._origin(comp, name, stack)
    if ins.opcode != "constant":
      return None
    try:
      return int(ins.args)
    except ValueError:
      return None

  # -- trip counts ----------------------------------------------------------------------------------------------

  def _bound(self, cond: str) -> tuple[int, str, int, bool] | None:
    """(counter index, direction, N, bounded) of the condition's `counter < N`; bounded when the condition is not
    that compare alone (`counter < N and ...`)."""
    todo = [(cond, self.root(cond).name, ())]
    first = True
    while todo:
      comp, name, stack = todo.pop()
      c, ins, st = self._origin(comp, name, stack)
      if ins.opcode == "compare":
        direction = _COMPARE_DIR.search(ins.attrs).group(1)
        a, b = ins.operands[:2]
        flip = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}
        for x, y, d in ((a, b, direction), (b, a, flip.get(direction, direction))):
          k, n = self._gte_index(c, x, st), self._const(c, y, st)
          if k is not None and n is not None and d in ("LT", "LE"):
            return k, d, n, not first
      elif ins.opcode in ("and", "not"):
        todo += [(c, o, st) for o in ins.operands]
      first = False
    return None

  def _step(self, body: str, index: int) -> int | None:
    """What the body adds to counter `index` per iteration."""
    out = self.root(body)
    if out.opcode != "tuple":
      return None
    c, ins, st = self._origin(body, out.operands[index])
    if ins.opcode != "add":
      return None
    a, b = ins.operands[:2]
    for x, y in ((a, b), (b, a)):
      if self._gte_index(c, x, st) == index:
        return self._const(c, y, st)
    return None

  def trip_count(self, caller: str, loop: Instr) -> tuple[int | None, bool]:
    """(iterations, bounded) of while `loop` in computation `caller`; (None, False) when they cannot be read."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if m:
      return int(m.group(1)), False
    found = self._bound(loop.attr("condition"))
    if found is None:
      return None, False
    index, direction, n, bounded = found
    step = self._step(loop.attr("body"), index)
    _, init, st = self._origin(caller, loop.operands[0])
    start = self._const(caller, init.operands[index], st) if init.opcode == "tuple" else None
    if not step or step < 0 or start is None:
      return None, False
    span = n - start + (1 if direction == "LE" else 0)
    return max(0, math.ceil(span / step)), bounded

  # -- slice-aware bytes ----------------------------------------------------------------------------------------

  def _read(self, comp: str, name: str) -> float:
    """Bytes a fused computation reads of its value `name`: through bitcasts and nested fusions, a dynamic-slice or
    slice reads its result, a dynamic-update-slice's in-place operand nothing, anything else all of it (once)."""
    full = array_bytes(self.instrs(comp)[name].shape)
    total = 0.0
    for user, k in self.users(comp).get(name, []):
      if user.opcode in ("dynamic-slice", "slice") and k == 0:
        total += array_bytes(user.shape)
      elif user.opcode == "dynamic-update-slice" and k == 0:
        pass
      elif user.opcode in _VIEW:
        total += self._read(comp, user.name)
      elif user.opcode == "fusion":
        inner = user.attr("calls")
        total += self._read(inner, self.param(inner, k).name)
      else:
        return full
    return min(total, full)

  def _written(self, comp: str, name: str) -> float:
    """Bytes a fused computation writes for its value `name`: a dynamic-update-slice writes its update."""
    ins = self.instrs(comp)[name]
    if ins.opcode == "tuple":
      return sum(self._written(comp, o) for o in ins.operands)
    if ins.opcode == "dynamic-update-slice":
      return array_bytes(self.instrs(comp)[ins.operands[1]].shape)
    if ins.opcode in _VIEW:
      return self._written(comp, ins.operands[0])
    return array_bytes(ins.shape)

  def own_bytes(self, comp: str) -> float:
    """Bytes `comp`'s own instructions read and write, slice-aware (its loops' bodies not included).

    XLA's rules (operands + result; a slice reads and writes its result, a dynamic-update-slice its update; tuples,
    get-tuple-element, bitcasts and constants nothing), except that a fusion's reads and writes are followed through
    bitcasts and nested fusions to the slices actually taken (XLA stops there and counts the whole operand)."""
    total = 0.0
    ins_of = self.instrs(comp)
    for ins in ins_of.values():
      op = ins.opcode
      if op in _FREE or op.endswith("-done"):
        continue
      if op == "fusion" and ins.attr("calls"):
        inner = ins.attr("calls")
        total += sum(self._read(inner, self.param(inner, k).name) for k in range(len(ins.operands)))
        total += self._written(inner, self.root(inner).name)
      elif op in ("dynamic-slice", "slice"):
        total += 2 * array_bytes(ins.shape) + sum(array_bytes(ins_of[o].shape) for o in ins.operands[1:])
      elif op == "dynamic-update-slice":
        total += 2 * array_bytes(ins_of[ins.operands[1]].shape)
      elif op.endswith("-start"):  # its result holds the source and destination buffers
        total += array_bytes(ins.shape)
      else:
        total += array_bytes(ins.shape) + sum(array_bytes(ins_of[o].shape) for o in ins.operands)
    return total


@dataclasses.dataclass
class Loop:
  """One while loop: per-run figures exclusive of the loops nested in it, and how often its body runs."""

  body: str
  trips: int | None  # per entry into the loop; None: not read (counted once)
  runs: int  # trips x runs of the computation that holds it
  bounded: bool
  flops: float  # XLA's analysis of the body, less its nested loops
  bytes_accessed: float  # slice-aware (HloText.own_bytes)
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
  ops and shapes), so the CPU client serves TPU modules: tests/test_hlo_cost.py checks it equals
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
    own = hlo.own_bytes(body)
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
