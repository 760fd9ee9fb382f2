"""Name -> object discovery through `importlib.metadata` entry points.

setup.cfg registers the plugin's trainer, configs, reward functions and rollout engines in the groups
below; other installed packages can add their own under the same groups, and `rollout_engine=NAME` /
`reward_functions=NAME` resolve through here before falling back to built-ins.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

GROUPS = {
    "trainers": "maxtext_rl_plugin.trainers",
    "configs": "maxtext_rl_plugin.configs",
    "reward_functions": "maxtext_rl_plugin.reward_functions",
    "rollout_engines": "maxtext_rl_plugin.rollout_engines",
}


def entry_points(kind: str) -> dict[str, metadata.EntryPoint]:
  return {ep.name: ep for ep in metadata.entry_points(group=GROUPS[kind])}


def load(kind: str, name: str) -> Any:
  """Load the object registered as `name` in group `kind`; KeyError lists what is registered."""
  eps = entry_points(kind)
  if name not in eps:
    raise KeyError(f"no {kind} entry named '{name}' (registered: {', '.join(sorted(eps)) or 'none'})")
  return eps[name].load()


def describe() -> dict[str, list[str]]:
  return {kind: sorted(entry_points(kind)) for kind in GROUPS}
