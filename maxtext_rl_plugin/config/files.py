"""The yml files of a config: the shipped configs, the `base_config` chain to MaxText's base.yml, model files.

The chain is read once, by the plugin (MaxText's `_load_config` looks only next to the file and in MaxText's own
configs, so `base_config: rl.yml` could not name the plugin's shipped rl.yml without a temporary copy of the user's
file, which may hold an `hf_access_token`). Light imports only: `config_precheck` reads the chain before JAX loads.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
from typing import Any

from maxtext.utils import globals as mt_globals
import omegaconf

from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config import key_status
from maxtext_rl_plugin.errors import CheckpointError
from maxtext_rl_plugin.errors import ConfigError

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # maxtext_rl_plugin/, above config/
CONFIGS_PACKAGE_DIR = os.path.join(_PACKAGE_DIR, "configs")


_REPO_CONFIGS_DIR = os.path.join(os.path.dirname(_PACKAGE_DIR), "configs")


def configs_dir() -> str:
  """Directory of the shipped yml files (inside the installed package, or the repo's configs/)."""
  for d in (CONFIGS_PACKAGE_DIR, _REPO_CONFIGS_DIR):
    if os.path.isfile(os.path.join(d, "rl.yml")):
      return d
  return _REPO_CONFIGS_DIR


def resolve_yml(path: str) -> str:
  """A yml path as given, or the shipped config of that name (`configs/rl.yml`, `rl.yml`, `rl`)."""
  if os.path.isfile(path):
    return os.path.abspath(path)
  if os.path.isdir(path):
    raise ConfigError(f"config file '{path}' is a directory; give a yml file (e.g. configs/rl.yml)")
  name = os.path.basename(path)
  if not name.endswith((".yml", ".yaml")):
    name += ".yml"
  packaged = os.path.join(configs_dir(), name)
  if os.path.isfile(packaged):
    return packaged
  raise ConfigError(f"config file '{path}' not found (nor a shipped config '{name}' in {configs_dir()})")


def _resolve_base(path: str, base: str) -> str:
  """Where `base_config: <base>` of `path` points: next to it, else a shipped plugin config, else MaxText's."""
  if os.path.isabs(base):
    return base
  for d in (os.path.dirname(path), configs_dir(), mt_globals.MAXTEXT_CONFIGS_DIR):
    cand = os.path.join(d, base)
    if os.path.isfile(cand):
      return cand
  return os.path.join(os.path.dirname(path), base)


def maxtext_configs_dir() -> str:
  """MaxText's configs directory, symlinks resolved."""
  return os.path.realpath(mt_globals.MAXTEXT_CONFIGS_DIR)


def is_maxtext_file(path: str) -> bool:
  """Whether `path` is one of MaxText's own configs (its keys are MaxText's, not checked by us)."""
  return os.path.realpath(path).startswith(maxtext_configs_dir() + os.sep)


def _yaml_problem(e: Exception) -> str:
  """What a YAML parser found wrong and where (`found duplicate key "run_name" (line 3)`), not only its context
  (`while constructing a mapping`)."""
  problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
  if problem and mark is not None:
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
  return str(e).splitlines()[0] if str(e) else type(e).__name__


def _read_yml(path: str, shown: str):
  """One yml file as an OmegaConf mapping, or a one-line error naming `shown` (the name the user gave)."""
  try:
    cfg = omegaconf.OmegaConf.load(path)
  except FileNotFoundError:
    raise ConfigError(f"config file '{shown}' not found") from None
  except OSError as e:  # OmegaConf's "Invalid loaded object type: int" for a yml that is a scalar
    raise ConfigError(f"config file '{shown}' must be a mapping of key: value ({str(e).splitlines()[0]})") from None
  except Exception as e:  # pylint: disable=broad-exception-caught  # yaml/omegaconf parse errors
    raise ConfigError(f"config file '{shown}' is not valid YAML: {_yaml_problem(e)}") from None
  if isinstance(cfg, omegaconf.ListConfig):
    raise ConfigError(f"config file '{shown}' must be a mapping of key: value, not a list")
  if not cfg:
    raise ConfigError(f"config file '{shown}' is empty; start it with 'base_config: rl.yml' and the keys to change")
  for block in key_status.NESTED_BLOCKS:
    if block in cfg and cfg[block] is not None and not isinstance(cfg[block], omegaconf.DictConfig):
      raise ConfigError(
          f"config file '{shown}': '{block}' must be a block of keys ({block}:\\n  key: value), got {cfg[block]!r}"
      )
  return cfg


def read_chain(given: str) -> list[tuple[str, Any]]:
  """`[(path, cfg), ...]` from the user's yml through its `base_config`s to MaxText's base.yml.

  We follow `base_config` ourselves (MaxText's `_load_config` looks only next to the file and in MaxText's own
  configs, so `base_config: rl.yml` could not name the plugin's shipped rl.yml without a temporary copy of the
  user's file -- which may hold an `hf_access_token`).
  """
  chain, path, shown, seen = [], resolve_yml(given), given, set()
  while True:
    if path in seen:
      raise ConfigError(f"config file '{shown}': base_config cycle through '{path}'")
    seen.add(path)
    cfg = _read_yml(path, shown)
    chain.append((path, cfg))
    base = cfg.get("base_config")
    if not base:
      break
    nxt = _resolve_base(path, str(base))
    if not os.path.isfile(nxt):
      raise ConfigError(f"config file '{base}' (base_config of '{shown}') not found")
    path, shown = nxt, str(base)
  if not any(is_maxtext_file(p) for p, _ in chain):
    raise ConfigError(
        f"config file '{given}' does not extend MaxText's configuration; add 'base_config: rl.yml' (the plugin's) "
        "or 'base_config: post_train/rl.yml' (MaxText's)"
    )
  return chain


def merge_chain(chain):
  """MaxText's merge order: the base first, each file nearer the user over it."""
  merged = omegaconf.OmegaConf.create({})
  for _, cfg in reversed(chain):
    merged = omegaconf.OmegaConf.merge(merged, cfg)
  return merged


def merged_chain(yml: str) -> dict[str, Any]:
  """The merged yml chain of `yml` as plain containers (values unresolved), before any pydantic processing."""
  return omegaconf.OmegaConf.to_container(merge_chain(read_chain(yml)), resolve=False)


def model_file_overrides(chain, raw: dict, overrides: list[str]) -> dict[str, Any]:
  """Keys of the plugin's own yml chain that the model file (configs/models/<model>.yml) also sets.

  MaxText applies the model file *over* the base yml, and `override_model_config=true` only lets
  command-line/kwargs keys win. A plugin yml such as cpu_tiny.yml that shrinks a named model must
  win too, so with `override_model_config: true` those keys are passed to pyconfig as kwargs.
  """
  cli = dict(a.split("=", 1) for a in overrides)
  if str(cli.get("override_model_config", raw.get("override_model_config", False))).lower() != "true":
    return {}
  model = str(cli.get("model_name", raw.get("model_name", "default"))).replace("-Instruct", "")
  model_file = os.path.join(maxtext_configs_dir(), "models", f"{model}.yml")
  if not os.path.isfile(model_file):
    return {}
  own: dict[str, Any] = {}
  for path, cfg in chain:  # nearest the user first: the first file that sets a key wins
    if is_maxtext_file(path):
      break
    for k, v in omegaconf.OmegaConf.to_container(cfg, resolve=False).items():
      own.setdefault(k, v)
  model_keys = omegaconf.OmegaConf.load(model_file).keys()
  return {k: own[k] for k in model_keys if k in own and k not in cli}


def resolve_tokenizer_path(overrides: list[str], raw: dict) -> list[str]:
  """A tokenizer_path that is neither local nor absolute but exists under the shipped configs or MaxText's
  assets is made absolute.

  This lets shipped configs say `tokenizer_path: tokenizers/qwen3-tokenizer` (inside the maxtext wheel)
  while hub ids such as `meta-llama/Llama-3.1-8B-Instruct` pass through unchanged.
  """
  value = raw.get("tokenizer_path")
  for arg in overrides:
    if arg.startswith("tokenizer_path="):
      value = arg.split("=", 1)[1]
  candidate = resolved_tokenizer_path(value)
  if candidate == value:
    return overrides
  return [a for a in overrides if not a.startswith("tokenizer_path=")] + [f"tokenizer_path={candidate}"]


# Keys that name a path on the user's machine: `~` in them means the home directory, as a shell would have expanded it
# (pyconfig does not, and `base_output_directory=~/runs` made a literal `./~/runs`).
HOME_PATH_KEYS = (
    "base_output_directory",
    "metrics_file",
    "checkpoint_dir",
    "tensorboard_dir",
    "train_data_path",
    "eval_data_path",
    "load_parameters_path",
    "data_template_path",
    "reward_functions_path",
    "tokenizer_path",
)


def expand_home_paths(overrides: list[str], raw: dict) -> list[str]:
  """`overrides` plus `key=<expanded>` for each HOME_PATH_KEYS value (from the yml chain or the overrides) that
  starts with `~`, so MaxText derives checkpoint_dir and tensorboard_dir from the expanded directory."""
  values = {k: raw.get(k) for k in HOME_PATH_KEYS}
  for arg in overrides:
    key, _, value = arg.partition("=")
    if key in values:
      values[key] = value
  out = list(overrides)
  for key, value in values.items():
    if isinstance(value, str) and value.startswith("~"):
      out = [a for a in out if not a.startswith(f"{key}=")] + [f"{key}={os.path.expanduser(value)}"]
  return out


def resolved_tokenizer_path(value: Any) -> Any:
  """`value` as the typed config holds it (`resolve_tokenizer_path`); anything else unchanged."""
  if not isinstance(value, str) or not value or os.path.isabs(value) or os.path.exists(value):
    return value
  # MAXTEXT_ASSETS_ROOT points into a source checkout; a wheel keeps its assets next to the package.
  for root in (configs_dir(), mt_globals.MAXTEXT_ASSETS_ROOT, os.path.join(mt_globals.MAXTEXT_PKG_DIR, "assets")):
    candidate = os.path.join(root, value)
    if os.path.exists(candidate):
      return candidate
  return value


@functools.lru_cache(maxsize=16)
def _tokenizer_json_size(path: str, size: int, mtime_ns: int) -> int | None:
  """`tokenizer_size` of one tokenizer.json, read once per version of the file (Qwen3's is 11 MB)."""
  del size, mtime_ns  # cache key only
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    return None  # unreadable: the tokenizer's loader says so in its own words
  vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
  ids = list(vocab.values()) if isinstance(vocab, dict) else []
  ids += [t.get("id") for t in data.get("added_tokens") or () if isinstance(t, dict)]
  ids = [i for i in ids if isinstance(i, int)]
  count = len(vocab) if isinstance(vocab, (dict, list)) else 0
  return max([count - 1, *ids]) + 1 if count or ids else None


def tokenizer_size(tokenizer_path: Any) -> int | None:
  """How many token ids a local Hugging Face tokenizer has (its tokenizer.json: the model's vocabulary and the added
  tokens, as `len(tokenizer)` counts them), without importing transformers; None for a hub id or another format."""
  root = resolved_tokenizer_path(tokenizer_path)
  if not isinstance(root, str) or "://" in root:
    return None
  path = os.path.join(os.path.expanduser(root), "tokenizer.json")
  try:
    st = os.stat(path)
  except OSError:
    return None
  return _tokenizer_json_size(path, st.st_size, st.st_mtime_ns)


def check_tokenizer_fits(tokenizer_path: Any, tokens: int | None, vocab_size: Any) -> None:
  """A tokenizer with more ids than the model's embedding has rows (vocab_size) feeds it ids past the table (JAX clips
  or fills them silently) and its end token may never be sampled: refused in one line."""
  if tokens is None or not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or tokens <= vocab_size:
    return
  raise ConfigError(
      f"invalid value for 'vocab_size'={vocab_size}: the tokenizer at '{tokenizer_path}' has {tokens} token ids, more "
      "than the model's embedding rows, so ids past them would be used and its end token could never be sampled; "
      f"set vocab_size >= {tokens} or use the model's own tokenizer"
  )


_DIGEST_BYTES = 1 << 20  # a file's digest reads its size and first MiB: cheap for a GB Parquet, still exact enough


@functools.lru_cache(maxsize=64)
def file_digest(path: str, version: str) -> str:
  """Size and first MiB of a file (storage.version, size and modification, is the cache key: a changed file is read
  again)."""
  h = hashlib.sha256(version.split(":", 1)[0].encode())
  h.update(storage.read_head(path, _DIGEST_BYTES))
  return h.hexdigest()[:16]


def tokenizer_identity(path: Any) -> str:
  """What makes a tokenizer another one: a local tokenizer directory's content (each file's name and digest, so the
  same tokenizer found at another path is the same), else the hub id as written. A resume compares it (run/meta.py),
  and so does a reward model checkpoint (reward_model.py)."""
  resolved = resolved_tokenizer_path(path)
  if not isinstance(resolved, str) or "://" in resolved or not os.path.isdir(os.path.expanduser(resolved)):
    return str(path)
  root = os.path.expanduser(resolved)
  h = hashlib.sha256()
  for name in sorted(os.listdir(root)):
    full = os.path.join(root, name)
    if os.path.isfile(full):
      h.update(f"{name}:{file_digest(full, storage.version(full))};".encode())
  return f"files {h.hexdigest()[:16]}"


def check_load_parameters_path(path: Any) -> None:
  """One line instead of MaxText's traceback for a missing local base checkpoint (the first pass, and the model
  build)."""
  if isinstance(path, str) and path and "://" not in path and not storage.exists(path):
    raise CheckpointError(f"invalid value for 'load_parameters_path'='{path}': no such checkpoint directory")


def check_model_name(model_name: str) -> None:
  """Refuse a model_name MaxText 0.2.5 has no models/<name>.yml for, naming the closest ones."""
  models_dir = os.path.join(mt_globals.MAXTEXT_CONFIGS_DIR, "models")
  known = sorted(f[:-4] for f in os.listdir(models_dir) if f.endswith(".yml"))
  base = model_name.replace("-Instruct", "")
  if model_name != "default" and base not in known:
    close = difflib.get_close_matches(base, known, n=3, cutoff=0.6)
    hint = f"; close: {', '.join(close)}" if close else f"; see {models_dir}"
    raise ConfigError(f"invalid value for 'model_name'='{model_name}': MaxText 0.2.5 does not know this model{hint}")
