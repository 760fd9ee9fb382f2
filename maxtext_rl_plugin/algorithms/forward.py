"""The trainer's differentiated forward: the per-token log-probs a policy loss reads, by one of three routes.

    packed    `max_seq_token_per_tpu`: the batch's sequences packed into rows (packing.py), log-probs gathered back
    replayed  an MoE model with `rl.router_replay` or a load-balancing term: the routing forced or the term collected
              (moe.forward_logps)
    plain     Tunix's `compute_per_token_logps` on the left-padded prompt + right-padded completion rows

The route is the example's (a packed example carries packed fields, a replayed one its routing) and the model's (an
MoE model with `load_balance_loss_weight` > 0); the loss (loss.py) sees only the [B, T] arrays, whatever the route.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
import jax
from tunix.rl import common as tunix_common

from maxtext_rl_plugin import moe
from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin.algorithms import packing


@dataclasses.dataclass(frozen=True)
class Forward:
  """What a forward gives the loss: [B, T] log-probs (differentiated), [B, T] entropy (no gradient; None unless asked)
  and MaxText's load-balancing term (None unless the model sows one)."""

  per_token_logps: jax.Array
  entropy: jax.Array | None = None
  lb_loss: jax.Array | None = None


def policy_forward(
    model: nnx.Module, example: Any, pad_id: int, eos_id: int, temperature: float, with_entropy: bool
) -> Forward:
  """The per-token log-probs of `example`'s completion tokens under `model`, by the route the example and the model
  call for (module docstring)."""
  graphdef, state = nnx.split(model)
  settings = moe.MoeSettings.of_model(model)  # from the model's own (MaxText) config
  forced = getattr(example, "routed_experts", None)
  with_lb = settings is not None and settings.with_lb
  if getattr(example, "packed_tokens", None) is not None:
    logps, entropy, lb_loss = packing.packed_forward(
        model,
        example.packed_tokens,
        example.packed_positions,
        example.packed_segments,
        example.src_row,
        example.src_col,
        example.src_valid,
        temperature=temperature,
        with_entropy=with_entropy,
        forced=getattr(example, "packed_routing", None),
        with_lb=with_lb,
    )
    return Forward(logps, entropy, lb_loss)
  if forced is not None or with_lb:
    logps, logits, _, lb_loss = moe.forward_logps(
        graphdef,
        state,
        example.prompt_ids,
        example.completion_ids,
        pad_id,
        eos_id,
        temperature=temperature,
        forced=forced,
        with_lb=with_lb,
    )
  else:
    logps, logits = tunix_common.compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens=example.prompt_ids,
        completion_tokens=example.completion_ids,
        pad_id=pad_id,
        eos_id=eos_id,
        stop_gradient=False,
        return_logits=True,
        segment_ids=getattr(example, "segment_ids", None),
        segment_positions=getattr(example, "segment_positions", None),
        temperature=temperature,
    )
    lb_loss = None
  return Forward(logps, loss_lib.token_entropy(logits) if with_entropy else None, lb_loss)
