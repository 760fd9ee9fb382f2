"""A tiny colocated GRPO step as one multi-process JAX program: the launchers' bring-up check.

Before spending TPU hours on `train_rl`, `launch ray --entry smoke` runs this on every worker: the global batch of
`prompts x num_generations` completions is sharded over all devices of all processes, the plugin's policy loss
(`maxtext_rl_plugin.loss_lib.policy_loss`, GRPO or GSPO-token) and group advantages are computed on a toy
linear softmax policy, and one SGD step is taken. The gradient of the replicated parameters is a cross-process
all-reduce inserted by XLA (gloo on CPU, ICI/DCN on TPU), so every worker reporting the same loss before and after
the update proves the collectives, the coordinator and the plugin's loss work together on that cluster.

Everything is a deterministic function of `seed` (each process builds the global batch and keeps its shard), so
a single process with one device computes the same numbers: that is what the tests compare against.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from maxtext_rl_plugin.algorithms import advantages as advantages_lib
from maxtext_rl_plugin.algorithms import loss as loss_lib


def make_batch(
    *, seed: int, prompts: int, num_generations: int, length: int, dim: int, vocab: int
) -> dict[str, np.ndarray]:
  """Sampled completions of a group rollout: features, tokens, masks, rewards, old/ref log-probs (NumPy)."""
  rng = np.random.default_rng(seed)
  b = prompts * num_generations
  feats = rng.standard_normal((b, length, dim)).astype(np.float32)
  tokens = rng.integers(0, vocab, size=(b, length)).astype(np.int32)
  lengths = rng.integers(1, length + 1, size=(b,))
  mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
  # Reward: share of the completion's tokens that hit the "correct" token 0..vocab/4 (varies within a group).
  hits = ((tokens < max(1, vocab // 4)) * mask).sum(-1) / mask.sum(-1)
  rewards = hits.astype(np.float32)
  old_shift = (0.05 * rng.standard_normal((b, length))).astype(np.float32)
  ref_shift = (0.05 * rng.standard_normal((b, length))).astype(np.float32)
  return {
      "feats": feats,
      "tokens": tokens,
      "mask": mask,
      "rewards": rewards,
      "old_shift": old_shift,
      "ref_shift": ref_shift,
  }


def grpo_step(
    *,
    seed: int = 0,
    prompts: int = 4,
    num_generations: int = 4,
    length: int = 8,
    dim: int = 16,
    vocab: int = 32,
    loss_algo: str = "grpo",
    learning_rate: float = 0.5,
    beta: float = 0.04,
) -> dict[str, Any]:
  """Run one GRPO update on all devices of all processes; returns the replicated metrics as Python floats."""
  devices = np.asarray(jax.devices())
  if (prompts * num_generations) % devices.size:
    raise ValueError(f"global batch {prompts * num_generations} is not divisible by {devices.size} devices")
  mesh = Mesh(devices, ("data",))
  batch_sharded = NamedSharding(mesh, P("data"))
  replicated = NamedSharding(mesh, P())

  host = make_batch(seed=seed, prompts=prompts, num_generations=num_generations, length=length, dim=dim, vocab=vocab)
  host["advantages"] = np.asarray(advantages_lib.group_advantages(host["rewards"], num_generations), np.float32)

  def to_global(x: np.ndarray) -> jax.Array:
    # Every process holds the same host batch and contributes only its addressable shards.
    return jax.make_array_from_callback(x.shape, batch_sharded, lambda idx: x[idx])

  batch = {k: to_global(v) for k, v in host.items() if k != "rewards"}
  w0 = np.random.default_rng(seed + 1).standard_normal((dim, vocab)).astype(np.float32) * 0.1
  params = jax.make_array_from_callback(w0.shape, replicated, lambda idx: w0[idx])

  def token_logps(w, b):
    logits = jnp.einsum("btd,dv->btv", b["feats"], w)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), b["tokens"][..., None], -1)[..., 0]

  def loss_fn(w, b, old, ref):
    """The plugin's GRPO loss of one batch (the same policy_loss training uses)."""
    return loss_lib.policy_loss(
        token_logps(w, b),
        old,
        ref,
        b["advantages"],
        b["mask"],
        loss_algo=loss_algo,
        epsilon=0.2,
        beta=beta,
        kl_estimator="k3",
        loss_agg_mode="sequence-mean-token-mean",
    )

  def step(w, b):
    # Sampler ("old") and reference log-probs are fixed before the update, as in a rollout -> learn cycle.
    logp0 = jax.lax.stop_gradient(token_logps(w, b))
    old, ref = logp0 + b["old_shift"], logp0 + b["ref_shift"]
    (loss, aux), grad = jax.value_and_grad(loss_fn, has_aux=True)(w, b, old, ref)
    new_w = w - learning_rate * grad
    loss_after, _ = loss_fn(new_w, b, old, ref)
    return loss, loss_after, jnp.sqrt(jnp.sum(grad * grad)), aux["clip_fraction"]

  step = jax.jit(step, in_shardings=(replicated, batch_sharded), out_shardings=replicated)
  loss, loss_after, grad_norm, clip = step(params, batch)
  return {
      "loss": float(loss),
      "loss_after_step": float(loss_after),
      "grad_norm": float(grad_norm),
      "clip_fraction": float(clip),
      "reward_mean": float(host["rewards"].mean()),
      "process_index": int(jax.process_index()),
      "process_count": int(jax.process_count()),
      "global_devices": int(devices.size),
  }
