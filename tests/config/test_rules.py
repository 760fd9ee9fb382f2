"""Each plugin key's rules live in its field (config/key_rule.py, config/fields.py, config/rl_fields.py), and what they
claim is what the run does: a key marked `invariant` is compared on resume, a `noted` one is noted, a key that `needs`
a switch is refused without it, a bound is checked by the first pass too.

References: the run's own resume records (`run_identity.identity`, `resume_invariants`, `update_changes`) and the
dependent-key check on a parsed cpu_tiny config with one key changed, not the tables derived from the rules.
"""

import dataclasses
import typing

import pytest

from maxtext_rl_plugin.run import identity as run_identity
from maxtext_rl_plugin.run import meta as run_meta
from maxtext_rl_plugin.config import dependent_keys
from maxtext_rl_plugin.config import key_rule
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.config import rules
from maxtext_rl_plugin.config import schema as config_schema
from maxtext_rl_plugin.config import validation
from maxtext_rl_plugin.errors import ConfigError

TINY = "configs/cpu_tiny.yml"
OTHER_DATA = "tests/data/gsm8k/test.jsonl"


@pytest.fixture(name="tiny_pc", scope="module")
def tiny_pc_fixture():
  return config_lib.load_pydantic([TINY])


def _own_keys() -> set[str]:
  """Every key the plugin declares, read from the schema (not from config/rules.py)."""
  out = set()
  for prefix, cls in (("", config_schema.PluginKeys), ("rl.", config_schema.PluginRL)):
    names = set(cls.model_fields)
    for klass in cls.__mro__:
      if klass.__module__.startswith("maxtext_rl_plugin."):
        out |= {prefix + n for n in vars(klass).get("__annotations__", {}) if n in names}
  return out


def test_every_plugin_key_carries_its_rule_in_its_field():
  # A key added without `json_schema_extra=rule(...)` has no status, no resume rule: it fails here.
  own = _own_keys()
  assert len(own) > 50
  assert own == set(rules.plugin_fields())
  missing = sorted(k for k, f in rules.plugin_fields().items() if key_rule.rule_of(f) is None)
  assert not missing, f"plugin keys without a KeyRule in their field: {missing}"


def test_a_malformed_rule_fails_when_the_schema_is_defined():
  for bad in (
      {"status": "read somewhere", "resume": "noted"},
      {"status": "honoured (x)", "resume": "exempt: "},
      {"status": "honoured (x)", "resume": "noted", "needs": "rl.x is on"},
  ):
    with pytest.raises(ValueError):
      key_rule.KeyRule(**bad)


def test_every_numeric_plugin_key_is_bounded_or_says_why_not():
  # A new int/float plugin key needs a bound (the field's ge/gt/le/lt) or `any_value` saying why every value means
  # something; each then has a RANGES row (first pass) or an UNBOUNDED line.
  loose = []
  for key, field in rules.plugin_fields().items():
    numeric = {int, float} & {field.annotation, *typing.get_args(field.annotation)}
    if numeric and key not in validation.RANGES and key not in validation.UNBOUNDED:
      loose.append(key)
  assert not loose, f"numeric plugin keys with no bound and no KeyRule.any_value: {loose}"


def _other(value, field):
  """A value of the field other than `value`: the next choice, the boolean's negation, a number within the
  field's bounds, another data file for a path."""
  literal = rules.literal_choices(field.annotation)
  if literal:
    return next((c for c in literal if c != value), f"not-{value}")  # a key of one choice: any other value
  if isinstance(value, bool):
    return not value
  if isinstance(value, int):
    return value + 1
  if isinstance(value, float):
    capped = any(symbol == "<=" for _, symbol, _limit in rules.bounds(field))
    return (value + 1.0) / 2 if capped else value + 0.5
  if value is None:
    return 1
  if isinstance(value, str):
    return OTHER_DATA
  raise AssertionError(f"no other value for {value!r}")


def _get(pc, key):
  value = pc
  for part in key.split("."):
    value = getattr(value, part)
  return value


def _set(pc, key, value):
  block, _, inner = key.rpartition(".")
  obj = getattr(pc, block) if block else pc
  object.__setattr__(obj, inner, value)


def _resume_record(pc):
  return {**run_identity.identity(pc), **run_meta.resume_invariants(pc)}


@pytest.mark.parametrize("key", rules.resume_keys(key_rule.INVARIANT))
def test_a_key_marked_invariant_is_compared_on_resume(tiny_pc, key):
  # What a checkpoint records and a resume compares (identity + resume_invariants) changes with the key's value.
  pc = tiny_pc.model_copy(deep=True)
  field = rules.plugin_fields()[key]
  _set(pc, key, _other(_get(pc, key), field))
  assert _resume_record(pc) != _resume_record(tiny_pc), key


@pytest.mark.parametrize("key", rules.resume_keys(key_rule.NOTED))
def test_a_key_marked_noted_is_one_note_on_resume(tiny_pc, key):
  pc = tiny_pc.model_copy(deep=True)
  field = rules.plugin_fields()[key]
  was = _get(pc, key)
  _set(pc, key, _other(was, field) if not isinstance(was, list) else [*was, *was[-1:]] or [1])
  meta = {"step": 2, "update_keys": run_meta.update_values(tiny_pc)}
  notes = run_meta.update_changes(pc, meta)
  assert len(notes) == 1 and f"resuming with {key}=" in notes[0], (key, notes)


@pytest.mark.parametrize("key", sorted(rules.dependents()))
def test_a_key_that_needs_a_switch_is_refused_while_it_is_off(tiny_pc, key):
  needs, default = rules.dependents()[key]
  switch, is_on = key_rule.condition(needs)
  assert not is_on(_get(tiny_pc, switch)), (key, switch)
  pc = tiny_pc.model_copy(deep=True)
  field = rules.plugin_fields()[key]
  _set(pc, key, _other(default, field) if not isinstance(default, list) else [])
  with pytest.raises(ConfigError, match=f"'{key}'=.* has no effect with {switch}="):
    dependent_keys.check(pc)


def test_the_rule_is_plain_json_in_the_schema():
  # `model_json_schema()` shows each plugin key's rules beside its description.
  extra = rules.plugin_fields()["rl.max_refill_rounds"].json_schema_extra["rule"]
  assert dataclasses.asdict(key_rule.KeyRule(**extra)) == extra
  assert extra["needs"] == "rl.dynamic_sampling=true" and extra["resume"] == key_rule.NOTED
