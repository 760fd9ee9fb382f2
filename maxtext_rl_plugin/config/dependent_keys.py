"""Keys that mean something only while another key turns their feature on: set while it is off, they are refused.

`rl.agentic_max_turns=8` with `rl.use_agentic_rollout=false` changes nothing; accepting it silently would let a user
believe the run uses it. The rule is the one `lora.validate` applies to the `lora:` block (a `lora.*` key with
`lora.enable_lora=false`), for every family below: a dependent key whose value differs from its shipped default while
its switch is off is one line naming the key, the switch and how to turn it on. Both passes run it
(`validation._light_checks`): the config as written, before the schema's imports, and the typed config.

`DEFAULTS` holds each dependent key's shipped default (configs/rl.yml, or the schema's for a schema-only key);
tests/config/test_validation.py keeps them equal to the schema's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
  """`keys` (dotted, with their defaults) mean something only when `is_on(value of switch)`; `on` says how."""

  switch: str
  is_on: Callable[[Any], bool]
  on: str
  keys: dict[str, Any]


FAMILIES: tuple[Family, ...] = (
    Family(
        "rl.use_agentic_rollout",
        bool,
        "rl.use_agentic_rollout=true",
        {
            "rl.agentic_tools": ["calculator"],
            "rl.agentic_tool_parser": "qwen",
            "rl.agentic_max_turns": 4,
            "rl.agentic_turn_tokens": 0,
            "rl.agentic_max_tokens": 0,
            "rl.agentic_tool_timeout_s": 2.0,
        },
    ),
    Family("rl.dynamic_sampling", bool, "rl.dynamic_sampling=true", {"rl.max_refill_rounds": 3}),
    Family("rl.overlong_buffer_len", lambda v: v > 0, "rl.overlong_buffer_len > 0", {"rl.overlong_penalty_factor": 1.0}),
    Family("rl.rollout_is", lambda v: v != "off", "rl.rollout_is=truncate or mask", {"rl.rollout_is_cap": 2.0}),
    Family(
        "rl.verify_weight_sync",
        lambda v: v == "every_n",
        "rl.verify_weight_sync=every_n",
        {"rl.verify_weight_sync_every": 10},
    ),
    Family("rl.parity_check", lambda v: v == "every_n", "rl.parity_check=every_n", {"rl.parity_check_every": 10}),
    Family(
        "sft_warmup_steps", lambda v: v > 0, "sft_warmup_steps > 0", {"sft_learning_rate": 1.0e-3, "sft_batch_size": 16}
    ),
    Family("synthetic_task", lambda v: v == "products", "synthetic_task=products", {"synthetic_tool_rate": 0.0}),
)


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
