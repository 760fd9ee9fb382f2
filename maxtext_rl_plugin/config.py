"""Load `<yml> key=value ...` with MaxText's pyconfig into the plugin's `PluginRLConfig`.

The argv contract is MaxText's (first the yml, then OmegaConf `key=value` overrides, dotted keys for
nested blocks such as `rl.kl_estimator=k3`). What this module adds on top of `pyconfig`:

* one-line errors naming the key (unknown keys, including unknown keys *inside* nested blocks,
  which pydantic would silently ignore), the file, or the bad value -- never a traceback;
* yml names resolve against the packaged configs, so `configs/rl.yml` works from any directory
  (e.g. inside the Docker image on a Pathways cluster); `base_config` may name a shipped plugin config, and the
  chain is read once, by us, without temporary copies of the user's files;
* every key has a status (`key_status.py`): a refused key set to anything but MaxText's RL default is an error;
* `validate` (validation.py): device-free checks, the same for `print_config=true`, the launchers and training;
* one parse per argv (`parse`): the trainer's device setup reuses the config instead of re-parsing;
* one source of truth for keys that MaxText keeps both flat and nested (`loss_algo` and
  `rl.loss_algo`): a dotted override is rewritten to its flat twin, which MaxText routes into the
  nested block, and the flat copy is then re-synced from the nested one.

MaxText's `pyconfig` and schema (and `config_types`, `tunix_compat`, built on them) are imported inside functions:
they import JAX (~5 s), and `--help` or a launcher's dry run should not pay for that.
"""

# JAX-importing modules are imported on first parse (see the module docstring).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from typing import Any, Sequence
import warnings

from maxtext.utils import globals as mt_globals
import omegaconf
import pydantic
import yaml

from maxtext_rl_plugin import key_status
from maxtext_rl_plugin import validation
from maxtext_rl_plugin.errors import ConfigError

CONFIGS_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
_REPO_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
REDACTED_KEYS = ("hf_access_token",)


def configs_dir() -> str:
  """Directory of the shipped yml files (inside the installed package, or the repo's configs/)."""
  for d in (CONFIGS_PACKAGE_DIR, _REPO_CONFIGS_DIR):
    if os.path.isfile(os.path.join(d, "rl.yml")):
      return d
  return _REPO_CONFIGS_DIR


def resolve_yml(path: str) -> str:
  """A yml path as given, or the shipped config of that name (`configs/rl.yml`, `rl.yml`, `rl`)."""
  if os.path.isfile(path):
    return os.path.abspath(path)
  if os.path.isdir(path):
    raise ConfigError(f"config file '{path}' is a directory; give a yml file (e.g. configs/rl.yml)")
  name = os.path.basename(path)
  if not name.endswith((".yml", ".yaml")):
    name += ".yml"
  packaged = os.path.join(configs_dir(), name)
  if os.path.isfile(packaged):
    return packaged
  raise ConfigError(f"config file '{path}' not found (nor a shipped config '{name}' in {configs_dir()})")


def _resolve_base(path: str, base: str) -> str:
  """Where `base_config: <base>` of `path` points: next to it, else a shipped plugin config, else MaxText's."""
  if os.path.isabs(base):
    return base
  for d in (os.path.dirname(path), configs_dir(), mt_globals.MAXTEXT_CONFIGS_DIR):
    cand = os.path.join(d, base)
    if os.path.isfile(cand):
      return cand
  return os.path.join(os.path.dirname(path), base)


@functools.cache
def config_class():
  """The plugin's pydantic schema (MaxText's RL config plus the plugin's keys), imported on first use."""
  from maxtext_rl_plugin.config_types import PluginRLConfig

  return PluginRLConfig


