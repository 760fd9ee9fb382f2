"""The first pass over a config, before the schema's imports: mistakes cost a second instead of ten.

`precheck` reads the yml chain and the command line (config_files), checks key names without the schema
(config_keys.light_keys), model_name, and runs `validation.validate_raw` on the config as written. `config.parse`
repeats every check on the typed config; keys this pass cannot type (derived keys, `M_<KEY>` environment overrides,
`${...}` interpolations) are left to it. Model-file keys are read as pyconfig applies them (over the yml chain, under
the command line), so a check on the model's shape or family (router replay, the vLLM route's head_dim) is decided
here too.
"""

from __future__ import annotations

import os
from typing import Sequence

import omegaconf

from maxtext_rl_plugin import config_files
from maxtext_rl_plugin import config_keys
from maxtext_rl_plugin import validation
from maxtext_rl_plugin.errors import ConfigError


def _raw_view(chain, overrides: list[str]) -> validation.RawConfig:
  """The config as written (the merged chain, the model file configs/models/<model_name>.yml, the overrides, in the
  order `config.parse` applies them) as a `validation.RawConfig`: typed by the shipped defaults; a key an `M_<KEY>`
  environment variable overrides, or one the command line and the model file both set without
  override_model_config (pyconfig refuses it), is left unresolved."""
  merged = config_files.merge_chain(chain)
  for arg in overrides:
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
  # `config.parse`'s order: the yml chain, then the model file, then the command line, which may override a model key
  # only with override_model_config=true (without it pyconfig refuses the pair in its own words: left unresolved);
  # with it, the plugin's own yml files win over the model file too (config_files.model_file_overrides).
  cli_keys = {arg.split("=", 1)[0] for arg in overrides}
  own = config_files.model_file_overrides(chain, values, overrides)
  twice = set()
  for key, value in model_values.items():
    if key not in cli_keys and key not in own:
      values[key] = value
    elif key in cli_keys and not values.get("override_model_config"):
      twice.add(key)
  env_keys = {k for k in values if f"M_{k.upper()}" in os.environ}
  return validation.RawConfig(values, config_keys.shipped_defaults(), frozenset(twice | env_keys))


def precheck(argv: Sequence[str]) -> validation.RawConfig:
  """The checks that need only the yml chain and the command line, before the schema's imports (JAX, MaxText: ~10 s
  on a loaded machine): the files, key names, model_name and `validation.validate_raw`. `parse` repeats them all on
  the typed config; this pass only makes a mistake cost a second instead of ten."""
  if not argv:
    raise ConfigError("usage: python -m maxtext_rl_plugin.train_rl <config.yml> [key=value ...]")
  keys = config_keys.light_keys()
  chain = config_files.read_chain(argv[0])
  overrides = config_keys.parse_overrides(argv[1:], keys)
  for path, cfg in chain:
    if not config_files.is_maxtext_file(path):
      config_keys.check_yml_keys(omegaconf.OmegaConf.to_container(cfg, resolve=False), f"in {path}", keys)
  try:
    view = _raw_view(chain, overrides)
  except omegaconf.errors.OmegaConfBaseException:
    return validation.RawConfig({}, {})  # an override OmegaConf cannot merge: `parse` says so in its words
  config_files.check_model_name(str(getattr(view, "model_name", "default")))
  validation.validate_raw(view)
  return view
