"""Which keys a config may set, and which it may not: key names (with or without the schema), overrides, refusals.

* an unknown key, including one *inside* a nested block (which pydantic would silently ignore), is one line naming it
  and the closest known key;
* `block.key` overrides are rewritten to MaxText's flat twin where it keeps one (`rl.loss_algo` -> `loss_algo`);
* every key has a status (`config/key_status.py`): a refused key set to anything but MaxText's RL default is an error.

`light_keys` names the keys without importing the schema (JAX, ~5 s) for `config_precheck`; `schema_keys` imports it.
"""

# The schema (config_types) imports JAX: imported on first use (see the module docstring).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from typing import Any, Sequence

import omegaconf
import yaml

from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import key_status
from maxtext_rl_plugin.errors import ConfigError


@functools.cache
def config_class():
  """The plugin's pydantic schema (MaxText's RL config plus the plugin's keys), imported on first use."""
  from maxtext_rl_plugin.config.schema import PluginRLConfig

  return PluginRLConfig


def nested_fields(cls) -> dict[str, Any]:
  """Fields of `cls` whose type is a pydantic model (MaxText's `rl`, `dataset`, `reward`, ...)."""
  return {
      name: f.annotation
      for name, f in cls.model_fields.items()
      if hasattr(getattr(f, "annotation", None), "model_fields")
  }


def nested_models(cls=None) -> dict[str, Any]:
  """Nested blocks of the schema (`rl`, `dataset`, `reward`, ...) and their pydantic classes."""
  return nested_fields(cls or config_class())


@dataclasses.dataclass(frozen=True)
class KeyNames:
  """The key names a yml or a command line may set: the top-level fields and each nested block's fields (None: a
  block whose fields are not known without the schema; a dotted key into it is left to the schema's check)."""

  top: frozenset[str]
  blocks: dict[str, frozenset[str] | None]

  def flat(self) -> set[str]:
    """Every key a flat `key=value` may name: the top-level fields and those of each nested block."""
    return set(self.top).union(*(inner for inner in self.blocks.values() if inner))


def schema_keys(cls=None) -> KeyNames:
  """The key names of the schema (imports it)."""
  cls = cls or config_class()
  return KeyNames(frozenset(cls.model_fields), {b: frozenset(m.model_fields) for b, m in nested_fields(cls).items()})


@functools.cache
def shipped_defaults() -> dict[str, Any]:
  """MaxText's base.yml under the plugin's shipped rl.yml chain, as plain containers: every key's default as written,
  which types the first pass's values (validation.RawConfig) without the schema."""
  base = omegaconf.OmegaConf.load(os.path.join(config_files.maxtext_configs_dir(), "base.yml"))
  rl = config_files.merge_chain(config_files.read_chain(os.path.join(config_files.configs_dir(), "rl.yml")))
  return omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.merge(base, rl), resolve=False)


@functools.cache
def light_keys() -> KeyNames:
  """The schema's key names without importing it: the shipped defaults' keys corrected by key_status's two lists
  of the difference (tests/config/test_config.py keeps them exact). Blocks with no shipped defaults are left to the
  schema."""
  defaults = shipped_defaults()
  top = (set(defaults) - key_status.YML_ONLY_KEYS) | {k for k in key_status.SCHEMA_ONLY_KEYS if "." not in k}
  blocks: dict[str, frozenset[str] | None] = {}
  for block in key_status.NESTED_BLOCKS:
    inner = defaults.get(block)
    if isinstance(inner, dict):
      extra = {k.partition(".")[2] for k in key_status.SCHEMA_ONLY_KEYS if k.startswith(f"{block}.")}
      blocks[block] = frozenset(set(inner) | extra)
    else:
      blocks[block] = None
  return KeyNames(frozenset(top | set(key_status.NESTED_BLOCKS)), blocks)


