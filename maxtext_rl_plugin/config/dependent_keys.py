"""Keys that mean something only while another key turns their feature on: set while it is off, they are refused.

`rl.agentic_max_turns=8` with `rl.use_agentic_rollout=false` changes nothing; accepting it silently would let a user
believe the run uses it. The rule is the one `lora.validate` applies to the `lora:` block (a `lora.*` key with
`lora.enable_lora=false`), for every family below: a dependent key whose value differs from its shipped default while
its switch is off is one line naming the key, the switch and how to turn it on. Both passes run it
(`validation._light_checks`): the config as written, before the schema's imports, and the typed config.

A key's family is its field's rule (`KeyRule.needs` in config/fields.py, config/rl_fields.py: `rl.dynamic_sampling=true`,
`rl.overlong_buffer_len > 0`), and its default is the field's: `FAMILIES` is derived from them (config/rules.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from maxtext_rl_plugin.config import key_rule
from maxtext_rl_plugin.config import rules
from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
  """`keys` (dotted, with their defaults) mean something only when `is_on(value of switch)`; `on` says how."""

  switch: str
  is_on: Callable[[Any], bool]
  on: str
  keys: dict[str, Any]


def _families() -> tuple[Family, ...]:
  """One family per switch, from the fields whose rule names it (`KeyRule.needs`), with the fields' defaults."""
  grouped: dict[str, dict[str, Any]] = {}
  for key, (needs, default) in rules.dependents().items():
    grouped.setdefault(needs, {})[key] = default
  out = []
  for needs, keys in grouped.items():
    switch, is_on = key_rule.condition(needs)
    out.append(Family(switch, is_on, needs, keys))
  return tuple(out)


FAMILIES: tuple[Family, ...] = _families()


def _get(config: Any, key: str) -> Any:
  """The value of a dotted key; `Unresolved` (the first pass) or AttributeError when it is not known."""
  value = config
  for part in key.split("."):
    value = getattr(value, part)
  return value


def _same(value: Any, default: Any) -> bool:
  if isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value) == default
  if isinstance(default, list) and isinstance(value, (list, tuple)):
    return list(value) == default
  return value == default


def check(config: Any, user_keys: frozenset[str] | None = None) -> None:
  """Refuse a dependent key set (to a non-default value) while its switch is off (module docstring). A key or switch
  the first pass cannot type is skipped there (the typed pass decides). `user_keys`: the keys the user set (None:
  unknown, every key counts); a key only a shipped yml sets is not the user's to drop (configs/cpu_demo.yml's
  sft_learning_rate with sft_warmup_steps=0 on the command line), and it changes nothing with its switch off."""
  for family in FAMILIES:
    try:
      switch = _get(config, family.switch)
    except (Unresolved, AttributeError):
      continue
    if switch is None or family.is_on(switch):
      continue
    for key, default in family.keys.items():
      if user_keys is not None and key not in user_keys:
        continue
      try:
        value = _get(config, key)
      except (Unresolved, AttributeError):
        continue
      if value is not None and not _same(value, default):
        shown = str(switch).lower() if isinstance(switch, bool) else repr(switch)
        raise ConfigError(
            f"config key '{key}'={value!r} has no effect with {family.switch}={shown}; set {family.on} " "or drop the key"
        )
