"""Name -> object discovery through `importlib.metadata` entry points.

setup.cfg registers the plugin's trainer, configs, reward functions, rollout engines, policy losses and advantage
estimators in the groups below, exactly as another installed package registers its own: `reward_functions=NAME`,
`rollout_engine=NAME` (each entry a light `rollout/engines.EngineSpec`), `rl.loss_algo=NAME` and
`rl.advantage_estimator=NAME` resolve through here (docs/extending.md). The built-ins are entries like any other, so a
third-party engine, loss or estimator is selected the way `embedded` or `grpo` is.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

from maxtext_rl_plugin.errors import ConfigError

GROUPS = {
    "trainers": "maxtext_rl_plugin.trainers",
    "configs": "maxtext_rl_plugin.configs",
    "reward_functions": "maxtext_rl_plugin.reward_functions",
    "rollout_engines": "maxtext_rl_plugin.rollout_engines",
    "policy_losses": "maxtext_rl_plugin.policy_losses",
    "advantage_estimators": "maxtext_rl_plugin.advantage_estimators",
}
# What the entries of a group are called in a refusal.
_WHAT = {
    "policy_losses": "policy losses",
    "advantage_estimators": "advantage estimators",
    "rollout_engines": "rollout engines",
}


def entry_points(kind: str) -> dict[str, metadata.EntryPoint]:
  return {ep.name: ep for ep in metadata.entry_points(group=GROUPS[kind])}


def names(kind: str) -> tuple[str, ...]:
  """The names registered in group `kind`, sorted (the choices of the key that selects one; no entry is loaded)."""
  return tuple(sorted(entry_points(kind)))


def load(kind: str, name: str) -> Any:
  """Load the object registered as `name` in group `kind`; KeyError lists what is registered."""
  eps = entry_points(kind)
  if name not in eps:
    raise KeyError(f"no {kind} entry named '{name}' (registered: {', '.join(sorted(eps)) or 'none'})")
  return eps[name].load()


class UnknownNameError(ConfigError, ValueError):
  """A name no installed package registered (or whose entry is not the contract's object): a `ConfigError` for the
  user, a `ValueError` for a library caller that passed the name as an argument."""


def unknown(kind: str, key: str, value: Any, also: tuple[str, ...] = ()) -> ConfigError:
  """The one-line refusal of a name no installed package registered in group `kind`, listing those that are (after
  `also`: a key's values that name no entry, e.g. rollout_engine's 'auto')."""
  registered = names(kind)
  listed = ", ".join([*also, *registered]) or "none"
  # No entry at all, not even the plugin's own: the installed metadata predates the group (an editable install whose
  # setup.cfg gained it since), which the message says rather than calling every name unknown.
  stale = "" if registered else "; the plugin's own entries are missing too: reinstall it (pip install -e .)"
  return ConfigError(
      f"invalid value for '{key}'={value!r}: expected one of {listed} (the registered {_WHAT.get(kind, kind)}: "
      f"entry-point group {GROUPS[kind]}, docs/extending.md{stale})"
  )


@functools.cache
def load_typed(kind: str, name: str, expected: type, key: str) -> Any:
  """The entry `name` of group `kind`, which must be an instance of `expected` (the contract); loaded once per process.

  An unknown name and an entry that is not the contract's object are one-line `ConfigError`s naming `key`; an entry
  whose import fails says which entry point failed and why."""
  eps = entry_points(kind)
  if name not in eps:
    raise UnknownNameError(str(unknown(kind, key, name)))
  ep = eps[name]
  try:
    obj = ep.load()
  except (ImportError, AttributeError, NameError, SyntaxError, TypeError, ValueError, RuntimeError) as e:
    raise ConfigError(f"{key}: entry point '{name}' ({ep.value}) failed to load: {type(e).__name__}: {e}") from None
  if not isinstance(obj, expected):
    raise UnknownNameError(
        f"{key}: entry point '{name}' ({ep.value}) is a {type(obj).__name__}, not a {expected.__module__}."
        f"{expected.__qualname__} (docs/extending.md)"
    )
  return obj


def describe() -> dict[str, list[str]]:
  return {kind: sorted(entry_points(kind)) for kind in GROUPS}