def _nested_models(cls) -> dict[str, Any]:
  """Fields of `cls` whose type is a pydantic model (MaxText's `rl`, `dataset`, `reward`, ...)."""
  return {
      name: f.annotation
      for name, f in cls.model_fields.items()
      if hasattr(getattr(f, "annotation", None), "model_fields")
  }


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
  return KeyNames(frozenset(cls.model_fields), {b: frozenset(m.model_fields) for b, m in _nested_models(cls).items()})


@functools.cache
def shipped_defaults() -> dict[str, Any]:
  """MaxText's base.yml under the plugin's shipped rl.yml chain, as plain containers: every key's default as written,
  which types the first pass's values (validation.RawConfig) without the schema."""
  base = omegaconf.OmegaConf.load(os.path.join(_maxtext_configs_dir(), "base.yml"))
  rl = _merge_chain(_read_chain(os.path.join(configs_dir(), "rl.yml")))
  return omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.merge(base, rl), resolve=False)


@functools.cache
def light_keys() -> KeyNames:
  """The schema's key names without importing it: the shipped defaults' keys corrected by key_status's two lists
  of the difference (tests/test_config.py keeps them exact). Blocks with no shipped defaults are left to the schema."""
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
      raise _unknown_key_error(key, where, set(known))
    return
  if head in keys.top:
    return  # a dict-typed field (e.g. generation_configs.greedy.eval_top_k); its value is validated by pydantic
  raise _unknown_key_error(key, where, flat)


def _check_yml_keys(raw: dict, where: str, keys: KeyNames) -> None:
  for key, value in raw.items():
    if key == "base_config":
      continue
    _check_key(key, where, keys)
    if key in keys.blocks and isinstance(value, dict):
      for inner in value:
        _check_key(f"{key}.{inner}", where, keys)


def _parse_overrides(overrides: Sequence[str], keys: KeyNames) -> list[str]:
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
    out.append(f"{key}={value}")
  return out


def _format_validation_error(e) -> str:
  """A pydantic ValidationError as one line naming the key and the bad value."""
  # MaxText validates a key both flat and nested (`loss_algo`, `rl.loss_algo`): report it once.
  seen: dict[str, dict] = {}
  for err in e.errors():
    loc = ".".join(str(p) for p in err.get("loc", ()) if not isinstance(p, int)) or "config"
    seen.setdefault(loc.rsplit(".", maxsplit=1)[-1], {**err, "loc_str": loc})
  errs = sorted(seen.values(), key=lambda x: -x["loc_str"].count("."))
  err = errs[0]
  msg = err.get("msg", "invalid value")
  if len(msg) > 160:
    msg = msg[:150].rsplit(",", 1)[0] + ", ..."
  value = err.get("input")
  shown = f"={value!r}" if isinstance(value, (str, int, float, bool)) or value is None else ""
  more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
  return f"invalid value for '{err['loc_str']}'{shown}: {msg}{more}"


def _sync_flat_from_nested(pc) -> None:
  """After MaxText routed flat keys into nested blocks, the nested value is the truth: mirror it."""
  for block in _nested_models(type(pc)):
    sub = getattr(pc, block)
    for inner in type(sub).model_fields:
      if inner in type(pc).model_fields:
        object.__setattr__(pc, inner, getattr(sub, inner))


def _check_model_name(model_name: str) -> None:
  """Refuse a model_name MaxText 0.2.5 has no models/<name>.yml for, naming the closest ones."""
  models_dir = os.path.join(mt_globals.MAXTEXT_CONFIGS_DIR, "models")
  known = sorted(f[:-4] for f in os.listdir(models_dir) if f.endswith(".yml"))
  base = model_name.replace("-Instruct", "")
  if model_name != "default" and base not in known:
    close = difflib.get_close_matches(base, known, n=3, cutoff=0.6)
    hint = f"; close: {', '.join(close)}" if close else f"; see {models_dir}"
    raise ConfigError(f"invalid value for 'model_name'='{model_name}': MaxText 0.2.5 does not know this model{hint}")


