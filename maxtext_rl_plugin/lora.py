"""LoRA RL: MaxText's `lora:` keys (its SFT keys) on the RL actor, with train_sft's meaning.

`lora.enable_lora=true` wraps the actor's MaxText `Transformer` with MaxText's own
`lora_utils.apply_lora_to_model` (qwix `LoraProvider`: rank `lora_rank`, scale `lora_alpha / lora_rank`, modules
matched by `lora_module_path`, else MaxText's `post_train/lora_module_path.yml` entry for the model), and restores
`lora_restore_path` with MaxText's `restore_lora_from_path` (run/models.apply_lora: both take MaxText's whole config).
Every other room reads the block through `LoraSettings`. What follows from Tunix 0.1.7 once the actor carries
`nnx.LoRAParam` leaves, and what this module adds:

* training: Tunix's `PeftTrainer` builds the optimizer with `wrt=nnx.LoRAParam` and differentiates only those
  leaves, so the frozen base gets no gradient and no optimizer state;
* reference: the model *before* the adapters were applied; `apply_lora` points the wrapped model at the same base arrays
  (qwix copies the kernels it adapts), so the KL anchor is the frozen base with no second copy of the weights;
* sync: `RLCluster.sync_weights` hands the rollout engine only the `nnx.LoRAParam` state; the embedded engine keeps
  the base and merges `W + alpha/rank * A @ B` into its decode weights on its side (`Merger`), recomputed only when
  the adapters changed;
* checkpoints: the trainer saves `trainable(model)` (adapters + their optimizer state); `export_lora` writes the
  merged weights as a MaxText params checkpoint that `load_parameters_path` loads.
"""

# JAX, Flax, Tunix and MaxText's LoRA utilities are imported inside the functions that use them: config loading
# imports this module for `validate` (config/validation.py), and loading a config must not import JAX (config/load.py).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from maxtext_rl_plugin.errors import ConfigError

# MaxText's own defaults of the `lora:` block (types.LoRA): a value other than these with enable_lora=false is a key
# set to no effect, which the plugin refuses rather than ignores.
_OFF_DEFAULTS = {"lora_rank": 0, "lora_alpha": 0.0, "lora_module_path": "", "lora_restore_path": ""}


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """The `lora:` block's values (MaxText's SFT keys, train_sft's meaning) and the model name MaxText's per-model table
  of adapted modules is keyed by: what every room but the run's builders reads of LoRA. The builders that hand the
  whole config to MaxText's `apply_lora_to_model` / `restore_lora_from_path` live in run/models.py."""

  enable: bool = False
  rank: int = 0
  alpha: float = 0.0
  module_path: str = ""  # as given; "" = MaxText's post_train/lora_module_path.yml entry for model_name
  restore_path: str = ""
  model_name: str = ""

  @classmethod
  def from_config(cls, config) -> LoraSettings:
    """The settings of `config` (typed, or config/validation's `RawConfig` view): disabled without a `lora:` block."""
    lora = getattr(config, "lora", None)
    if lora is None:
      return cls()
    return cls(
        enable=bool(lora.enable_lora),
        rank=int(lora.lora_rank),
        alpha=float(lora.lora_alpha),
        module_path=lora.lora_module_path,
        restore_path=lora.lora_restore_path,
        model_name=str(config.model_name),
    )

  @property
  def scale(self) -> float | None:
    """The adapter update's scale (`W + alpha/rank * A @ B`); None without LoRA."""
    return float(self.alpha) / float(self.rank) if self.enable else None

  def resolved_module_path(self) -> str:
    """The regex MaxText applies LoRA to: lora.lora_module_path, else lora_module_path.yml's entry for model_name
    (MaxText's own resolution, tunix_compat.maxtext_lora_module_path; imports MaxText's LoRA utilities)."""
    from maxtext_rl_plugin import tunix_compat

    return tunix_compat.maxtext_lora_module_path(self.model_name, self.module_path)


def validate(settings: LoraSettings) -> None:
  """Device-free checks of the `lora:` block (one line each); config/validation runs them on both passes."""
  if not settings.enable:
    given = {
        "lora_rank": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_module_path": settings.module_path,
        "lora_restore_path": settings.restore_path,
    }
    for key, default in _OFF_DEFAULTS.items():
      value = given[key]
      if value != default and not (isinstance(default, float) and float(value) == default):
        raise ConfigError(
            f"config key 'lora.{key}'={value!r} has no effect with lora.enable_lora=false; "
            "set lora.enable_lora=true or drop the key"
        )
    return
  if settings.rank < 1:
    raise ConfigError(f"invalid value for 'lora.lora_rank'={settings.rank}: must be >= 1 with lora.enable_lora=true")
  if not settings.alpha > 0:
    raise ConfigError(
        f"invalid value for 'lora.lora_alpha'={settings.alpha}: must be > 0 with lora.enable_lora=true "
        "(the adapter update is alpha/rank * A @ B; 0 trains nothing)"
    )
  if settings.module_path:
    try:
      re.compile(settings.module_path)
    except re.error as e:
      raise ConfigError(
          f"invalid value for 'lora.lora_module_path'='{settings.module_path}': not a regular " f"expression ({e})"
      ) from None
  path = settings.restore_path
  if path and not str(path).startswith("gs://") and not os.path.exists(path):
    raise ConfigError(f"invalid value for 'lora.lora_restore_path'='{path}': no such checkpoint directory")


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


class Merger:
  """The base params of a LoRA-wrapped MaxText `Transformer` with its current adapters merged in.

  The embedded engine's decode program is MaxText's plain (adapter-free) model; it gets these weights. Only the adapted
  kernels are recomputed (jitted, onto their own shardings); every other leaf is the base's own array, so the engine
  holds one extra copy of the adapted kernels, not of the model. The merge runs only when the adapter arrays changed
  since the last call, i.e. once per weight sync / optimizer step, never per decode step.
  """

  def __init__(self, scale: float, scan_axis: int):
    self.scale = float(scale)  # LoraSettings.scale
    self.scan_axis = int(scan_axis)  # MaxText's param_scan_axis: the scanned-layer axis of kernels and adapters
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


def merged_params(model, scale: float, scan_axis: int):
  """nnx.State of `model`'s (a TunixMaxTextAdapter or Transformer) base params with its adapters merged in (`Merger`'s
  scale and scan axis)."""
  base = getattr(model, "base", model)
  return Merger(scale, scan_axis).merged(base)
