"""The first pass over a config, before the schema's imports: mistakes cost a second instead of ten.

`read` reads the yml chain and the command line once (`Written`: config_files, key names checked without the schema by
config_keys.light_keys); `precheck` checks model_name and runs `validation.validate_raw` on the config as written, and
its view carries the `Written` on (`RawConfig.source`) to the typed pass (`config/load.typed`), which checks what
needs the schema; keys this pass cannot type (derived keys, `M_<KEY>` environment overrides, `${...}` interpolations)
are left to it. Model-file keys are read as pyconfig applies them (over the yml chain, under the command line), so a
check on the model's shape or family (router replay, the vLLM route's head_dim) is decided here too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import omegaconf

from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import keys as config_keys
from maxtext_rl_plugin.config import validation
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Written:
  """The config as written, read once: the yml chain (the given file, then each `base_config` to MaxText's base.yml)
  and the command line, whose `key=value` overrides are parsed (names checked, `block.key` rewritten to MaxText's
  flat twin); `args` keeps the user's own spelling (the refused-key check names what the user typed)."""

  chain: list[tuple[str, Any]]
  args: list[str]
  overrides: list[str]

  def user_keys(self) -> frozenset[str]:
    """The keys the user set, dotted (`rl.agentic_max_turns`; a flat twin under its block's name): the command line,
    MaxText's `M_<KEY>` environment overrides and the yml files that are neither the plugin's shipped configs nor
    MaxText's. A shipped demo's keys are defaults the user took, not settings they can be told to drop."""
    rl_inner = config_keys.light_keys().blocks["rl"] or frozenset()
    shipped = os.path.realpath(config_files.configs_dir()) + os.sep
    keys: set[str] = set()
    for path, cfg in self.chain:
      if config_files.is_maxtext_file(path) or os.path.realpath(path).startswith(shipped):
        continue
      for key, value in omegaconf.OmegaConf.to_container(cfg, resolve=False).items():
        if key in config_keys.light_keys().blocks and isinstance(value, dict):
          keys.update(f"{key}.{inner}" for inner in value)
        else:
          keys.add(key)
    keys.update(arg.split("=", 1)[0] for arg in self.overrides)
    keys.update(k[2:].lower() for k in os.environ if k.startswith("M_"))
    return frozenset(f"rl.{k}" if k in rl_inner else k for k in keys)


def read(argv: Sequence[str]) -> Written:
  """`[yml, key=value, ...]` read: the yml chain and the overrides, key names checked without the schema."""
  if not argv:
    raise ConfigError("usage: python -m maxtext_rl_plugin.train_rl <config.yml> [key=value ...]")
  keys = config_keys.light_keys()
  chain = config_files.read_chain(argv[0])
  overrides = config_keys.parse_overrides(argv[1:], keys)
  for path, cfg in chain:
    if not config_files.is_maxtext_file(path):
      config_keys.check_yml_keys(omegaconf.OmegaConf.to_container(cfg, resolve=False), f"in {path}", keys)
  return Written(chain, list(argv[1:]), overrides)


def _raw_view(written: Written) -> validation.RawConfig:
  """The config as written (the merged chain, the model file configs/models/<model_name>.yml, the overrides, in the
  order `config/load` applies them) as a `validation.RawConfig`: typed by the shipped defaults; a key an `M_<KEY>`
  environment variable overrides, or one the command line and the model file both set without
  override_model_config (pyconfig refuses it), is left unresolved."""
  merged = config_files.merge_chain(written.chain)
  for arg in written.overrides:
    merged = omegaconf.OmegaConf.merge(merged, omegaconf.OmegaConf.from_dotlist([arg]))
  values = omegaconf.OmegaConf.to_container(merged, resolve=False)
  rl_block = values.get("rl")
  for inner in config_keys.light_keys().blocks["rl"] or ():
    if inner in values and isinstance(rl_block, dict):  # a flat twin: MaxText routes it into the block
      rl_block[inner] = values.pop(inner)
  model = str(values.get("model_name", "default")).replace("-Instruct", "")
  model_file = os.path.join(config_files.maxtext_configs_dir(), "models", f"{model}.yml")
  model_values = (
      omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(model_file), resolve=False)
      if os.path.isfile(model_file)
      else {}
  )
  # `config/load`'s order: the yml chain, then the model file, then the command line, which may override a model key
  # only with override_model_config=true (without it pyconfig refuses the pair in its own words: left unresolved);
  # with it, the plugin's own yml files win over the model file too (config_files.model_file_overrides).
  cli_keys = {arg.split("=", 1)[0] for arg in written.overrides}
  own = config_files.model_file_overrides(written.chain, values, written.overrides)
  twice = set()
  for key, value in model_values.items():
    if key not in cli_keys and key not in own:
      values[key] = value
    elif key in cli_keys and not values.get("override_model_config"):
      twice.add(key)
  env_keys = {k for k in values if f"M_{k.upper()}" in os.environ}
  return validation.RawConfig(values, config_keys.shipped_defaults(), frozenset(twice | env_keys), written)


def precheck(argv: Sequence[str]) -> validation.RawConfig:
  """The checks that need only the yml chain and the command line, before the schema's imports (JAX, MaxText: ~10 s
  on a loaded machine): the files, key names (`read`), model_name and `validation.validate_raw`. The typed pass
  (`config/load.typed`, given `view.source()`) decides what needs the schema; this pass makes a mistake cost a second
  instead of ten."""
  written = read(argv)
  try:
    view = _raw_view(written)
  except omegaconf.errors.OmegaConfBaseException:
    return validation.RawConfig({}, {}, source=written)  # an override OmegaConf cannot merge: the typed pass says so
  config_files.check_model_name(str(value_or(view, "model_name", "default")))
  validation.validate_raw(view)
  return view
