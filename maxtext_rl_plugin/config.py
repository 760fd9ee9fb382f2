"""Load `<yml> key=value ...` with MaxText's pyconfig into the plugin's `PluginRLConfig`.

The argv contract is MaxText's (first the yml, then OmegaConf `key=value` overrides, dotted keys for
nested blocks such as `rl.kl_estimator=k3`). What this module adds on top of `pyconfig`:

* one-line errors naming the key (unknown keys, including unknown keys *inside* nested blocks,
  which pydantic would silently ignore), the file, or the bad value -- never a traceback;
* yml names resolve against the packaged configs, so `configs/rl.yml` works from any directory
  (e.g. inside the Docker image on a Pathways cluster);
* one source of truth for keys that MaxText keeps both flat and nested (`loss_algo` and
  `rl.loss_algo`): a dotted override is rewritten to its flat twin, which MaxText routes into the
  nested block, and the flat copy is then re-synced from the nested one.
"""

from __future__ import annotations

import difflib
import functools
import os
import warnings
from typing import Any, Sequence

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
  name = os.path.basename(path)
  if not name.endswith((".yml", ".yaml")):
    name += ".yml"
  packaged = os.path.join(configs_dir(), name)
  if os.path.isfile(packaged):
    return packaged
  raise ConfigError(f"config file '{path}' not found (nor a shipped config '{name}' in {configs_dir()})")


def _resolve_base(path: str, base: str) -> str:
  """Where `base_config: <base>` of `path` points: next to it, else a shipped plugin config, else MaxText's."""
  from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # pylint: disable=import-outside-toplevel

  if os.path.isabs(base):
    return base
  for d in (os.path.dirname(path), configs_dir(), MAXTEXT_CONFIGS_DIR):
    cand = os.path.join(d, base)
    if os.path.isfile(cand):
      return cand
  return os.path.join(os.path.dirname(path), base)


def _materialize_yml(yml: str) -> str:
  """A user yml whose `base_config` names a shipped plugin config (e.g. `rl.yml`) is copied to a temp file
  with that base made absolute, because MaxText resolves bases only next to the file or in its own configs."""
  import tempfile  # pylint: disable=import-outside-toplevel

  import omegaconf  # pylint: disable=import-outside-toplevel

  try:
    cfg = omegaconf.OmegaConf.load(yml)
  except Exception:  # pylint: disable=broad-exception-caught  (reported by the caller with the file name)
    return yml
  base = cfg.get("base_config")
  if not base or os.path.isabs(base) or os.path.isfile(os.path.join(os.path.dirname(yml), base)):
    return yml
  resolved = _resolve_base(yml, base)
  if not resolved.startswith(configs_dir() + os.sep):
    return yml
  cfg["base_config"] = resolved
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(yml).rsplit(".", 1)[0] + "-", suffix=".yml")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(omegaconf.OmegaConf.to_yaml(cfg))
  return tmp


@functools.cache
def _config_class():
  from maxtext_rl_plugin.config_types import PluginRLConfig  # pylint: disable=import-outside-toplevel

  return PluginRLConfig


def _nested_models(cls) -> dict[str, Any]:
  """Fields of `cls` whose type is a pydantic model (MaxText's `rl`, `dataset`, `reward`, ...)."""
  return {
      name: f.annotation
      for name, f in cls.model_fields.items()
      if hasattr(getattr(f, "annotation", None), "model_fields")
  }


def _all_flat_keys(cls) -> set[str]:
  keys = set(cls.model_fields)
  for model in _nested_models(cls).values():
    keys |= set(model.model_fields)
  return keys


def _unknown_key_error(key: str, where: str, candidates: set[str]) -> ConfigError:
  close = difflib.get_close_matches(key.split(".")[-1], sorted(candidates), n=1, cutoff=0.75)
  hint = f"; did you mean '{close[0]}'?" if close else ""
  return ConfigError(f"unknown config key '{key}' ({where}){hint}")


def _check_key(key: str, where: str, cls) -> None:
  nested = _nested_models(cls)
  flat = _all_flat_keys(cls)
  head, _, tail = key.partition(".")
  if not tail:
    if key not in flat:
      raise _unknown_key_error(key, where, flat)
    return
  if head in nested:
    inner, _, rest = tail.partition(".")
    if inner not in nested[head].model_fields:
      raise _unknown_key_error(key, where, set(nested[head].model_fields))
    return
  if head in cls.model_fields:
    return  # a dict-typed field (e.g. generation_configs.greedy.eval_top_k); its value is validated by pydantic
  raise _unknown_key_error(key, where, flat)


def _check_yml_keys(raw: dict, where: str, cls) -> None:
  nested = _nested_models(cls)
  for key, value in raw.items():
    if key == "base_config":
      continue
    _check_key(key, where, cls)
    if key in nested and isinstance(value, dict):
      for inner in value:
        _check_key(f"{key}.{inner}", where, cls)


def _parse_overrides(overrides: Sequence[str], cls) -> list[str]:
  """Validate `key=value` overrides and rewrite `block.key` to `key` where MaxText keeps a flat twin."""
  nested = _nested_models(cls)
  out = []
  for arg in overrides:
    if "=" not in arg or arg.startswith("="):
      raise ConfigError(f"argument '{arg}' is not of the form key=value")
    key, value = arg.split("=", 1)
    key = key.strip().lstrip("-")
    _check_key(key, "command line", cls)
    head, _, tail = key.partition(".")
    if head in nested and tail and "." not in tail and tail in cls.model_fields:
      key = tail
    out.append(f"{key}={value}")
  return out