def _resolve_tokenizer_path(overrides: list[str], raw: dict) -> list[str]:
  """A tokenizer_path that is neither local nor absolute but exists under the shipped configs or MaxText's
  assets is made absolute.

  This lets shipped configs say `tokenizer_path: tokenizers/qwen3-tokenizer` (inside the maxtext wheel)
  while hub ids such as `meta-llama/Llama-3.1-8B-Instruct` pass through unchanged.
  """
  value = raw.get("tokenizer_path")
  for arg in overrides:
    if arg.startswith("tokenizer_path="):
      value = arg.split("=", 1)[1]
  if not value or os.path.isabs(value) or os.path.exists(value):
    return overrides
  # MAXTEXT_ASSETS_ROOT points into a source checkout; a wheel keeps its assets next to the package.
  for root in (configs_dir(), mt_globals.MAXTEXT_ASSETS_ROOT, os.path.join(mt_globals.MAXTEXT_PKG_DIR, "assets")):
    candidate = os.path.join(root, value)
    if os.path.exists(candidate):
      return [a for a in overrides if not a.startswith("tokenizer_path=")] + [f"tokenizer_path={candidate}"]
  return overrides


def _maxtext_configs_dir() -> str:
  """MaxText's configs directory, symlinks resolved."""
  return os.path.realpath(mt_globals.MAXTEXT_CONFIGS_DIR)


def _is_maxtext_file(path: str) -> bool:
  """Whether `path` is one of MaxText's own configs (its keys are MaxText's, not checked by us)."""
  return os.path.realpath(path).startswith(_maxtext_configs_dir() + os.sep)


def _yaml_problem(e: Exception) -> str:
  """What a YAML parser found wrong and where (`found duplicate key "run_name" (line 3)`), not only its context
  (`while constructing a mapping`)."""
  problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
  if problem and mark is not None:
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
  return str(e).splitlines()[0] if str(e) else type(e).__name__


def _read_yml(path: str, shown: str):
  """One yml file as an OmegaConf mapping, or a one-line error naming `shown` (the name the user gave)."""
  try:
    cfg = omegaconf.OmegaConf.load(path)
  except FileNotFoundError:
    raise ConfigError(f"config file '{shown}' not found") from None
  except OSError as e:  # OmegaConf's "Invalid loaded object type: int" for a yml that is a scalar
    raise ConfigError(f"config file '{shown}' must be a mapping of key: value ({str(e).splitlines()[0]})") from None
  except Exception as e:  # pylint: disable=broad-exception-caught  # yaml/omegaconf parse errors
    raise ConfigError(f"config file '{shown}' is not valid YAML: {_yaml_problem(e)}") from None
  if isinstance(cfg, omegaconf.ListConfig):
    raise ConfigError(f"config file '{shown}' must be a mapping of key: value, not a list")
  if not cfg:
    raise ConfigError(f"config file '{shown}' is empty; start it with 'base_config: rl.yml' and the keys to change")
  for block in key_status.NESTED_BLOCKS:
    if block in cfg and cfg[block] is not None and not isinstance(cfg[block], omegaconf.DictConfig):
      raise ConfigError(
          f"config file '{shown}': '{block}' must be a block of keys ({block}:\\n  key: value), got {cfg[block]!r}"
      )
  return cfg


def _read_chain(given: str) -> list[tuple[str, Any]]:
  """`[(path, cfg), ...]` from the user's yml through its `base_config`s to MaxText's base.yml.

  We follow `base_config` ourselves (MaxText's `_load_config` looks only next to the file and in MaxText's own
  configs, so `base_config: rl.yml` could not name the plugin's shipped rl.yml without a temporary copy of the
  user's file -- which may hold an `hf_access_token`).
  """
  chain, path, shown, seen = [], resolve_yml(given), given, set()
  while True:
    if path in seen:
      raise ConfigError(f"config file '{shown}': base_config cycle through '{path}'")
    seen.add(path)
    cfg = _read_yml(path, shown)
    chain.append((path, cfg))
    base = cfg.get("base_config")
    if not base:
      break
    nxt = _resolve_base(path, str(base))
    if not os.path.isfile(nxt):
      raise ConfigError(f"config file '{base}' (base_config of '{shown}') not found")
    path, shown = nxt, str(base)
  if not any(_is_maxtext_file(p) for p, _ in chain):
    raise ConfigError(
        f"config file '{given}' does not extend MaxText's configuration; add 'base_config: rl.yml' (the plugin's) "
        "or 'base_config: post_train/rl.yml' (MaxText's)"
    )
  return chain


