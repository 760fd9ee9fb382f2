"""What a run is, compared before a rerun touches it: the model it trains and the examples it trains on.

A checkpoint's metadata holds `identity(config)`: the model (its name and shape), the LoRA adapters it holds, and
whatever decides which examples batch k holds (the dataset, the synthetic task's seed and ranges, a digest of each
local data file, the prompt budget that filters long prompts). `check_rerun`, called before any model is built,
reads the newest checkpoint's metadata straight from disk (`<step>/meta/metadata`, Orbax's JSON item) and refuses
in one line:

* a run asked to stop before where it already is (a rerun of a finished 2-step run with `num_batches=1`): nothing
  is rewritten, no summary, no plot, no record;
* a resume whose model or data would differ from the checkpoint's: it would continue silently on other examples,
  or fail deep inside Orbax's restore.

Keys a checkpoint written before a key existed does not hold are not compared.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import key_rule
from maxtext_rl_plugin.config import rules
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin.data import prompts
from maxtext_rl_plugin.data import rows
from maxtext_rl_plugin.errors import CheckpointError
from maxtext_rl_plugin.errors import ConfigError

_DIGEST_BYTES = 1 << 20  # a data file's digest reads its size and first MiB: cheap for a GB Parquet, still exact enough
_MODEL_KEYS = ("emb_dim", "mlp_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size")
_HUB_KEYS = ("dataset_name", "hf_subset", "train_split", "eval_dataset_name", "eval_split")
_SYNTHETIC_KEYS = (
    "synthetic_seed",
    "synthetic_min_steps",
    "synthetic_max_steps",
    "synthetic_max_value",
    "synthetic_num_eval",
)


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, version: str) -> str:
  """Size and first MiB of a file (storage.version, size and modification, is the cache key: a changed file is read
  again)."""
  h = hashlib.sha256(version.split(":", 1)[0].encode())
  h.update(storage.read_head(path, _DIGEST_BYTES))
  return h.hexdigest()[:16]


def data_digest(spec: str) -> str | None:
  """Digest of the file(s) a comma-separated path/glob spec names, local or in a bucket (None: no spec, or a file
  that cannot be read: the data loader reports it in its own words)."""
  if not spec:
    return None
  h = hashlib.sha256()
  try:
    for part in (p.strip() for p in spec.split(",")):
      for path in storage.glob(part) if any(c in part for c in "*?[") else [part]:
        h.update(f"{os.path.basename(path)}:{_file_digest(path, storage.version(path))};".encode())
  except OSError:
    return None
  return h.hexdigest()[:16]


def _template_digest(config) -> str | None:
  """Digest of the prompt template's content (the file data_template_path resolves to, or the built-in one)."""
  try:
    tpl = prompts.load_template(config.data_template_path or "")
  except ConfigError:
    return None  # unreadable: the data loader says so in its own words
  return hashlib.sha256(json.dumps(tpl, sort_keys=True).encode()).hexdigest()[:16]


def identity(config) -> dict[str, Any]:
  """The model and data identity of a run, stored in every checkpoint's metadata and compared on resume.

  Every key that defines the examples batch k holds: the source (a local file's digest, the hub dataset and its split,
  or the synthetic task), the eval set (its questions are kept out of training), and the prompt text each example is
  trained with (the template, the chat template switch, the tags)."""
  out: dict[str, Any] = {
      "model_name": config.model_name,
      "model_shape": {k: int(getattr(config, k)) for k in _MODEL_KEYS},
      "lora": lora_keys(config),
      "max_prefill_predict_length": int(config.max_prefill_predict_length),
      "train_data_digest": data_digest(config.train_data_path),
      "eval_data_digest": data_digest(config.eval_data_path),
      "hub_data": {k: str(getattr(config, k, "") or "") for k in _HUB_KEYS},
      "prompt": {
          "template_digest": _template_digest(config),
          "use_chat_template": bool(config.use_chat_template),
          "reasoning_start_token_in_prompt": bool(config.reasoning_start_token_in_prompt),
          **prompts.tag_tokens(config),
      },
  }
  if not config.train_data_path and config.dataset_name == "synthetic":
    out["synthetic"] = {k: int(getattr(config, k)) for k in _SYNTHETIC_KEYS}
    out["synthetic_task"] = str(config.synthetic_task)
  return out


# Keys that change the update (the loss, the optimizer, the rewards, the sampling of rollouts) but not which examples a
# step trains on. A resume may change them (a lower learning rate for the rest of a run is a common, legitimate
# choice), and each change is said in one `note:` line naming the key, the checkpoint's value and the new one
# (`update_changes`), so a resumed run is never silently another run. Keys that change which examples batch k holds are
# refused instead (`identity`, `resume_invariants`). MaxText's keys here; a plugin key's rule is in its field.
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
    "learning_rate_schedule_steps": "resume.schedule_change notes a schedule that changes length",
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
  """The keys the data position of a checkpoint is counted in (resume._meta stores them under these names): a resume
  that changes one is refused before any model is built (resume._RESUME_INVARIANTS checks them again at restore)."""
  return {
      "batch_size": int(config.batch_size),
      "num_generations": int(config.rl.num_generations),
      "data_shuffle_seed": int(config.data_shuffle_seed),
      "dataset": config.train_data_path or config.dataset_name,
  }


