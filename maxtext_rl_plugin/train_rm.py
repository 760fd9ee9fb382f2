r"""Train a reward model on preference pairs: `python -m maxtext_rl_plugin.train_rm <config.yml> key=value ...`.

The name follows MaxText's trainers, one entry point per objective beside the others (`train` for pre-training,
`sft_trainer` / `train_sft` for supervised fine-tuning, `train_rl` for RL): `train_rm` trains the reward model that a
`train_rl` run scores with (`rl.reward_model_path`), with the same config files and `key=value` overrides.

Data: `train_data_path`, a JSONL file of rows `{"prompt": ..., "chosen": ..., "rejected": ...}` (the prompt is the
question; it is formatted as the run formats prompts, data/prompts.build_prompt: the tokenizer's chat template or
`data_template_path`, so the reward model reads what the policy's completions will follow). Held-out pairs:
`eval_data_path`, or when it is empty every 5th row of `train_data_path` (rows 4, 9, 14, ...), never trained on.

Model: the run's model keys (reward_model.py: MaxText's model of that family and size with a linear head on the
last token's final-norm hidden state), initialised from `load_parameters_path` or at random (`init_weights_seed`).

Objective (Bradley-Terry): loss = -mean log sigmoid(r(x, y_chosen) - r(x, y_rejected)), AdamW at `learning_rate`
(constant, `adam_*` and `adam_weight_decay` as MaxText's), `gradient_clipping_threshold`; `batch_size` pairs per step
for `num_batches` steps, pairs shuffled by `data_shuffle_seed` (each pass a new order).

Outputs under `<base_output_directory>/<run_name>`: Orbax checkpoints of the parameters and the reward model's meta
(`checkpoint_dir`: every `checkpoint_period` steps and at the end), TensorBoard scalars (`tensorboard_dir`:
rm/loss, rm/train_accuracy, rm/margin, eval/pair_accuracy, eval/margin), `metrics_file` when set, a progress line.
Held-out pair accuracy (the fraction of pairs with r(chosen) > r(rejected)) is measured before the first step, every
`eval_interval` steps (> 0) and after the last. Exit 2 with one `error:` line for a config or data mistake.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from maxtext_rl_plugin import checkpointing
from maxtext_rl_plugin import errors
from maxtext_rl_plugin import metrics as metrics_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.data import prompts as prompts_lib
from maxtext_rl_plugin.errors import DataError
from maxtext_rl_plugin.errors import exit_on_user_error
from maxtext_rl_plugin import reward_model as rm_lib
from maxtext_rl_plugin.run import rewards as run_rewards

HOLDOUT_EVERY = 5  # without eval_data_path, every 5th pair is held out


def read_pairs(path: str) -> list[dict[str, str]]:
  """The JSONL rows of `path`, each with string `prompt`, `chosen`, `rejected`; a bad row is one line naming it."""
  if not path:
    raise DataError("train_rm needs train_data_path: a JSONL file of {prompt, chosen, rejected} rows")
  try:
    text = storage.read_text(path)
  except OSError as e:
    raise DataError(f"train_data_path='{path}': {storage.describe_error(e, path)}") from None
  rows = []
  for n, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
    if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")):
      raise DataError(f"{path}:{n}: expected string fields prompt, chosen and rejected")
    rows.append(row)
  if not rows:
    raise DataError(f"{path}: no preference pairs")
  return rows


def split_pairs(config: Any) -> tuple[list[dict], list[dict]]:
  """(train, held-out) pairs (module docstring)."""
  rows = read_pairs(str(config.train_data_path))
  if config.eval_data_path:
    return rows, read_pairs(str(config.eval_data_path))
  held = [r for i, r in enumerate(rows) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
  kept = [r for i, r in enumerate(rows) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
  if not kept or not held:
    raise DataError(f"{config.train_data_path}: {len(rows)} pairs, too few to hold every {HOLDOUT_EVERY}th out")
  return kept, held


def pair_texts(rows: Sequence[dict], tokenizer: Any, config: Any) -> tuple[list[str], list[str]]:
  """(chosen texts, rejected texts): the formatted prompt followed by each response."""
  settings = prompts_lib.PromptSettings.from_config(config)
  prompts = [prompts_lib.build_prompt(r["prompt"], tokenizer, settings) for r in rows]
  return [p + r["chosen"] for p, r in zip(prompts, rows)], [p + r["rejected"] for p, r in zip(prompts, rows)]


def bt_loss(rm: rm_lib.RewardModel, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Bradley-Terry loss of a batch whose first half is the chosen texts and second half the rejected ones."""
  r = rm(tokens, lengths)
  n = r.shape[0] // 2
  margin = r[:n] - r[n:]
  return -jnp.mean(jax.nn.log_sigmoid(margin)), margin


@nnx.jit
def train_step(rm: rm_lib.RewardModel, optimizer: nnx.Optimizer, tokens: jax.Array, lengths: jax.Array):
  """One AdamW update of the Bradley-Terry loss; (loss, per-pair margins)."""
  (loss, margin), grads = nnx.value_and_grad(bt_loss, has_aux=True)(rm, tokens, lengths)
  optimizer.update(rm, grads)
  return loss, margin


