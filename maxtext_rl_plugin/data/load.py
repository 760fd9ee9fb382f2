"""`load_splits`: the run's (train, eval) splits from the config, each from its first applicable source."""

from __future__ import annotations

from typing import Optional

from absl import logging

from maxtext_rl_plugin.data import prompts as prompts_lib
from maxtext_rl_plugin.data import rows as rows_lib
from maxtext_rl_plugin.data import splits
from maxtext_rl_plugin.data import synthetic
from maxtext_rl_plugin.errors import DataError


def _max_prompt_tokens(config) -> Optional[int]:
  """The prompt token limit (max_prefill_predict_length), None when unset."""
  v = config.max_prefill_predict_length
  return int(v) if v and v > 0 else None


def _materialize(
    rows: list[tuple[str, str, str, str]], tokenizer, config, name: str, drop_questions: frozenset = frozenset()
) -> list[splits.Example]:
  """Rows as Examples with built prompts, dropping eval questions and prompts over the token limit."""
  if drop_questions:
    kept = [r for r in rows if r[0] not in drop_questions]
    if not kept:  # train and eval are the same data: the user asked for it (e.g. a smoke test)
      logging.warning("%s: every question is also in the eval split; using it unchanged", name)
    elif len(kept) < len(rows):
      logging.warning("%s: dropped %d examples whose question is also in the eval split", name, len(rows) - len(kept))
      rows = kept
  prompts = [prompts_lib.build_prompt(q, tokenizer, config) for q, _, _, _ in rows]
  keep = list(range(len(rows)))
  limit = _max_prompt_tokens(config)
  if limit and tokenizer is not None:
    lengths = prompts_lib.prompt_lengths(tokenizer, prompts)
    keep = [i for i, n in enumerate(lengths) if n <= limit]
    if len(keep) < len(rows):
      logging.warning(
          "%s: filtered %d of %d prompts longer than max_prefill_predict_length=%d tokens (longest %d)",
          name,
          len(rows) - len(keep),
          len(rows),
          limit,
          max(lengths),
      )
  if not keep:
    raise DataError(f"{name}: every prompt is longer than max_prefill_predict_length={limit} tokens; raise it")
  return [splits.Example(rows[i][0], rows[i][1], rows[i][2], prompts[i], rows[i][3]) for i in keep]


def _synthetic_cfg(config) -> synthetic.SyntheticConfig:
  """The synthetic generator's settings from `config` (validation refuses min_steps > max_steps)."""
  return synthetic.SyntheticConfig(
      int(config.synthetic_seed),
      int(config.synthetic_min_steps),
      int(config.synthetic_max_steps),
      int(config.synthetic_max_value),
      float(config.synthetic_teacher_error_rate or 0.0),
      str(config.synthetic_task),
      float(config.synthetic_tool_rate),
  )


def _rows_for(config, which: str) -> Optional[list[tuple[str, str, str, str]]]:
  """Rows of the train/eval source, or None when that source is synthetic."""
  path = getattr(config, f"{which}_data_path", "") or ""
  if path:
    return rows_lib.load_file_rows(path, f"{which}_data_path")
  name = config.dataset_name if which == "train" else (config.eval_dataset_name or config.dataset_name)
  if name == synthetic.SYNTHETIC:
    return None
  split = getattr(config, "train_split" if which == "train" else "eval_split")
  return rows_lib.load_hub_rows(name, config.hf_subset or "", split, config.hf_access_token)


def load_splits(config, tokenizer) -> tuple[splits.DatasetSplit, splits.DatasetSplit]:
  """(train, eval) for the config. Train is shuffled by `data_shuffle_seed` and repeats over epochs;
  eval keeps its stored order, is finite, and shares no question with train."""
  max_tokens = _max_prompt_tokens(config)
  eval_rows = _rows_for(config, "eval")
  if eval_rows is None:
    eval_split: splits.DatasetSplit = synthetic.synthetic_eval(
        _synthetic_cfg(config), int(config.synthetic_num_eval), tokenizer, config, max_tokens
    )
  else:
    eval_split = splits.ListSplit(_materialize(eval_rows, tokenizer, config, "eval"), "eval")
  eval_questions = frozenset(e.question for e in eval_split)
  train_rows = _rows_for(config, "train")
  if train_rows is None:
    train_split: splits.DatasetSplit = synthetic.SyntheticSplit(
        _synthetic_cfg(config),
        "train",
        tokenizer,
        config,
        exclude=eval_questions,
        max_prompt_tokens=max_tokens,
        name="synthetic/train",
    )
  else:
    train_split = splits.ListSplit(
        _materialize(train_rows, tokenizer, config, "train", eval_questions),
        "train",
        seed=int(config.data_shuffle_seed),
        repeat=True,
    )
  logging.info(
      "data: train %s (%s), eval %s (%d examples)",
      train_split.name,
      "unlimited" if train_split.unlimited else f"{len(train_split)} examples",
      eval_split.name,
      len(eval_split),
  )
  return train_split, eval_split
