"""LoRA RL: MaxText's `lora:` keys (its SFT keys) on the RL actor, with train_sft's meaning.

`lora.enable_lora=true` wraps the actor's MaxText `Transformer` with MaxText's own
`lora_utils.apply_lora_to_model` (qwix `LoraProvider`: rank `lora_rank`, scale `lora_alpha / lora_rank`, modules
matched by `lora_module_path`, else MaxText's `post_train/lora_module_path.yml` entry for the model), and restores
`lora_restore_path` with MaxText's `restore_lora_from_path`. What follows from Tunix 0.1.7 once the actor carries
`nnx.LoRAParam` leaves, and what this module adds:

* training: Tunix's `PeftTrainer` builds the optimizer with `wrt=nnx.LoRAParam` and differentiates only those
  leaves, so the frozen base gets no gradient and no optimizer state;
* reference: the model *before* the adapters were applied; `apply` points the wrapped model at the same base arrays
  (qwix copies the kernels it adapts), so the KL anchor is the frozen base with no second copy of the weights;
* sync: `RLCluster.sync_weights` hands the rollout engine only the `nnx.LoRAParam` state; the embedded engine keeps
  the base and merges `W + alpha/rank * A @ B` into its decode weights on its side (`Merger`), recomputed only when
  the adapters changed;
* checkpoints: the trainer saves `trainable(model)` (adapters + their optimizer state); `export_merged` writes the
  merged weights as a MaxText params checkpoint that `load_parameters_path` loads.
"""

# JAX, Flax, Tunix and MaxText's LoRA utilities are imported inside the functions that use them: config loading
# imports this module for `validate` (config/validation.py), and loading a config must not import JAX (config/load.py).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import math
import os
import re
from typing import Any

from absl import logging

from maxtext_rl_plugin.errors import ConfigError

# MaxText's own defaults of the `lora:` block (types.LoRA): a value other than these with enable_lora=false is a key
# set to no effect, which the plugin refuses rather than ignores.
_OFF_DEFAULTS = {"lora_rank": 0, "lora_alpha": 0.0, "lora_module_path": "", "lora_restore_path": ""}


def enabled(config) -> bool:
  lora = getattr(config, "lora", None)
  return bool(lora is not None and lora.enable_lora)


def validate(config) -> None:
  """Device-free checks of the `lora:` block (one line each); called from config.validate."""
  lora = config.lora
  if not lora.enable_lora:
    for key, default in _OFF_DEFAULTS.items():
      value = getattr(lora, key)
      if value != default and not (isinstance(default, float) and float(value) == default):
        raise ConfigError(
            f"config key 'lora.{key}'={value!r} has no effect with lora.enable_lora=false; "
            "set lora.enable_lora=true or drop the key"
        )
    return
  if lora.lora_rank < 1:
    raise ConfigError(f"invalid value for 'lora.lora_rank'={lora.lora_rank}: must be >= 1 with lora.enable_lora=true")
  if not lora.lora_alpha > 0:
    raise ConfigError(
        f"invalid value for 'lora.lora_alpha'={lora.lora_alpha}: must be > 0 with lora.enable_lora=true "
        "(the adapter update is alpha/rank * A @ B; 0 trains nothing)"
    )
  if lora.lora_module_path:
    try:
      re.compile(lora.lora_module_path)
    except re.error as e:
      raise ConfigError(
          f"invalid value for 'lora.lora_module_path'='{lora.lora_module_path}': not a regular " f"expression ({e})"
      ) from None
  path = lora.lora_restore_path
  if path and not str(path).startswith("gs://") and not os.path.exists(path):
    raise ConfigError(f"invalid value for 'lora.lora_restore_path'='{path}': no such checkpoint directory")


def module_path(config) -> str:
  """The regex MaxText applies LoRA to: lora.lora_module_path, else lora_module_path.yml's entry for model_name."""
  from maxtext_rl_plugin import tunix_compat

  return tunix_compat.maxtext_lora_module_path(config)


