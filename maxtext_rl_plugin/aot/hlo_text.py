"""An optimized (compiled) HLO module's text, parsed: its computations, their instructions, and loop trip counts.

The loop-aware cost (aot/hlo_cost.py) reads a module through this: which computations exist and call which, each
instruction's shape, opcode and operands (`Instr`), a shape's bytes as XLA sizes it (`array_bytes`), and how often
each while loop runs (`HloText.trip_count`). Nothing here calls XLA: it is the text alone.

Trip counts: XLA's `known_trip_count` (CPU records it); TPU modules do not, so from the loop itself: the condition
`counter < N` (or `<=`), the counter's constant start in the caller's tuple and the step the body adds (windowed
einsums step by 2). A condition that ands the bound with another test (the engine's decode: `step < T and not all
rows done`) gives a bound: the trip count is that bound and `bounded` says so. A loop whose count cannot be read
gives None.

The text is parsed once (`HloText`: each computation's instruction table built on first use and cached): a 70B
update's module is ~40 MB of text with a dozen loops.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

# Ops a value passes through unchanged for the loop-counter analysis (the counter is often copied, and CPU wraps
# scalar ops in fusions, which _origin steps into).
_PASS = frozenset(("copy", "bitcast", "convert", "reshape", "copy-start", "copy-done", "optimization-barrier"))
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
_END = re.compile(r'^\}(, execution_thread="[^"]*")?$')
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
      elif _END.match(line):  # only a lone brace ends it (attributes may span lines that start with '}'), or one
        # that names the computation's thread: TPU modules print SparseCore computations as `}, execution_thread=...`
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