def _format_validation_error(e) -> str:
  # MaxText validates a key both flat and nested (`loss_algo`, `rl.loss_algo`): report it once.
  seen: dict[str, dict] = {}
  for err in e.errors():
    loc = ".".join(str(p) for p in err.get("loc", ()) if not isinstance(p, int)) or "config"
    seen.setdefault(loc.split(".")[-1], {**err, "loc_str": loc})
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
  from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # pylint: disable=import-outside-toplevel

  models_dir = os.path.join(MAXTEXT_CONFIGS_DIR, "models")
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
  from maxtext.utils import globals as mt_globals  # pylint: disable=import-outside-toplevel

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


def _model_file_overrides(yml: str, raw: dict, overrides: list[str]) -> dict[str, Any]:
  """Keys of the plugin's own yml chain that the model file (configs/models/<model>.yml) also sets.

  MaxText applies the model file *over* the base yml, and `override_model_config=true` only lets
  command-line/kwargs keys win. A plugin yml such as cpu_tiny.yml that shrinks a named model must
  win too, so with `override_model_config: true` those keys are passed to pyconfig as kwargs.
  """
  import omegaconf  # pylint: disable=import-outside-toplevel
  from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # pylint: disable=import-outside-toplevel

  cli = dict(a.split("=", 1) for a in overrides)
  if str(cli.get("override_model_config", raw.get("override_model_config", False))).lower() != "true":
    return {}
  model = str(cli.get("model_name", raw.get("model_name", "default"))).replace("-Instruct", "")
  model_file = os.path.join(MAXTEXT_CONFIGS_DIR, "models", f"{model}.yml")
  if not os.path.isfile(model_file):
    return {}
  own = {}
  path = yml
  mt_dir = os.path.realpath(MAXTEXT_CONFIGS_DIR)
  while path and not os.path.realpath(path).startswith(mt_dir + os.sep):
    cfg = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(path), resolve=False)
    for k, v in cfg.items():
      own.setdefault(k, v)  # the file nearer the user wins
    base = cfg.get("base_config")
    if not base:
      break
    path = _resolve_base(path, base)
  model_keys = omegaconf.OmegaConf.load(model_file).keys()
  return {k: own[k] for k in model_keys if k in own and k not in cli}


def load_pydantic(argv: Sequence[str]):
  """`[yml, key=value, ...]` -> validated `PluginRLConfig` (pydantic), or `ConfigError`."""
  import omegaconf  # pylint: disable=import-outside-toplevel
  import pydantic  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  if not argv:
    raise ConfigError("usage: python -m maxtext_rl_plugin.train_rl <config.yml> [key=value ...]")
  given = resolve_yml(argv[0])
  yml = _materialize_yml(given)
  cls = _config_class()
  overrides = _parse_overrides(argv[1:], cls)
  try:
    raw = omegaconf.OmegaConf.to_container(pyconfig._load_config(yml), resolve=False)  # pylint: disable=protected-access
  except FileNotFoundError as e:
    raise ConfigError(f"config file '{e.filename}' (base_config of '{given}') not found") from None
  except Exception as e:  # pylint: disable=broad-exception-caught  (yaml/omegaconf parse errors)
    raise ConfigError(f"config file '{given}' is not valid YAML: {str(e).splitlines()[0]}") from None
  _check_yml_keys(raw, f"in {given}", cls)
  cli = dict(a.split("=", 1) for a in overrides)
  _check_model_name(str(cli.get("model_name", raw.get("model_name", "default"))))
  overrides = _resolve_tokenizer_path(overrides, raw)
  kwargs = _model_file_overrides(yml, raw, overrides)
  try:
    # The private entry point raises instead of calling sys.exit(2) after multi-line logging, which
    # is what `pyconfig.initialize_pydantic` does outside pytest; we turn the error into one line.
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      pc = pyconfig._initialize_pydantic(["", yml, *overrides], config_class=cls, **kwargs)  # pylint: disable=protected-access
  except pydantic.ValidationError as e:
    raise ConfigError(_format_validation_error(e)) from None
  except omegaconf.errors.OmegaConfBaseException as e:
    raise ConfigError(f"could not parse overrides: {str(e).splitlines()[0]}") from None
  except (ValueError, TypeError, KeyError) as e:
    raise ConfigError(str(e).splitlines()[0] if str(e) else repr(e)) from None
  _sync_flat_from_nested(pc)
  return pc


def load_config(argv: Sequence[str]):
  """`[yml, key=value, ...]` -> MaxText `HyperParameters` over a `PluginRLConfig`."""
  return to_hyperparameters(load_pydantic(argv))


def to_hyperparameters(pc):
  """MaxText's read-only attribute view (`config.rl.loss_algo`, `config.emb_dim`)."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

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


def canonical_argv(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
  """(argv, kwargs) for MaxText calls that re-parse argv themselves
  (`model_creation_utils.setup_configs_and_devices`): yml absolute, overrides canonicalised."""
  import omegaconf  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  yml = _materialize_yml(resolve_yml(argv[0]))
  overrides = _parse_overrides(argv[1:], _config_class())
  raw = omegaconf.OmegaConf.to_container(pyconfig._load_config(yml), resolve=False)  # pylint: disable=protected-access
  overrides = _resolve_tokenizer_path(overrides, raw)
  return ["", yml, *overrides], _model_file_overrides(yml, raw, overrides)


def dump_yaml(config) -> str:
  """The resolved configuration as YAML (secrets redacted), for `print_config=true`."""
  import yaml  # pylint: disable=import-outside-toplevel

  pc = getattr(config, "_pydantic_config", config)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    data = pc.model_dump(mode="json")
  for k in REDACTED_KEYS:
    if data.get(k):
      data[k] = "<redacted>"
  return yaml.safe_dump(data, sort_keys=True, default_flow_style=None, width=120)
