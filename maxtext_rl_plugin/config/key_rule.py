"""Each plugin key's rules, kept in its schema field: `KeyRule`, which config/rules.py derives the checks' tables from.

A plugin key is one field of config/fields.py: its type, default, bounds (pydantic's `ge`/`gt`/`le`/`lt`) and
description, and in `json_schema_extra` its `KeyRule` (`rule(...)`): where it is honoured (or why refused), what a
resume does when it changes, and the switch it depends on. As MaxText's `types.py` keeps a description per field, the
plugin keeps each key's rules with the key; the six tables that restated them are derived (config/rules.py).
Pure Python, imported by config/fields.py before any JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

NOTED = "noted"  # a resume may change it; the change is one `note:` line (run/meta.update_changes)
INVARIANT = "invariant"  # a resume that changes it is refused (run/meta.resume_invariants or run/identity.identity)
EXEMPT = "exempt: "  # + why a change needs no note (a check, a shape, the console)


@dataclasses.dataclass(frozen=True)
class KeyRule:
  """The rules of one plugin key besides its type, default, bounds and description (module docstring).

  status: `honoured (<where>)` or `refused: <why>`. resume: `noted`, `invariant` or `exempt: <why>`. needs: the
  switch that turns the key's feature on (`rl.dynamic_sampling=true`, `rl.overlong_buffer_len > 0`); set while it is
  off the key is refused. any_value: why a numeric key needs no bound. why: appended to a bound's refusal. items /
  items_ge / nonempty: a list key's items (named `items` in the refusal) are >= `items_ge`, the list non-empty."""

  status: str
  resume: str
  needs: str = ""
  any_value: str = ""
  why: str = ""
  items: str = ""
  items_ge: Optional[int] = None
  nonempty: bool = False

  def __post_init__(self):
    if not self.status.startswith(("honoured (", "refused: ")):
      raise ValueError(f"a key's status is 'honoured (<where>)' or 'refused: <why>', not {self.status!r}")
    if self.resume not in (NOTED, INVARIANT) and not (self.resume.startswith(EXEMPT) and self.resume[len(EXEMPT) :]):
      raise ValueError(f"a key's resume rule is {NOTED!r}, {INVARIANT!r} or 'exempt: <why>', not {self.resume!r}")
    if self.needs:
      condition(self.needs)  # parses, or raises here, when the schema is defined


def rule(status: str, resume: str, **more: Any) -> dict[str, Any]:
  """A field's `json_schema_extra`: its `KeyRule` as plain JSON (so `model_json_schema()` shows the rules too)."""
  return {"rule": dataclasses.asdict(KeyRule(status, resume, **more))}


def rule_of(field: Any) -> KeyRule | None:
  """The `KeyRule` a pydantic field carries, None for a field without one (MaxText's)."""
  extra = field.json_schema_extra
  return KeyRule(**extra["rule"]) if isinstance(extra, dict) and "rule" in extra else None


def condition(needs: str) -> tuple[str, Callable[[Any], bool]]:
  """`<switch>=<a>[ or <b>...]` (a bool as true/false) or `<switch> > <n>`: the switch's key and whether a value of it
  turns the feature on."""
  if " > " in needs:
    switch, _, bound = needs.partition(" > ")
    threshold = float(bound)
    return switch.strip(), lambda v: v > threshold
  switch, eq, values = needs.partition("=")
  if not eq or not switch.strip() or " " in switch.strip():
    raise ValueError(f"a key's switch is '<key>=<value>[ or <value>]' or '<key> > <number>', not {needs!r}")
  choices = {v.strip() for v in values.split(" or ")}
  return switch.strip(), lambda v: (str(v).lower() if isinstance(v, bool) else str(v)) in choices