def apply(config, actor, mesh, pad_id: int | None = None) -> tuple[Any, Any]:
  """(LoRA actor, frozen base actor) when lora.enable_lora, else (actor, None).

  The LoRA actor is a new `TunixMaxTextAdapter` over MaxText's `apply_lora_to_model(actor.base)`; the base actor is
  the one passed in, whose arrays the LoRA actor shares (every non-adapter leaf is the same jax.Array).
  """
  if not enabled(config):
    return actor, None
  from flax import nnx
  from flax.core.spmd import logical_axis_rules
  import jax
  from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
  from maxtext.utils import lora_utils

  with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
    base = apply_abstract(config, actor.base, mesh)
    # qwix's wrapped model holds copies of the kernels it adapts and of the RNG state (same values); point it at the
    # base's arrays so the reference (the frozen base) and the actor share one copy of the weights.
    nnx.update(base, nnx.state(actor.base))
    if config.lora.lora_restore_path:
      lora_utils.restore_lora_from_path(base, config)
  lora_actor = TunixMaxTextAdapter(base_model=base, pad_id=pad_id)
  n_lora = sum(x.size for x in jax.tree.leaves(nnx.state(lora_actor, nnx.LoRAParam)))
  n_base = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
  logging.info(
      "LoRA rank %d alpha %g on '%s': %d adapter parameters (%.3f%% of %d base parameters)",
      config.lora.lora_rank,
      config.lora.lora_alpha,
      module_path(config),
      n_lora,
      100.0 * n_lora / n_base,
      n_base,
  )
  return lora_actor, actor


def apply_abstract(config, base, mesh):
  """MaxText's `apply_lora_to_model` on a MaxText model (concrete, or inside `nnx.eval_shape` for the AOT compile),
  its module-path mismatch as one line; the adapters' trace intermediates dropped."""
  from flax import nnx
  from maxtext.utils import lora_utils

  try:
    base = lora_utils.apply_lora_to_model(base, mesh, config)
  except ValueError as e:  # MaxText's "module_path ... did not match any weights"
    raise ConfigError(f"invalid value for 'lora.lora_module_path'='{module_path(config)}': {e}") from None
  nnx.pop(base, nnx.Intermediate)
  return base


def keep_base_shared(rl_cluster, frozen_base) -> None:
  """After every actor update, point the actor's base params back at the frozen base's arrays.

  Tunix's train step is an `nnx.jit` over the whole model: it returns fresh buffers for every variable, the frozen
  base included (same values: the base gets no gradient). Left alone, the actor would hold a second copy of the base
  after the first update while the reference keeps the first. Re-pointing after each update drops that copy.
  """
  if frozen_base is None:
    return
  from flax import nnx

  original = rl_cluster.update_actor

  def update_actor(*args, **kwargs):
    out = original(*args, **kwargs)
    nnx.update(rl_cluster.actor_trainer.model, nnx.state(frozen_base, nnx.Param))
    return out

  rl_cluster.update_actor = update_actor


def trainable(model) -> Any:
  """The nnx filter of what the trainer updates and checkpoints: adapters on a LoRA model, else every Param."""
  from flax import nnx
  from tunix.sft import utils as sft_utils

  return nnx.LoRAParam if sft_utils.is_lora_enabled(model) else nnx.Param


def has_adapters(model) -> bool:
  from tunix.sft import utils as sft_utils

  return sft_utils.is_lora_enabled(model)


# ------------------------------------------------------------------------------------------------------------------
# Merging adapters into base kernels
# ------------------------------------------------------------------------------------------------------------------


def merge_kernel(w, a, b, scale: float, scan_axis: int):
  """`w + scale * A @ B` in w's layout, for qwix's dot_general LoRA of a MaxText DenseGeneral kernel.

  qwix flattens the kernel's contracting dims into A [C, r] and the remaining dims into B [r, M] (per layer; the
  scanned-layer axis sits at `param_scan_axis` in w, A and B alike). MaxText kernels put the contracting dims first,
  so the delta is (A @ B) reshaped to the per-layer kernel shape.
  """
  import jax.numpy as jnp

  scanned = a.ndim == 3
  if a.ndim not in (2, 3) or b.ndim != a.ndim:
    raise NotImplementedError(f"LoRA merge: adapter ranks {a.ndim}/{b.ndim} (batched dot_general) not supported")
  wl = jnp.moveaxis(w, scan_axis, 0) if scanned else w[None]
  al = jnp.moveaxis(a, scan_axis, 0) if scanned else a[None]
  bl = jnp.moveaxis(b, scan_axis, 0) if scanned else b[None]
  c, m = al.shape[-2], bl.shape[-1]
  per_layer = tuple(wl.shape[1:])
  prefix, k = 1, 0
  while prefix < c and k < len(per_layer):
    prefix, k = prefix * per_layer[k], k + 1
  if prefix != c or c * m != math.prod(per_layer):
    raise NotImplementedError(f"LoRA merge: kernel {tuple(w.shape)} does not split into contracting {c} x {m}")
  delta = jnp.einsum("lcr,lrm->lcm", al.astype(jnp.float32), bl.astype(jnp.float32)) * scale
  merged = (wl.astype(jnp.float32) + delta.reshape(wl.shape)).astype(w.dtype)
  return jnp.moveaxis(merged, 0, scan_axis) if scanned else merged[0]


