"""MaxText trainer parameters -> vLLM (Hugging Face checkpoint layout) parameters, on device.

vLLM loads a model by its Hugging Face checkpoint names and layouts (`model.layers.3.self_attn.q_proj.weight`
as `[heads * head_dim, hidden]`). The trainer holds MaxText's layout instead: scanned layers stacked on
`param_scan_axis`, attention kernels as `[embed, heads, head_dim]`, Llama's query pre-scaled by
1/sqrt(head_dim) and its RoPE dimensions interleaved. This module bridges the two in two steps:

1. `map_maxtext_to_vllm`: MaxText tree -> flat `{hf_name: array}`. Names, per-layer unstacking and the
   transforms are MaxText's own export tables (`checkpoint_conversion.utils.param_mapping.PARAM_MAPPING`
   / `HOOK_FNS`, target shapes from `hf_shape.HF_SHAPE`), the ones `to_huggingface.py` uses; we only
   apply them with jax ops instead of NumPy so the weights never leave the accelerator during a sync.
2. `to_engine_state`: `{hf_name: array}` -> the leaves of the engine's own weight tree. vLLM-TPU's JAX
   models name the same tensors `...q_proj.kernel` in `[in, ...out]` layout (the naming rule MaxText's
   `integration.tunix.utils.VllmWeightMapping` also encodes); engines that keep HF names (torchax) get
   the HF layout unchanged; tpu-inference's padding (head_dim, kv heads, Qwen3's vocab) is applied as its own
   loader does. Every engine weight (RNG state excluded) must be written: a sampler left with any of vLLM's
   dummy-initialised weights would silently sample garbage.

Supported: dense Qwen3 (`qwen3-*`) and Llama 3.1 (`llama3.1-*`), scanned or unscanned layers. Every other family
(`native_refusal` says why, one line) runs through MaxText's own decoder inside vLLM (rollout/vllm_maxtext.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
from maxtext.checkpoint_conversion.utils import param_mapping
from maxtext.checkpoint_conversion.utils.hf_shape import HF_SHAPE
from maxtext.checkpoint_conversion.utils.utils import apply_hook_fns

from maxtext_rl_plugin.errors import ConfigError

SUPPORTED_FAMILIES = ("qwen3-", "llama3.1-")
# Qwen3 variants whose layers are not the dense Qwen3 decoder this mapping covers.
_UNSUPPORTED_QWEN3 = ("qwen3-next", "qwen3-vl", "qwen3-omni", "qwen3-coder", "qwen3-30b", "qwen3-235b")


# Families MaxText 0.2.5 has that tpu-inference's native JAX classes do not run through this mapping, with what is missing
# (docs/models.md). Each runs on vLLM through MaxText's own decoder instead (rollout/vllm_maxtext.py), chosen for it.
_MOE = ("qwen3-30b", "qwen3-235b", "qwen3-next", "qwen3.5", "llama4", "mixtral", "kimi")
_REFUSED = {
    _MOE: "MoE is not mapped onto a native class: tpu-inference 0.32.0 has no JAX Qwen3-MoE class (Qwen3MoeForCausalLM "
    "runs as vLLM's PyTorch model) and the plugin has no expert-stacked mapping for its JAX MoE classes",
    ("deepseek",): "tpu-inference's DeepseekV3ForCausalLM (MLA attention, expert-stacked weights) has no mapping in the "
    "plugin (MaxText's weight_mapping/deepseek3.py is not proven by the forward check)",
    ("gpt-oss",): "tpu-inference 0.32.0 prefers vLLM's PyTorch GptOss (_VLLM_PREFERRED_ARCHITECTURES) and the plugin "
    "has no expert-stacked mapping for its JAX class",
    ("gemma",): "tpu-inference 0.32.0's only Gemma JAX class is Gemma4ForCausalLM (no Gemma 2/3; MaxText's "
    "weight_mapping/gemma3.py targets vLLM's PyTorch Gemma3)",
    (
        "qwen2",
    ): "the plugin does not map tpu-inference's Qwen2ForCausalLM (q/k/v biases; not proven by the forward check)",
}
_ADAPTER_WAY = "its vLLM route is MaxText's own decoder inside vLLM (MaxTextForCausalLM)"


def native_refusal(model_name: str) -> str | None:
  """Why no native tpu-inference class runs `model_name` through this mapping (one line), or None when one does."""
  ok = (
      model_name.startswith(SUPPORTED_FAMILIES)
      and not model_name.startswith(_UNSUPPORTED_QWEN3)
      and model_name in param_mapping.PARAM_MAPPING
  )
  if ok:
    return None
  why = next((w for prefixes, w in _REFUSED.items() if model_name.startswith(prefixes)), None)
  return (
      f"no native vLLM class for {model_name}: "
      + (why or "the MaxText->vLLM weight mapping covers dense Qwen3 (qwen3-0.6b ... qwen3-32b) and Llama 3.1")
      + f"; {_ADAPTER_WAY}"
  )


def check_supported(model_name: str) -> None:
  """Raise a one-line ConfigError unless the native-class weight mapping covers `model_name`."""
  why = native_refusal(model_name)
  if why:
    raise ConfigError(f"invalid value for 'model_name'='{model_name}' with rollout_engine=vllm: {why}")


def route_line(model_name: str) -> str:
  """The one line a run prints for the native route."""
  return (
      f"vLLM route: tpu-inference's native class for {model_name} (weights through MaxText's export tables, "
      "rollout/vllm_mapping.py)"
  )


def path_str(path) -> str:
  parts = []
  for k in path:
    key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
    parts.append(str(key))
  return ".".join(parts)


def flatten_params(tree: Any) -> dict[str, Any]:
  """`{dotted.path: array}` for an nnx.State / nested dict of parameters (nnx Variable wrappers unwrapped)."""
  if hasattr(tree, "to_pure_dict"):
    tree = tree.to_pure_dict()
  flat = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = path_str(path)
    if name.endswith(".value"):
      name = name[: -len(".value")]
    flat[name] = getattr(leaf, "value", leaf)
  return flat


def _maxtext_key(name: str) -> str:
  """'base.decoder.layers.mlp.wi_0.kernel' -> 'params-decoder-layers-mlp-wi_0-kernel' (PARAM_MAPPING's keys)."""
  if name.startswith("base."):
    name = name[len("base.") :]
  return "params-" + name.replace(".", "-")


def hf_config_from_params(params: Any, model_name: str) -> dict[str, Any]:
  """The HF config fields the mapping needs, read off the parameter shapes (works for shrunk test models)."""
  check_supported(model_name)
  flat = {_maxtext_key(k): v for k, v in flatten_params(params).items()}
  try:
    vocab, hidden = flat["params-token_embedder-embedding"].shape
  except KeyError:
    raise ValueError("not a MaxText decoder parameter tree: no token_embedder.embedding") from None
  scanned = "params-decoder-layers-self_attention-query-kernel" in flat
  if scanned:
    q = flat["params-decoder-layers-self_attention-query-kernel"]  # [embed, layers, heads, head_dim]
    k = flat["params-decoder-layers-self_attention-key-kernel"]
    wi = flat["params-decoder-layers-mlp-wi_0-kernel"]  # [embed, layers, mlp]
    n_layers, n_heads, head_dim, n_kv, inter = q.shape[1], q.shape[2], q.shape[3], k.shape[2], wi.shape[2]
  else:
    n_layers = len({m.group(1) for m in (re.match(r"params-decoder-layers_(\d+)-", key) for key in flat) if m})
    q = flat["params-decoder-layers_0-self_attention-query-kernel"]  # [embed, heads, head_dim]
    k = flat["params-decoder-layers_0-self_attention-key-kernel"]
    inter = flat["params-decoder-layers_0-mlp-wi_0-kernel"].shape[1]
    n_heads, head_dim, n_kv = q.shape[1], q.shape[2], k.shape[1]
  return {
      "vocab_size": int(vocab),
      "hidden_size": int(hidden),
      "num_hidden_layers": int(n_layers),
      "num_attention_heads": int(n_heads),
      "num_key_value_heads": int(n_kv),
      "head_dim": int(head_dim),
      "intermediate_size": int(inter),
      "tie_word_embeddings": "params-decoder-logits_dense-kernel" not in flat,
      "scan_layers": scanned,
  }


@dataclasses.dataclass(frozen=True)
class HfShape:
  """The same HF config fields from a MaxText config (`as_dict`: vLLM's `hf_overrides` on shrunk models, the config.json
  the AOT compile writes)."""

  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  intermediate_size: int
  tie_word_embeddings: bool

  @classmethod
  def from_config(cls, config: Any) -> "HfShape":
    return cls(
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.emb_dim),
        num_hidden_layers=int(config.num_decoder_layers),
        num_attention_heads=int(config.num_query_heads),
        num_key_value_heads=int(config.num_kv_heads),
        head_dim=int(config.head_dim),
        intermediate_size=int(config.mlp_dim),
        tie_word_embeddings=bool(config.logits_via_embedding),
    )

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def vllm_param_shapes(model_name: str, hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
  """The inverse spec: every vLLM (HF checkpoint) parameter name -> shape, from MaxText's HF_SHAPE tables."""

  check_supported(model_name)
  shapes = {k: tuple(v) for k, v in HF_SHAPE[model_name](dict(hf_config)).items()}
  if hf_config.get("tie_word_embeddings"):
    shapes.pop("lm_head.weight", None)  # vLLM reuses embed_tokens; tied checkpoints have no lm_head
  return shapes


class _HookConfig:
  """The two MaxText config fields `process_maxtext_param`-style unstacking reads."""

  def __init__(self, scan_layers: bool, param_scan_axis: int):
    self.scan_layers = scan_layers
    self.param_scan_axis = param_scan_axis


def map_maxtext_to_vllm(
    params_tree: Any,
    model_name: str,
    hf_config: Mapping[str, Any] | None = None,
    *,
    param_scan_axis: int = 1,
) -> dict[str, jax.Array]:
  """MaxText parameters (`nnx.state(adapter, nnx.Param)` or `{'base': ...}` dict) -> `{hf_name: array}`.

  Scanned layers are unstacked along `param_scan_axis`; kernels are transposed/reshaped to HF's
  `[out, in]`, Llama's query is un-scaled and both q/k RoPE halves de-interleaved, with MaxText's own
  hook functions. Arrays stay on their devices (jax ops only); dtypes are preserved.
  """

  check_supported(model_name)
  hf_cfg = dict(hf_config) if hf_config is not None else hf_config_from_params(params_tree, model_name)
  scanned = hf_cfg.get("scan_layers", True)
  flat = {_maxtext_key(k): v for k, v in flatten_params(params_tree).items()}
  name_map = param_mapping.PARAM_MAPPING[model_name](hf_cfg, None, scanned)
  hooks = param_mapping.HOOK_FNS[model_name](hf_cfg, None, scanned, saving_to_hf=True)
  shapes = HF_SHAPE[model_name](hf_cfg)

  out: dict[str, jax.Array] = {}
  unknown = sorted(k for k in flat if k not in name_map)
  if unknown:
    raise ValueError(f"{len(unknown)} trainer parameters have no vLLM mapping for {model_name}, e.g. {unknown[:3]}")
  for mt_key, weight in flat.items():
    targets = name_map[mt_key]
    hook = hooks.get(mt_key)
    if isinstance(targets, str):
      _emit(out, targets, weight, hook, shapes)
      continue
    if targets and isinstance(targets[0], list):
      raise ValueError(f"{mt_key}: expert-stacked (MoE) parameters are not supported by the vLLM mapping")
    axis = param_scan_axis if weight.ndim > param_scan_axis else 0
    if weight.shape[axis] != len(targets):
      raise ValueError(f"{mt_key}: {weight.shape[axis]} stacked layers on axis {axis}, expected {len(targets)}")
    for i, hf_name in enumerate(targets):
      _emit(out, hf_name, jax.lax.index_in_dim(weight, i, axis=axis, keepdims=False), hook, shapes)
  return out


def _emit(out: dict, hf_name: str, weight, hook, shapes: Mapping[str, Any]) -> None:

  if hf_name in out:
    raise ValueError(f"two trainer parameters map to the same vLLM parameter {hf_name}")
  target = tuple(shapes[hf_name])
  dtype = weight.dtype
  weight = apply_hook_fns(weight, target, hook)
  out[hf_name] = jnp.reshape(weight, target).astype(dtype)


# ---------------------------------------------------------------- engine side


def engine_name_candidates(hf_name: str) -> list[str]:
  """Names an engine may give the HF tensor `hf_name`, in the order they are tried.

  The HF name itself (vLLM torch models via torchax; tpu-inference's newer JaxModule layers also alias
  `.weight` to their kernels), then vLLM-TPU's flax naming: `...q_proj.kernel`, norms `.scale`,
  `model.embed.embedding` / `model.embed_tokens.embedding`, `model.lm_head` (the rule MaxText's
  `VllmWeightMapping._correct_hf_wildcard_name` encodes). The layout is decided from the shapes, see
  `to_engine_layout`.
  """
  cands = [hf_name]
  if hf_name == "model.embed_tokens.weight":
    cands += ["model.embed.embedding", "model.embed_tokens.embedding"]
  elif hf_name == "lm_head.weight":
    cands += ["model.lm_head", "lm_head.kernel"]
  elif hf_name.endswith("norm.weight"):
    cands += [hf_name[: -len("weight")] + "scale"]
  elif hf_name.endswith(".weight"):
    cands += [hf_name[: -len("weight")] + "kernel"]
  return cands


def engine_weights(state: Any) -> dict[str, Any]:
  """`{dotted.path: array}` of the engine's weights: every leaf except RNG state.

  tpu-inference's Llama keeps `self.rng = nnx.Rngs(...)`, so its state has `rng.default.key` / `rng.default.count`
  beside the weights (its own weight loading binds only the weight leaves). Those are not parameters and must not
  count as "unwritten" (nnx RNG variables, or a PRNG-key dtype in a plain dict).
  """
  flat = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    if isinstance(leaf, nnx.RngState):
      continue
    value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
      continue
    name = path_str(path)
    flat[name[: -len(".value")] if name.endswith(".value") else name] = value
  return flat


def is_flax_layout(state: Any) -> bool:
  """True for tpu-inference's JAX models (an `nnx.State`): 2-D linear weights are `[in, out]` whatever their name
  (Qwen3 in 0.32.0 names them `.weight`). A plain dict (vLLM torch models via torchax) keeps HF's `[out, in]`."""
  return isinstance(state, nnx.State)


def _is_vocab(engine_name: str) -> bool:
  return "embed" in engine_name or "lm_head" in engine_name


def _heads(weight, n_dst: int, h_dst: int, head_axis: int, name: str):
  """Fit `[.., n, h, ..]` (heads on `head_axis`, head_dim after it) to `n_dst` heads of `h_dst`, as tpu-inference's
  loader does (`weight_utils._load_and_shard_weight`, also Tunix's `_align_shape`): heads repeated in place
  (`jnp.repeat`: kv head k serves the same query heads as before), head_dim zero-padded at the end of each head."""
  n, h = weight.shape[head_axis], weight.shape[head_axis + 1]
  if n_dst < n or n_dst % n or h_dst < h:
    raise ValueError(f"vLLM parameter {name}: {n} heads of {h} cannot become {n_dst} heads of {h_dst}")
  if n_dst != n:
    weight = jnp.repeat(weight, n_dst // n, axis=head_axis)
  if h_dst != h:
    pad = [(0, 0)] * weight.ndim
    pad[head_axis + 1] = (0, h_dst - h)
    weight = jnp.pad(weight, pad)
  return weight


def to_engine_layout(
    weight, dst_shape: tuple[int, ...], engine_name: str, *, head_dim: int | None = None, flax_layout: bool | None = None
):
  """An HF-layout tensor in the engine's layout, decided by shape (by layout/name only where shapes cannot tell).

  HF linear weights are `[out, in]`; flax kernels are `[in, ...out]`, split per head for attention:
  `[hidden, heads, head_dim]` (q/k/v) and `[heads, head_dim, hidden]` (o). tpu-inference pads: `head_dim` to a
  multiple of 128 (64 excepted), kv (and query) heads up to the TP size, Qwen3's vocab to a multiple of TP; with
  the model's `head_dim` given, heads are repeated and head_dim / vocab zero-padded as its own loader does.
  A square 2-D weight is transposed for flax layouts (`flax_layout`, else by name: `.kernel`, `model.lm_head`).
  Anything else raises rather than guessing.
  """
  dst = tuple(int(d) for d in dst_shape)
  shape = tuple(weight.shape)
  if weight.ndim == 2 and len(dst) == 3:
    out_dim, in_dim = shape
    in_first = dst[0] == in_dim  # q/k/v: [hidden, heads, head_dim]
    out_last = dst[-1] == out_dim  # o: [heads, head_dim, hidden]
    if in_first and out_last:
      in_first = "o_proj" not in engine_name
    if in_first or out_last:
      flat_dim = out_dim if in_first else in_dim
      hd = head_dim
      if hd is None and flat_dim == (dst[1] * dst[2] if in_first else dst[0] * dst[1]):
        hd = dst[2] if in_first else dst[1]  # unpadded: the shapes say it (padded needs the model's head_dim)
      if hd is not None and flat_dim % hd == 0:
        if in_first:
          return _heads(jnp.reshape(weight.T, (in_dim, flat_dim // hd, hd)), dst[1], dst[2], 1, engine_name)
        return _heads(jnp.reshape(weight.T, (flat_dim // hd, hd, out_dim)), dst[0], dst[1], 0, engine_name)
  elif weight.ndim == 2 and len(dst) == 2:
    flax = flax_layout if flax_layout is not None else (engine_name.endswith(".kernel") or engine_name == "model.lm_head")
    prefer_t = flax and "embed" not in engine_name  # embeddings are [vocab, hidden] in both layouts
    for transpose in (prefer_t, not prefer_t):  # both fit only when square: the layout decides
      w = weight.T if transpose else weight
      if tuple(w.shape) == dst:
        return w
      vax = 1 if transpose else 0  # HF's vocab axis is 0
      if _is_vocab(engine_name) and w.shape[1 - vax] == dst[1 - vax] and w.shape[vax] < dst[vax]:
        pad = [(0, 0), (0, 0)]
        pad[vax] = (0, dst[vax] - w.shape[vax])
        return jnp.pad(w, pad)  # zero rows, as tpu-inference's load_nnx_param_from_reshaped_torch pads vocab
  elif (
      weight.ndim == 1
      and len(dst) == 1
      and shape[0] == head_dim
      and shape[0] < dst[0]
      and ("q_norm" in engine_name or "k_norm" in engine_name)
  ):
    # Written as its loader would pad it, but tpu-inference then normalises q/k over the padded width: a Qwen3 with
    # head_dim < 128 (only shrunk test models; its own Qwen3 loader refuses them) samples from different numerics.
    logging.log_first_n(
        logging.WARNING,
        "vLLM parameter %s: head_dim %d padded to %d; tpu-inference's q/k RMS norm "
        "then averages over the padded width, so its samples do not match the trainer's model",
        1,
        engine_name,
        shape[0],
        dst[0],
    )
    return jnp.pad(weight, (0, dst[0] - shape[0]))
  elif shape == dst:
    return weight
  raise ValueError(f"vLLM parameter {engine_name} has shape {dst}, which no layout of the trainer's {shape} matches")


def to_engine_state(
    hf_weights: Mapping[str, jax.Array],
    engine_params: Mapping[str, Any],
    *,
    require_all: bool = True,
    head_dim: int | None = None,
    flax_layout: bool | None = None,
) -> tuple[dict[str, jax.Array], dict[str, str]]:
  """Match `{hf_name: array}` to the engine's flat `{name: array-like}`; returns (new leaves, hf->engine name).

  `engine_params` is `engine_weights(state)`; `head_dim` (the model's, unpadded) and `flax_layout` go to
  `to_engine_layout`.

  Raises if any HF tensor finds no engine parameter or (with `require_all`, i.e. a whole-model sync in one
  piece) any engine parameter is left unwritten; chunked syncs check coverage with `check_all_written`.
  """
  new: dict[str, jax.Array] = {}
  names: dict[str, str] = {}
  missing = []
  for hf_name, w in hf_weights.items():
    for cand in engine_name_candidates(hf_name):
      if cand in engine_params:
        if any(engine_params[o] is engine_params[cand] for o in new):
          break  # an alias of a tensor already written (same array under two names)
        dst = engine_params[cand]
        if cand in new:
          raise ValueError(f"two vLLM tensors map to engine parameter {cand}")
        new[cand] = to_engine_layout(w, tuple(dst.shape), cand, head_dim=head_dim, flax_layout=flax_layout).astype(
            dst.dtype
        )
        names[hf_name] = cand
        break
    else:
      missing.append(hf_name)
  if missing:
    raise ValueError(f"{len(missing)} weights have no parameter in the vLLM model, e.g. {missing[:3]}")
  if require_all:
    check_all_written(engine_params, new)
  return new, names


def check_all_written(engine_params: Mapping[str, Any], written) -> None:
  """Raise unless every engine parameter was written (else vLLM would sample its dummy weights).

  Names that are aliases of one array (a flax layer exposing its kernel also as `.weight`) count as written
  when any of them was.
  """
  written_ids = {id(engine_params[n]) for n in written if n in engine_params}
  unwritten = sorted(n for n in set(engine_params) - set(written) if id(engine_params[n]) not in written_ids)
  if unwritten:
    raise ValueError(f"{len(unwritten)} vLLM parameters would keep their dummy initialisation, e.g. {unwritten[:3]}")


def engine_state_setter(state: Any) -> Callable[[Mapping[str, Any]], None]:
  """A function writing `{dotted name: array}` back into the engine's nested state (nnx.State or dicts)."""

  def _set(values: Mapping[str, Any]) -> None:
    for name, value in values.items():
      node = state
      parts = name.split(".")
      for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, (list, tuple)) else node[p if p in node else int(p)]
      leaf_key = parts[-1] if parts[-1] in node else int(parts[-1])
      leaf = node[leaf_key]
      if hasattr(leaf, "value"):
        leaf.value = value
      else:
        node[leaf_key] = value

  return _set
