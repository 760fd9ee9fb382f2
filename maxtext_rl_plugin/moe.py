r"""Mixture-of-experts RL: which experts each token was routed to, on the sampler and the trainer, and router replay.

An MoE policy is two networks in RL unless both sides route alike: the sampler (the embedded engine's KV-cached decode,
one token per step, maybe another dtype) and the trainer (a full forward of prompt + completion) can send the same
token to different experts, so pi_theta / pi_old compares different networks (Megatron-LM's, NeMo-RL's and AReaL's
"routing replay", R3). MaxText 0.2.5 has both halves in its model code:

* recording: `RoutedMoE.get_topk` returns the top-k expert indices [batch, seq, k] of each MoE layer. MaxText itself
  records them (`return_routed_experts`, an `nnx.Intermediate` named `selected_experts`) only on its vLLM fused-MoE
  path; here a recording subclass (`Recording`) does the same on every path, and `routing` collects the values the way
  MaxText's NNX decoder does (sorted by layer; scanned layers already carry a leading layer axis);
* replay: a decoder call with `forced_routed_experts` [batch, seq, layers, k] uses those indices instead of the
  router's top-k (the router's logits still give the weights, so the router keeps its gradient); an index outside
  [0, num_experts) (-1 here) is an unused slot: the token gets no expert output there. MaxText's decoder passes it
  down for `types.FORCED_ROUTING_SUPPORTED_DECODER_BLOCKS` (Qwen3.5, Mixtral, Gemma 4 at this pin) and refuses the
  others, whose layers take no such argument (Qwen3-MoE, gpt-oss, DeepSeek). For those the plugin forces the routing
  where it records it: `set_replay` puts each layer's experts on its `RoutedMoE` module (`force_experts`, an intermediate
  that a scanned stack's scan slices per layer like the layer's weights) and the recording class's `__call__` hands
  them to MaxText's own `RoutedMoE.__call__` as its `forced_routed_experts`, which threads them to `get_topk` on the
  dense, sparse (megablox / ragged) and expert-parallel paths.

Routing arrays are laid out like the trainer's input, prompt then completion: [rows, P + T, layers, k] int32 with
P = max_prompt_length (prompts left-padded) and T = the completion budget; -1 where no token was routed (prompt
padding, positions after a completion's end, and a completion's last token, which the decode loop never feeds back:
its logits predict past the completion and are never used).

Metrics (per step, rollout and trainer side): expert load over the real tokens of a batch, tokens routed to each
expert per layer: `moe/<side>_load_max` = max over layers and experts of count / mean count (1 = perfectly balanced),
and `moe/routing_mismatch_fraction`, the fraction of (token, layer) pairs whose top-k expert *sets* differ between
sampler and trainer (over completion tokens but the last, the ones the trainer's loss sees through their successors).

The reference model keeps its own routing (it is never replayed): the KL term regularises towards the reference
network as it is, and no ratio is taken against it, so its routing cannot make the update off-policy; replaying the
current policy's routes through the reference would measure the distance to a network that never existed.
"""

from __future__ import annotations

import contextvars
import dataclasses
import re
from typing import Any

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from maxtext.configs import types as maxtext_types
from maxtext.layers import moe as maxtext_moe
from maxtext.utils import maxtext_utils
from tunix.rl import common as tunix_common
from tunix.rl.grpo import grpo_learner

UNSET = -1  # no routing recorded for this token (MaxText's forced-routing sentinel, Tunix's UNSET_ROUTED_EXPERT)