def adapter_pairs(adapters: dict, prefix: tuple = ()):
  """(module path, kernel name) of every `<name>_lora_a/_lora_b` pair in a pure-dict adapter tree."""
  for key, value in adapters.items():
    if isinstance(value, dict):
      yield from adapter_pairs(value, prefix + (key,))
    elif key.endswith("_lora_a"):
      yield prefix, key[: -len("_lora_a")]


_ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")


def is_adapter(name: str) -> bool:
  """True for a flattened qwix adapter leaf (`...query.kernel_lora_a`)."""
  return name.endswith(_ADAPTER_SUFFIXES)


def merge_flat(base: dict, adapters: dict, scale: float, scan_axis: int) -> dict:
  """`{kernel path: W + scale * A @ B}` for every adapter pair in flat `adapters` (`<kernel path>_lora_a/_b`), with W
  from flat `base`: only the adapted kernels, in their MaxText layout (the vLLM sync maps them like any kernel)."""
  out = {}
  for name in sorted(k[: -len("_lora_a")] for k in adapters if k.endswith("_lora_a")):
    if name not in base or name + "_lora_b" not in adapters:
      raise ValueError(f"LoRA adapter {name}_lora_a has no base kernel or no _lora_b beside it")
    out[name] = merge_kernel(base[name], adapters[name + "_lora_a"], adapters[name + "_lora_b"], scale, scan_axis)
  return out


def _at(tree: dict, path: tuple) -> dict:
  for k in path:
    tree = tree[k]
  return tree


def scale_of(config) -> float:
  return float(config.lora.lora_alpha) / float(config.lora.lora_rank)


class Merger:
  """The base params of a LoRA-wrapped MaxText `Transformer` with its current adapters merged in.

  The embedded engine's decode program is MaxText's plain (adapter-free) model; it gets these weights. Only the adapted
  kernels are recomputed (jitted, onto their own shardings); every other leaf is the base's own array, so the engine
  holds one extra copy of the adapted kernels, not of the model. The merge runs only when the adapter arrays changed
  since the last call, i.e. once per weight sync / optimizer step, never per decode step.
  """

  def __init__(self, config):
    self.scale = scale_of(config)
    self.scan_axis = int(getattr(config, "param_scan_axis", 1))
    self._key: list | None = None
    self._merged = None
    self._fn = None
    self.num_merges = 0

  def forget(self) -> None:
    """Drop the last merge, so the next `merged` merges again (what an adapter sync triggers)."""
    self._key = None

  def merged(self, module):
    """The adapted weights, merged once per adapter change (the same adapter leaves reuse the last merge)."""
    from flax import nnx
    import jax

    adapters = nnx.state(module, nnx.LoRAParam)
    leaves = jax.tree.leaves(adapters)
    if self._key is not None and len(leaves) == len(self._key) and all(x is y for x, y in zip(leaves, self._key)):
      return self._merged
    base_state = nnx.state(module, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    base_pure, ad = nnx.to_pure_dict(base_state), nnx.to_pure_dict(adapters)
    pairs = list(adapter_pairs(ad))
    ws = [_at(base_pure, p)[n] for p, n in pairs]
    a_s = [_at(ad, p)[n + "_lora_a"] for p, n in pairs]
    b_s = [_at(ad, p)[n + "_lora_b"] for p, n in pairs]
    if self._fn is None:
      self._fn = jax.jit(
          lambda ws, a_s, b_s: [merge_kernel(w, a, b, self.scale, self.scan_axis) for w, a, b in zip(ws, a_s, b_s)],
          out_shardings=[w.sharding for w in ws],
      )
    new = self._fn(ws, a_s, b_s)
    update: dict = {}
    for (path, name), w in zip(pairs, new):
      node = update
      for k in path:
        node = node.setdefault(k, {})
      node[name] = w
    out = jax.tree.map(lambda x: x, base_state)  # a fresh State: the module's own variables are never touched
    nnx.replace_by_pure_dict(out, update)
    self._key, self._merged = leaves, out
    self.num_merges += 1
    return out


def merged_params(model, config):
  """nnx.State of `model`'s (a TunixMaxTextAdapter or Transformer) base params with its adapters merged in."""
  base = getattr(model, "base", model)
  return Merger(config).merged(base)
