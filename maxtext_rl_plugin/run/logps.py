"""The trainer's log-prob forwards of a sampled batch, and where host rows go on the trainer mesh.

`TrainerLogps` computes the old policy's log-probs at the actor's current weights (no gradient): Tunix's
`compute_per_token_logps` on padded rows, MaxText's recording forward on an MoE model (its routing out, the sampler's
replayed in), or the forward on packed rows under `max_seq_token_per_tpu` (algorithms/packing.py), which also serves
the reference model's log-probs then. `put_rows` is the one rule for host rows becoming trainer arrays.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from flax import nnx
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import common as tunix_common
from tunix.rl import rl_cluster as rl_cluster_lib

from maxtext_rl_plugin.algorithms import packing
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import moe


def put_rows(cluster: Any) -> Callable[[Any], jax.Array]:
  """Host rows (the same on every process) -> global arrays on the trainer mesh, rows over Tunix's data axis
  (distributed.py); Tunix passes arrays that are already global through unchanged."""
  return functools.partial(
      distributed.global_batch,
      mesh=cluster.cluster_config.role_to_mesh[rl_cluster_lib.Role.ACTOR],
      axes=cluster.cluster_config.training_config.data_sharding_axis,
  )


class TrainerLogps:
  """Log-probs of sampled completions under the actor's *current* weights, on the trainer mesh (no gradient).

  On an MoE model the forward also records the experts the trainer routed each token to (`last_routing`, host
  [rows, P+T, layers, k]), and `forced` replays the sampler's (rl.router_replay, moe.py).
  """

  def __init__(self, rl_cluster: Any, mesh: Any, logical_axis_rules: Any, row_tokens: int = 0):
    self._cluster = rl_cluster
    self._mesh = mesh
    self._rules = logical_axis_rules
    self._moe_fn = None
    self.row_tokens = int(row_tokens)  # max_seq_token_per_tpu: > 0 packs the forwards (algorithms/packing.py)
    self.last_routing: np.ndarray | None = None

  def reference(self, prompt_ids, completion_ids, pad_id: int, temperature: float, micro_batch_size=None) -> jax.Array:
    """The reference model's log-probs on packed rows (a packed run; otherwise Tunix's `get_ref_per_token_logps`)."""
    model = self._cluster.inference_worker.get_model("reference")
    return self._packed(model, prompt_ids, completion_ids, pad_id, temperature, micro_batch_size)

  def _packed(self, model, prompt_ids, completion_ids, pad_id, temperature, micro_batch_size, forced=None) -> jax.Array:
    """`model`'s log-probs on packed rows (algorithms/packing.py), on the trainer mesh; `forced` replays routing."""
    with self._mesh, nn_partitioning.axis_rules(self._rules):
      return packing.batch_logps(
          model,
          prompt_ids,
          completion_ids,
          pad_id,
          self.row_tokens,
          temperature,
          put_rows(self._cluster),
          micro_batch_size,
          forced=forced,
      )

  def __call__(
      self,
      prompt_ids: jax.Array,
      completion_ids: jax.Array,
      pad_id: int,
      eos_id: int,
      temperature: float,
      micro_batch_size: int | None = None,
      forced: jax.Array | None = None,
  ) -> jax.Array:
    model = self._cluster.actor_trainer.model
    temperature = float(temperature) if temperature and temperature > 0 else 1.0
    rows = prompt_ids.shape[0]
    step = micro_batch_size or rows
    if self.row_tokens > 0:  # packed rows; an MoE batch's routing is packed with them (the trainer's is not unpacked)
      self.last_routing = None
      return self._packed(model, prompt_ids, completion_ids, pad_id, temperature, step, forced)
    config = getattr(getattr(model, "base", None), "config", None)
    graphdef, state = nnx.split(model)
    outs, routes = [], []
    with self._mesh, nn_partitioning.axis_rules(self._rules):
      if config is not None and moe.MoeSettings.from_config(config).is_moe:
        if self._moe_fn is None:  # the actor's graph is fixed; weights and the forced routing are arguments
          rec = moe.recording_graphdef(model)

          def fn(state, prompt, completion, forced, temperature):
            lp, _, route, _ = moe.forward_logps(
                rec, state, prompt, completion, pad_id, eos_id, temperature=temperature, forced=forced
            )
            return lp, route

          self._moe_fn = jax.jit(fn, static_argnums=(4,))
        for s in range(0, rows, step):
          lp, route = self._moe_fn(
              state,
              prompt_ids[s : s + step],
              completion_ids[s : s + step],
              None if forced is None else forced[s : s + step],
              temperature,
          )
          outs.append(lp)
          routes.append(distributed.to_host(route))
        self.last_routing = np.concatenate(routes) if all(r is not None for r in routes) else None
        return jnp.concatenate(outs, axis=0)
      for s in range(0, rows, step):
        outs.append(
            tunix_common.compute_per_token_logps(
                graphdef,
                state,
                prompt_tokens=prompt_ids[s : s + step],
                completion_tokens=completion_ids[s : s + step],
                pad_id=pad_id,
                eos_id=eos_id,
                stop_gradient=True,
                return_logits=False,
                temperature=temperature,
            )
        )
    self.last_routing = None
    return jnp.concatenate(outs, axis=0)
