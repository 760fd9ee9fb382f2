"""Rollout engines by name: what each declares before it is imported (light: no JAX, no Tunix, no engine module).

`rollout_engine=NAME` resolves through the `maxtext_rl_plugin.rollout_engines` entry-point group (setup.cfg; the
built-ins register there like any third-party package). Each entry names an `EngineSpec`, not the engine class: the
first pass (config/precheck.py, before JAX is imported) must know an engine's capabilities and refusals within a second,
and importing an engine module pulls in JAX, Tunix and MaxText (~2 s and up). The spec says:

* `capabilities`: what the RL loop may ask of the engine beyond Tunix's `BaseRollout` (rollout/contract.py states the
  methods; the flags say which of them the engine honours, so no caller probes an engine with `hasattr`);
* `checks`: the engine's own refusals of a config, light functions of the config as written or typed (one
  `ConfigError` line each), run in both passes by config/early_checks.check_engine, then the refusal of a
  `rollout_quantization` its capabilities do not declare (`precision_refusal`); `typed_checks`: `module:function` paths
  of the ones that need the engine's heavier modules, imported and run by config/validation.py in the second pass only;
* `routing_refusal`: why this engine cannot report a given MoE model's routing (rl.router_replay, return_routed_experts);
* `engine`: `module:Class` of the `contract.RolloutEngine` subclass, imported when a run builds it (`load_engine`);
  `bind`: `module:function` of the keyword arguments the run builds it with (its settings, read from the config);
* `auto`: when `rollout_engine=auto` may pick it (run/engine.resolve_name);
* `aot_programs`: `module:function` of its rollout programs for `compile_topology` (aot/run.py).

The checks and `bind` take the config: they are the engine's own reading of it, in its spec module (an engine
registered by a third party reads its own keys, which no settings object of the plugin's can anticipate); the rest of
rollout/ takes settings. Nothing in run/, aot/ or config/ branches on an engine's name: they read these declarations,
so a registered engine is compiled, checked and built without a change there (tests/rollout/test_engines.py scans).

The name 'auto' is not an engine: it is the run's choice between the registered engines that declare `auto`
(run/engine.py), so it is accepted beside the registered names.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Literal

from maxtext_rl_plugin import registry
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import precision

AUTO = "auto"
GROUP = registry.GROUPS["rollout_engines"]

# How the trainer's weights reach the engine (resharding/sync.attach_to_rl_cluster):
# 'engine'  -- the engine takes the plugin's `resharding.sync.WeightSync` as its `weight_sync` attribute and runs it
#              inside its own `update_params` (chunked reshard onto its shardings, then the guard);
# 'wrapped' -- an nnx engine whose `update_params` the plugin wraps with the same sync (install_into_rl_cluster);
# 'own'     -- the engine maps, reshards and checks the weights itself (vLLM: another layout, its own session).
WeightSyncRoute = Literal["engine", "wrapped", "own"]
# When an instance samples only its own host's share of a batch in a multi-process run (the instance's `per_host`; the
# rows are then gathered across processes, run/experience.py):
# 'split'   -- only on a per-host sampler mesh: a disaggregated split per process (run/build.per_host_split); a
#              colocated engine is one program over every process's devices;
# 'process' -- one engine per JAX process in every multi-controller run, colocated too (each host's engine holds its
#              own copy of the weights on that host's devices, as vLLM does); on Pathways one controller drives one.
PerHost = Literal["split", "process"]


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What an engine can do for the RL loop; each flag gates one part of the contract (rollout/contract.py)."""

  # `take_routing()` returns the experts each token was routed to on MoE models (rl.router_replay,
  # return_routed_experts); False: it always returns None and the config checks refuse replay.
  routing_capture: bool = False
  # Samples a LoRA actor (the adapters merged into the weights it samples with).
  lora: bool = False
  # When it runs as one engine per host (`PerHost`): the run's build decides from it, before the engine exists, whether
  # rollouts may run ahead of the trainer across processes (distributed.check_asynchronous).
  per_host: PerHost = "split"
  # `generate_turn` (multi-turn episodes with tools, rl.use_agentic_rollout).
  multi_turn: bool = False
  # Per-row sampling keys from a global prompt index (`prompt_offset`): a row samples the same tokens however the batch
  # is split across calls and processes (disaggregated and per-host runs set it).
  row_keys: bool = False
  # `snapshot_weights()` / `release_snapshot()`: pins a weight version while a colocated trainer updates the arrays
  # it shares (rl.off_policy_steps > 0 on a colocated split).
  snapshots: bool = False
  # The config key whose dtype the engine samples in ('dtype': MaxText's compute dtype, as the trainer;
  # 'weight_dtype': the weights' dtype), for the parity gate's precision pairing (run/parity.py).
  sample_dtype_key: Literal["dtype", "weight_dtype"] = "dtype"
  # The quantized weight formats (`rollout_quantization` values besides 'none') it samples in; () = float weights only.
  quantized_weights: tuple[str, ...] = ()
  weight_sync: WeightSyncRoute = "wrapped"


