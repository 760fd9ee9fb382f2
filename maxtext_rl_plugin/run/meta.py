"""What a run records in every checkpoint and a resume compares: its step and update counts, and the resume rules.

One owner for the run's metadata, used by the first pass and by the restore alike:

* the counts: `total_steps` (RL steps: MaxText's train_steps counts one update per iteration), `UpdatePlan` (one
  step's iterations, mini- and micro-batches: `updates_per_step`), `total_updates` and `schedule_updates` (the
  learning-rate schedule's length), all light;
* the resume rules: `resume_invariants` (the data position, the loss, the rollout seed, the updates per step, the
  tokenizer, the weights' dtype: a change is refused), `UPDATE_KEYS` (a change is one `note:` line) and
  `RESUME_EXEMPT`; a plugin key's rule is its field's (config/rules.py), MaxText's keys' are listed here;
* `checkpoint_meta`, the metadata every checkpoint holds (with run/identity.identity, the model and data it trains);
* `check_rerun` / `preflight`, before any model is built (train_rl), and `check_resume_invariants`, which the restore
  (run/resume.py) applies again to the checkpoint it restores.

Light (no JAX; run/__init__.py imports nothing): the first pass (train_rl._precheck) compares the resume invariants
on the config as written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import key_rule
from maxtext_rl_plugin.config import rules
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin.errors import CheckpointError
from maxtext_rl_plugin.run import identity as run_identity


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
  """The update schedule of one RL step (all sizes in prompts)."""

  batch_size: int
  mini_batch_size: int
  micro_batch_size: int
  num_iterations: int
  num_generations: int
  force_on_policy_ratio: bool = False
  off_policy_steps: int = 0  # rl.off_policy_steps: batches may be sampled by weights this many RL steps old
  use_rollout_logps: bool = False

  @classmethod
  def from_config(cls, config: Any) -> "UpdatePlan":
    """The plan of `config`'s batch, mini-batch, micro-batch and iteration sizes."""
    b, mini = int(config.batch_size), mini_batch_size(config)
    micro = int(config.train_micro_batch_size)
    micro = mini if micro <= 0 else micro
    plan = cls(
        b,
        mini,
        micro,
        int(config.rl.num_iterations),
        int(config.rl.num_generations),
        bool(config.rl.force_on_policy_ratio),
        int(config.rl.off_policy_steps),
        bool(config.rl.use_rollout_logps),
    )
    plan.check()
    return plan

  def check(self) -> None:
    """Divisibility (also validated with one-line errors when the config loads); a programming error here."""
    if self.batch_size % self.mini_batch_size or self.mini_batch_size % self.micro_batch_size:
      raise ValueError(f"inconsistent update plan {self}")

  @property
  def mini_batches_per_iteration(self) -> int:
    return self.batch_size // self.mini_batch_size

  @property
  def updates_per_step(self) -> int:
    return self.num_iterations * self.mini_batches_per_iteration

  @property
  def accumulation_steps(self) -> int:
    """Micro-batches per optimizer update (MaxText's gradient_accumulation_steps), accumulated inside the update's one
    jitted step (accumulation.py)."""
    return self.mini_batch_size // self.micro_batch_size

  @property
  def micro_steps_per_step(self) -> int:
    return self.updates_per_step * self.accumulation_steps

  @property
  def trainer_calls_per_update(self) -> int:
    """Calls of Tunix's train step per optimizer update: 1, the micro-batches are accumulated inside it
    (accumulation.py; Tunix's own `gradient_accumulation_steps` stays unset, so it counts one micro-step per update)."""
    return 1

  @property
  def needs_old_logps(self) -> bool:
    """Whether the loss needs old-policy log-probs: any update after the first sees moved weights; and a stale batch
    (`off_policy_steps` > 0) whose PPO ratio is taken against the behaviour policy (`use_rollout_logps`)."""
    stale_ratio = self.off_policy_steps > 0 and self.use_rollout_logps
    return (self.updates_per_step > 1 or stale_ratio) and not self.force_on_policy_ratio

  def micro_batch_rows(self) -> Iterator[slice]:
    """Row slices (rows = prompts x G) of the micro-batches of one RL step, in training order.

    Every iteration walks the batch in the same order: rows are contiguous prompt groups, so a mini-batch holds
    whole groups and group-normalised advantages stay as computed over the full group.
    """
    rows = self.micro_batch_size * self.num_generations
    n = self.batch_size * self.num_generations
    for _ in range(self.num_iterations):
      for start in range(0, n, rows):
        yield slice(start, start + rows)


def mini_batch_size(config) -> int:
  """Prompts per optimizer update: rl.mini_batch_size, or batch_size when unset (None or <= 0; as written, unset)."""
  b, mini = int(config.batch_size), value_or(config.rl, "mini_batch_size", None)
  return b if mini is None or int(mini) <= 0 else int(mini)


