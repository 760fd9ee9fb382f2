"""The plugin's configuration schema: MaxText's `types.RLConfig` plus the plugin's own keys.

We extend rather than fork: `PluginRLConfig` subclasses MaxText 0.2.5's pydantic `RLConfig`, so
every key of MaxText's `post_train/rl.yml` keeps its meaning, validation and flat-key routing
(`loss_algo=gspo-token` on the command line lands in `rl.loss_algo`).

The plugin's own keys come in one class per concern, as MaxText's `types.py` keeps one class per concern and combines
them in `RLConfig`: the flat ones in config/fields.py (`PluginKeys`) and the `rl:` block's in config/rl_fields.py
(`PluginRLKeys`, which `PluginRL` adds to MaxText's `types.RL`). Those modules are pydantic only, so the first pass
reads each key's rules (config/key_rule.py: status, resume rule, switch; bounds and choices from the type) before this
module's imports (JAX, MaxText). Each field has a description, which docs/config_reference.md is generated from
(`python -m maxtext_rl_plugin.config.doc`). A concern's cross-key checks are plain functions in config/validation.py
and config/early_checks.py, named in each class's docstring, and both passes run the same ones.
"""

from __future__ import annotations

from maxtext.configs import types
from pydantic import Field

from maxtext_rl_plugin.config.fields import PluginKeys
from maxtext_rl_plugin.config.rl_fields import PluginLossName
from maxtext_rl_plugin.config.rl_fields import PluginRLKeys


class PluginRL(PluginRLKeys, types.RL):
  """`rl:` block: MaxText's RL keys, with GRPO-group validation and the plugin's concerns (config/rl_fields.py).

  Bases in reverse: pydantic orders fields from the last base to the first, so MaxText's keys come first and the
  plugin's keep the order of rl_fields.py (print_config, docs/config_reference.md)."""


class PluginRLConfig(PluginKeys, PluginLossName, types.RLConfig):
  """MaxText's RLConfig + the plugin's keys; passed to pyconfig as `config_class`."""

  rl: PluginRL = Field(default_factory=PluginRL, description="RL algorithm configuration (GRPO/GSPO).")
  # MaxText keeps `lora:` in MaxTextConfig (its SFT trainer reads it) but not in RLConfig; the plugin adds the same
  # block so `lora.enable_lora=true` means what it means in MaxText's train_sft (read by maxtext_rl_plugin.lora).
  lora: types.LoRA = Field(default_factory=types.LoRA, description="LoRA / QLoRA adapters (MaxText's `lora:` block).")
