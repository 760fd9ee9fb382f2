"""What a run is, compared before a rerun touches it: the model it trains and the examples it trains on.

A checkpoint's metadata holds `identity(config)`: the model (its name and shape), the LoRA adapters it holds, and
whatever decides which examples batch k holds (the dataset, the synthetic task's seed and ranges, a digest of each
local data file, the prompt budget that filters long prompts). `run/meta.check_rerun`, called before any model is
built, reads the newest checkpoint's metadata straight from disk (`read_meta`: `<step>/meta/metadata`, Orbax's JSON
item) and refuses a resume whose model or data would differ from the checkpoint's (it would continue silently on other
examples, or fail deep inside Orbax's restore). Keys a checkpoint written before a key existed does not hold are not
compared. Also here: the run's input and output path checks (`check_inputs`, `check_outputs`, `path_values`).

In `run/` (a room the whole config may reach) because each function here guards or records the run as a whole: the
identity reads some twenty keys of every concern (the model, LoRA, the data source, the prompt), and the path checks
read every path key, on the typed config or on the first pass's `validation.RawConfig` (a key it cannot type is
skipped), so no one room's settings object holds what they read. run/meta.py owns the rest of the run's metadata
(counts, resume rules) and calls these; the file digests and the tokenizer's identity, which lower rooms need too,
are config/files.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin.data import prompts
from maxtext_rl_plugin.data import rows
from maxtext_rl_plugin.errors import CheckpointError
from maxtext_rl_plugin.errors import ConfigError

_MODEL_KEYS = ("emb_dim", "mlp_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size")
_HUB_KEYS = ("dataset_name", "hf_subset", "train_split", "eval_dataset_name", "eval_split")
_SYNTHETIC_KEYS = (
    "synthetic_seed",
    "synthetic_min_steps",
    "synthetic_max_steps",
    "synthetic_max_value",
    "synthetic_num_eval",
)


def data_digest(spec: str) -> str | None:
  """Digest of the file(s) a comma-separated path/glob spec names, local or in a bucket (None: no spec, or a file
  that cannot be read: the data loader reports it in its own words)."""
  if not spec:
    return None
  h = hashlib.sha256()
  try:
    for part in (p.strip() for p in spec.split(",")):
      for path in storage.glob(part) if any(c in part for c in "*?[") else [part]:
        h.update(f"{os.path.basename(path)}:{config_files.file_digest(path, storage.version(path))};".encode())
  except OSError:
    return None
  return h.hexdigest()[:16]


def _template_digest(template_path: str) -> str | None:
  """Digest of the prompt template's content (the file data_template_path resolves to, or the built-in one)."""
  try:
    tpl = prompts.load_template(template_path)
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
          "template_digest": _template_digest(config.data_template_path or ""),
          "use_chat_template": bool(config.use_chat_template),
          "reasoning_start_token_in_prompt": bool(config.reasoning_start_token_in_prompt),
          **prompts.tag_tokens(prompts.PromptSettings.from_config(config)),
      },
  }
  if not config.train_data_path and config.dataset_name == "synthetic":
    out["synthetic"] = {k: int(getattr(config, k)) for k in _SYNTHETIC_KEYS}
    out["synthetic_task"] = str(config.synthetic_task)
  return out


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


def _local(path: Any) -> bool:
  return isinstance(path, str) and bool(path) and "://" not in path


def check_inputs(config) -> None:
  """The local files a run reads exist: data files (the data loader's own checks, `rows.check_file_rows`: they exist
  and hold a usable row), the prompt template (`prompts.load_template`), the base checkpoint, and a tokenizer_path
  written as a local path (absolute, `./`, `../`, `~`; `org/name` may be a hub id), which has no more token ids than
  vocab_size. `config` may be a `validation.RawConfig` (a key it cannot type is skipped)."""
  for key in ("train_data_path", "eval_data_path"):
    spec = value_or(config, key)
    if isinstance(spec, str) and spec:  # local files and objects in a bucket alike (storage)
      rows.check_file_rows(spec, key)  # they exist and a local file holds a usable row (the loader's refusals)
  config_files.check_load_parameters_path(value_or(config, "load_parameters_path"))
  template = value_or(config, "data_template_path")
  if isinstance(template, str) and template:
    prompts.load_template(template)  # every prompt is built from it (the system prompt, with or without chat)
  tokenizer = value_or(config, "tokenizer_path")
  if _local(tokenizer) and tokenizer.startswith(("/", "./", "../", "~")):
    if not os.path.exists(os.path.expanduser(tokenizer)):
      raise ConfigError(f"invalid value for 'tokenizer_path'='{tokenizer}': no such directory")
  # More token ids than embedding rows: read from a local tokenizer.json here, from the loaded tokenizer otherwise
  # (data/tokenizer.load_tokenizer), before any model is built either way.
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
