"""`load_splits`: the run's (train, eval) splits from `DataSettings`, each from its first applicable source.

`DataSettings.from_config` is the one place data/ reads the config: every function here and in prompts.py and
synthetic.py takes the settings it needs (`DataSettings`, `prompts.PromptSettings`, `synthetic.SyntheticSettings`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from absl import logging

from maxtext_rl_plugin.data import prompts as prompts_lib
from maxtext_rl_plugin.data import rows as rows_lib
from maxtext_rl_plugin.data import splits
from maxtext_rl_plugin.data import synthetic
from maxtext_rl_plugin.errors import DataError


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """The keys data/ reads, from the config once (`from_config`)."""

  prompt: prompts_lib.PromptSettings
  generator: synthetic.SyntheticSettings  # the synthetic task's
  max_prompt_tokens: Optional[int] = None  # max_prefill_predict_length; None when unset
  train_data_path: str = ""
  eval_data_path: str = ""
  dataset_name: str = synthetic.SYNTHETIC
  eval_dataset_name: str = ""
  hf_subset: str = ""
  train_split: str = "train"
  eval_split: str = "test"
  hf_access_token: str = dataclasses.field(default="", repr=False)  # a secret: never in a repr or a log line
  data_shuffle_seed: int = 0
  synthetic_num_eval: int = 256

  @classmethod
  def from_config(cls, config: Any) -> "DataSettings":
    """The data keys of a MaxText/plugin config (validation refuses synthetic_min_steps > synthetic_max_steps)."""
    limit = config.max_prefill_predict_length
    return cls(
        prompt=prompts_lib.PromptSettings.from_config(config),
        generator=synthetic.SyntheticSettings(
            int(config.synthetic_seed),
            int(config.synthetic_min_steps),
            int(config.synthetic_max_steps),
            int(config.synthetic_max_value),
            float(config.synthetic_teacher_error_rate or 0.0),
            str(config.synthetic_task),
            float(config.synthetic_tool_rate),
        ),
        max_prompt_tokens=int(limit) if limit and limit > 0 else None,
        train_data_path=getattr(config, "train_data_path", "") or "",
        eval_data_path=getattr(config, "eval_data_path", "") or "",
        dataset_name=config.dataset_name,
        eval_dataset_name=config.eval_dataset_name or "",
        hf_subset=config.hf_subset or "",
        train_split=config.train_split,
        eval_split=config.eval_split,
        hf_access_token=config.hf_access_token,
        data_shuffle_seed=int(config.data_shuffle_seed),
        synthetic_num_eval=int(config.synthetic_num_eval),
    )


def _materialize(
    rows: list[tuple[str, str, str, str]],
    tokenizer,
    settings: DataSettings,
    name: str,
    drop_questions: frozenset = frozenset(),
) -> list[splits.Example]:
  """Rows as Examples with built prompts, dropping eval questions and prompts over the token limit."""
  if drop_questions:
    kept = [r for r in rows if r[0] not in drop_questions]
    if not kept:  # train and eval are the same data: the user asked for it (e.g. a smoke test)
      logging.warning("%s: every question is also in the eval split; using it unchanged", name)
    elif len(kept) < len(rows):
      logging.warning("%s: dropped %d examples whose question is also in the eval split", name, len(rows) - len(kept))
      rows = kept
  prompts = [prompts_lib.build_prompt(q, tokenizer, settings.prompt) for q, _, _, _ in rows]
  keep = list(range(len(rows)))
  limit = settings.max_prompt_tokens
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


def _rows_for(settings: DataSettings, which: str) -> Optional[list[tuple[str, str, str, str]]]:
  """Rows of the train/eval source, or None when that source is synthetic."""
  path = settings.train_data_path if which == "train" else settings.eval_data_path
  if path:
    return rows_lib.load_file_rows(path, f"{which}_data_path")
  name = settings.dataset_name if which == "train" else (settings.eval_dataset_name or settings.dataset_name)
  if name == synthetic.SYNTHETIC:
    return None
  split = settings.train_split if which == "train" else settings.eval_split
  return rows_lib.load_hub_rows(name, settings.hf_subset, split, settings.hf_access_token)


def load_splits(settings: DataSettings, tokenizer) -> tuple[splits.DatasetSplit, splits.DatasetSplit]:
  """(train, eval) for the config. Train is shuffled by `data_shuffle_seed` and repeats over epochs;
  eval keeps its stored order, is finite, and shares no question with train."""
  max_tokens = settings.max_prompt_tokens
  eval_rows = _rows_for(settings, "eval")
  if eval_rows is None:
    eval_split: splits.DatasetSplit = synthetic.synthetic_eval(
        settings.generator, settings.synthetic_num_eval, tokenizer, settings.prompt, max_tokens
    )
  else:
    eval_split = splits.ListSplit(_materialize(eval_rows, tokenizer, settings, "eval"), "eval")
  eval_questions = frozenset(e.question for e in eval_split)
  train_rows = _rows_for(settings, "train")
  if train_rows is None:
    train_split: splits.DatasetSplit = synthetic.SyntheticSplit(
        settings.generator,
        "train",
        tokenizer,
        settings.prompt,
        exclude=eval_questions,
        max_prompt_tokens=max_tokens,
        name="synthetic/train",
    )
  else:
    train_split = splits.ListSplit(
        _materialize(train_rows, tokenizer, settings, "train", eval_questions),
        "train",
        seed=settings.data_shuffle_seed,
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
