"""Rollout engines by name (rollout/engines.py) and the engine contract (rollout/contract.py).

An engine registered by a package that is not the plugin (a dist-info written here, put on the path) is found by
`rollout_engine=NAME`: its capabilities and its own refusals reach the first pass, and the run's build constructs its
class. An unknown name is one line listing the registered ones, before JAX is imported. No caller probes an engine
object with `hasattr`/`getattr`: they read the declared capabilities (AST scan of the packages that call engines).
"""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import subprocess
import sys
import textwrap

import pytest

from maxtext_rl_plugin import errors
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.config import precheck
from maxtext_rl_plugin.rollout import contract
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.rollout import engines
from maxtext_rl_plugin.rollout import vllm as vllm_rollout
from maxtext_rl_plugin.run import engine as run_engine

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/cpu_tiny.yml")
MOE = str(REPO / "configs/cpu_tiny_moe.yml")

# A third party's engine: its light spec (what the entry point names) and its engine class, in two modules.
_SPEC = """
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import engines


def refuse_long_targets(pc):
  if int(pc.max_target_length) > 4096:
    raise ConfigError(f"rollout_engine=toy samples at most 4096 positions (max_target_length={pc.max_target_length})")


ENGINE = engines.EngineSpec(
    name="toy",
    engine="toy_engine_impl:ToyRollout",
    capabilities=engines.Capabilities(multi_turn=True, weight_sync="wrapped"),
    checks=(refuse_long_targets,),
)
"""
_IMPL = """
from maxtext_rl_plugin.rollout import contract
import toy_engine_spec


class ToyRollout(contract.RolloutEngine):
  spec = toy_engine_spec.ENGINE

  def __init__(self, rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None, *, config=None):
    self.config = config

  def generate(self, prompts, rollout_config, **kwargs):
    raise NotImplementedError

  def get_per_token_logps(self, prompt_tokens, completion_tokens):
    raise NotImplementedError

  def update_params(self, params, filter_types=None):
    raise NotImplementedError

  def pad_id(self):
    return 0

  def eos_id(self):
    return 1

  def model(self):
    return None

  def generate_turn(self, contexts, *, num_generations, max_new_tokens, rollout_config, rng, stop_strings=()):
    return []
"""


def _install_toy(root: pathlib.Path) -> pathlib.Path:
  """A package 'toy-engine' as pip would leave it in site-packages: two modules and a dist-info whose
  entry_points.txt registers `toy` in the plugin's rollout_engines group. Returns the folder to put on the path."""
  (root / "toy_engine_spec.py").write_text(_SPEC)
  (root / "toy_engine_impl.py").write_text(_IMPL)
  info = root / "toy_engine-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine\nVersion: 0.1\n")
  # `classy` names the engine class instead of its spec (as the metadata of an install older than the contract does).
  (info / "entry_points.txt").write_text(
      f"[{engines.GROUP}]\ntoy = toy_engine_spec:ENGINE\nclassy = toy_engine_impl:ToyRollout\n"
  )
  return root


@pytest.fixture(name="toy")
def toy_fixture(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(_install_toy(tmp_path)))
  yield tmp_path
  for name in ("toy_engine_spec", "toy_engine_impl"):
    sys.modules.pop(name, None)


def test_a_third_party_engine_is_found_by_name_and_built(toy):
  del toy
  assert engines.names() == ["classy", "embedded", "toy", "vllm"]
  spec = engines.spec("toy")
  assert spec.capabilities.multi_turn and not spec.capabilities.routing_capture and not spec.capabilities.snapshots
  # The first pass accepts the name, and runs the engine's own refusal (one line), before the schema's imports.
  precheck.precheck([TINY, "rollout_engine=toy"])
  with pytest.raises(errors.ConfigError, match=r"^rollout_engine=toy samples at most 4096 positions") as e:
    precheck.precheck([TINY, "rollout_engine=toy", "max_target_length=8192"])
  assert "\n" not in str(e.value)
  # An entry that names the class, not its spec: one line, in the first pass too.
  with pytest.raises(errors.ConfigError, match=r"^rollout_engine=classy: its entry point \(toy_engine_impl:ToyRollout\)"):
    precheck.precheck([TINY, "rollout_engine=classy"])
  # Router replay needs an engine that declares routing capture: the toy one does not.
  with pytest.raises(errors.ConfigError, match="needs rollout_engine=embedded or vllm: the toy engine does not report"):
    config_lib.load_config([MOE, "rollout_engine=toy", "rl.router_replay=true"])
  # The run's build constructs the registered class (bound to the sampler config), through the contract.
  cfg = config_lib.load_config([TINY, "rollout_engine=toy"])
  factory = run_engine.rollout_engine_factory("toy", cfg)
  assert isinstance(factory, functools.partial) and factory.keywords == {"config": cfg}
  engine = factory(rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None)
  assert isinstance(engine, contract.RolloutEngine) and engine.capabilities is spec.capabilities
  assert engine.take_routing() is None and not engine.per_host  # the contract's defaults
  with pytest.raises(NotImplementedError, match="capabilities.snapshots"):
    engine.snapshot_weights()