def evaluate(scorer: rm_lib.Scorer, chosen: list[str], rejected: list[str]) -> dict[str, float]:
  """Held-out pair accuracy (r(chosen) > r(rejected)) and mean margin."""
  margin = scorer(chosen) - scorer(rejected)
  return {"eval/pair_accuracy": float(np.mean(margin > 0)), "eval/margin": float(np.mean(margin))}


def _optimizer(config: Any, rm: rm_lib.RewardModel) -> nnx.Optimizer:
  """AdamW with MaxText's adam_* keys at a constant learning_rate, clipped by gradient_clipping_threshold (> 0)."""
  tx = optax.adamw(
      float(config.learning_rate),
      b1=float(config.adam_b1),
      b2=float(config.adam_b2),
      eps=float(config.adam_eps),
      weight_decay=float(config.adam_weight_decay),
  )
  if float(config.gradient_clipping_threshold) > 0:
    tx = optax.chain(optax.clip_by_global_norm(float(config.gradient_clipping_threshold)), tx)
  return nnx.Optimizer(rm, tx, wrt=nnx.Param)


def train(argv: Sequence[str]) -> dict[str, Any]:
  """Train and checkpoint a reward model for the config `argv`; returns the summary (also written as rm_summary.json)."""
  parsed = config_lib.parse(argv)
  setup = models.setup_devices(parsed)
  config, devices = setup.trainer_config, setup.trainer_devices
  tokenizer = tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config))
  pad_id = int(tokenizer.pad_token_id)
  train_rows, held_rows = split_pairs(config)
  train_c, train_r = pair_texts(train_rows, tokenizer, config)
  held_c, held_r = pair_texts(held_rows, tokenizer, config)
  rm, mesh = run_rewards.build_reward_model(config, devices, pad_id, seed=int(config.init_weights_seed))
  meta = rm_lib.meta_of(rm_lib.ModelIdentity.of(config), tokenizer)
  b, steps, max_len = int(config.batch_size), int(config.num_batches), int(config.max_target_length)
  scorer = rm_lib.Scorer(rm, mesh, tokenizer, 2 * b, max_len)
  store = checkpointing.Storage.from_config(config)
  run_dir = os.path.join(str(config.base_output_directory), str(config.run_name))
  metrics_file = config.metrics_file or None
  if metrics_file and not os.path.isabs(metrics_file) and not storage.is_remote(metrics_file):
    metrics_file = os.path.join(run_dir, metrics_file)  # relative to the run, as train_rl's
  logger = metrics_lib.RunLogger(str(config.tensorboard_dir), metrics_file, steps, log_period=int(config.log_period))
  rng = np.random.default_rng(int(config.data_shuffle_seed))
  order: list[int] = []
  with mesh:
    optimizer = _optimizer(config, rm)
    first = evaluate(scorer, held_c, held_r)
    logger.log_eval(0, first)
    history = [{"step": 0, **first}]
    t0 = time.time()
    for step in range(1, steps + 1):
      while len(order) < b:
        order += rng.permutation(len(train_rows)).tolist()
      idx, order = order[:b], order[b:]
      tokens, lengths = rm_lib.encode(tokenizer, [train_c[i] for i in idx] + [train_r[i] for i in idx], max_len, pad_id)
      loss, margin = train_step(rm, optimizer, jnp.asarray(tokens), jnp.asarray(lengths))
      m = {
          "rm/loss": float(loss),
          "rm/train_accuracy": float(np.mean(np.asarray(margin) > 0)),
          "rm/margin": float(np.mean(np.asarray(margin))),
      }
      every = int(config.eval_interval)
      if step == steps or (every > 0 and step % every == 0):
        m.update(evaluate(scorer, held_c, held_r))
      logger.log_step(step, m)
      if step % int(config.log_period) == 0 or step == steps:
        shown = ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in m.items())
        logger.note(f"  rm step {step}: {shown}")
      history.append({"step": step, **m})
      if step == steps or step % int(config.checkpoint_period) == 0:
        rm_lib.save(str(config.checkpoint_dir), step, rm, {**meta, "step": step, **m}, store)
  summary = {
      "train_pairs": len(train_rows),
      "heldout_pairs": len(held_rows),
      "steps": steps,
      "seconds": round(time.time() - t0, 1),
      "heldout_accuracy_before": first["eval/pair_accuracy"],
      "heldout_accuracy": history[-1]["eval/pair_accuracy"],
      "checkpoint_dir": str(config.checkpoint_dir),
  }
  storage.makedirs(run_dir)
  storage.write_atomic(os.path.join(run_dir, "rm_summary.json"), json.dumps(summary, indent=1) + "\n")
  print(
      f"reward model: held-out pair accuracy {summary['heldout_accuracy_before']:.3f} -> "
      f"{summary['heldout_accuracy']:.3f} ({len(held_rows)} pairs), {steps} steps; checkpoints: {config.checkpoint_dir}",
      flush=True,
  )
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; `argv` excludes the program name."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  errors.quiet_third_party_logs()
  with exit_on_user_error():
    train(argv)
  metrics_lib.close_all()
  return 0


if __name__ == "__main__":
  sys.exit(main())