def tokenizer_identity(path: Any) -> str:
  """What makes a tokenizer another one: a local tokenizer directory's content (each file's name and digest, so the
  same tokenizer found at another path is the same), else the hub id as written."""
  resolved = config_files.resolved_tokenizer_path(path)
  if not isinstance(resolved, str) or "://" in resolved or not os.path.isdir(os.path.expanduser(resolved)):
    return str(path)
  root = os.path.expanduser(resolved)
  h = hashlib.sha256()
  for name in sorted(os.listdir(root)):
    full = os.path.join(root, name)
    if os.path.isfile(full):
      h.update(f"{name}:{_file_digest(full, storage.version(full))};".encode())
  return f"files {h.hexdigest()[:16]}"


def resume_invariants(config) -> dict[str, Any]:
  """What a resume may not change, under the names resume._meta stores them: the data position (`position_keys`), the
  loss, the rollout seed, the optimizer updates per step, the tokenizer (its ids are what the weights were trained on)
  and the dtype the weights are kept and saved in. Light: the first pass (`train_rl._precheck`) compares them on the
  config as written, before any model is built; the restore (run/resume.py) compares them again with the checkpoint it
  restores."""
  b, rl = int(config.batch_size), config.rl
  mini = value_or(rl, "mini_batch_size", None)  # unset as written: the schema's default, None (= batch_size)
  mini = b if mini is None or int(mini) <= 0 else int(mini)
  return {
      **position_keys(config),
      "loss_algo": rl.loss_algo,
      "rollout_seed": int(config.rollout_seed),
      "updates_per_step": int(rl.num_iterations) * (b // mini),
      "tokenizer": tokenizer_identity(config.tokenizer_path),
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
    meta = next((m for m in (read_meta(directory, s) for s in checkpoint_steps(directory)) if m is not None), None)
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


def lora_keys(config) -> dict[str, Any]:
  """The `lora:` keys that decide what a checkpoint's adapters are and how they merge (export_lora reads them)."""
  lo = config.lora
  return {
      "enable_lora": bool(lo.enable_lora),
      "lora_rank": int(lo.lora_rank),
      "lora_alpha": float(lo.lora_alpha),
      "lora_module_path": str(lo.lora_module_path),
  }


def checkpoint_dir(config, run_dir: str) -> str:
  """Where the run's checkpoints live (MaxText derives checkpoint_dir from base_output_directory/run_name)."""
  return config.checkpoint_dir or os.path.join(run_dir, "checkpoints")


def checkpoint_steps(directory: str) -> list[int]:
  """Complete checkpoint steps on disk, newest first (Orbax renames `<step>.orbax-checkpoint-tmp-*` when done;
  set-aside corrupt steps are `<step>.corrupt-*`), without importing Orbax."""
  try:
    names = storage.listdir(directory)
  except OSError:
    return []
  return sorted((int(n) for n in names if n.isdigit() and storage.isdir(os.path.join(directory, n))), reverse=True)


def read_meta(directory: str, step: int) -> dict[str, Any] | None:
  """The JSON metadata item of a checkpoint step, or None when it is missing or unreadable (a corrupt step: the
  restore sets it aside and says so)."""
  try:
    meta = json.loads(storage.read_text(os.path.join(directory, str(step), "meta", "metadata")))
  except (OSError, ValueError):
    return None
  return meta if isinstance(meta, dict) else None


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
  directory = checkpoint_dir(config, run_dir)
  # A step directory whose metadata does not read (an empty `5/`, a torn or tampered checkpoint) is not a step the run
  # trained to: the restore sets it aside, so it neither refuses a rerun nor decides what is compared.
  readable = [(s, m) for s, m in ((s, read_meta(directory, s)) for s in checkpoint_steps(directory)) if m is not None]
  if not readable:
    check_overwrite(config, run_dir)
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
  now = identity(config)
  for key, value in now.items():
    if key in meta and meta[key] != json.loads(json.dumps(value)):
      raise CheckpointError(
          f"cannot resume {run_dir}: its checkpoints were written with {_shown(key, meta[key])} but this run has "
          f"{_shown(key, value)}; the run would continue on another model or other examples: restore the setting "
          "or use a new run_name"
      )


def check_overwrite(config, run_dir: str) -> None:
  """A run without checkpoints to resume from (enable_checkpointing=false) would start over in `run_dir`, replacing a
  finished run's records, summary, plot and batches: refused in one line unless `overwrite_run=true` asks for it."""
  summary = os.path.join(run_dir, "summary.json")
  if value_or(config, "overwrite_run") is True or not storage.isfile(summary):
    return
  raise CheckpointError(
      f"{run_dir} holds a finished run (its summary.json) and no checkpoint to resume from (enable_checkpointing="
      f"{value_or(config, 'enable_checkpointing')}); this run would start over and replace its records, summary and "
      "plot: use a new run_name, or overwrite_run=true to replace them"
  )


def total_steps(config) -> int:
  """RL steps the run asks for (run.build.num_rl_steps): MaxText's train_steps counts one update per iteration."""
  return int(config.train_steps) // max(1, int(config.rl.num_iterations))


def _local(path: Any) -> bool:
  return isinstance(path, str) and bool(path) and "://" not in path


def check_load_parameters_path(path: Any) -> None:
  """One line instead of MaxText's traceback for a missing local base checkpoint."""
  if _local(path) and not storage.exists(path):
    raise CheckpointError(f"invalid value for 'load_parameters_path'='{path}': no such checkpoint directory")


def check_inputs(config) -> None:
  """The local files a run reads exist: data files (the data loader's own checks, `rows.check_file_rows`: they exist
  and hold a usable row), the prompt template (`prompts.load_template`), the base checkpoint, and a tokenizer_path
  written as a local path (absolute, `./`, `../`, `~`; `org/name` may be a hub id), which has no more token ids than
  vocab_size. `config` may be a `validation.RawConfig` (a key it cannot type is skipped)."""
  for key in ("train_data_path", "eval_data_path"):
    spec = value_or(config, key)
    if isinstance(spec, str) and spec:  # local files and objects in a bucket alike (storage)
      rows.check_file_rows(spec, key)  # they exist and a local file holds a usable row (the loader's refusals)
  check_load_parameters_path(value_or(config, "load_parameters_path"))
  template = value_or(config, "data_template_path")
  if isinstance(template, str) and template:
    prompts.load_template(template)  # every prompt is built from it (the system prompt, with or without chat)
  tokenizer = value_or(config, "tokenizer_path")
  if _local(tokenizer) and tokenizer.startswith(("/", "./", "../", "~")):
    if not os.path.exists(os.path.expanduser(tokenizer)):
      raise ConfigError(f"invalid value for 'tokenizer_path'='{tokenizer}': no such directory")
  # More token ids than embedding rows: read from a local tokenizer.json here, from the loaded tokenizer otherwise
  # (models.load_tokenizer), before any model is built either way.
  config_files.check_tokenizer_fits(tokenizer, config_files.tokenizer_size(tokenizer), value_or(config, "vocab_size"))


_INPUT_KEYS = ("train_data_path", "eval_data_path", "data_template_path", "reward_functions_path", "tokenizer_path")


def check_outputs(config) -> None:
  """Every output has one owner (`run_dir.check_owners`), and the run directory and the metrics file can be written
  (`run_dir.check_writable`); a `RawConfig` that cannot type metrics_file probes the directory alone."""
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  metrics_file = run_dir_lib.resolve_metrics_file(value_or(config, "metrics_file"), run_dir)
  run_dirs = {
      "checkpoint_dir": value_or(config, "checkpoint_dir") or os.path.join(run_dir, "checkpoints"),
      "tensorboard_dir": value_or(config, "tensorboard_dir") or os.path.join(run_dir, "tensorboard"),
  }
  inputs = {k: v for k in _INPUT_KEYS if isinstance(v := value_or(config, k), str)}
  run_dir_lib.check_owners(metrics_file, run_dir, run_dirs, inputs)
  run_dir_lib.check_writable(run_dir, metrics_file)


# Every key check_inputs and check_outputs read: equal values, equal verdicts (the checks read nothing else).
PATH_KEYS = (
    "base_output_directory",
    "run_name",
    "metrics_file",
    "checkpoint_dir",
    "tensorboard_dir",
    "load_parameters_path",
    *_INPUT_KEYS,
)


def path_values(config) -> tuple:
  """The values of PATH_KEYS as the checks read them: unset (or, in a first-pass view, not typed yet) as None, and the
  checkpoint and TensorBoard directories as the paths check_outputs resolves (MaxText derives the typed config's from
  the run directory, with a trailing '/')."""
  run_dir = os.path.join(str(value_or(config, "base_output_directory") or ""), str(value_or(config, "run_name") or ""))
  resolved = {"checkpoint_dir": "checkpoints", "tensorboard_dir": "tensorboard"}

  def read(key):
    value = value_or(config, key)
    if key in resolved:
      return os.path.normpath(value or os.path.join(run_dir, resolved[key]))
    if key == "tokenizer_path":  # a shipped tokenizer's name: the typed config holds its absolute path
      value = config_files.resolved_tokenizer_path(value)
    return value or None

  return tuple(read(k) for k in PATH_KEYS)


def preflight(config, checked_paths: tuple | None = None) -> None:
  """The run's path checks, before the trainer's imports (JAX backends, MaxText models, Tunix: seconds on a loaded
  machine): inputs exist, outputs writable, and no rerun that would rewrite a finished run or resume another model
  or data. `checked_paths`: the `path_values` the first pass (train_rl._precheck) already checked the inputs and
  outputs with; when the typed config reads the same, those checks are not run again."""
  if checked_paths is None or path_values(config) != checked_paths:
    check_inputs(config)
    check_outputs(config)
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  check_rerun(config, run_dir, total_steps(config))
