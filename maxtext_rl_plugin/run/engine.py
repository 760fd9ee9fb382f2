"""The run's rollout engine: which one `rollout_engine` names (`auto` included), and the engine built with its settings.

Every decision here reads what the engines declare (`rollout/engines.EngineSpec`: capabilities, `auto`, `bind`), found
by name through the entry points, never an engine's name: an engine a third party registers is chosen, bound and
checked exactly as the built-ins are (tests/rollout/test_engines.py scans run/ and aot/ for engine names).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

from absl import logging
from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
from maxtext.utils import model_creation_utils

from maxtext_rl_plugin import pathways
from maxtext_rl_plugin.rollout import decode
from maxtext_rl_plugin.rollout import embedded_spec
from maxtext_rl_plugin.rollout import engines


def backend() -> str:
  """The JAX backend a run samples on, as `AutoChoice.backends` names it: a Pathways run counts as 'tpu'."""
  return "tpu" if pathways.requested() else jax.default_backend()


def engine_per_process(capabilities: engines.Capabilities) -> bool:
  """Whether the engine runs one instance per JAX process even colocated (`Capabilities.per_host == 'process'`, off
  Pathways, whose single controller drives one engine): its rollouts then never span processes."""
  return capabilities.per_host == "process" and not pathways.requested()


def _auto_order() -> list[engines.EngineSpec]:
  """The registered engines `auto` may pick, highest `AutoChoice.rank` first (then by name)."""
  found = [s for s in engines.specs().values() if s.auto is not None]
  return sorted(found, key=lambda s: (-s.auto.rank, s.name))


def auto_choice(config: Any, on: str | None = None, installed: bool | None = None) -> tuple[str, list[tuple[str, str]]]:
  """(the engine `rollout_engine=auto` takes on backend `on` (default: this run's), the engines ranked above it that
  were passed over for this config, each with the reason). An engine is tried when `on` is one of its backends and
  the module it `needs` is installed (`installed`: True/False to suppose every such module present/absent, as the
  ahead-of-time compile does for its target); it is taken unless its `passes_over` gives a reason for this config or
  it cannot sample the config's `rollout_quantization` (`EngineSpec.precision_refusal`)."""
  on = on or backend()
  passed: list[tuple[str, str]] = []
  for spec in _auto_order():
    choice = spec.auto
    if on not in choice.backends:
      continue
    if choice.needs and not (installed if installed is not None else importlib.util.find_spec(choice.needs)):
      continue
    why = engines.load(choice.passes_over)(config) if choice.passes_over else None
    why = why or spec.precision_refusal(getattr(config, "rollout_quantization", ""))
    if not why:
      return spec.name, passed
    passed.append((spec.name, why))
  raise ValueError(f"rollout_engine=auto: no registered rollout engine declares the {on} backend (EngineSpec.auto)")


def resolve_name(config: Any) -> str:
  """`rollout_engine` resolved: 'auto' takes the highest-ranked engine that declares this backend and takes the config
  (`auto_choice`; the built-ins: vLLM on TPU and Pathways when installed and its route for the model is proven, one
  engine per host in multi-controller runs; else the embedded engine)."""
  if config.rollout_engine != engines.AUTO:
    return config.rollout_engine
  name, passed = auto_choice(config)
  if passed:  # auto takes a proven route only; rollout_engine=<name> runs it anyway, saying so
    logging.info("rollout_engine=auto resolved to '%s': %s", name, passed[-1][1])
  else:
    per_host = engine_per_process(engines.spec(name).capabilities) and jax.process_count() > 1
    logging.info(
        "rollout_engine=auto resolved to '%s' (backend %s%s)",
        name,
        jax.default_backend(),
        f"; one engine per host on {jax.process_count()} JAX processes" if per_host else "",
    )
  return name


def rollout_engine_factory(name: str, sampler_config: Any, mesh: jax.sharding.Mesh | None = None) -> Any:
  """A Tunix-constructible rollout engine: `functools.partial` of the `rollout/contract.RolloutEngine` subclass
  registered as `name` (rollout/engines.py) with the keyword arguments its spec's `bind` makes from the sampler's config
  on the rollout `mesh` (its settings; `config=` the config whole when the spec names no `bind`); its optional
  dependencies are checked first (`ensure_available`: vLLM's [tpu] extra)."""
  spec = engines.spec(name)
  engine = spec.load_engine()
  engine.ensure_available()
  arguments = engines.load(spec.bind)(sampler_config, mesh) if spec.bind else {"config": sampler_config}
  return functools.partial(engine, **arguments)


def decode_models(config: Any, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """MaxText's decode-capable models of the sampler's `config` on `mesh`, one per mode of `decode.MODES`, built
  abstractly (`nnx.eval_shape`: shapes only; the embedded engine merges their graphdefs with the actor's weights).

  A builder that takes the config whole: MaxText's model creation (`model_creation_utils.get_nnx_create_model_fn`)
  reads its HyperParameters itself. The ahead-of-time compile builds its sampler from the same (aot/programs.py)."""
  with decode.warnings_off(), logical_axis_rules(config.logical_axis_rules):
    return {
        mode: nnx.eval_shape(model_creation_utils.get_nnx_create_model_fn(config, mesh=mesh, model_mode=mode))
        for mode in decode.MODES
    }


def embedded_arguments(config: Any, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """The embedded engine's `bind` (rollout/embedded_spec.py): its settings and MaxText's abstract decode models."""
  return {"settings": embedded_spec.EmbeddedSettings.from_config(config), "decode_models": decode_models(config, mesh)}