def test_an_unknown_engine_is_one_line_listing_the_registered_ones_before_jax(toy):
  """In a fresh process with the toy package on the path: the first pass refuses the name and JAX is never imported
  (the registry reads the installed metadata; no engine module is imported)."""
  code = textwrap.dedent(f"""
      import sys
      from maxtext_rl_plugin import errors
      from maxtext_rl_plugin.config import precheck
      try:
        precheck.precheck([{TINY!r}, "rollout_engine=nope"])
      except errors.ConfigError as e:
        print(e)
      print("jax imported:", "jax" in sys.modules)
      """)
  out = subprocess.run(
      [sys.executable, "-c", code],
      cwd=toy,
      env={"PYTHONPATH": f"{toy}:{REPO}", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
      capture_output=True,
      text=True,
      check=True,
  ).stdout.splitlines()
  assert out[0].startswith(
      "invalid value for 'rollout_engine'='nope': expected one of auto, classy, embedded, toy, vllm ("
  ), out
  assert engines.GROUP in out[0] and out[1] == "jax imported: False", out


def _parameters(fn) -> list[tuple]:
  """A method's parameters as a caller sees them: names, kinds, defaults (annotations are the engine's own text)."""
  return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_built_in_engines_implement_the_contract():
  """Each engine's class carries the spec its entry point names; generate_turn answers the contract's signature."""
  for name, cls in (("embedded", embedded.EmbeddedRollout), ("vllm", vllm_rollout.VllmRollout)):
    spec = engines.spec(name)
    assert spec.load_engine() is cls and cls.spec is spec and issubclass(cls, contract.RolloutEngine)
    assert _parameters(cls.generate_turn) == _parameters(contract.RolloutEngine.generate_turn)
  # What differs between them is declared, not probed: vLLM seeds its own sampler and holds its own weights.
  emb, vll = engines.spec("embedded").capabilities, engines.spec("vllm").capabilities
  assert (emb.row_keys, emb.snapshots, emb.weight_sync, emb.sample_dtype_key) == (True, True, "engine", "dtype")
  assert (vll.row_keys, vll.snapshots, vll.weight_sync, vll.sample_dtype_key) == (False, False, "own", "weight_dtype")


def test_every_path_a_built_in_spec_names_resolves():
  """A spec names its engine, its typed checks, its binding, its AOT programs and its `auto` refusal by 'module:attr'
  (imported only where used): each must import and name a callable (a typo would surface at a run's build only)."""
  for name in ("embedded", "vllm"):
    spec = engines.spec(name)
    paths = [spec.engine, *spec.typed_checks, spec.bind, spec.aot_programs, spec.auto.passes_over if spec.auto else ""]
    for path in filter(None, paths):
      assert callable(engines.load(path)), path


# The contract's members (rollout/contract.py) and the names the sync used to mark a wrapped engine with.
_ENGINE_MEMBERS = {
    "take_routing",
    "prompt_offset",
    "snapshot_weights",
    "release_snapshot",
    "per_host",
    "weight_sync",
    "generate_turn",
    "capabilities",
    "maxtext_rl_weight_sync",
}


def engine_probes(source: str) -> list[str]:
  """`hasattr(x, ...)` / `getattr(x, ...)` calls whose object is an engine (its text names a rollout) or whose attribute
  is a contract member: a caller asking the object what it can do instead of reading its declared capabilities."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")):
      continue
    if len(node.args) < 2:
      continue
    target = ast.unparse(node.args[0])
    attr = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
    on_engine = "rollout" in target.lower() or target.endswith("engine")
    if on_engine or attr in _ENGINE_MEMBERS:
      found.append(f"line {node.lineno}: {ast.unparse(node)}")
  return found


def test_the_probe_finder_finds_the_probes_the_contract_replaced():
  """The scan on the calls main had before the contract (it can fail), and on what replaced them (it passes)."""
  before = textwrap.dedent("""
      take = getattr(run.rl_cluster.rollout, "take_routing", None)
      keyed = hasattr(rollout, "prompt_offset")
      ok = not hasattr(rl_cluster.rollout, "snapshot_weights")
      if hasattr(type(rl_cluster.rollout), "weight_sync"): pass
      if getattr(x, "maxtext_rl_weight_sync", None) is not None: pass
      """)
  assert len(engine_probes(before)) == 5
  after = "routing = run.rl_cluster.rollout.take_routing()\nkeyed = rollout.capabilities.row_keys\nn = getattr(f, 'x')"
  assert not engine_probes(after)


def test_no_caller_probes_an_engine():
  root = REPO / "maxtext_rl_plugin"
  probes = {
      str(path.relative_to(REPO)): engine_probes(path.read_text(encoding="utf-8"))
      for package in ("run", "resharding", "agentic", "aot", "bench")
      for path in sorted((root / package).rglob("*.py"))
  }
  assert not {k: v for k, v in probes.items() if v}


# Where an engine's name may be compared: its own spec module (rollout/<name>_spec.py declares it) and nowhere else.
_SPEC_MODULE = "_spec.py"


def engine_name_branches(source: str, names: set[str]) -> list[str]:
  """Comparisons (`==`, `!=`, `in`, `not in`) and dict keys that hold a registered engine's name as a string literal:
  code that decides by which engine runs, where it should read the engine's declaration (`EngineSpec`)."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
    elif isinstance(node, ast.Dict):
      operands = [k for k in node.keys if k is not None]
    else:
      continue
    literals = {
        n.value for op in operands for n in ast.walk(op) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    if literals & names:
      found.append(f"line {node.lineno}: {ast.unparse(node)[:100]}")
  return found


def test_the_name_branch_finder_finds_the_branches_the_specs_replaced():
  """The scan on lines main had before the engines declared their auto choice, per-host policy, AOT programs and
  quantization refusal (it can fail), and on what replaced them (it passes)."""
  names = {"embedded", "vllm"}
  before = textwrap.dedent("""
      name = "vllm" if on_tpu and importlib.util.find_spec("vllm") is not None else "embedded"
      if name == "vllm" and head_dim_reason: pass
      distributed.check_asynchronous(k, rs.disaggregated or (engine_name == "vllm" and not pathways.requested()))
      if engine == "vllm": pass
      _WHY = {"vllm": "tpu-inference 0.32.0 ..."}
      if engine in ("embedded", "vllm"): pass
      """)
  assert len(engine_name_branches(before, names)) == 6  # find_spec("vllm") is not None: the auto policy's dependency
  after = textwrap.dedent("""
      name, passed = auto_choice(config)
      distributed.check_asynchronous(k, rs.disaggregated or run_engine.engine_per_process(engine))
      if engine == engines.AUTO: pass
      builder = engines.spec(compiled).aot_programs
      log("rollout_engine=vllm runs it anyway")
      """)
  assert not engine_name_branches(after, names)


def test_nothing_outside_an_engines_spec_branches_on_its_name():
  """Issue 60: a registered engine is chosen (`auto`), checked, built, compiled ahead of time and gated without a change
  in run/, aot/ or config/: they read its `EngineSpec`, never its name. Only the spec modules may name an engine."""
  root = REPO / "maxtext_rl_plugin"
  names = set(engines.names())
  found = {
      str(path.relative_to(REPO)): engine_name_branches(path.read_text(encoding="utf-8"), names)
      for path in sorted(root.rglob("*.py"))
      if not path.name.endswith(_SPEC_MODULE)
  }
  assert not {k: v for k, v in found.items() if v}