def _unknown_key_error(key: str, where: str, candidates: set[str]) -> ConfigError:
  """An unknown key as one line, with the closest known key when there is one."""
  close = difflib.get_close_matches(key.rsplit(".", maxsplit=1)[-1], sorted(candidates), n=1, cutoff=0.75)
  hint = f"; did you mean '{close[0]}'?" if close else ""
  return ConfigError(f"unknown config key '{key}' ({where}){hint}")


def _check_key(key: str, where: str, keys: KeyNames) -> None:
  """Raise for a key that is not in the schema (top-level, flat twin, or `<block>.<key>` of a nested block)."""
  flat = keys.flat()
  head, _, tail = key.partition(".")
  if not tail:
    if key not in flat:
      raise _unknown_key_error(key, where, flat)
    return
  if head in keys.blocks:
    inner = tail.partition(".")[0]
    known = keys.blocks[head]
    if known is not None and inner not in known:
      if inner in keys.top and "." not in tail:  # `rl.train_micro_batch_size`: a top-level key, not the block's
        raise ConfigError(
            f"unknown config key '{key}' ({where}): '{inner}' is a top-level key, not one of the {head}: block; "
            f"did you mean '{inner}'?"
        )
      raise _unknown_key_error(key, where, set(known))
    return
  if head in keys.top:
    return  # a dict-typed field (e.g. generation_configs.greedy.eval_top_k); its value is validated by pydantic
  raise _unknown_key_error(key, where, flat)


def check_yml_keys(raw: dict, where: str, keys: KeyNames) -> None:
  for key, value in raw.items():
    if key == "base_config":
      continue
    _check_key(key, where, keys)
    if key in keys.blocks and isinstance(value, dict):
      for inner in value:
        _check_key(f"{key}.{inner}", where, keys)


def parse_overrides(overrides: Sequence[str], keys: KeyNames) -> list[str]:
  """Validate `key=value` overrides and rewrite `block.key` to `key` where MaxText keeps a flat twin."""
  out = []
  for arg in overrides:
    if "=" not in arg or arg.startswith("="):
      raise ConfigError(f"argument '{arg}' is not of the form key=value")
    key, value = arg.split("=", 1)
    key = key.strip().lstrip("-")
    _check_key(key, "command line", keys)
    if key in keys.blocks:
      raise ConfigError(f"'{key}' is a block of keys; set them one by one as {key}.<key>=value (command line)")
    head, _, tail = key.partition(".")
    if head in keys.blocks and tail and "." not in tail and tail in keys.top:
      key = tail
    if not value.strip() and isinstance(shipped_defaults().get(key), str):
      value = "''"  # `key=` clears a string key (OmegaConf would read None, which a str field refuses)
    elif _is_text_key(key) and _NUMBER.fullmatch(value.strip()):
      value = f"'{value.strip()}'"  # `run_name=7`: a string key's value is the text typed, as the user meant it
    _check_yaml_value(key, value)
    out.append(f"{key}={value}")
  return out


def _is_text_key(key: str) -> bool:
  """A key whose shipped default is text (base.yml's `None` placeholders stand for numbers: not those)."""
  default = shipped_defaults().get(key)
  return isinstance(default, str) and default.strip().lower() != "none"