@dataclasses.dataclass(frozen=True)
class MoeSettings:
  """What the plugin reads of MaxText's mixture-of-experts keys, built once from a config (`from_config`) or, inside a
  jitted forward that holds only the model, from the config MaxText keeps on it (`of_model`)."""

  num_experts: int = 1
  num_experts_per_tok: int = 1
  # Whether MaxText's decoder forces this model's routing itself (`forced_routed_experts`, its own list of decoder
  # blocks); the plugin forces the others at their MoE modules (`set_replay`).
  replay_native: bool = False
  load_balance_loss_weight: float = 0.0
  # MaxText's `uses_megatron_seq_aux_loss`: the load-balancing term summed over MoE layers instead of averaged.
  megatron_seq_aux_loss: bool = False

  @classmethod
  def from_config(cls, config: Any) -> MoeSettings:
    return cls(
        num_experts=int(config.num_experts),
        num_experts_per_tok=int(config.num_experts_per_tok),
        replay_native=config.decoder_block in maxtext_types.FORCED_ROUTING_SUPPORTED_DECODER_BLOCKS,
        load_balance_loss_weight=float(getattr(config, "load_balance_loss_weight", 0.0) or 0.0),
        megatron_seq_aux_loss=bool(maxtext_moe.uses_megatron_seq_aux_loss(config)),
    )

  @classmethod
  def of_model(cls, model: Any) -> MoeSettings | None:
    """The settings of a MaxText model's own config (a `TunixMaxTextAdapter`'s `base.config`, which MaxText's
    `Transformer` keeps); None for a model without one."""
    config = getattr(getattr(model, "base", None), "config", None)
    return None if config is None else cls.from_config(config)

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 1

  @property
  def replay_supported(self) -> bool:
    """Whether the trainer can replay this MoE model's routing: every MaxText decoder block whose MoE layers are
    `RoutedMoE` modules (MaxText's list, and the plugin's forcing for Qwen3-MoE, gpt-oss, DeepSeek and the rest)."""
    return self.is_moe

  @property
  def with_lb(self) -> bool:
    """Whether the model sows MaxText's load-balancing term (an MoE model with load_balance_loss_weight > 0)."""
    return self.load_balance_loss_weight > 0 and self.is_moe


# ----------------------------------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------------------------------


# Set while MaxText's sparse path runs: its get_topk calls happen inside a shard_map, where a module cannot be written.
_INSIDE_SPARSE = contextvars.ContextVar("maxtext_rl_plugin_moe_inside_sparse", default=False)


def _record(module: Any, indices: jax.Array) -> None:
  module.selected_experts = nnx.Intermediate(jnp.reshape(indices, (-1, indices.shape[-1])).astype(jnp.int32))


def _recording_get_topk(self, *args, **kwargs):
  """MaxText's `get_topk`, also recording its indices as MaxText's fused path does (`selected_experts`, an
  `nnx.Intermediate` of [tokens, k]); inside the sparse path `_recording_sparse_matmul` records instead."""
  weights, indices = super(type(self), self).get_topk(*args, **kwargs)
  if not _INSIDE_SPARSE.get():
    _record(self, indices)
  return weights, indices


def _recording_sparse_matmul(
    self, inputs, gate_logits, pre_bias_logits, *args, input_ids=None, forced_routed_experts=None, **kwargs
):
  """MaxText's `sparse_matmul` (`sparse_matmul=true`, its TPU default), recording the routing from the same `get_topk`
  on the same logits outside the path's shard_map: writing the module inside it is a Flax TraceContextError. Top-k is
  per token, so the global call gives each token the indices its shard computes (tests/test_moe.py compares both
  paths' routing with the trainer's)."""
  parent = super(type(self), self)
  _, indices = parent.get_topk(gate_logits, pre_bias_logits, None, input_ids, forced_routed_experts)
  _record(self, indices)
  token = _INSIDE_SPARSE.set(True)
  try:
    return parent.sparse_matmul(
        inputs,
        gate_logits,
        pre_bias_logits,
        *args,
        input_ids=input_ids,
        forced_routed_experts=forced_routed_experts,
        **kwargs,
    )
  finally:
    _INSIDE_SPARSE.reset(token)


def force_experts(module: Any, experts: jax.Array) -> None:
  """Make `module` (a recording `RoutedMoE`) route each token to `experts` in its next call (router replay where
  MaxText's decoder does not pass `forced_routed_experts` down): [batch, seq, k], or [layers, batch, seq, k] on a
  scanned stack, whose scan slices it per layer with the rest of the layer's state. An `nnx.Intermediate` named
  `forced_experts`: never a parameter, so never trained, synced or checkpointed."""
  module.forced_experts = nnx.Intermediate(experts)


