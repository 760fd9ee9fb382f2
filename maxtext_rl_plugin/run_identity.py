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
import glob
import hashlib
import json
import os
from typing import Any

from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin.data import prompts
from maxtext_rl_plugin.data import rows
from maxtext_rl_plugin.errors import CheckpointError
from maxtext_rl_plugin.errors import ConfigError

_DIGEST_BYTES = 1 << 20  # a data file's digest reads its size and first MiB: cheap for a GB Parquet, still exact enough
_MODEL_KEYS = ("emb_dim", "mlp_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size")
_SYNTHETIC_KEYS = (
    "synthetic_seed",
    "synthetic_min_steps",
    "synthetic_max_steps",
    "synthetic_max_value",
    "synthetic_num_eval",
)


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
  del mtime_ns  # cache key only
  h = hashlib.sha256(str(size).encode())
  with open(path, "rb") as f:
    h.update(f.read(_DIGEST_BYTES))
  return h.hexdigest()[:16]


def data_digest(spec: str) -> str | None:
  """Digest of the local file(s) a comma-separated path/glob spec names (None: no spec, or remote files)."""
  if not spec or "://" in spec:
    return None
  h = hashlib.sha256()
  for part in (p.strip() for p in spec.split(",")):
    for path in sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]:
      try:
        st = os.stat(path)
        h.update(f"{os.path.basename(path)}:{_file_digest(path, st.st_size, st.st_mtime_ns)};".encode())
      except OSError:
        return None  # unreadable: the data loader reports it in its own words
  return h.hexdigest()[:16]


def identity(config) -> dict[str, Any]:
  """The model and data identity of a run, stored in every checkpoint's metadata and compared on resume."""
  out: dict[str, Any] = {
      "model_name": config.model_name,
      "model_shape": {k: int(getattr(config, k)) for k in _MODEL_KEYS},
      "lora": lora_keys(config),
      "max_prefill_predict_length": int(config.max_prefill_predict_length),
      "train_data_digest": data_digest(config.train_data_path),
  }
  if not config.train_data_path and config.dataset_name == "synthetic":
    out["synthetic"] = {k: int(getattr(config, k)) for k in _SYNTHETIC_KEYS}
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
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted((int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n))), reverse=True)


def read_meta(directory: str, step: int) -> dict[str, Any] | None:
  """The JSON metadata item of a checkpoint step, or None when it is missing or unreadable (a corrupt step: the
  restore sets it aside and says so)."""
  try:
    with open(os.path.join(directory, str(step), "meta", "metadata"), encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  return meta if isinstance(meta, dict) else None


def _shown(key: str, value: Any) -> str:
  if key == "synthetic" and isinstance(value, dict):
    return ", ".join(f"{k}={v}" for k, v in value.items())
  if key == "model_shape" and isinstance(value, dict):
    return ", ".join(f"{k}={v}" for k, v in value.items())
  if key == "lora" and isinstance(value, dict):
    return ", ".join(f"lora.{k}={v!r}" for k, v in value.items())
  if key == "train_data_digest":
    return f"train_data_path content digest {value}"
  return f"{key}={value!r}"


def check_rerun(config, run_dir: str, asked_steps: int) -> None:
  """Refuse (one line, nothing written) a rerun that asks to stop before the newest checkpoint, or whose model or
  data differ from the newest checkpoint's (see the module docstring)."""
  directory = checkpoint_dir(config, run_dir)
  # A step directory whose metadata does not read (an empty `5/`, a torn or tampered checkpoint) is not a step the run
  # trained to: the restore sets it aside, so it neither refuses a rerun nor decides what is compared.
  readable = [(s, m) for s, m in ((s, read_meta(directory, s)) for s in checkpoint_steps(directory)) if m is not None]
  if not readable:
    return
  newest, meta = readable[0]
  if newest > asked_steps:
    raise CheckpointError(
        f"{run_dir} already trained {newest} RL steps (checkpoint step {newest} in {directory}) and this run asks for "
        f"{asked_steps} (num_batches); nothing was changed: ask for at least {newest} steps to continue it, or use a "
        "new run_name"
    )
  now = identity(config)
  for key, value in now.items():
    if key in meta and meta[key] != json.loads(json.dumps(value)):
      raise CheckpointError(
          f"cannot resume {run_dir}: its checkpoints were written with {_shown(key, meta[key])} but this run has "
          f"{_shown(key, value)}; the run would continue on another model or other examples: restore the setting "
          "or use a new run_name"
      )


def total_steps(config) -> int:
  """RL steps the run asks for (run.build.num_rl_steps): MaxText's train_steps counts one update per iteration."""
  return int(config.train_steps) // max(1, int(config.rl.num_iterations))


def _local(path: Any) -> bool:
  return isinstance(path, str) and bool(path) and "://" not in path


def check_load_parameters_path(path: Any) -> None:
  """One line instead of MaxText's traceback for a missing local base checkpoint."""
  if _local(path) and not os.path.exists(path):
    raise CheckpointError(f"invalid value for 'load_parameters_path'='{path}': no such checkpoint directory")


def check_inputs(config) -> None:
  """The local files a run reads exist: data files (the data loader's own check, `rows.expand_paths`), the prompt
  template (`prompts.load_template`), the base checkpoint, and a tokenizer_path written as a local path (absolute,
  `./`, `../`, `~`; `org/name` may be a hub id). `config` may be a `validation.RawConfig` (a key it cannot type is
  skipped)."""
  for key in ("train_data_path", "eval_data_path"):
    spec = getattr(config, key, None)
    if _local(spec):
      rows.expand_paths(spec, key)
  check_load_parameters_path(getattr(config, "load_parameters_path", None))
  template = getattr(config, "data_template_path", None)
  if isinstance(template, str) and template:
    prompts.load_template(template)  # every prompt is built from it (the system prompt, with or without chat)
  tokenizer = getattr(config, "tokenizer_path", None)
  if _local(tokenizer) and tokenizer.startswith(("/", "./", "../", "~")):
    if not os.path.exists(os.path.expanduser(tokenizer)):
      raise ConfigError(f"invalid value for 'tokenizer_path'='{tokenizer}': no such directory")


def check_outputs(config) -> None:
  """The run directory and the metrics file can be written (`run_dir.check_writable`; a `RawConfig` that cannot
  type metrics_file probes the directory alone)."""
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  metrics_file = getattr(config, "metrics_file", None)
  run_dir_lib.check_writable(run_dir, run_dir_lib.resolve_metrics_file(metrics_file, run_dir))


def preflight(config) -> None:
  """The run's path checks, before the trainer's imports (JAX backends, MaxText models, Tunix: seconds on a loaded
  machine): inputs exist, outputs writable, and no rerun that would rewrite a finished run or resume another model
  or data."""
  check_inputs(config)
  check_outputs(config)
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  check_rerun(config, run_dir, total_steps(config))
