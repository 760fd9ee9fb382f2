"""The checks' tables for the plugin's keys, derived from the fields' rules (config/key_rule.py, config/fields.py).

| rule | from the field | read by |
| --- | --- | --- |
| status: honoured (where) / refused (why) | `KeyRule.status` | key_status.status |
| bound | `ge`/`gt`/`le`/`lt` (a list: `KeyRule.items_ge`); else `KeyRule.any_value` | validation.RANGES / UNBOUNDED |
| choices | a `Literal[...]` type | early_checks.CHOICES (config/choices.py) |
| resume | `KeyRule.resume`: `noted`, `invariant`, `exempt: <why>` | run/meta.UPDATE_KEYS / RESUME_EXEMPT |
| switch | `KeyRule.needs`: `<switch>=<value>[ or <value>]`, `<switch> > 0` | dependent_keys.FAMILIES |

Light (pydantic, no JAX or MaxText), so the first pass (config/precheck) checks a plugin key's bound, choices and switch
before the schema's imports, from the same field the typed pass validates with. MaxText's own keys keep their tables
(config/key_status.py, config/choices.py, validation's MaxText rows): their fields are MaxText's.
"""

from __future__ import annotations

import functools
import operator
import typing
from typing import Any, Callable, Iterator, Literal

import annotated_types

from maxtext_rl_plugin.config import fields
from maxtext_rl_plugin.config import rl_fields
from maxtext_rl_plugin.config.key_rule import EXEMPT
from maxtext_rl_plugin.config.key_rule import KeyRule
from maxtext_rl_plugin.config.key_rule import rule_of

_CLASSES = (("rl.", rl_fields.PluginRLKeys), ("", fields.PluginKeys))


@functools.cache
def plugin_fields() -> dict[str, Any]:
  """Every plugin key (`rl.<key>` for the `rl:` block) -> its pydantic field, in the schema's order."""
  return {prefix + name: field for prefix, cls in _CLASSES for name, field in cls.model_fields.items()}


def rules() -> Iterator[tuple[str, KeyRule, Any]]:
  """(key, rule, field) of every plugin key (a field without a rule fails tests/config/test_rules.py)."""
  for key, field in plugin_fields().items():
    r = rule_of(field)
    if r is not None:
      yield key, r, field


@functools.cache
def statuses() -> dict[str, str]:
  """key -> `honoured (...)` / `refused: ...` (config/key_status.status reads it first)."""
  return {key: r.status for key, r, _ in rules()}


def resume_keys(kind: str) -> tuple[str, ...]:
  """The plugin keys whose resume rule is `kind` (`noted`, `invariant`)."""
  return tuple(key for key, r, _ in rules() if r.resume == kind)


def resume_exempt() -> dict[str, str]:
  """key -> why a resume may change it without a note."""
  return {key: r.resume[len(EXEMPT) :] for key, r, _ in rules() if r.resume.startswith(EXEMPT)}


def dependents() -> dict[str, tuple[str, Any]]:
  """key -> (its switch condition, its default) for every key that means something only while a switch is on."""
  return {key: (r.needs, field.default) for key, r, field in rules() if r.needs}


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
  """The choices of a `Literal[...]` or `Optional[Literal[...]]` type, None for any other."""
  for a in (annotation, *typing.get_args(annotation)):
    if typing.get_origin(a) is Literal:
      return typing.get_args(a)
  return None


@functools.cache
def choices() -> dict[str, tuple[Any, ...]]:
  """key -> its choices, for every `Literal[...]` plugin key (a list of choices is checked by pydantic, per item)."""
  out = {}
  for key, field in plugin_fields().items():
    if typing.get_origin(field.annotation) is list:
      continue
    found = literal_choices(field.annotation)
    if found is not None:
      out[key] = found
  return out


_BOUNDS = (
    (annotated_types.Ge, "ge", operator.ge, ">="),
    (annotated_types.Gt, "gt", operator.gt, ">"),
    (annotated_types.Le, "le", operator.le, "<="),
    (annotated_types.Lt, "lt", operator.lt, "<"),
)


def bounds(field: Any) -> list[tuple[Callable[[Any, Any], bool], str, Any]]:
  """(compare, symbol, limit) of the field's pydantic bounds (`ge=`, `gt=`, `le=`, `lt=`)."""
  out = []
  for meta in field.metadata:
    for kind, attr, compare, symbol in _BOUNDS:
      if isinstance(meta, kind):
        out.append((compare, symbol, getattr(meta, attr)))
  return out


def _bound_text(found: list[tuple[Any, str, Any]]) -> str:
  """`must be >= 1`, or `must be in [0, 100]` for a lower and an upper bound."""
  lows = [(s, v) for _, s, v in found if s in (">=", ">")]
  highs = [(s, v) for _, s, v in found if s in ("<=", "<")]
  if lows and highs:
    (ls, lv), (hs, hv) = lows[0], highs[0]
    return f"must be in {'[' if ls == '>=' else '('}{lv:g}, {hv:g}{']' if hs == '<=' else ')'}"
  return " and ".join(f"must be {s} {v:g}" for _, s, v in found)


def ranges() -> dict[str, tuple[Callable[[Any], bool], str]]:
  """key -> (accepts the value, what is expected) for every bounded plugin key: the schema's bounds, which pydantic
  checks in the typed pass, checked by the first pass too (config/validation.RANGES)."""
  out: dict[str, tuple[Callable[[Any], bool], str]] = {}
  for key, r, field in rules():
    if r.items_ge is not None:
      lo, nonempty = r.items_ge, r.nonempty
      what = f"must be a non-empty list of {r.items} >= {lo}" if nonempty else f"must be {r.items} >= {lo}"
      out[key] = (lambda v, lo=lo, nonempty=nonempty: (bool(v) or not nonempty) and all(t >= lo for t in v), what)
      continue
    found = bounds(field)
    if found:
      text = _bound_text(found) + (f" ({r.why})" if r.why else "")
      out[key] = (lambda v, found=tuple(found): all(compare(v, limit) for compare, _, limit in found), text)
  return out


def unbounded() -> dict[str, str]:
  """key -> why every value of this numeric key means something (no bound)."""
  return {key: r.any_value for key, r, _ in rules() if r.any_value}