def _merge_chain(chain):
  """MaxText's merge order: the base first, each file nearer the user over it."""
  merged = omegaconf.OmegaConf.create({})
  for _, cfg in reversed(chain):
    merged = omegaconf.OmegaConf.merge(merged, cfg)
  return merged


def merged_chain(yml: str) -> dict[str, Any]:
  """The merged yml chain of `yml` as plain containers (values unresolved), before any pydantic processing."""
  return omegaconf.OmegaConf.to_container(_merge_chain(_read_chain(yml)), resolve=False)


def nested_models(cls=None) -> dict[str, Any]:
  """Nested blocks of the schema (`rl`, `dataset`, `reward`, ...) and their pydantic classes."""
  return _nested_models(cls or config_class())


def _model_file_overrides(chain, raw: dict, overrides: list[str]) -> dict[str, Any]:
  """Keys of the plugin's own yml chain that the model file (configs/models/<model>.yml) also sets.

  MaxText applies the model file *over* the base yml, and `override_model_config=true` only lets
  command-line/kwargs keys win. A plugin yml such as cpu_tiny.yml that shrinks a named model must
  win too, so with `override_model_config: true` those keys are passed to pyconfig as kwargs.
  """
  cli = dict(a.split("=", 1) for a in overrides)
  if str(cli.get("override_model_config", raw.get("override_model_config", False))).lower() != "true":
    return {}
  model = str(cli.get("model_name", raw.get("model_name", "default"))).replace("-Instruct", "")
  model_file = os.path.join(_maxtext_configs_dir(), "models", f"{model}.yml")
  if not os.path.isfile(model_file):
    return {}
  own: dict[str, Any] = {}
  for path, cfg in chain:  # nearest the user first: the first file that sets a key wins
    if _is_maxtext_file(path):
      break
    for k, v in omegaconf.OmegaConf.to_container(cfg, resolve=False).items():
      own.setdefault(k, v)
  model_keys = omegaconf.OmegaConf.load(model_file).keys()
  return {k: own[k] for k in model_keys if k in own and k not in cli}


# --- refused keys -------------------------------------------------------------------------------------------------


def _flatten_user_keys(data: dict, out: dict[str, Any]) -> None:
  """Status-table names (`rl.x`, flat others) -> value, for one yml mapping or the command line."""
  blocks = _nested_models(config_class())
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


def _user_set_values(chain, overrides: list[str]) -> dict[str, Any]:
  """Keys the user set -- their yml files (and the plugin's shipped ones), `M_<KEY>` environment variables and the
  command line; not MaxText's own base.yml / post_train/rl.yml / model files -- with the value they set."""
  out: dict[str, Any] = {}
  for path, cfg in reversed(chain):
    if not _is_maxtext_file(path):
      _flatten_user_keys(omegaconf.OmegaConf.to_container(cfg, resolve=False), out)
  fields = config_class().model_fields
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
  _flatten_user_keys(merged_chain(os.path.join(_maxtext_configs_dir(), "post_train", "rl.yml")), out)
  return out


def _schema_default(key: str) -> Any:
  cls = config_class()
  head, _, inner = key.partition(".")
  if inner and head in key_status.DOTTED_BLOCKS:
    field = _nested_models(cls)[head].model_fields.get(inner)
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