@dataclasses.dataclass(frozen=True)
class AutoChoice:
  """When `rollout_engine=auto` may pick an engine (run/engine.resolve_name): the registered engines that declare
  one are tried by `rank`, highest first; the first whose backend, dependency and config allow it is the run's."""

  rank: int
  # JAX backends ('cpu', 'gpu', 'tpu') it is picked on; a Pathways run counts as 'tpu'.
  backends: tuple[str, ...]
  # A module that must be importable (an optional extra), found without importing it.
  needs: str = ""
  # 'module:function' of `f(sampler_config) -> str | None`: why `auto` passes this engine over for a config it would
  # sample differently or unproven (one clause, logged), or None.
  passes_over: str = ""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """One engine's declaration (see the module docstring); registered by an entry point in `GROUP`."""

  name: str
  engine: str  # 'module:Class' of the contract.RolloutEngine subclass
  capabilities: Capabilities
  checks: tuple[Callable[[Any], None], ...] = ()
  typed_checks: tuple[str, ...] = ()  # 'module:function', imported in the second pass only
  routing_refusal: Callable[[Any, str], str | None] | None = None
  summary: str = ""
  # Why it cannot sample the `rollout_quantization` formats its capabilities do not declare (one clause of the refusal's
  # line); '' gives the generic one.
  quantization_refusal: str = ""
  # 'module:function' of `f(sampler_config, mesh) -> dict`: the keyword arguments the engine is built with besides
  # Tunix's four (run/engine.rollout_engine_factory binds them); '' binds `config=` the sampler config whole.
  bind: str = ""
  auto: AutoChoice | None = None  # None: `auto` never picks it; only `rollout_engine=<name>` does
  # 'module:function' of `f(rs, compile_topology, trainer_resident) -> (programs, facts)`: the engine's rollout for the
  # ahead-of-time compile (aot/run.py); '' : the compile lists its rollout as not compiled.
  aot_programs: str = ""

  def precision_refusal(self, value: Any) -> str | None:
    """Why this engine cannot sample the precision a `rollout_quantization` value asks for (one line), or None: the
    formats it declares (`Capabilities.quantized_weights`) are the ones it serves (rollout/precision.py)."""
    return precision.refusal(self.name, value, self.capabilities.quantized_weights, self.quantization_refusal)

  def load_engine(self) -> Any:
    """The engine class (imports the engine's module: JAX, Tunix, its own dependencies)."""
    return load(self.engine)


def load(path: str) -> Any:
  """The object a 'module:attribute' path names (a spec's `engine`, `typed_checks`, `bind`, `aot_programs`)."""
  module, _, attr = path.partition(":")
  return getattr(importlib.import_module(module), attr)


def names() -> list[str]:
  """The registered engine names, sorted (reads the installed packages' metadata; imports nothing)."""
  return sorted(registry.entry_points("rollout_engines"))


def spec(name: str) -> EngineSpec:
  """The `EngineSpec` registered as `name`; one ConfigError line listing the registered names when there is none."""
  registered = registry.entry_points("rollout_engines")
  if name not in registered:
    raise ConfigError(
        f"invalid value for 'rollout_engine'={name!r}: expected one of {', '.join([AUTO, *sorted(registered)])} (the "
        f"registered rollout engines: entry-point group {GROUP})"
    )
  found = registered[name].load()
  if not isinstance(found, EngineSpec):
    raise ConfigError(
        f"rollout_engine={name}: the entry point {registered[name].value} in {GROUP} names a "
        f"{type(found).__name__}, not a maxtext_rl_plugin.rollout.engines.EngineSpec (metadata older than the plugin? "
        "reinstall it: pip install -e .)"
    )
  return found


def specs() -> dict[str, EngineSpec]:
  return {n: spec(n) for n in names()}
