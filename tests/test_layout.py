"""The package's shape, checked on its source text (pure AST, no import): the numbers issue 47 asked for.

* no `config_*`, `key_status`, `dependent_keys` or `validation` module at the package top (they live in `config/`),
  and at most `MAX_FLAT` flat modules there;
* no import cycle between the plugin's modules (Tarjan's strongly connected components over every `import` statement,
  top-level and function-local alike), and no arrow up: each module's layer (`LAYERS`) is at least the layer of every
  plugin module it imports;
* no module over `MAX_LINES` lines except the key-status table;
* at most `MAX_DISABLES` `pylint: disable` comments in the package and rewards/;
* the argv walk from `train_rl.main` climbs back up at most `MAX_CLIMBS` times (`argv_walk` defines it).

`python tests/test_layout.py` prints the numbers.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import re
import sys

REPO = pathlib.Path(os.environ.get("LAYOUT_REPO") or pathlib.Path(__file__).resolve().parents[1])
PACKAGE = "maxtext_rl_plugin"
# setup.cfg's package_dir: these folders are installed inside the package.
ROOTS = {PACKAGE: REPO / PACKAGE, f"{PACKAGE}.rewards": REPO / "rewards"}

MAX_FLAT = 22
MAX_LINES = 500
LONG_ALLOWED = {f"{PACKAGE}.config.key_status"}  # the key-status table: one row per key, nothing else
MAX_DISABLES = 80
MAX_CLIMBS = 22
CONFIG_NAMES = re.compile(r"^(config_\w+|config|key_status|dependent_keys|validation)$")

# Layers, lowest first: a module may import modules of its own layer or below, never above. Matched by the longest
# dotted prefix; every plugin module must match one.
LAYERS: dict[str, int] = {
    # 0: leaves every room may use
    "errors": 0,
    "signals": 0,
    "run_dir": 0,
    "storage": 0,
    "distributed": 0,
    "pathways": 0,
    "registry": 0,
    "tunix_compat": 0,
    # 1: the rooms a run is built from: configuration, engines, math, data, models, checkpoints
    "config": 1,
    "data": 1,
    "rewards": 1,
    "algorithms": 1,
    "agentic": 1,
    "rollout": 1,
    "resharding": 1,
    "lora": 1,
    "moe": 1,
    "metrics": 1,
    "checkpointing": 1,
    "demo_tokenizer": 1,
    # 2: the run
    "run": 2,
    # 3: what a user types, and the tools that drive a run
    "aot": 3,
    "bench": 3,
    "launch": 3,
    "train_rl": 3,
    "compile_rl": 3,
    "export_lora": 3,
    "train_rm": 3,
    "reward_model": 1,
    "cli": 3,
    "config.doc": 3,  # `python -m maxtext_rl_plugin.config.doc`: a command, reads the whole configuration
    "__init__": 0,
}


@dataclasses.dataclass
class Module:
  name: str
  path: pathlib.Path
  tree: ast.Module
  text: str


def modules() -> dict[str, Module]:
  """Every module of the installed package (rewards/ under its installed name), parsed."""
  out = {}
  for package, root in ROOTS.items():
    for path in sorted(root.rglob("*.py")):
      rel = path.relative_to(root).with_suffix("")
      parts = [p for p in rel.parts if p != "__init__"] if rel.parts[-1] == "__init__" else list(rel.parts)
      name = ".".join([package, *parts])
      text = path.read_text(encoding="utf-8")
      out[name] = Module(name, path, ast.parse(text), text)
  return out


def _package_of(mods: dict[str, Module], name: str) -> str:
  return name if mods[name].path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(mods: dict[str, Module], target: str) -> str | None:
  """The plugin module `target` names (a module, or a name inside one), None outside the plugin."""
  while target:
    if target in mods:
      return target
    target = target.rpartition(".")[0]
  return None


def imports(mods: dict[str, Module], name: str) -> dict[str, str]:
  """Local name -> plugin module or `module:attr` bound by every import statement of `name` (any depth)."""
  out = {}
  for node in ast.walk(mods[name].tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith(PACKAGE) and _resolve(mods, a.name):
          out[a.asname or a.name] = _resolve(mods, a.name)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        pkg = _package_of(mods, name).split(".")
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
      if not base.startswith(PACKAGE):
        continue
      for a in node.names:
        full = f"{base}.{a.name}"
        if full in mods:
          out[a.asname or a.name] = full
        elif base in mods:
          out[a.asname or a.name] = f"{base}:{a.name}"
  return out


def import_graph(mods: dict[str, Module]) -> dict[str, set[str]]:
  graph = {}
  for name in mods:
    targets = {t.partition(":")[0] for t in imports(mods, name).values()}
    graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}  # a package's own __init__
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Tarjan's strongly connected components with more than one module (or a module importing itself)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  out = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1 or v in graph.get(v, ()):
        out.append(sorted(comp))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """The import graph between the package's rooms and flat modules (`maxtext_rl_plugin.config`, `...rollout`,
  `...models`): an edge wherever a module of one imports a module of another."""

  def room(name: str) -> str:
    return ".".join(name.split(".")[:2])

  out: dict[str, set[str]] = {}
  for a, targets in graph.items():
    out.setdefault(room(a), set()).update(room(b) for b in targets if room(b) != room(a))
  return out


def layer(name: str) -> int | None:
  rel = name[len(PACKAGE) + 1 :] if name != PACKAGE else "__init__"
  parts = rel.split(".")
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in LAYERS:
      return LAYERS[".".join(parts[:n])]
  return None


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
  return [
      f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
      for a, targets in sorted(graph.items())
      for b in sorted(targets)
      if None not in (layer(a), layer(b)) and layer(b) > layer(a)
  ]


def flat_modules(mods: dict[str, Module]) -> list[str]:
  """Modules directly at the package top (not `__init__`, not a subpackage)."""
  return sorted(
      n for n, m in mods.items() if n.count(".") == 1 and m.path.parent == ROOTS[PACKAGE] and m.path.name != "__init__.py"
  )


def line_counts(mods: dict[str, Module]) -> dict[str, int]:
  return {n: len(m.text.splitlines()) for n, m in mods.items()}


def disable_comments(mods: dict[str, Module]) -> int:
  return sum(m.text.count("pylint: disable") for m in mods.values())


# --- the argv walk ---


def _functions(mod: Module) -> dict[str, ast.FunctionDef]:
  """Top-level functions of a module by name (methods are not followed: argv reaches none)."""
  return {n.name: n for n in mod.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _names(node: ast.AST) -> set[str]:
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _carries(expr: ast.AST, tainted: set[str]) -> bool:
  """Whether `expr` passes argv on: a tainted name, possibly indexed, sliced, starred, listed or wrapped in
  `list(...)`/`tuple(...)`; never a call's result (a call consumes argv and returns something else)."""
  if isinstance(expr, ast.Name):
    return expr.id in tainted
  if isinstance(expr, (ast.Subscript, ast.Starred)):
    return _carries(expr.value, tainted)
  if isinstance(expr, (ast.List, ast.Tuple)):
    return any(_carries(e, tainted) for e in expr.elts)
  if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("list", "tuple"):
    return any(_carries(a, tainted) for a in expr.args)
  if isinstance(expr, ast.IfExp):
    return _carries(expr.body, tainted) or _carries(expr.orelse, tainted)
  return False