def updates_per_step(config) -> int:
  """Optimizer updates per RL step (`UpdatePlan.updates_per_step`), from the sizes alone: the first pass's config as
  written leaves the plan's other keys to the schema."""
  mini = mini_batch_size(config)
  return UpdatePlan(int(config.batch_size), mini, mini, int(config.rl.num_iterations), 1).updates_per_step


def total_steps(config) -> int:
  """RL steps (rollout batches) of the run. MaxText's `train_steps` counts num_batches * num_iterations *
  train_fraction * num_epoch, i.e. updates with one update per iteration; the plugin's step is one rollout batch."""
  return int(config.train_steps) // max(1, int(config.rl.num_iterations))


def total_updates(config) -> int:
  """Optimizer updates of the whole run: the learning-rate schedule's length (unless set explicitly)."""
  return total_steps(config) * updates_per_step(config)


def schedule_updates(config) -> int:
  """The learning-rate schedule's length in optimizer updates: the run's update count (`total_updates`: mu *
  batch_size / mini_batch_size per RL step; MaxText's `train_steps` when each batch gets one update per iteration),
  unless `learning_rate_schedule_steps` is set deliberately (MaxText's rule: a positive value different from `steps`,
  which the validator fills in when unset). It depends on num_batches: a resume that asks for more steps stretches it.
  """
  sched_steps = config.learning_rate_schedule_steps
  explicit = sched_steps and sched_steps > 0 and sched_steps not in (config.steps, config.train_steps)
  return int(sched_steps) if explicit else total_updates(config)


def schedule_change(config, meta: dict) -> str | None:
  """A notice when this run's learning-rate schedule is not the one the checkpoint's steps trained on.

  Asking a resumed run for more steps (num_batches) stretches the warmup + cosine schedule, which is sized by the
  run's update count: a legitimate way to extend a run, but not the run an uninterrupted job would have been, so it
  is said, with the key that keeps the old schedule. (Resuming with the same schedule continues bit for bit.)
  """
  was, now = meta.get("lr_schedule_updates"), schedule_updates(config)
  if was is None or was == now:
    return None
  return (
      f"note: the learning-rate schedule now spans {now} optimizer updates, not the {was} the checkpoint's steps "
      f"trained on (num_batches changed): later steps follow the new schedule; learning_rate_schedule_steps={was} "
      "keeps the old one"
  )


# Keys that change the update (the loss, the optimizer, the rewards, the sampling of rollouts) but not which examples a
# step trains on. A resume may change them (a lower learning rate for the rest of a run is a common, legitimate
# choice), and each change is said in one `note:` line naming the key, the checkpoint's value and the new one
# (`update_changes`), so a resumed run is never silently another run. Keys that change which examples batch k holds are
# refused instead (run_identity.identity, `resume_invariants`). MaxText's keys here; a plugin key's rule is in its field.
_MAXTEXT_UPDATE_KEYS = (
    "learning_rate",
    "learning_rate_final_fraction",
    "warmup_steps_fraction",
    "adam_b1",
    "adam_b2",
    "adam_eps",
    "adam_weight_decay",
    "gradient_clipping_threshold",
    "rl.grpo_beta",
    "rl.grpo_epsilon",
    "rl.epsilon_high",
    "rl.loss_agg_mode",
    "rl.use_rollout_logps",
    "rl.off_policy_steps",
    "rl.force_on_policy_ratio",
    "load_balance_loss_weight",
    "moe_use_megatron_seq_aux_loss",
    "adam_eps_root",
    "rl.use_agentic_rollout",
    "decode_sampling_temperature",
    "decode_sampling_top_k",
    "decode_sampling_nucleus_p",
    "stop_strings",
    "max_target_length",
    "reward_functions",
    "reward_functions_path",
    "reward_exact_answer",
    "reward_white_space_format_match",
    "reward_exact_format_match",
    "reward_partial_format_match",
    "reward_ratio_guess_to_answer_high",
    "reward_ratio_guess_to_answer_low",
    "penalty_incorrect_format",
    "penalty_incorrect_answer",
)
# ... and the plugin's keys whose field says `noted` (config/rules.py).
UPDATE_KEYS = (*_MAXTEXT_UPDATE_KEYS, *rules.resume_keys(key_rule.NOTED))
# Keys of the update's concerns (the rl: block, the loss, the optimizer, the rewards, the rollout) that a resume may
# change without a note, with why (MaxText's here, the plugin's in their fields); tests/test_bad_input.py fails when
# such a key is in none of UPDATE_KEYS, `resume_invariants` (refused on resume) and this table.
RESUME_EXEMPT = {
    "learning_rate_schedule_steps": "schedule_change notes a schedule that changes length",
    "math_verify_num_procs": "how many processes verify answers, not what they reward",
    "rl.log_sampler_trainer_agreement": "a metric, not the update",
    "rl.reshard_chunk_size": "how the weights move to the sampler, not which",
    **rules.resume_exempt(),  # the plugin's keys: their fields say why (`exempt: ...`)
}