# --- parsing, once ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Parsed:
  """One parse of `[yml, k=v, ...]`: the validated config and what it was built from (to derive others)."""

  config: Any
  yml: str
  merged: Any
  overrides: list[str]
  kwargs: dict[str, Any]

  def derive(self, **updates):
    """The same configuration with `updates` applied the way MaxText applies kwargs (re-validated by pydantic,
    from the already-read yml chain): MaxText's multislice trainer/sampler configs."""
    return _initialize(self.yml, self.merged, self.overrides, {**self.kwargs, **updates})


def _initialize(yml: str, merged, overrides: list[str], kwargs: dict[str, Any]):
  """MaxText's pydantic initialization of the merged yml chain plus overrides; its errors as one-line ConfigErrors."""
  from maxtext_rl_plugin import tunix_compat

  try:
    with warnings.catch_warnings(), tunix_compat.pyconfig_reads(merged) as initialize:
      warnings.simplefilter("ignore")
      pc = initialize(["", yml, *overrides], config_class=config_class(), **kwargs)
  except pydantic.ValidationError as e:
    raise ConfigError(_format_validation_error(e)) from None
  except omegaconf.errors.OmegaConfBaseException as e:  # an override OmegaConf cannot read, a `${...}` it cannot resolve
    raise ConfigError(f"could not read the configuration (yml and overrides): {str(e).splitlines()[0]}") from None
  except (ValueError, TypeError, KeyError) as e:
    raise ConfigError(str(e).splitlines()[0] if str(e) else repr(e)) from None
  _sync_flat_from_nested(pc)
  return pc


def _parse_uncached(argv: Sequence[str]) -> Parsed:
  """Read, check and validate `[yml, key=value, ...]` (see `parse`, which caches this)."""
  if not argv:
    raise ConfigError("usage: python -m maxtext_rl_plugin.train_rl <config.yml> [key=value ...]")
  given = argv[0]
  keys = schema_keys()
  chain = _read_chain(given)
  overrides = _parse_overrides(argv[1:], keys)
  for path, cfg in chain:
    if not _is_maxtext_file(path):
      _check_yml_keys(omegaconf.OmegaConf.to_container(cfg, resolve=False), f"in {path}", keys)
  # The user's own spelling (`rl.system_prompt`, not the flat twin the override was rewritten to) picks the status.
  check_refused(_user_set_values(chain, [a.strip().lstrip("-") for a in argv[1:]]))
  merged = _merge_chain(chain)
  raw = omegaconf.OmegaConf.to_container(merged, resolve=False)
  cli = dict(a.split("=", 1) for a in overrides)
  _check_model_name(str(cli.get("model_name", raw.get("model_name", "default"))))
  overrides = _resolve_tokenizer_path(overrides, raw)
  kwargs = _model_file_overrides(chain, raw, overrides)
  pc = _initialize(chain[0][0], merged, overrides, kwargs)
  validation.validate(pc)
  return Parsed(pc, chain[0][0], merged, overrides, kwargs)


# --- the first pass, before the schema's imports ------------------------------------------------------------------


def _raw_view(chain, overrides: list[str]) -> validation.RawConfig:
  """The config as written (the merged chain and the overrides) as a `validation.RawConfig`: typed by the shipped
  defaults; keys a model file sets (configs/models/<model_name>.yml) or an `M_<KEY>` environment variable overrides
  (both applied by pyconfig, with their own rules) are left unresolved."""
  merged = _merge_chain(chain)
  for arg in overrides:
    merged = omegaconf.OmegaConf.merge(merged, omegaconf.OmegaConf.from_dotlist([arg]))
  values = omegaconf.OmegaConf.to_container(merged, resolve=False)
  rl_block = values.get("rl")
  for inner in light_keys().blocks["rl"] or ():
    if inner in values and isinstance(rl_block, dict):  # a flat twin: MaxText routes it into the block
      rl_block[inner] = values.pop(inner)
  model = str(values.get("model_name", "default")).replace("-Instruct", "")
  model_file = os.path.join(_maxtext_configs_dir(), "models", f"{model}.yml")
  model_keys = set(omegaconf.OmegaConf.load(model_file).keys()) if os.path.isfile(model_file) else set()
  env_keys = {k for k in values if f"M_{k.upper()}" in os.environ}
  return validation.RawConfig(values, shipped_defaults(), frozenset(model_keys | env_keys))