def _callee(mods: dict[str, Module], where: str, func: ast.AST) -> tuple[str, str] | None:
  """(module, function) a call's target names inside the plugin: `f(...)` (a function of the module or imported by
  name) or `alias.f(...)` (a function of an imported module)."""
  names = imports(mods, where)
  if isinstance(func, ast.Name):
    if func.id in _functions(mods[where]):
      return where, func.id
    target = names.get(func.id, "")
    if ":" in target:
      mod, _, attr = target.partition(":")
      return (mod, attr) if attr in _functions(mods[mod]) else None
    return None
  if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
    target = names.get(func.value.id)
    if target and ":" not in target and func.attr in _functions(mods[target]):
      return target, func.attr
  return None


def _parameters(fn: ast.FunctionDef) -> list[str]:
  return [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]


def _tainted_calls(mods: dict[str, Module], mod: str, fname: str, params: set[str]):
  """(callee, its parameters that receive argv) for each call of `mod.fname` that passes argv on, in source order."""
  fn = _functions(mods[mod])[fname]
  tainted = set(params)
  for node in ast.walk(fn):  # a name assigned from argv anywhere in the body carries it
    if isinstance(node, ast.Assign) and _carries(node.value, tainted):
      tainted |= {t.id for t in node.targets if isinstance(t, ast.Name)}
  for call in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
    target = _callee(mods, mod, call.func)
    if target is None:
      continue
    names = _parameters(_functions(mods[target[0]])[target[1]])
    got = {names[i] for i, a in enumerate(call.args) if i < len(names) and _carries(a, tainted)}
    got |= {k.arg for k in call.keywords if k.arg and _carries(k.value, tainted)}
    if got:
      yield target, got


