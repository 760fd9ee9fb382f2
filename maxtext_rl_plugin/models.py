"""Build the MaxText models, meshes and tokenizer an RL run needs, through MaxText's own code.

Device split (colocated vs. disaggregated trainer/sampler, multislice) follows
`model_creation_utils.setup_configs_and_devices`, from the config parsed once; weights come from
`from_pretrained` (an Orbax `load_parameters_path`, or random init from `init_weights_seed` when none is
given), wrapped in `TunixMaxTextAdapter` so Tunix's RLCluster can drive them.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any
import warnings

from absl import logging
import jax
from jax.sharding import Mesh
from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils
from transformers import AutoTokenizer

from maxtext_rl_plugin.config import early_checks
from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.errors import ConfigError


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


def setup_devices(parsed: config_lib.Parsed, devices=None) -> RunSetup:
  """MaxText's trainer/sampler device split for the run's config (`config_lib.Parsed`, parsed once by the caller).

  Same semantics as MaxText 0.2.5's `model_creation_utils.setup_configs_and_devices` (compared in
  tests/config/test_config.py), without its re-parse of argv: single slice -> one config; Pathways with >= 2 VMs splits
  the devices by `trainer_devices_fraction` / `sampler_devices_fraction`; multislice derives the trainer and sampler
  configs (slice counts, fsdp/tensor parallelism) from the parsed one, as MaxText's kwargs do.
  """
  pc = parsed.config
  devices = list(jax.devices() if devices is None else devices)
  if pc.num_trainer_slices == -1 and pc.num_samplers_slices == -1:
    t_dev = s_dev = devices
    if len(devices) // pc.chips_per_vm >= 2 and pc.use_pathways:
      n = len(devices)
      t_dev = devices[: int(n * pc.trainer_devices_fraction)]
      s_dev = devices[n - int(n * pc.sampler_devices_fraction) :]
    t_pc = s_pc = pc
  elif pc.num_trainer_slices > 0 and pc.num_samplers_slices > 0:
    by_slice: dict[int, list] = {}
    for d in devices:
      by_slice.setdefault(d.slice_index, []).append(d)
    slices = sorted(by_slice)
    n_t, n_s = pc.num_trainer_slices, pc.num_samplers_slices
    if len(slices) < n_t + n_s:
      raise ConfigError(
          f"invalid value for 'num_trainer_slices'={n_t}: with num_samplers_slices={n_s} it needs "
          f"{n_t + n_s} slices, found {len(slices)}"
      )
    t_dev = [d for i in slices[:n_t] for d in by_slice[i]]
    s_dev = [d for i in slices[n_t : n_t + n_s] for d in by_slice[i]]
    per_slice, tp = len(t_dev) // n_t, pc.ici_tensor_parallelism
    fsdp = per_slice
    if tp > 1:
      if per_slice % tp:
        raise ConfigError(
            f"invalid value for 'ici_tensor_parallelism'={tp}: must divide the {per_slice} trainer " "devices per slice"
        )
      if pc.ici_fsdp_parallelism != -1 and pc.ici_fsdp_parallelism * tp != per_slice:
        raise ConfigError(
            f"invalid value for 'ici_fsdp_parallelism'={pc.ici_fsdp_parallelism}: times "
            f"ici_tensor_parallelism={tp} must equal the {per_slice} trainer devices per slice"
        )
      fsdp = per_slice // tp
    t_pc = parsed.derive(num_slices=n_t, ici_fsdp_parallelism=fsdp, ici_tensor_parallelism=tp, dcn_data_parallelism=n_t)
    s_pc = parsed.derive(
        num_slices=n_s, ici_fsdp_parallelism=len(s_dev) // n_s, ici_tensor_parallelism=-1, dcn_data_parallelism=n_s
    )
  else:
    raise ConfigError(
        f"invalid value for 'num_trainer_slices'={pc.num_trainer_slices}: num_trainer_slices and "
        f"num_samplers_slices (={pc.num_samplers_slices}) must both be -1 or both be positive"
    )
  t_hp = config_lib.to_hyperparameters(t_pc)
  s_hp = t_hp if s_pc is t_pc else config_lib.to_hyperparameters(s_pc)
  # Before any model is built: MaxText's mesh creation asserts the same, 10-20 s later, in a traceback.
  early_checks.check_mesh(t_hp, len(t_dev), " of the trainer" if s_dev is not t_dev else "")
  if s_dev is not t_dev:
    early_checks.check_mesh(s_hp, len(s_dev), " of the sampler")
  return RunSetup(t_hp, s_hp, list(t_dev), list(s_dev))


def load_tokenizer(config):
  """The HF tokenizer at `tokenizer_path` (local dir or hub id); pad falls back to EOS."""
  path = config.tokenizer_path
  try:
    tok = _tokenizer(path, config.hf_access_token or None, _version(path))
  except (OSError, ValueError) as e:
    raise ConfigError(
        f"invalid value for 'tokenizer_path'='{path}': cannot load a Hugging Face tokenizer ({type(e).__name__})"
    ) from None
  if config.use_chat_template and not getattr(tok, "chat_template", None):
    raise ConfigError(
        f"tokenizer at '{path}' has no chat template; set use_chat_template=false to use data_template_path instead"
    )
  return tok


def load_run_tokenizer(config):
  """A run's tokenizer (`load_tokenizer`) with no more ids than the model's embedding rows: a hub id's size is first
  known here (a local tokenizer was checked in the first pass). Tests and benchmarks that feed random ids to a small
  vocabulary load a larger tokenizer through `load_tokenizer` alone."""
  tok = load_tokenizer(config)
  config_files.check_tokenizer_fits(config.tokenizer_path, len(tok), int(config.vocab_size))
  return tok


def _version(path: str) -> tuple:
  """What makes a local tokenizer directory another tokenizer: its files' names, sizes and modification times (a hub
  id has none: the hub's own cache decides)."""
  root = pathlib.Path(path)
  if not root.is_dir():
    return ()
  return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in root.iterdir() if f.is_file()))


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str, token: str | None, version: tuple):
  """One load per tokenizer and process: Qwen3's 151k-token tokenizer takes ~0.6 s to build, which every run in a
  process that runs several (the tests, a notebook) paid again. `version` keys the cache on the files' state. The
  object is shared: nothing in the plugin changes a tokenizer after this, and the pad fallback is set here, once."""
  del version  # the cache key only
  tok = AutoTokenizer.from_pretrained(path, token=token)
  if tok.pad_token_id is None:
    tok.pad_token = tok.eos_token
  return tok


def build_model(config, devices, pad_id: int | None = None, rng_seed: int | None = None):
  """A `TunixMaxTextAdapter` and its mesh on `devices` (weights from load_parameters_path or random init)."""
  config_files.check_load_parameters_path(config.load_parameters_path)
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
  logging.info(
      "built %s (%d layers, emb %d) on %d devices, mesh %s",
      config.model_name,
      config.num_decoder_layers,
      config.emb_dim,
      len(devices),
      dict(mesh.shape),
  )
  return model, mesh


def build_sampler_mesh(sampler_config, sampler_devices):
  """The rollout mesh MaxText would build for `sampler_devices`."""
  return Mesh(maxtext_utils.create_device_mesh(sampler_config, sampler_devices), sampler_config.mesh_axes)
