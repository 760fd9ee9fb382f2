"""The run's Hugging Face tokenizer: `tokenizer_path` (a local directory or a hub id), loaded once per process.

Loading needs only the path, the hub token, the chat-template switch and the model's embedding rows (`vocab_size`):
`TokenizerSettings`, built once from the config (`from_config`).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

from transformers import AutoTokenizer

from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
  """What loading the run's tokenizer reads of the config."""

  path: str  # tokenizer_path
  hf_access_token: str = ""
  use_chat_template: bool = False
  vocab_size: int | None = None  # the model's embedding rows (load_run_tokenizer's bound)

  @classmethod
  def from_config(cls, config) -> TokenizerSettings:
    return cls(
        path=str(config.tokenizer_path),
        hf_access_token=str(config.hf_access_token or ""),
        use_chat_template=bool(config.use_chat_template),
        vocab_size=int(config.vocab_size),
    )


def load_tokenizer(settings: TokenizerSettings):
  """The HF tokenizer at `tokenizer_path` (local dir or hub id); pad falls back to EOS."""
  path = settings.path
  try:
    tok = _tokenizer(path, settings.hf_access_token or None, _version(path))
  except (OSError, ValueError) as e:
    raise ConfigError(
        f"invalid value for 'tokenizer_path'='{path}': cannot load a Hugging Face tokenizer ({type(e).__name__})"
    ) from None
  if settings.use_chat_template and not getattr(tok, "chat_template", None):
    raise ConfigError(
        f"tokenizer at '{path}' has no chat template; set use_chat_template=false to use data_template_path instead"
    )
  return tok


def load_run_tokenizer(settings: TokenizerSettings):
  """A run's tokenizer (`load_tokenizer`) with no more ids than the model's embedding rows: a hub id's size is first
  known here (a local tokenizer was checked in the first pass). Tests and benchmarks that feed random ids to a small
  vocabulary load a larger tokenizer through `load_tokenizer` alone."""
  tok = load_tokenizer(settings)
  config_files.check_tokenizer_fits(settings.path, len(tok), settings.vocab_size)
  return tok


def _version(path: str) -> tuple:
  """What makes a local tokenizer directory another tokenizer: its files' names, sizes and modification times (a hub
  id has none: the hub's own cache decides)."""
  root = pathlib.Path(path)
  if not root.is_dir():
    return ()
  return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in root.iterdir() if f.is_file()))


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str, token: str | None, version: tuple):
  """One load per tokenizer and process: Qwen3's 151k-token tokenizer takes ~0.6 s to build, which every run in a
  process that runs several (the tests, a notebook) paid again. `version` keys the cache on the files' state. The
  object is shared: nothing in the plugin changes a tokenizer after this, and the pad fallback is set here, once."""
  del version  # the cache key only
  tok = AutoTokenizer.from_pretrained(path, token=token)
  if tok.pad_token_id is None:
    tok.pad_token = tok.eos_token
  return tok