# A YAML number (int or float, as OmegaConf's dotlist would type it), which a string key would refuse.
_NUMBER = re.compile(r"[-+]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def check_override_names(overrides: Sequence[str], keys: KeyNames) -> None:
  """The names of overrides `parse_overrides` already parsed, against `keys` (the typed pass: the schema knows the keys
  of every block, where the first pass's `light_keys` leave some open)."""
  for arg in overrides:
    _check_key(arg.split("=", 1)[0], "command line", keys)


def _check_yaml_value(key: str, value: str) -> None:
  """pyconfig reads a command-line value as YAML (OmegaConf's dotlist): `run_name=[abc` or a JSON object missing its
  brace is one line here, not a parser's traceback later."""
  try:
    omegaconf.OmegaConf.from_dotlist([f"{key}={value}"])
  except (omegaconf.errors.OmegaConfBaseException, yaml.YAMLError) as e:
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ConfigError(
        f"invalid value for '{key}'={value!r} (command line): not valid YAML ({problem}); close its brackets, or "
        "quote a string that starts with [ or {"
    ) from None


def _flatten_user_keys(data: dict, out: dict[str, Any]) -> None:
  """Status-table names (`rl.x`, flat others) -> value, for one yml mapping or the command line."""
  blocks = nested_fields(config_class())
  for key, value in data.items():
    if key == "base_config":
      continue
    if key in blocks and isinstance(value, dict):
      for inner, v in value.items():
        out[key_status.canonical(f"{key}.{inner}")] = v
    elif isinstance(value, dict) and value:
      # A dict-valued key (generation_configs): compared leaf by leaf, as OmegaConf merges it.
      _flatten_user_keys({f"{key}.{k}": v for k, v in value.items()}, out)
    elif "." in key and key.partition(".")[0] not in blocks:
      out[key] = value  # a path inside a dict-valued key (generation_configs.greedy.eval_top_k): compared there
    else:
      out[key_status.canonical(key)] = value


def user_set_values(chain, overrides: list[str]) -> dict[str, Any]:
  """Keys the user set -- their yml files (and the plugin's shipped ones), `M_<KEY>` environment variables and the
  command line; not MaxText's own base.yml / post_train/rl.yml / model files -- with the value they set."""
  out: dict[str, Any] = {}
  for path, cfg in reversed(chain):
    if not config_files.is_maxtext_file(path):
      _flatten_user_keys(omegaconf.OmegaConf.to_container(cfg, resolve=False), out)
  fields = set(config_class().model_fields)
  for env_key, value in os.environ.items():  # MaxText's `M_<KEY>` environment overrides of top-level keys
    if env_key.startswith("M_") and env_key[2:].lower() in fields:
      overrides = [f"{env_key[2:].lower()}={value}", *overrides]
  for arg in overrides:
    key, value = arg.split("=", 1)
    try:
      parsed = yaml.safe_load(value) if value.strip() else value  # `key=` is an empty string, as OmegaConf reads it
    except yaml.YAMLError:
      parsed = value
    _flatten_user_keys({key: parsed}, out)
  return out


@functools.cache
def _maxtext_rl_defaults() -> dict[str, Any]:
  """What MaxText's own RL path gives every key: post_train/rl.yml over base.yml, flattened like the table."""
  out: dict[str, Any] = {}
  _flatten_user_keys(
      config_files.merged_chain(os.path.join(config_files.maxtext_configs_dir(), "post_train", "rl.yml")), out
  )
  return out


def _schema_default(key: str) -> Any:
  cls = config_class()
  head, _, inner = key.partition(".")
  if inner and head in key_status.DOTTED_BLOCKS:
    field = nested_fields(cls)[head].model_fields.get(inner)
  else:
    field = cls.model_fields.get(key)
  return field.get_default(call_default_factory=True) if field is not None else None


def _rl_default(key: str) -> Any:
  """MaxText's RL default of a status-table key, or of a path inside a dict-valued key."""
  defaults = _maxtext_rl_defaults()
  head, _, path = key.partition(".")
  if key in defaults or head in key_status.DOTTED_BLOCKS:
    return defaults[key] if key in defaults else _schema_default(key)
  value = defaults[head] if head in defaults else _schema_default(head)
  for part in path.split(".") if path else ():
    value = value.get(part) if isinstance(value, dict) else None
  return value


def check_refused(user_values: dict[str, Any]) -> None:
  """A refused key set to anything but MaxText's RL default is an error: it would have no effect."""
  for key, value in user_values.items():
    why = key_status.refusal(key)
    if why is None:
      continue
    if not key_status.same_value(value, _rl_default(key)):
      raise ConfigError(f"config key '{key}' is not supported by maxtext_rl_plugin: {why}")