def _forcing_call(self, inputs, *args, forced_routed_experts=None, **kwargs):
  """MaxText's `RoutedMoE.__call__`, given the module's `force_experts` as its own `forced_routed_experts` argument
  when the decoder passed none: MaxText threads that argument to `get_topk` on the dense, sparse and expert-parallel
  paths (an all-gather on EP meshes), where the recording above sees the forced indices."""
  if forced_routed_experts is None and isinstance(getattr(self, "forced_experts", None), nnx.Variable):
    forced_routed_experts = self.forced_experts.value
  return super(type(self), self).__call__(inputs, *args, forced_routed_experts=forced_routed_experts, **kwargs)


_RECORDING_CLASSES: dict[type, type] = {}


def _recording_class(cls: type) -> type:
  """A subclass of a MaxText MoE class that records its routing (same instance layout, so a module can switch)."""
  if getattr(cls, "_records_routing", False):
    return cls
  if cls not in _RECORDING_CLASSES:
    _RECORDING_CLASSES[cls] = type(
        f"Recording{cls.__name__}",
        (cls,),
        {
            "__slots__": (),
            "__call__": _forcing_call,
            "get_topk": _recording_get_topk,
            "sparse_matmul": _recording_sparse_matmul,
            "_records_routing": True,
        },
    )
  return _RECORDING_CLASSES[cls]


def record_routing(model: Any) -> int:
  """Make every routed-MoE module of `model` record its routing (in place); returns how many there are.

  The graph keeps its variables; only the modules' classes change, so a graphdef taken afterwards merges with the
  same parameters and records on every call.
  """
  n = 0
  for _, node in nnx.iter_graph(model):
    if isinstance(node, maxtext_moe.RoutedMoE):
      node.__class__ = _recording_class(type(node))
      n += 1
  return n


def recording_graphdef(model: Any) -> Any:
  """A graphdef of `model` whose MoE modules record, leaving `model` itself unchanged."""
  saved = [(node, type(node)) for _, node in nnx.iter_graph(model) if isinstance(node, maxtext_moe.RoutedMoE)]
  try:
    record_routing(model)
    graphdef, _ = nnx.split(model)
  finally:
    for node, cls in saved:
      node.__class__ = cls
  return graphdef


def _layer_key(path) -> tuple:
  """Sort key of an intermediate's path: numbers as numbers (layers_10 after layers_9), as MaxText's decoder sorts."""
  key = []
  for part in path:
    nums = re.findall(r"\d+", str(part))
    key.append(int(nums[0]) if nums else str(part))
  return tuple(key)


def _moe_modules(model: Any) -> list[tuple[Any, int]]:
  """`model`'s routed-MoE modules in `routing`'s layer order (path order, numbers as numbers), each with the number
  of layers it runs: its router kernel's scan axis on a scanned stack ([emb, layers, experts]), else 1."""
  found = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, maxtext_moe.RoutedMoE)]
  found.sort(key=lambda item: _layer_key(item[0]))
  out = []
  for _, node in found:
    kernel = node.gate.kernel.value
    out.append((node, int(kernel.shape[int(node.config.param_scan_axis)]) if kernel.ndim == 3 else 1))
  return out


def set_replay(model: Any, forced: jax.Array) -> None:
  """Force `model`'s next call to route as `forced` [batch, seq, layers, k] (layers in `routing`'s order) at each
  routed-MoE module (`force_experts`): router replay for decoder blocks whose layers MaxText does not hand
  `forced_routed_experts`. Call it on a model merged for one forward (the modules' classes become the recording ones,
  which read `forced_experts`)."""
  record_routing(model)
  modules = _moe_modules(model)
  total = sum(n for _, n in modules)
  if forced.shape[2] != total:
    raise ValueError(f"forced routing has {forced.shape[2]} MoE layers; the model has {total}")
  start = 0
  for node, n in modules:
    part = forced[:, :, start : start + n, :].astype(jnp.int32)
    scanned = node.gate.kernel.value.ndim == 3
    force_experts(node, jnp.transpose(part, (2, 0, 1, 3)) if scanned else part[:, :, 0, :])
    start += n