def _dotted(config, key: str) -> Any:
  """The value of a dotted key (`rl.grpo_beta`)."""
  value = config
  for part in key.split("."):
    value = getattr(value, part)
  return value


def position_keys(config) -> dict[str, Any]:
  """The keys the data position of a checkpoint is counted in (`checkpoint_meta` stores them under these names): a
  resume that changes one is refused before any model is built, and again at the restore (`check_resume_invariants`)."""
  return {
      "batch_size": int(config.batch_size),
      "num_generations": int(config.rl.num_generations),
      "data_shuffle_seed": int(config.data_shuffle_seed),
      "dataset": config.train_data_path or config.dataset_name,
  }


def resume_invariants(config) -> dict[str, Any]:
  """What a resume may not change, under the names `checkpoint_meta` stores them: the data position (`position_keys`), the
  loss, the rollout seed, the optimizer updates per step, the tokenizer (its ids are what the weights were trained on)
  and the dtype the weights are kept and saved in. Light: the first pass (`train_rl._precheck`) compares them on the
  config as written, before any model is built; the restore (run/resume.py) compares them again with the checkpoint it
  restores."""
  return {
      **position_keys(config),
      "loss_algo": config.rl.loss_algo,
      "rollout_seed": int(config.rollout_seed),
      "updates_per_step": updates_per_step(config),
      "tokenizer": config_files.tokenizer_identity(config.tokenizer_path),
      "weight_dtype": str(getattr(config.weight_dtype, "name", config.weight_dtype)),  # the typed config's np.dtype
  }


# An invariant's key as the user writes it, and why a resume may not change it (default: the data position's reason).
_SHOWN_INVARIANT = {
    "num_generations": "rl.num_generations",
    "loss_algo": "rl.loss_algo",
    "updates_per_step": "rl.num_iterations * batch_size / rl.mini_batch_size",
    "tokenizer": "tokenizer_path",
}
_DATA_POSITION = (
    "the checkpoint's data position (batch k = the prompts after k batches of this size and order) would mean other "
    "prompts"
)
_WHY_INVARIANT = {
    "loss_algo": "the checkpoint's steps were trained with it, and its learning-rate schedule and sampling seeds are "
    "counted in them",
    "rollout_seed": "the checkpoint's steps were trained with it, and its learning-rate schedule and sampling seeds are "
    "counted in them",
    "updates_per_step": "the checkpoint's steps were trained with it, and its learning-rate schedule and sampling seeds "
    "are counted in them",
    "tokenizer": "the checkpoint's weights were trained on that tokenizer's ids, and another tokenizer would feed them "
    "other tokens",
    "weight_dtype": "the checkpoint's weights and optimizer state were kept in that precision; resuming would round "
    "them and save every later step in the new one",
}


def check_resume_invariants(config, run_dir: str, meta: dict[str, Any] | None = None) -> None:
  """Refuse (one line) a resume that changes a `resume_invariants` key; `meta`: the newest readable checkpoint's
  metadata (read here when None; nothing to compare without a checkpoint)."""
  if meta is None:
    directory = value_or(config, "checkpoint_dir", None) or os.path.join(run_dir, "checkpoints")
    steps = run_identity.checkpoint_steps(directory)
    meta = next((m for m in (run_identity.read_meta(directory, s) for s in steps) if m is not None), None)
    if meta is None:
      return
  for key, value in resume_invariants(config).items():
    if key in meta and meta[key] != value:  # a checkpoint written before a key was recorded is not compared on it
      shown = _SHOWN_INVARIANT.get(key, key)
      if key == "tokenizer":  # the identity is a digest: name the path the user gave
        value = f"{config.tokenizer_path} ({value})"
      why = _WHY_INVARIANT.get(key, _DATA_POSITION)
      raise CheckpointError(
          f"cannot resume {run_dir}: its checkpoints were written with {shown}={meta[key]!r} but this run has "
          f"{shown}={value!r}; {why}: restore the setting or use a new run_name"
      )


def update_values(config) -> dict[str, Any]:
  """`UPDATE_KEYS` and their values as JSON holds them (stored in every checkpoint's metadata)."""
  return json.loads(json.dumps({k: _dotted(config, k) for k in UPDATE_KEYS}, default=str))


