"""Build the MaxText models, meshes and tokenizer an RL run needs, through MaxText's own code.

Device split (colocated vs. disaggregated trainer/sampler, multislice) comes from
`model_creation_utils.setup_configs_and_devices`; weights come from `from_pretrained` (an Orbax
`load_parameters_path`, or random init from `init_weights_seed` when none is given), wrapped in
`TunixMaxTextAdapter` so Tunix's RLCluster can drive them.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from absl import logging

from maxtext_rl_plugin import config as config_lib
from maxtext_rl_plugin.errors import CheckpointError, ConfigError


@dataclasses.dataclass
class RunSetup:
  """Configs and device sets for the trainer (actor/reference) and the sampler (rollout)."""

  trainer_config: Any
  sampler_config: Any
  trainer_devices: list
  sampler_devices: list

  @property
  def disaggregated(self) -> bool:
    return list(self.trainer_devices) != list(self.sampler_devices)


def setup_devices(argv) -> RunSetup:
  """MaxText's device split for `argv` (`[yml, k=v, ...]`), with the plugin's config class."""
  from maxtext.utils import model_creation_utils  # pylint: disable=import-outside-toplevel

  mt_argv, kwargs = config_lib.canonical_argv(argv)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      t_pc, s_pc, t_dev, s_dev = model_creation_utils.setup_configs_and_devices(
          mt_argv, kwargs, config_class=config_lib._config_class()  # pylint: disable=protected-access
      )
    except ValueError as e:
      raise ConfigError(str(e).splitlines()[0]) from None
  return RunSetup(config_lib.to_hyperparameters(t_pc), config_lib.to_hyperparameters(s_pc), list(t_dev), list(s_dev))


def load_tokenizer(config):
  """The HF tokenizer at `tokenizer_path` (local dir or hub id); pad falls back to EOS."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel

  path = config.tokenizer_path
  try:
    tok = AutoTokenizer.from_pretrained(path, token=config.hf_access_token or None)
  except (OSError, ValueError) as e:
    raise ConfigError(f"invalid value for 'tokenizer_path'='{path}': cannot load a Hugging Face tokenizer ({type(e).__name__})") from None
  if tok.pad_token_id is None:
    tok.pad_token = tok.eos_token
  if config.use_chat_template and not getattr(tok, "chat_template", None):
    raise ConfigError(
        f"tokenizer at '{path}' has no chat template; set use_chat_template=false to use data_template_path instead"
    )
  return tok


def check_load_parameters_path(config) -> None:
  path = config.load_parameters_path
  if path and not str(path).startswith("gs://") and not os.path.exists(path):
    raise CheckpointError(f"invalid value for 'load_parameters_path'='{path}': no such checkpoint directory")


def build_model(config, devices, pad_id: int | None = None, rng_seed: int | None = None):
  """A `TunixMaxTextAdapter` and its mesh on `devices` (weights from load_parameters_path or random init)."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.utils import model_creation_utils  # pylint: disable=import-outside-toplevel

  check_load_parameters_path(config)
  seed = config.init_weights_seed if rng_seed is None else rng_seed
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, mesh = model_creation_utils.from_pretrained(
        config,
        devices=devices,
        wrap_with_tunix_adapter=True,
        tokenizer_pad_id=pad_id,
        rng_key=jax.random.PRNGKey(seed),
    )
  logging.info("built %s (%d layers, emb %d) on %d devices, mesh %s", config.model_name, config.num_decoder_layers,
               config.emb_dim, len(devices), dict(mesh.shape))
  return model, mesh


def build_sampler_mesh(sampler_config, sampler_devices):
  """The rollout mesh MaxText would build for `sampler_devices`."""
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  return Mesh(maxtext_utils.create_device_mesh(sampler_config, sampler_devices), sampler_config.mesh_axes)
