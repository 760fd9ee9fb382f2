"""The actor's optimizer update: gradients of a mini-batch's micro-batches summed inside one jitted step.

Tunix 0.1.7's trainer accumulates across calls: with `train_micro_batch_size` set, `PeftTrainer` wraps the optimizer
in `optax.MultiSteps`, whose accumulator (a copy of the trainable params) lives in the optimizer state for the whole
run, in HBM and in every checkpoint, even when a mini-batch is one micro-batch and nothing is accumulated (8.2 GiB
per chip for Llama 3.1 70B on v5p-128, docs/aot.md). The plugin instead gives the trainer one example per optimizer
update and accumulates inside the jitted step, as MaxText 0.2.5's pre-training does
(`utils/gradient_accumulation.gradient_accumulation_loss_and_grad`):

* one micro-batch per update (`steps == 1`): Tunix's own step body (value_and_grad, global norm, optimizer update);
  no accumulator exists at all;
* several: `jax.lax.scan` over the micro-batches, each one's gradient added to a carry that lives only while the
  step runs. The carry is `jnp.zeros_like` of the trainable params, MaxText's choice: it accumulates in the params'
  own dtype (`weight_dtype`: float32 in MaxText's base.yml and the CPU configs; bfloat16 under post_train/rl.yml, where
  the MultiSteps accumulator was float32-sized, 8.22 GiB per chip for the 70B, against 4.11 of bf16 params). The
  sum is divided by the number of
  micro-batches: the mean of micro-batch gradients that `MultiSteps` averaged before (so the update is the same to
  float32 round-off), the loss and every aux metric likewise averaged over the micro-batches.

Rows: micro-batch i of a mini-batch is the contiguous block of rows it was before (`updates.update_batches` orders
the mini-batch so that MaxText's strided split, `reshape_to_microbatch_accumulations`, takes exactly that block;
each device keeps the rows it held). Under `token-mean` aggregation the micro-batches are normalised separately, as
before, so the same grouping gives the same update.

Reported `grad_norm`: the global norm of the averaged gradient the optimizer applies (MaxText's `raw_grad_norm`); with
MultiSteps it was the mean of the micro-batches' own norms. Identical with one micro-batch per update.
"""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
import optax


def split_micro_batches(example: Any, steps: int) -> Any:
  """[steps * r, ...] rows -> [steps, r, ...]: MaxText's `reshape_to_microbatch_accumulations` (micro-batch i takes
  rows i, i + steps, i + 2 * steps, ...: a strided split keeps each device's rows on the device)."""

  def split(x):
    if not isinstance(x, jax.Array) or x.ndim == 0:
      return x
    y = jnp.reshape(x, (x.shape[0] // steps, steps) + x.shape[1:])
    return jnp.swapaxes(y, 0, 1)

  return jax.tree.map(split, example)


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    inputs: Any,
    *,
    loss_fn: Callable[..., Any],
    gen_model_input_fn: Callable[[Any], dict],
    lora: bool,
    steps: int,
) -> tuple[jax.Array, Any, jax.Array]:
  """One optimizer update over `inputs` (a mini-batch of `steps` micro-batches): (loss, aux, grad_norm), Tunix's
  train-step contract. `loss_fn(model, **gen_model_input_fn(example))` returns (loss, aux)."""
  wrt = nnx.LoRAParam if lora else nnx.Param
  grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)
  if steps == 1:
    (loss, aux), grads = grad_fn(model, **gen_model_input_fn(inputs))
  else:
    # Under LoRA the frozen base params are closed over (read-only), not carried: a carry would need a copy of them.
    filters = (wrt, nnx.Param, ...) if lora else (wrt, ...)
    graphdef, trainable, *frozen, rest = nnx.split(model, *filters)

    def accumulate(carry, micro):
      acc, rest = carry
      local = nnx.merge(graphdef, trainable, *frozen, rest, copy=True)
      (loss, aux), grads = grad_fn(local, **gen_model_input_fn(micro))
      *_, rest = nnx.split(local, *filters)  # non-param state (RNG counters) advances as MaxText's carry does
      return (jax.tree.map(jnp.add, acc, grads), rest), (loss, aux)

    init = (jax.tree.map(jnp.zeros_like, trainable), rest)
    (acc, rest), (losses, auxes) = jax.lax.scan(accumulate, init, split_micro_batches(inputs, steps))
    nnx.update(model, rest)
    grads = jax.tree.map(lambda g: g / steps, acc)
    loss = jnp.mean(losses)
    aux = jax.tree.map(lambda x: jnp.mean(x, axis=0), auxes)
  grad_norm = optax.global_norm(grads)
  optimizer.update(model, grads)
  return loss, aux, grad_norm