def precheck(argv: Sequence[str]) -> validation.RawConfig:
  """The checks that need only the yml chain and the command line, before the schema's imports (JAX, MaxText: ~10 s
  on a loaded machine): the files, key names, model_name and `validation.validate_raw`. `parse` repeats them all on
  the typed config; this pass only makes a mistake cost a second instead of ten."""
  if not argv:
    raise ConfigError("usage: python -m maxtext_rl_plugin.train_rl <config.yml> [key=value ...]")
  keys = light_keys()
  chain = _read_chain(argv[0])
  overrides = _parse_overrides(argv[1:], keys)
  for path, cfg in chain:
    if not _is_maxtext_file(path):
      _check_yml_keys(omegaconf.OmegaConf.to_container(cfg, resolve=False), f"in {path}", keys)
  try:
    view = _raw_view(chain, overrides)
  except omegaconf.errors.OmegaConfBaseException:
    return validation.RawConfig({}, {})  # an override OmegaConf cannot merge: `parse` says so in its words
  _check_model_name(str(getattr(view, "model_name", "default")))
  validation.validate_raw(view)
  return view


@functools.lru_cache(maxsize=8)
def _parse_cached(argv: tuple[str, ...], context: tuple) -> Parsed:
  del context  # cache key only (see parse)
  return _parse_uncached(argv)


def parse(argv: Sequence[str]) -> Parsed:
  """`[yml, key=value, ...]` parsed and validated once per process; later calls with the same argv (the trainer's
  `models.setup_devices`, the launchers) get the same result instead of re-reading and re-validating.

  The cache key also holds what else changes the result: the working directory (relative paths), MaxText's
  `M_<KEY>` environment overrides and HF_TOKEN, and the yml's modification time and size.
  """
  env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("M_") or k == "HF_TOKEN"))
  stat = os.stat(argv[0]) if argv and os.path.isfile(argv[0]) else None
  version = (stat.st_mtime_ns, stat.st_size) if stat else None
  return _parse_cached(tuple(argv), (os.getcwd(), env, version))


def load_pydantic(argv: Sequence[str]):
  """`[yml, key=value, ...]` -> validated `PluginRLConfig` (pydantic), or `ConfigError`."""
  return parse(argv).config


def load_config(argv: Sequence[str]):
  """`[yml, key=value, ...]` -> MaxText `HyperParameters` over a `PluginRLConfig`."""
  return to_hyperparameters(load_pydantic(argv))


def to_hyperparameters(pc):
  """MaxText's read-only attribute view (`config.rl.loss_algo`, `config.emb_dim`)."""
  from maxtext.configs import pyconfig

  _sync_flat_from_nested(pc)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hp = pyconfig.HyperParameters(pc)
  # RLConfig's validator sets derived values (train_steps, ...) with object.__setattr__, outside the
  # pydantic fields that HyperParameters dumps; MaxText's RL code reads them, so expose them too.
  flat = object.__getattribute__(hp, "_flat_config")
  for k, v in vars(pc).items():
    if not k.startswith("_"):
      flat.setdefault(k, v)
  return hp


def dump_yaml(config) -> str:
  """The resolved configuration as YAML (secrets redacted), for `print_config=true`."""
  pc = getattr(config, "_pydantic_config", config)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    data = pc.model_dump(mode="json")
  for k in REDACTED_KEYS:
    if data.get(k):
      data[k] = "<redacted>"
  return yaml.safe_dump(data, sort_keys=True, default_flow_style=None, width=120)