def update_changes(config, meta: dict[str, Any]) -> list[str]:
  """One `note:` line per `UPDATE_KEYS` key whose value differs from the checkpoint's (none for checkpoints written
  before the values were recorded)."""
  was = meta.get("update_keys")
  if not isinstance(was, dict):
    return []
  step = meta.get("step", "?")
  notes = []
  for key, value in update_values(config).items():
    if key in was and was[key] != value:
      notes.append(
          f"note: resuming with {key}={value!r}, not the {was[key]!r} of the checkpoint's steps (1-{step}): the "
          "steps from here use the new value"
      )
  return notes


def _shown(key: str, value: Any) -> str:
  """An identity entry as the refusal names it (`key=value`, a block's keys one by one)."""
  if key == "synthetic" and isinstance(value, dict):
    return ", ".join(f"{k}={v}" for k, v in value.items())
  if key == "model_shape" and isinstance(value, dict):
    return ", ".join(f"{k}={v}" for k, v in value.items())
  if key == "lora" and isinstance(value, dict):
    return ", ".join(f"lora.{k}={v!r}" for k, v in value.items())
  if key in ("train_data_digest", "eval_data_digest"):
    return f"{key.split('_digest')[0]}_path content digest {value}"
  if key in ("hub_data", "prompt") and isinstance(value, dict):
    return ", ".join(f"{k}={v!r}" for k, v in value.items())
  return f"{key}={value!r}"


def check_rerun(config, run_dir: str, asked_steps: int) -> None:
  """Refuse (one line, nothing written) a rerun that asks to stop before the newest checkpoint, or whose model or
  data differ from the newest checkpoint's (see the module docstring)."""
  directory = run_identity.checkpoint_dir(config, run_dir)
  # A step directory whose metadata does not read (an empty `5/`, a torn or tampered checkpoint) is not a step the run
  # trained to: the restore sets it aside, so it neither refuses a rerun nor decides what is compared.
  steps = run_identity.checkpoint_steps(directory)
  readable = [(s, m) for s, m in ((s, run_identity.read_meta(directory, s)) for s in steps) if m is not None]
  if not readable:
    run_identity.check_overwrite(config, run_dir)
    return
  newest, meta = readable[0]
  if newest > asked_steps:
    raise CheckpointError(
        f"{run_dir} already trained {newest} RL steps (checkpoint step {newest} in {directory}) and this run asks for "
        f"{asked_steps} (num_batches); nothing was changed: ask for at least {newest} steps to continue it, or use a "
        "new run_name"
    )
  run_dir_lib.check_resumed_metrics_file(
      run_dir_lib.resolve_metrics_file(config.metrics_file, run_dir), run_dir, meta.get("metrics_file"), newest
  )
  check_resume_invariants(config, run_dir, meta)
  now = run_identity.identity(config)
  for key, value in now.items():
    if key in meta and meta[key] != json.loads(json.dumps(value)):
      raise CheckpointError(
          f"cannot resume {run_dir}: its checkpoints were written with {_shown(key, meta[key])} but this run has "
          f"{_shown(key, value)}; the run would continue on another model or other examples: restore the setting "
          "or use a new run_name"
      )


def preflight(config, checked_paths: tuple | None = None) -> None:
  """The run's path checks, before the trainer's imports (JAX backends, MaxText models, Tunix: seconds on a loaded
  machine): inputs exist, outputs writable, and no rerun that would rewrite a finished run or resume another model
  or data. `checked_paths`: the `path_values` the first pass (train_rl._precheck) already checked the inputs and
  outputs with; when the typed config reads the same, those checks are not run again."""
  if checked_paths is None or run_identity.path_values(config) != checked_paths:
    run_identity.check_inputs(config)
    run_identity.check_outputs(config)
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  check_rerun(config, run_dir, total_steps(config))


def checkpoint_meta(config, step: int, extra: dict | None = None) -> dict:
  """The metadata every checkpoint holds (Orbax's JSON item `meta`): the data position, what a resume may not change
  (`resume_invariants`), the update keys a resume notes, the schedule's length, the metrics file, the run's identity
  (run_identity.identity: model and data), and `extra` (the run's own: eval_before, the prompt position)."""
  per_step = updates_per_step(config)
  return {
      "step": step,
      "next_batch_index": step,  # batches are indexed by step: batch k is trained at step k + 1
      "optimizer_updates": step * per_step,
      **resume_invariants(config),  # batch_size, num_generations, updates_per_step, dataset, loss_algo, ...
      "lr_schedule_updates": schedule_updates(config),
      "update_keys": update_values(config),  # resume notes: update_changes
      "metrics_file": _metrics_path(config),  # the file this run's records go to (run_dir.check_resumed_metrics_file)
      **run_identity.identity(config),
      **(extra or {}),
  }


def _metrics_path(config) -> str | None:
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  path = run_dir_lib.resolve_metrics_file(config.metrics_file, run_dir)
  return storage.absolute(path) if path else path
