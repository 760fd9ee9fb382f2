"""Load `<yml> key=value ...` with MaxText's pyconfig into the plugin's `PluginRLConfig`: the typed load.

The argv contract is MaxText's (first the yml, then OmegaConf `key=value` overrides, dotted keys for
nested blocks such as `rl.kl_estimator=k3`). The concerns around it have rooms of their own:

* `config/files.py`: yml names resolve against the packaged configs, so `configs/rl.yml` works from any directory
  (e.g. inside the Docker image on a Pathways cluster); `base_config` may name a shipped plugin config;
* `config/keys.py`: unknown keys and refused keys as one-line errors naming the key;
* `config/precheck.py`: the same checks on the config as written, before JAX and the schema are imported;
* `config/validation.py`: device-free checks, the same for `print_config=true`, the launchers and training.

What this module does: MaxText's pydantic initialization of the chain and overrides the first pass read (`typed`,
given `config/precheck.Written`; its errors as one line naming the key and value, never a traceback), once: the
`Parsed` result is handed down (train_rl -> run/loop -> run/build -> run/models.setup_devices), and nothing below the
entry points reads argv again; MaxText's `HyperParameters` view, and one source of truth for keys that MaxText keeps
both flat and nested (`loss_algo` and `rl.loss_algo`): a dotted override is rewritten to its flat twin, which MaxText
routes into the nested block, and the flat copy is then re-synced from the nested one.

MaxText's `pyconfig` and schema (and `config_types`, `tunix_compat`, built on them) are imported inside functions:
they import JAX (~5 s), and `--help` or a launcher's dry run should not pay for that.
"""

# JAX-importing modules are imported on first parse (see the module docstring).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence
import warnings

import omegaconf
import pydantic
import yaml

from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import keys as config_keys
from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin.config import validation
from maxtext_rl_plugin.errors import ConfigError

REDACTED_KEYS = ("hf_access_token",)


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
  more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
  # A model-level validator of MaxText's names its key first ("Value error, max_seq_token_per_tpu (100) must be ..."):
  # name it as a field error is named.
  key = msg.removeprefix("Value error, ").split(" ", 1)[0]
  if err["loc_str"] == "config" and msg.startswith("Value error, ") and isinstance(value, dict) and key in value:
    why = re.sub(r"^\(\S+\)\s*", "", msg.removeprefix(f"Value error, {key}").lstrip())
    return f"invalid value for '{key}'={value[key]!r}: {why}{more}"
  shown = f"={value!r}" if isinstance(value, (str, int, float, bool)) or value is None else ""
  return f"invalid value for '{err['loc_str']}'{shown}: {msg}{more}"


def _sync_flat_from_nested(pc) -> None:
  """After MaxText routed flat keys into nested blocks, the nested value is the truth: mirror it."""
  for block in config_keys.nested_fields(type(pc)):
    sub = getattr(pc, block)
    for inner in type(sub).model_fields:
      if inner in type(pc).model_fields:
        object.__setattr__(pc, inner, getattr(sub, inner))


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

  def hyperparameters(self):
    """MaxText's `HyperParameters` view of the config (`to_hyperparameters`)."""
    return to_hyperparameters(self.config)


def _initialize(yml: str, merged, overrides: list[str], kwargs: dict[str, Any]):
  """MaxText's pydantic initialization of the merged yml chain plus overrides; its errors as one-line ConfigErrors."""
  from maxtext_rl_plugin import tunix_compat

  try:
    with warnings.catch_warnings(), tunix_compat.pyconfig_reads(merged) as initialize:
      warnings.simplefilter("ignore")
      pc = initialize(["", yml, *overrides], config_class=config_keys.config_class(), **kwargs)
  except pydantic.ValidationError as e:
    raise ConfigError(_format_validation_error(e)) from None
  except omegaconf.errors.OmegaConfBaseException as e:  # an override OmegaConf cannot read, a `${...}` it cannot resolve
    raise ConfigError(f"could not read the configuration (yml and overrides): {str(e).splitlines()[0]}") from None
  except (ValueError, TypeError, KeyError) as e:
    raise ConfigError(str(e).splitlines()[0] if str(e) else repr(e)) from None
  _sync_flat_from_nested(pc)
  return pc


def typed(written: config_precheck.Written) -> Parsed:
  """The config the first pass read (`config_precheck.read`), typed and validated: the key names the schema alone
  knows, refused keys, model_name, the tokenizer and model files, MaxText's pydantic initialization, `validate`."""
  keys = config_keys.schema_keys()
  config_keys.check_override_names(written.overrides, keys)
  for path, cfg in written.chain:
    if not config_files.is_maxtext_file(path):
      config_keys.check_yml_keys(omegaconf.OmegaConf.to_container(cfg, resolve=False), f"in {path}", keys)
  # The user's own spelling (`rl.system_prompt`, not the flat twin the override was rewritten to) picks the status.
  config_keys.check_refused(config_keys.user_set_values(written.chain, [a.strip().lstrip("-") for a in written.args]))
  merged = config_files.merge_chain(written.chain)
  raw = omegaconf.OmegaConf.to_container(merged, resolve=False)
  overrides = written.overrides
  cli = dict(a.split("=", 1) for a in overrides)
  config_files.check_model_name(str(cli.get("model_name", raw.get("model_name", "default"))))
  overrides = config_files.resolve_tokenizer_path(config_files.expand_home_paths(overrides, raw), raw)
  kwargs = config_files.model_file_overrides(written.chain, raw, overrides)
  pc = _initialize(written.chain[0][0], merged, overrides, kwargs)
  validation.validate(pc, written)
  return Parsed(pc, written.chain[0][0], merged, overrides, kwargs)


def parse(argv: Sequence[str]) -> Parsed:
  """`[yml, key=value, ...]` read and typed, without the first pass's checks (tests, benchmarks, export_lora's second
  load); `train_rl` runs the first pass and hands its `Written` to `typed`. Each call reads the files again: callers
  parse once and hand the result down."""
  return typed(config_precheck.read(argv))


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
