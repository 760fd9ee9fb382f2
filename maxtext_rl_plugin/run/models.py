"""Builders that hand the whole config to MaxText's own API: the LoRA-wrapped actor.

MaxText's `lora_utils.apply_lora_to_model` and `restore_lora_from_path` take its `HyperParameters` (they read the
`lora:` block, `lora_input_adapters_path`, the mesh keys and the model name), so the functions that call them take the
config and live in `run/`, where the whole config may go; every other room reads LoRA through `lora.LoraSettings`.
"""

from __future__ import annotations

from typing import Any

from absl import logging
from flax import nnx
from flax.core.spmd import logical_axis_rules
import jax
from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
from maxtext.utils import lora_utils

from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin.errors import ConfigError


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