def routing(model: Any, batch: int) -> jax.Array | None:
  """The routing `model`'s last call recorded, as [batch, seq, layers, k] (None when nothing was recorded).

  Collected like MaxText's NNX decoder collects `selected_experts`: leaves sorted by path, scanned layers already
  [layers, tokens, k], sequential ones [tokens, k].
  """
  flat = [
      (path, v.value if hasattr(v, "value") else v)
      for path, v in nnx.state(model, nnx.Intermediate).flat_state()
      if path and str(path[-1]) == "selected_experts"
  ]
  if not flat:
    return None
  flat.sort(key=lambda item: _layer_key(item[0]))
  stacked = jnp.concatenate([v if v.ndim == 3 else v[None] for _, v in flat], axis=0)  # [layers, tokens, k]
  layers, tokens, k = stacked.shape
  return jnp.transpose(stacked.reshape(layers, batch, tokens // batch, k), (1, 2, 0, 3))


def lb_loss(model: Any, settings: MoeSettings) -> jax.Array | None:
  """MaxText's load-balancing term of its last call, as its pre-training loss adds it (`train.py`): the mean over MoE
  layers of each layer's `moe_lb_loss` (already scaled by load_balance_loss_weight), the sum for Megatron's
  sequence-wise aux loss (`settings.megatron_seq_aux_loss`). None when the model sowed none (weight 0)."""
  inter = nnx.to_pure_dict(nnx.state(model, nnx.Intermediate))
  values = maxtext_utils.collect_intermediates_by_suffix(inter, "moe_lb_loss")
  if not values:
    return None
  losses = jnp.concatenate(values)
  return jnp.sum(losses) if settings.megatron_seq_aux_loss else jnp.mean(losses)


# ----------------------------------------------------------------------------------------------------------------------
# Trainer forward with routing
# ----------------------------------------------------------------------------------------------------------------------


def forward_logps(
    graphdef: Any,
    state: Any,
    prompt_tokens: jax.Array,
    completion_tokens: jax.Array,
    pad_id: int,
    eos_id: int,
    *,
    temperature: float = 1.0,
    forced: jax.Array | None = None,
    with_lb: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
  """Tunix's `compute_per_token_logps` (unpacked rows) with MaxText's `forced_routed_experts`, plus what the MoE layers
  recorded: (per-token log-probs [B, T], logits [B, T, V], routing [B, P+T, layers, k] or None, lb loss or None).

  The same steps as Tunix's function, from its own helpers (`process_ids`, `selective_log_softmax`): Tunix's calls
  the model with a fixed set of arguments, with no way to pass the forced experts. `graphdef` from
  `recording_graphdef` to get the routing; `with_lb` to get the load-balancing loss (`MoeSettings.with_lb`).
  """
  model = nnx.merge(graphdef, state)
  tokens, positions, attn_mask, _ = tunix_common.process_ids(prompt_tokens, completion_tokens, pad_id, eos_id)
  settings = MoeSettings.of_model(model)
  native = settings is not None and settings.replay_native
  if forced is not None and not native:  # forced at the MoE modules themselves
    set_replay(model, forced)
    forced = None
  logits, _ = model(tokens, positions, None, attn_mask, forced_routed_experts=forced)
  t = completion_tokens.shape[1]
  logits = logits[:, -t - 1 : -1, :]
  if temperature not in (0.0, 1.0):
    logits = logits / temperature
  logps = tunix_common.selective_log_softmax(logits, tokens[:, -t:])
  aux = lb_loss(model, settings) if with_lb and settings is not None else None
  return logps, logits, routing(model, tokens.shape[0]), aux


@flax.struct.dataclass(frozen=True)
class RoutedTrainExample(grpo_learner.TrainExample):
  """Tunix's `TrainExample` with the experts the sampler routed each token to (router replay): [rows, P+T, layers, k].

  A field of the example, so micro-batching (`updates.slice_rows`), Tunix's input sharding and the gradient-accumulation
  loop slice and place it with the rows it belongs to.
  """

  routed_experts: jax.Array | None = None


# ----------------------------------------------------------------------------------------------------------------------
# Layout and metrics (host side)
# ----------------------------------------------------------------------------------------------------------------------


def pad_layout(prompt: np.ndarray, completion: np.ndarray, prompt_width: int, completion_width: int) -> np.ndarray:
  """[rows, prompt_width + completion_width, layers, k]: `prompt` routing (right-aligned: prompts are left-padded) and
  `completion` routing (left-aligned), cut or filled with UNSET."""
  rows, _, layers, k = prompt.shape
  out = np.full((rows, prompt_width + completion_width, layers, k), UNSET, np.int32)
  p = prompt[:, -prompt_width:] if prompt.shape[1] >= prompt_width else prompt
  out[:, prompt_width - p.shape[1] : prompt_width] = p
  c = completion[:, :completion_width]
  out[:, prompt_width : prompt_width + c.shape[1]] = c
  return out


def widen_prompt(route: np.ndarray, completion_width: int, prompt_width: int) -> np.ndarray:
  """`route` [rows, P + T, ...] with its prompt part left-padded (or cut) to `prompt_width`, as prompts are when
  batches of different prompt widths are joined (dynamic_sampling.assemble)."""
  p = route.shape[1] - completion_width
  return pad_layout(route[:, :p], route[:, p:], prompt_width, completion_width)


def expert_load(route: np.ndarray, token_mask: np.ndarray, num_experts: int) -> dict[str, float]:
  """Tokens per expert per layer over the masked tokens of `route` [rows, L, layers, k]: max/mean and min/mean."""
  r = np.asarray(route)
  m = np.asarray(token_mask, bool)
  sel = r[m]  # [tokens, layers, k]
  if sel.size == 0:
    return {}
  counts = np.stack(
      [np.bincount(sel[:, j].ravel()[sel[:, j].ravel() >= 0], minlength=num_experts) for j in range(sel.shape[1])]
  )  # [layers, experts]
  mean = counts.mean(axis=1, keepdims=True)
  ratio = counts / np.maximum(mean, 1e-9)
  return {"load_max": float(ratio.max()), "load_min": float(ratio.min())}


def mismatch_fraction(a: np.ndarray, b: np.ndarray, token_mask: np.ndarray) -> float:
  """Fraction of (masked token, layer) pairs whose top-k expert sets differ between routings `a` and `b`."""
  m = np.asarray(token_mask, bool)
  sa, sb = np.sort(np.asarray(a)[m], axis=-1), np.sort(np.asarray(b)[m], axis=-1)  # [tokens, layers, k]
  if sa.size == 0:
    return 0.0
  return float(np.any(sa != sb, axis=-1).mean())


def routed_mask(prompt_mask: np.ndarray, completion_mask: np.ndarray) -> np.ndarray:
  """[rows, P+T] tokens whose routing both sides record: real prompt tokens and completion tokens but the last."""
  cm = np.asarray(completion_mask, bool)
  fed = cm & np.concatenate([cm[:, 1:], np.zeros_like(cm[:, :1])], axis=1)  # a successor exists
  return np.concatenate([np.asarray(prompt_mask, bool), fed], axis=1)


def step_metrics(
    sampler: np.ndarray | None, trainer: np.ndarray | None, mask: np.ndarray, num_experts: int
) -> dict[str, float]:
  """The step's `moe/*` metrics from whichever routings were recorded (module docstring)."""
  out: dict[str, float] = {}
  for side, route in (("rollout", sampler), ("trainer", trainer)):
    if route is not None:
      out.update({f"moe/{side}_{k}": v for k, v in expert_load(route, mask, num_experts).items()})
  if sampler is not None and trainer is not None:
    out["moe/routing_mismatch_fraction"] = mismatch_fraction(sampler, trainer, mask)
  return out