def argv_walk(mods: dict[str, Module], start: tuple[str, str] = (f"{PACKAGE}.train_rl", "main")) -> dict:
  """The walk argv takes from `train_rl.main`, defined precisely:

  * a stop is a plugin function that receives argv: `train_rl.main`'s first parameter, then every parameter bound to
    an argument that carries argv (`_carries`: the tainted name itself, an index or slice of it, a list, tuple or
    star of those); inside a function, a name assigned (`x = ...`) from an expression that carries argv is tainted
    too. A call's return value is never tainted: what a function makes of argv (a parsed config) is not argv;
  * calls are resolved statically through the module's imports (any depth) and its top-level functions, and visited
    in source order, depth first: a function reached twice is read twice (each call is a stop), except a call into a
    function already on the walk's stack (recursion);
  * a **climb back** is a return from a stop to its caller in another file (a reader who followed argv down into a
    file walks back up to one they had left); a **re-entry** is arriving (by a call or a return) in a file left earlier.

  Returns {stops, files, climbs, reentries, path}.
  """
  stack: list[tuple[str, str]] = []
  stops: list[str] = []
  files: list[str] = []  # the file of each step of the walk: entering a stop, and returning to its caller
  climbs = 0

  def visit(mod: str, fname: str, params: set[str]) -> None:
    nonlocal climbs
    stack.append((mod, fname))
    stops.append(f"{mod}.{fname}")
    files.append(mod)
    for target, got in _tainted_calls(mods, mod, fname, params):
      if target in stack:
        continue
      visit(*target, got)
      files.append(mod)
      climbs += target[0] != mod
    stack.pop()

  visit(*start, {_parameters(_functions(mods[start[0]])[start[1]])[0]})
  reentries, left = 0, set()
  for prev, cur in zip(files, files[1:]):
    if cur != prev:
      left.add(prev)
      reentries += cur in left
  return {"stops": len(stops), "files": len(set(files)), "climbs": climbs, "reentries": reentries, "path": stops}


# Issue 60: who may take the whole config. The commands, `config/` (which makes it), `run/` (which builds the run from
# it), `aot/`, `bench/` and `launch/`; every other room takes a settings object built from it in one place
# (`X.from_config`). Nothing else takes it (`config_takers`: 81 functions at 74f036c, 65 at 1ffb370, 0 since).
WHOLE_CONFIG_ROOMS = {
    "config",
    "run",
    "aot",
    "bench",
    "launch",
    "train_rl",
    "compile_rl",
    "export_lora",
    "train_rm",
    "cli",
}
CONFIG_PARAMETERS = {"config", "cfg"}
# The config under another name is still the config: a parameter annotated with MaxText's config types counts too.
CONFIG_ANNOTATIONS = re.compile(r"\b(HyperParameters|MaxTextConfig|RLConfig|PluginConfig)\b")
# An engine's spec module carries the engine's own config checks (rollout/engines.py `EngineSpec`): a third-party
# engine reads its own keys there, which no settings object of the plugin's can anticipate. Only those modules.
ENGINE_SPEC_MODULE = re.compile(rf"^{PACKAGE}\.rollout\.[a-z0-9_]+_spec$")


