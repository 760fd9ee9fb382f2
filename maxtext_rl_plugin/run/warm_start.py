"""Supervised warm start before RL (`sft_warmup_steps=N`).

RL can only sharpen behaviour the policy already samples: a random-init or base model that never emits
the answer format gets zero reward everywhere and zero advantage. A short SFT phase on reference
solutions (`data/prompts.format_target`) puts it where GRPO has signal. It is a small optax loop
on the same MaxText model (next-token cross-entropy on completion tokens only, stop token included),
checkpointed with Orbax under `<run>/checkpoints/sft/` so a rerun of the same command skips it.

A SIGTERM/SIGINT during the warm start finishes the current step, saves the steps so far (params, optimizer state) as
`checkpoints/sft/<k>` and stops with one line; a rerun of the same command continues from step k (batch k is a pure
function of the seed and k, and the optimizer state carries the schedule's position), ending where an uninterrupted
warm start ends.

The warm start reads its keys through `SftSettings` (built once, `from_config`): it hands nothing to MaxText's API that
needs the whole config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any

from absl import logging
from flax import nnx
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from maxtext_rl_plugin import checkpointing
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import signals
from maxtext_rl_plugin import storage as storage_lib
from maxtext_rl_plugin.data import prompts
from maxtext_rl_plugin.metrics import format_duration
from maxtext_rl_plugin.metrics import is_writer

_DATA_AXES = ("data", "fsdp")
# What a partial warm start's steps depend on besides the model: continuing one written with other values would mix two
# schedules or two data orders, so it starts over instead (with a line).
_PLAN_KEYS = ("sft_warmup_steps", "sft_learning_rate", "sft_batch_size", "data_shuffle_seed", "max_target_length")


@dataclasses.dataclass(frozen=True)
class SftSettings:
  """What the warm start reads of the config: its `sft_*` keys, the data order and row length, the trainer's logical
  axis rules, the checkpoint storage keys and how an SFT target is written (`PromptSettings`)."""

  steps: int  # sft_warmup_steps
  learning_rate: float  # sft_learning_rate
  batch_size: int  # sft_batch_size
  data_shuffle_seed: int
  max_target_length: int
  logical_axis_rules: tuple[tuple[str, Any], ...]
  storage: checkpointing.Storage
  prompt_settings: prompts.PromptSettings

  @classmethod
  def from_config(cls, config) -> SftSettings:
    return cls(
        steps=int(config.sft_warmup_steps),
        learning_rate=float(config.sft_learning_rate),
        batch_size=int(config.sft_batch_size),
        data_shuffle_seed=int(config.data_shuffle_seed),
        max_target_length=int(config.max_target_length),
        logical_axis_rules=tuple((k, v) for k, v in config.logical_axis_rules),
        storage=checkpointing.Storage.from_config(config),
        prompt_settings=prompts.PromptSettings.from_config(config),
    )

  def plan(self) -> dict[str, Any]:
    """The values a partial warm start is continued under, by key name (`_PLAN_KEYS`; saved in its meta)."""
    values = (self.steps, self.learning_rate, self.batch_size, self.data_shuffle_seed, self.max_target_length)
    return dict(zip(_PLAN_KEYS, values))


def _tokenize_batch(examples, tokenizer, settings: prompts.PromptSettings, length: int):
  """Right-padded [prompt + target + eos] rows and a loss mask over the target and eos tokens."""
  pad = tokenizer.pad_token_id
  tokens = np.full((len(examples), length), pad, dtype=np.int32)
  mask = np.zeros((len(examples), length), dtype=np.float32)
  for i, ex in enumerate(examples):
    p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
    t = tokenizer(prompts.format_target(ex, settings), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    row = (p + t)[:length]
    tokens[i, : len(row)] = row
    # position j predicts token j+1: supervise predictions of target tokens only.
    start, end = len(p) - 1, min(len(p) + len(t), length) - 1
    mask[i, start:end] = 1.0
  return tokens, mask


def _say(line: str) -> None:
  """Console progress: process 0 only (every process trains the same warm start)."""
  if is_writer():
    print(line, flush=True)


def lr_schedule(steps: int, learning_rate: float) -> optax.Schedule:
  """Linear warmup over a tenth of the steps, then cosine to a tenth of the rate; the cosine keeps at least one step
  (sft_warmup_steps=1 left it none: optax's ValueError, a traceback)."""
  warmup = min(max(1, steps // 10), steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, steps, learning_rate * 0.1)


def warm_start(settings: SftSettings, model, mesh, tokenizer, train_split, run_dir: str) -> dict:
  """Train `model` in place for `settings.steps` (sft_warmup_steps) steps, or restore the finished warm start."""
  steps = settings.steps
  ckpt_dir = os.path.join(storage_lib.absolute(run_dir), "checkpoints", "sft")  # a bucket path as given
  storage = settings.storage
  manager = checkpointing.open_manager(ckpt_dir, ("params", "opt_state", "meta"), storage=storage, max_to_keep=1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  latest = manager.latest_step()
  if latest == steps:
    restored, meta = checkpointing.restore_items(manager, steps, {"params": params}, mesh)
    nnx.update(model, restored["params"])
    manager.close()
    _say(f"SFT warm start: restored {steps} steps from {ckpt_dir} (skipping)")
    signals.note_kept(f"the SFT warm start is saved in {ckpt_dir}")
    return meta

  length = settings.max_target_length
  schedule = lr_schedule(steps, settings.learning_rate)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
  opt_state = tx.init(params)
  plan = settings.plan()
  done, losses = 0, []
  if latest is not None and latest < steps:
    done, params, opt_state, losses = _continue(manager, latest, plan, params, opt_state, mesh, ckpt_dir)

  def loss_fn(p, tokens, mask):
    m = nnx.merge(graphdef, p, rest)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = m(tokens, positions, None, None)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * mask[:, :-1]) / jnp.maximum(jnp.sum(mask[:, :-1]), 1.0)

  @jax.jit
  def train_step(p, o, tokens, mask):
    loss, grads = jax.value_and_grad(loss_fn)(p, tokens, mask)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  t0 = time.time()
  # Batch k is trained at step k + 1: a continued warm start takes up at batch `done`.
  batches = train_split.batches(settings.batch_size, start_batch=done, seed=settings.data_shuffle_seed + 7919)
  with mesh, nn_partitioning.axis_rules(settings.logical_axis_rules), signals.stop_at_step_boundaries():
    for step in range(done + 1, steps + 1):
      tokens, mask = _tokenize_batch(next(batches), tokenizer, settings.prompt_settings, length)
      # The same rows on every process -> global arrays, rows over the mesh's data axes (distributed.py).
      params, opt_state, loss = train_step(
          params,
          opt_state,
          distributed.global_batch(tokens, mesh, _DATA_AXES),
          distributed.global_batch(mask, mesh, _DATA_AXES),
      )
      losses.append(float(loss))
      if step == 1 or step % max(1, steps // 10) == 0 or step == steps:
        el = time.time() - t0
        _say(
            f"SFT warm start step {step}/{steps} | loss {np.mean(losses[-10:]):.3f} | "
            f"ETA {format_duration(el / (step - done) * (steps - step))}"
        )
      if signals.stop_requested() and step < steps:
        meta = {**plan, "steps": step, "recent_losses": losses[-10:]}
        _stop(manager, storage, ckpt_dir, step, params, opt_state, meta)
  nnx.update(model, params)
  meta = {"steps": steps, "final_loss": float(np.mean(losses[-10:])), "seconds": time.time() - t0}
  checkpointing.save_items(manager, steps, {"params": params}, meta, storage=storage)
  manager.close()
  signals.note_kept(f"the SFT warm start is saved in {ckpt_dir}")
  logging.info("SFT warm start done: %s", json.dumps(meta))
  return meta


def _continue(manager, latest: int, plan: dict, params, opt_state, mesh, ckpt_dir: str):
  """(steps done, params, optimizer state, recent losses) of the partial warm start `latest` that a stop saved, or
  (0, the fresh ones, []) with a line when it was written for another plan or does not restore."""
  try:
    meta = dict(manager.restore(latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)
    changed = [f"{k}={meta.get(k)!r}" for k in _PLAN_KEYS if meta.get(k) != plan[k]]
    if changed:
      _say(f"SFT warm start: step {latest} in {ckpt_dir} was written with {', '.join(changed)}; starting over")
      return 0, params, opt_state, []
    restored, _ = checkpointing.restore_items(manager, latest, {"params": params, "opt_state": opt_state}, mesh)
  except Exception as e:  # pylint: disable=broad-exception-caught  # any restore failure: train from the start
    _say(f"SFT warm start: step {latest} in {ckpt_dir} does not restore ({type(e).__name__}); starting over")
    return 0, params, opt_state, []
  _say(f"SFT warm start: continuing from step {latest}/{plan['sft_warmup_steps']} ({ckpt_dir})")
  return latest, restored["params"], restored["opt_state"], list(meta.get("recent_losses", []))


def _stop(manager, storage, ckpt_dir: str, step: int, params, opt_state, meta: dict) -> None:
  """A stop was requested during step `step`: save the steps so far and stop with one line (exit 128 + N)."""
  checkpointing.save_items(manager, step, {"params": params, "opt_state": opt_state}, meta, storage=storage)
  manager.close()
  signum = signals.requested_signal() or signal.SIGTERM
  raise signals.Stopped(
      f"stopped by {signal.Signals(signum).name} during the SFT warm start after step {step}/"
      f"{meta['sft_warmup_steps']}; its steps are saved in {ckpt_dir}: rerunning the same command continues "
      f"the warm start from step {step}",
      signum,
  )
