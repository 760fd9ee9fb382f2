"""Build the MaxText models, meshes and LoRA-wrapped actor an RL run needs, through MaxText's own code.

Device split (colocated vs. disaggregated trainer/sampler, multislice) follows
`model_creation_utils.setup_configs_and_devices`, from the config parsed once; weights come from
`from_pretrained` (an Orbax `load_parameters_path`, or random init from `init_weights_seed` when none is
given), wrapped in `TunixMaxTextAdapter` so Tunix's RLCluster can drive them; LoRA is MaxText's
`lora_utils.apply_lora_to_model` / `restore_lora_from_path`.

Builders: each hands MaxText's `HyperParameters` (the whole config) to MaxText's own API (`from_pretrained`,
`create_device_mesh`, `apply_lora_to_model`, `restore_lora_from_path`, which read the model, mesh and `lora:` keys
themselves), so they take the config and live in `run/`, where the whole config may go. Every other room reads what it
needs through a settings object (`lora.LoraSettings`, `moe.MoeSettings`, `data/tokenizer.TokenizerSettings`).
"""

from __future__ import annotations

import dataclasses
from typing import Any
import warnings

from absl import logging
from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
from jax.sharding import Mesh
from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
from maxtext.utils import lora_utils
from maxtext.utils import maxtext_utils
from maxtext.utils import model_creation_utils

from maxtext_rl_plugin.config import early_checks
from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin import lora as lora_lib
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


def apply_lora(config, actor, mesh, pad_id: int | None = None) -> tuple[Any, Any]:
  """(LoRA actor, frozen base actor) when lora.enable_lora, else (actor, None).

  The LoRA actor is a new `TunixMaxTextAdapter` over MaxText's `apply_lora_to_model(actor.base)`; the base actor is
  the one passed in, whose arrays the LoRA actor shares (every non-adapter leaf is the same jax.Array).
  """
  settings = lora_lib.LoraSettings.from_config(config)
  if not settings.enable:
    return actor, None
  with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
    base = apply_lora_abstract(config, actor.base, mesh)
    # qwix's wrapped model holds copies of the kernels it adapts and of the RNG state (same values); point it at the
    # base's arrays so the reference (the frozen base) and the actor share one copy of the weights.
    nnx.update(base, nnx.state(actor.base))
    if settings.restore_path:
      lora_utils.restore_lora_from_path(base, config)
  lora_actor = TunixMaxTextAdapter(base_model=base, pad_id=pad_id)
  n_lora = sum(x.size for x in jax.tree.leaves(nnx.state(lora_actor, nnx.LoRAParam)))
  n_base = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
  logging.info(
      "LoRA rank %d alpha %g on '%s': %d adapter parameters (%.3f%% of %d base parameters)",
      settings.rank,
      settings.alpha,
      settings.resolved_module_path(),
      n_lora,
      100.0 * n_lora / n_base,
      n_base,
  )
  return lora_actor, actor


def apply_lora_abstract(config, base, mesh):
  """MaxText's `apply_lora_to_model` on a MaxText model (concrete, or inside `nnx.eval_shape` for the AOT compile),
  its module-path mismatch as one line; the adapters' trace intermediates dropped."""
  try:
    base = lora_utils.apply_lora_to_model(base, mesh, config)
  except ValueError as e:  # MaxText's "module_path ... did not match any weights"
    module_path = lora_lib.LoraSettings.from_config(config).resolved_module_path()
    raise ConfigError(f"invalid value for 'lora.lora_module_path'='{module_path}': {e}") from None
  nnx.pop(base, nnx.Intermediate)
  return base