def config_takers(mods: dict[str, Module]) -> dict[str, list[str]]:
  """Functions and methods outside `WHOLE_CONFIG_ROOMS` with a parameter named `config`/`cfg` (the config by its
  name), a settings builder (`from_config`, `of`) excepted: that is the one place a room reads the config."""
  out: dict[str, list[str]] = {}
  for name, mod in mods.items():
    rel = name.split(".")[1:] if name.startswith(f"{PACKAGE}.") else []
    if not rel or rel[0] in WHOLE_CONFIG_ROOMS or ENGINE_SPEC_MODULE.match(name):
      continue
    for node in ast.walk(mod.tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in ("from_config", "of"):
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        if CONFIG_PARAMETERS & {a.arg for a in args} or any(
            a.annotation is not None and CONFIG_ANNOTATIONS.search(ast.unparse(a.annotation)) for a in args
        ):
          out.setdefault(name, []).append(node.name)
  return out


def numbers() -> dict:
  mods = modules()
  graph = import_graph(mods)
  walk = argv_walk(mods)
  return {
      "flat_modules": len(flat_modules(mods)),
      "config_modules_at_top": [n for n in flat_modules(mods) if CONFIG_NAMES.match(n.rpartition(".")[2])],
      "cycles": cycles(graph),
      "package_cycles": cycles(package_graph(graph)),
      "arrows_up": arrows_up(graph),
      "long_modules": {n: c for n, c in line_counts(mods).items() if c > MAX_LINES},
      "pylint_disables": disable_comments(mods),
      "argv_walk": {k: v for k, v in walk.items() if k != "path"},
      "config_takers": {n: len(f) for n, f in sorted(config_takers(mods).items())},
      "config_takers_total": sum(len(f) for f in config_takers(mods).values()),
  }


# --- the checks ---


def test_no_configuration_module_at_the_package_top():
  mods = modules()
  assert not [n for n in flat_modules(mods) if CONFIG_NAMES.match(n.rpartition(".")[2])]
  assert f"{PACKAGE}.config.schema" in mods and f"{PACKAGE}.config.key_status" in mods


def test_at_most_22_flat_modules():
  flat = flat_modules(modules())
  assert len(flat) <= MAX_FLAT, flat


def test_every_module_has_a_layer():
  assert not [n for n in modules() if layer(n) is None]


def test_no_import_cycle():
  assert not cycles(import_graph(modules()))


def test_no_import_cycle_between_packages():
  """No two rooms import each other, through any of their modules (issue 60: config/early_checks imported
  rollout/vllm_maxtext while rollout/vllm_config imported config/early_checks; each engine's checks now live with it)."""
  assert not cycles(package_graph(import_graph(modules())))
  assert package_graph({"p.a.x": {"p.b.y"}, "p.b.z": {"p.a.w"}, "p.a.w": {"p.a.x"}}) == {"p.a": {"p.b"}, "p.b": {"p.a"}}


def test_cycle_finder_finds_a_cycle():
  """Tarjan's components over a graph with a known cycle and a known acyclic tail (the finder can fail)."""
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert not cycles({"a": {"b"}, "b": {"c"}, "c": set()})


def test_imports_point_down():
  assert not arrows_up(import_graph(modules()))


def test_no_module_over_500_lines_but_the_key_status_table():
  long = {n: c for n, c in line_counts(modules()).items() if c > MAX_LINES and n not in LONG_ALLOWED}
  assert not long


def test_at_most_80_pylint_disables():
  assert disable_comments(modules()) <= MAX_DISABLES


def test_argv_walk_climbs_back_at_most_22_times():
  walk = argv_walk(modules())
  assert walk["path"][0] == f"{PACKAGE}.train_rl.main" and len(walk["path"]) > 1
  assert walk["climbs"] <= MAX_CLIMBS, walk["path"]


def test_the_whole_config_reaches_no_function_outside_its_rooms():
  """Issue 60: outside the commands, `config/`, `run/`, `aot/`, `bench/`, `launch/` and the engine spec modules, code
  takes settings built from the config in one place, never the config (by its name or its type)."""
  assert not config_takers(modules())
  src = {
      f"{PACKAGE}.data.x": "def f(config):\n  pass\ndef from_config(config):\n  pass\n",
      f"{PACKAGE}.run.y": "def g(cfg):\n  pass\n",
      f"{PACKAGE}.lora": "def h(hp: 'pyconfig.HyperParameters'):\n  pass\ndef k(rank: int):\n  pass\n",
      f"{PACKAGE}.rollout.mine_spec": "def check(config):\n  pass\n",
      f"{PACKAGE}.rollout.mine": "def check(config):\n  pass\n",
  }
  assert config_takers({n: Module(n, pathlib.Path(n), ast.parse(t), t) for n, t in src.items()}) == {
      f"{PACKAGE}.data.x": ["f"],
      f"{PACKAGE}.lora": ["h"],
      f"{PACKAGE}.rollout.mine": ["check"],
  }


def test_argv_walk_on_a_known_program():
  """The walk on three tiny modules, counted by hand: main -> a.f -> a.g (same file) -> b.h, back up to a.g (climb 1),
  back up to main (climb 2); main's second call reads a.f, a.g, b.h again (climbs 3 and 4). `b.unrelated` and
  `a.later` receive what was made of argv, not argv: not stops. Files: train_rl a a b a a train_rl a a b a a train_rl,
  six arrivals in a file left earlier."""
  src = {
      f"{PACKAGE}.train_rl": "from maxtext_rl_plugin import a\ndef main(argv):\n  x = list(argv)\n  r = a.f(x[1:])\n"
      "  a.f(argv)\n  a.later(r)\n",
      f"{PACKAGE}.a": "from maxtext_rl_plugin import b\ndef f(args):\n  g(args)\n  b.unrelated(len(args))\n"
      "def g(more):\n  b.h(more[0])\ndef later(r):\n  return r\n",
      f"{PACKAGE}.b": "def h(first):\n  return first\ndef unrelated(n):\n  return n\n",
  }
  mods = {n: Module(n, pathlib.Path(n.replace(".", "/") + ".py"), ast.parse(t), t) for n, t in src.items()}
  walk = argv_walk(mods)
  once = [f"{PACKAGE}.a.f", f"{PACKAGE}.a.g", f"{PACKAGE}.b.h"]
  assert walk["path"] == [f"{PACKAGE}.train_rl.main", *once, *once]
  assert walk["climbs"] == 4 and walk["files"] == 3 and walk["reentries"] == 6


if __name__ == "__main__":
  for key, value in numbers().items():
    print(f"{key}: {value}")
