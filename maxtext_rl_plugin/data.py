"""GSM8K-style problems for RL: the HF hub, local JSONL/Parquet files, or built-in synthetic arithmetic.

Sources (per split, first that applies):
* `train_data_path=` / `eval_data_path=`: local JSONL, JSON or Parquet file(s) (comma-separated, globs ok)
  with GSM8K's columns `question` and `answer` ("... #### N");
* `dataset_name=synthetic` / `eval_dataset_name=synthetic`: seeded arithmetic word problems with exact
  integer answers and worked solutions (the CPU demo's data; no download);
* otherwise `datasets.load_dataset(dataset_name, hf_subset, split=train_split|eval_split)` (openai/gsm8k).

Gold answers are parsed once here (`#### 1,200` -> "1200"). Malformed rows (no question, no parsable
gold) are skipped and counted in one warning per source instead of failing a run hours in; prompts
longer than `max_prefill_predict_length` tokens are dropped with a count (MaxText does the same
filtering, silently). Splits are random-access and deterministic: batch k of a split is a pure function
of (seed, k), so a resumed run continues at its data position with no repeated or skipped batch.
"""

# pyarrow (Parquet files) and datasets (the HF hub) are optional extras, imported where a config asks for them.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import abc
import dataclasses
import functools
import glob
import json
import os
import random
import re
import sys
from typing import Any, Iterable, Iterator, Optional, Sequence

from absl import logging
import maxtext

from maxtext_rl_plugin.config import configs_dir
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.errors import describe_not_a_file
from maxtext_rl_plugin.errors import DataError
from maxtext_rl_plugin.errors import MissingExtraError
from maxtext_rl_plugin.rewards import extraction
from maxtext_rl_plugin.rewards import gsm8k

SYNTHETIC = "synthetic"
_UNSET: Any = object()
_CALC_ANNOTATION_RE = re.compile(r"<<[^<>]{0,200}>>")
_QUESTION_KEYS = ("question", "problem", "prompt")
_ANSWER_KEYS = ("answer", "solution", "expected_answer")

# Used when data_template_path is empty: a shorter instruction than MaxText's gsm8k_rl.json (about 30
# fewer tokens), which keeps synthetic prompts for the CPU demo's tiny model near 60 tokens.
_DEFAULT_TEMPLATE = {
    "SYSTEM_PROMPT": (
        "Reason step by step between {reasoning_start_token} and {reasoning_end_token}, then give only the final "
        "number between {solution_start_token} and {solution_end_token}."
    ),
    "TEMPLATE": "{system_prompt}\n\n{question}\n",
}


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem. `answer` is the canonical gold ("72"); `solution` the full reference text ending in
  `#### N` (GSM8K's own, or the synthetic worked solution); `prompt` the fully templated model input."""

  question: str
  answer: str
  solution: str
  prompt: str
  id: str


# ----------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------


def _template_candidates(path: str) -> list[str]:
  """Where a relative data_template_path may live: as given, MaxText's package root, the shipped configs."""
  cands = [path]
  if not os.path.isabs(path):
    pkg = os.path.dirname(os.path.abspath(maxtext.__file__))
    cands.append(os.path.join(os.path.dirname(pkg), path))  # MaxText's own resolution (site-packages root)
    if path.startswith("maxtext/"):
      cands.append(os.path.join(pkg, path[len("maxtext/") :]))
    cands.append(os.path.join(configs_dir(), path))
  return cands


@functools.lru_cache(maxsize=16)
def load_template(path: str) -> dict[str, str]:
  """MaxText's data template JSON (`SYSTEM_PROMPT`, `TEMPLATE`), resolved like MaxText does.

  A relative path is tried from the working directory, then against MaxText's installed package (the
  default 'maxtext/examples/chat_templates/gsm8k_rl.json'), then the plugin's configs.
  """
  if not path:
    return dict(_DEFAULT_TEMPLATE)
  found = next((c for c in _template_candidates(path) if os.path.isfile(c)), None)
  if found is None:
    raise ConfigError(
        f"invalid value for 'data_template_path'='{path}': file not found (also looked in MaxText's package)"
    )
  try:
    with open(found, encoding="utf-8") as f:
      tpl = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"invalid value for 'data_template_path'='{path}': not a readable JSON file ({e})") from None
  if not isinstance(tpl, dict) or not isinstance(tpl.get("SYSTEM_PROMPT"), str):
    raise ConfigError(
        f"invalid value for 'data_template_path'='{path}': expected a JSON object with a 'SYSTEM_PROMPT' string"
    )
  if not isinstance(tpl.get("TEMPLATE", ""), str) or "{question}" not in tpl.get("TEMPLATE", "{question}"):
    raise ConfigError(
        f"invalid value for 'data_template_path'='{path}': 'TEMPLATE' must be a string containing {{question}}"
    )
  tpl.setdefault("TEMPLATE", _DEFAULT_TEMPLATE["TEMPLATE"])
  return tpl


def tag_tokens(config) -> dict[str, str]:
  """The four tag tokens of `config`; missing keys default to the reward stack's (MaxText rl.yml) values."""
  default = gsm8k.RewardConfig()
  keys = ("reasoning_start_token", "reasoning_end_token", "solution_start_token", "solution_end_token")
  return {k: getattr(config, k, getattr(default, k)) for k in keys}


def system_prompt(config) -> str:
  """The instruction to answer as `<reasoning>...</reasoning><answer>...</answer>` (configured tokens)."""
  tpl = load_template(config.data_template_path or "")
  try:
    return tpl["SYSTEM_PROMPT"].format(**tag_tokens(config))
  except (KeyError, IndexError) as e:
    raise ConfigError(f"data_template_path: SYSTEM_PROMPT has an unknown placeholder {e}") from None


def _has_chat_template(tokenizer) -> bool:
  return (
      tokenizer is not None
      and bool(getattr(tokenizer, "chat_template", None))
      and hasattr(tokenizer, "apply_chat_template")
  )


def build_prompt(question: str, tokenizer, config) -> str:
  """The model input for a question.

  With `use_chat_template` and a tokenizer that has one: system prompt + user question through
  `apply_chat_template(add_generation_prompt=True)` (templates without a system role, e.g. Gemma's,
  get the system prompt prepended to the user turn). Otherwise the template file's `TEMPLATE`.
  With `reasoning_start_token_in_prompt`, the prompt ends with the reasoning start token.
  """
  sp = system_prompt(config)
  if config.use_chat_template and _has_chat_template(tokenizer):
    msgs = [{"role": "system", "content": sp}, {"role": "user", "content": question}]
    try:
      prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    except Exception:  # pylint: disable=broad-exception-caught  # jinja raises for unsupported roles
      prompt = tokenizer.apply_chat_template(
          [{"role": "user", "content": f"{sp}\n\n{question}"}], add_generation_prompt=True, tokenize=False
      )
  else:
    tpl = load_template(config.data_template_path or "")
    try:
      prompt = tpl["TEMPLATE"].format(system_prompt=sp, question=question)
    except (KeyError, IndexError) as e:
      raise ConfigError(f"data_template_path: TEMPLATE has an unknown placeholder {e}") from None
  if config.reasoning_start_token_in_prompt:
    rs = tag_tokens(config)["reasoning_start_token"]
    if not prompt.endswith(rs):
      prompt += rs
  return prompt


def format_target(example: Example, config) -> str:
  """The completion an SFT warm start should learn: `<reasoning>steps</reasoning>\\n<answer>N</answer>`.

  Steps are the reference solution without its `#### N` line and GSM8K's `<<calculator>>` notes.
  """
  t = tag_tokens(config)
  sol = example.solution or ""
  if t["solution_start_token"] in sol and t["solution_end_token"] in sol:
    return sol
  reasoning, _, final = sol.rpartition("####") if "####" in sol else (sol, "", "")
  reasoning = _CALC_ANNOTATION_RE.sub("", reasoning).strip()
  shown = final.strip() or example.answer  # the demonstration's own answer (a flawed teacher's may be wrong)
  rs = "" if config.reasoning_start_token_in_prompt else t["reasoning_start_token"]
  return f"{rs}{reasoning}{t['reasoning_end_token']}\n{t['solution_start_token']}{shown}{t['solution_end_token']}"


def prompt_lengths(tokenizer, prompts: Sequence[str]) -> list[int]:
  """Token counts as the rollout will see them (special tokens the tokenizer adds included)."""
  if not prompts:
    return []
  if callable(tokenizer) and hasattr(tokenizer, "batch_decode"):  # a Hugging Face tokenizer: batched, fast
    return [len(ids) for ids in tokenizer(list(prompts))["input_ids"]]
  if hasattr(tokenizer, "encode"):
    return [len(tokenizer.encode(p)) for p in prompts]
  return [len(tokenizer.tokenize(p)) for p in prompts]


# ----------------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------------


class DatasetSplit(abc.ABC):
  """A sized, deterministic, random-access source of Examples.

  `batch(k, batch_size)` is batch k of the split's stream: for a shuffled (train) split the stream is
  epoch 0 in the order of permutation(seed, 0), then epoch 1 in permutation(seed, 1), ...; for an
  unshuffled (eval) split it is the stored order, once. `batches(...)` iterates the same stream from
  `start_batch`, so resuming at batch k reproduces exactly what an uninterrupted run would have seen.
  """

  name: str = ""
  seed: Optional[int] = None
  repeat: bool = False
  unlimited: bool = False
  _warned_small: bool = False  # batch_size > len(self) was reported (once per split)

  @abc.abstractmethod
  def __len__(self) -> int:
    ...

  @abc.abstractmethod
  def __getitem__(self, i: int) -> Example:
    ...

  def __iter__(self) -> Iterator[Example]:
    for i in range(len(self)):
      yield self[i]

  @functools.lru_cache(maxsize=4)  # noqa: B019  (a handful of epochs in flight; splits live for the run)
  def _perm(self, seed: int, epoch: int) -> list[int]:
    order = list(range(len(self)))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order

  def position_index(self, pos: int, seed: Any = _UNSET) -> int:
    """Index of the example at stream position `pos`."""
    seed = self.seed if seed is _UNSET else seed
    n = len(self)
    if self.unlimited:
      return pos
    if pos >= n and not self.repeat:
      raise IndexError(f"position {pos} is past the end of split '{self.name}' ({n} examples)")
    epoch, off = divmod(pos, n)
    return off if seed is None else self._perm(seed, epoch)[off]

  def num_batches(self, batch_size: int) -> Optional[int]:
    """Batches in one pass (None if the stream is unbounded); a non-repeating split keeps its tail batch."""
    if self.unlimited or self.repeat:
      return None
    return -(-len(self) // batch_size)

  def batch(self, k: int, batch_size: int, seed: Any = _UNSET) -> list[Example]:
    """Batch k (0-based) of the stream."""
    if k < 0 or batch_size < 1:
      raise ValueError(f"batch index {k} / batch_size {batch_size}")
    start = k * batch_size
    stop = start + batch_size
    if self.repeat and not self.unlimited and batch_size > len(self) and not self._warned_small:
      self._warned_small = True
      logging.warning(
          "split '%s' has %d examples, fewer than batch_size=%d: every batch repeats prompts "
          "(they are drawn from consecutive shuffled epochs)",
          self.name,
          len(self),
          batch_size,
      )
    if not (self.unlimited or self.repeat):
      if start >= len(self):
        raise IndexError(f"batch {k} of size {batch_size} is past the end of split '{self.name}' ({len(self)} examples)")
      stop = min(stop, len(self))
    return [self[self.position_index(p, seed)] for p in range(start, stop)]

  def batches(
      self, batch_size: int, start_batch: int = 0, seed: Any = _UNSET, num_batches: Optional[int] = None
  ) -> Iterator[list[Example]]:
    """Batches `start_batch, start_batch+1, ...` (up to `num_batches` in total counting from 0, or the end)."""
    end = self.num_batches(batch_size)
    if num_batches is not None:
      end = num_batches if end is None else min(end, num_batches)
    k = start_batch
    while end is None or k < end:
      yield self.batch(k, batch_size, seed)
      k += 1


class ListSplit(DatasetSplit):
  """A materialized split (files, hub)."""

  def __init__(self, examples: Sequence[Example], name: str, seed: Optional[int] = None, repeat: bool = False):
    if not examples:
      raise DataError(f"split '{name}' has no examples")
    self.examples = list(examples)
    self.name, self.seed, self.repeat = name, seed, repeat

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, i: int) -> Example:
    return self.examples[i]


# ----------------------------------------------------------------------------------------------------
# Synthetic arithmetic word problems
# ----------------------------------------------------------------------------------------------------

_NAMES = (
    "Ava",
    "Ben",
    "Cara",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivan",
    "Jo",
    "Kai",
    "Lena",
    "Milo",
    "Nia",
    "Omar",
    "Pia",
    "Raj",
    "Sara",
    "Tom",
    "Uma",
    "Vic",
    "Wen",
    "Yara",
    "Zoe",
)
_ITEMS = (
    "apples",
    "marbles",
    "stickers",
    "books",
    "coins",
    "pencils",
    "cookies",
    "shells",
    "cards",
    "stamps",
    "eggs",
    "beads",
    "toy cars",
    "balloons",
    "plums",
)
_CONTAINERS = ("bags", "boxes", "jars", "baskets", "packs")


def _noun(n: int, unit: str) -> str:
  return unit[:-1] if n == 1 and unit.endswith("s") else unit


def _count(n: int, unit: str) -> str:
  return f"{n} {_noun(n, unit)}"


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  seed: int = 1234
  min_steps: int = 1
  max_steps: int = 2
  max_value: int = 20
  teacher_error_rate: float = 0.0


def synthetic_problem(rng: random.Random, cfg: SyntheticConfig) -> tuple[str, int, str]:
  """(question, answer, GSM8K-style solution ending in '#### N') with 1..N exact integer steps.

  Operands are in [1, max_value]; running values stay in [0, 5 * max_value] so the answer space stays
  small enough for a tiny model to learn. Division only when exact.
  """
  steps = rng.randint(cfg.min_steps, max(cfg.min_steps, cfg.max_steps))
  mv = cfg.max_value
  cap = 5 * mv
  name = rng.choice(_NAMES)
  money = rng.random() < 0.25
  unit = "dollars" if money else rng.choice(_ITEMS)
  sentences: list[str] = []
  lines: list[str] = []
  done = 0
  if not money and steps >= 1 and rng.random() < 0.3 and mv >= 2:
    a, b = rng.randint(2, min(mv, 10)), rng.randint(1, mv)
    if a * b <= cap:
      box = rng.choice(_CONTAINERS)
      sentences.append(f"{name} has {a} {box} with {_count(b, unit)} in each.")
      v = a * b
      lines.append(f"{a} * {b} = {v}")
      done = 1
  if not done:
    v = rng.randint(1, mv)
    sentences.append(f"{name} has ${v}." if money else f"{name} has {_count(v, unit)}.")
  while done < steps:
    ops = ["add"] if v < cap else []
    if v >= 1:
      ops.append("sub")
    if 2 * v <= cap and v >= 1:
      ops.append("mul")
    if any(v % k == 0 for k in range(2, min(5, v) + 1)):
      ops.append("div")
    op = rng.choice(ops)
    if op == "add":
      b = rng.randint(1, min(mv, cap - v))
      s = rng.choice(
          (f"{name} earns ${b}.", f"{name} is paid ${b} more.")
          if money
          else (
              f"{name} buys {_count(b, unit)} more.",
              f"{name} finds {b} more {_noun(b, unit)}.",
              f"A friend gives {name} {_count(b, unit)}.",
          )
      )
      r = v + b
      lines.append(f"{v} + {b} = {r}")
    elif op == "sub":
      b = rng.randint(1, min(v, mv))
      s = rng.choice(
          (f"{name} spends ${b}.", f"{name} pays ${b} for lunch.")
          if money
          else (
              f"{name} gives away {_count(b, unit)}.",
              f"{name} loses {_count(b, unit)}.",
              f"{name} sells {_count(b, unit)}.",
          )
      )
      r = v - b
      lines.append(f"{v} - {b} = {r}")
    elif op == "mul":
      k = rng.randint(2, max(2, min(5, cap // v)))
      what = "money" if money else f"number of {unit}"
      s = {2: f"Then {name} doubles the {what}.", 3: f"Then {name} triples the {what}."}.get(
          k, f"Then the {what} grows {k} times."
      )
      r = v * k
      lines.append(f"{v} * {k} = {r}")
    else:
      k = rng.choice([k for k in range(2, min(5, v) + 1) if v % k == 0])
      s = (
          f"{name} splits the money equally among {k} people, {name} included."
          if money
          else f"{name} shares the {unit} equally among {k} friends, {name} included."
      )
      r = v // k
      lines.append(f"{v} / {k} = {r}")
    sentences.append(s)
    v = r
    done += 1
  if "/" in lines[-1] if lines else False:
    q = "How many dollars does each person get?" if money else f"How many {unit} does each friend get?"
  elif money:
    q = f"How many dollars does {name} have now?" if len(sentences) > 1 else f"How many dollars does {name} have?"
  else:
    q = f"How many {unit} does {name} have now?" if len(sentences) > 1 else f"How many {unit} does {name} have?"
  return " ".join(sentences + [q]), v, "\n".join(lines + [f"#### {v}"])


_STEP_RE = re.compile(r"^(\d+) [-+*/] (\d+) = \d+$")


def adding_teacher(solution: str) -> tuple[str, int]:
  """The worked solution of a teacher who adds every pair of numbers whatever the wording says.

  `7 * 3 = 21` becomes `7 + 3 = 10`; later steps continue from the teacher's own running value. Returns
  the flawed solution and its (wrong, unless every step was an addition) final answer.
  """
  lines, value = [], None
  for line in solution.splitlines():
    m = _STEP_RE.match(line)
    if not m:
      continue
    a = int(m.group(1)) if value is None else value
    b = int(m.group(2))
    value = a + b
    lines.append(f"{a} + {b} = {value}")
  if value is None:
    raise ValueError(f"not a synthetic worked solution: {solution!r}")
  return "\n".join(lines + [f"#### {value}"]), value


class SyntheticSplit(DatasetSplit):
  """Synthetic problems generated from (seed, stream, index): unlimited (train) or a fixed list (eval).

  Train problems whose question text appears in `exclude` (the eval questions) or whose prompt is
  longer than the limit are redrawn from (seed, stream, index, attempt), so item i is still a pure
  function of the seed.
  """

  def __init__(
      self,
      cfg: SyntheticConfig,
      stream: str,
      tokenizer,
      config,
      exclude: frozenset = frozenset(),
      max_prompt_tokens: Optional[int] = None,
      name: str = "",
  ):
    self.cfg, self.stream, self.tokenizer, self.config = cfg, stream, tokenizer, config
    self.exclude = exclude
    self.max_prompt_tokens = max_prompt_tokens
    self.name = name or f"synthetic/{stream}"
    self.unlimited = True
    self.seed = None
    self.filtered_long = 0
    self.redrawn_eval_overlap = 0

  def __len__(self) -> int:
    return sys.maxsize

  def _draw(self, i: int, attempt: int) -> tuple[str, int, str]:
    rng = random.Random(f"{self.cfg.seed}:{self.stream}:{i}:{attempt}")
    return synthetic_problem(rng, self.cfg)

  @functools.lru_cache(maxsize=4096)  # noqa: B019
  def __getitem__(self, i: int) -> Example:
    if i < 0:
      raise IndexError(i)
    for attempt in range(100):
      q, a, sol = self._draw(i, attempt)
      if q in self.exclude:
        self.redrawn_eval_overlap += 1
        continue
      prompt = build_prompt(q, self.tokenizer, self.config)
      if (
          self.max_prompt_tokens
          and self.tokenizer is not None
          and prompt_lengths(self.tokenizer, [prompt])[0] > self.max_prompt_tokens
      ):
        self.filtered_long += 1
        if self.filtered_long in (1, 100, 10000):
          logging.warning(
              "synthetic/%s: %d prompts longer than max_prefill_predict_length=%d redrawn so far",
              self.stream,
              self.filtered_long,
              self.max_prompt_tokens,
          )
        continue
      if (
          self.stream == "train"
          and self.cfg.teacher_error_rate > 0
          and random.Random(f"{self.cfg.seed}:teacher:{i}").random() < self.cfg.teacher_error_rate
      ):
        sol = adding_teacher(sol)[0]  # wrong unless all steps add; the gold answer stays the true one
      return Example(q, str(a), sol, prompt, f"synthetic-{self.stream}-{i}")
    raise DataError(
        f"synthetic problems do not fit max_prefill_predict_length={self.max_prompt_tokens} "
        f"(or all collide with the eval set); raise it or lower synthetic_max_steps"
    )


def _synthetic_eval(cfg: SyntheticConfig, n: int, tokenizer, config, max_tokens: Optional[int]) -> ListSplit:
  """`n` distinct synthetic problems from the eval stream (deduplicated on question text)."""
  gen = SyntheticSplit(cfg, "eval", tokenizer, config, max_prompt_tokens=max_tokens)
  seen: set[str] = set()
  out: list[Example] = []
  i = 0
  while len(out) < n and i < 50 * n + 1000:
    e = gen[i]
    i += 1
    if e.question in seen:
      continue
    seen.add(e.question)
    out.append(e)
  if len(out) < n:
    logging.warning("synthetic eval: only %d distinct problems exist for these knobs (asked for %d)", len(out), n)
  if gen.filtered_long:
    logging.warning(
        "synthetic eval: %d prompts over max_prefill_predict_length=%s redrawn", gen.filtered_long, max_tokens
    )
  return ListSplit(out, "synthetic/eval")


# ----------------------------------------------------------------------------------------------------
# Rows (files, hub) -> Examples
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Skips:
  """Counts of the rows a file loses, by reason, for the one-line skip summary."""

  rows: int = 0
  bad_json: int = 0
  not_object: int = 0  # valid JSON that is not an object (a list, a number, a string)
  not_utf8: int = 0
  no_question: int = 0
  no_answer: int = 0
  first_bad: Optional[int] = None

  def bad(self, row: int, kind: str) -> None:
    setattr(self, kind, getattr(self, kind) + 1)
    if self.first_bad is None:
      self.first_bad = row

  @property
  def skipped(self) -> int:
    return self.bad_json + self.not_object + self.not_utf8 + self.no_question + self.no_answer


def _first(row: dict, keys: Sequence[str]) -> Any:
  for k in keys:
    if k in row and row[k] is not None:
      return row[k]
  return None


class NotUtf8:
  """Stands for a data-file line whose bytes are not UTF-8 (counted and skipped, never trained on as U+FFFD)."""


def rows_to_examples(rows: Iterable[Any], source: str, unit: str = "") -> tuple[list[tuple[str, str, str, str]], _Skips]:
  """(question, gold, solution, id) per usable row; malformed rows are counted, not raised.

  A row is a dict with `question` (or `problem`/`prompt`) and `answer` (or `solution`/`expected_answer`)
  whose gold is the value after `####`, or the whole answer if it is a plain number. `None` rows stand
  for lines that were not valid JSON, `NotUtf8` for lines that were not UTF-8. With a `unit` ("line", "row"),
  `rows` holds (number, row) pairs, so ids and messages name file lines; else rows are counted from 1.
  """
  out = []
  sk = _Skips()
  for n, row in rows if unit else enumerate(rows, 1):
    sk.rows += 1
    if isinstance(row, NotUtf8):
      sk.bad(n, "not_utf8")
      continue
    if not isinstance(row, dict):
      sk.bad(n, "bad_json" if row is None else "not_object")
      continue
    q = _first(row, _QUESTION_KEYS)
    if not isinstance(q, str) or not q.strip():
      sk.bad(n, "no_question")
      continue
    a = _first(row, _ANSWER_KEYS)
    gold = extraction.parse_gold(a) if a is not None else None
    if gold is None:
      sk.bad(n, "no_answer")
      continue
    out.append((q.strip(), gold, str(a), f"{source}:{n}"))
  if sk.skipped:
    logging.warning(
        "%s: skipped %d of %d rows (invalid JSON: %d, JSON but not an object: %d, not UTF-8: %d, no question: %d, "
        "no parsable gold answer ('#### N'): %d); first at %s %d",
        source,
        sk.skipped,
        sk.rows,
        sk.bad_json,
        sk.not_object,
        sk.not_utf8,
        sk.no_question,
        sk.no_answer,
        unit or "row",
        sk.first_bad,
    )
  return out, sk


def _expand_paths(spec: str, key: str) -> list[str]:
  """The files a comma-separated path/glob spec names; a part matching nothing is a DataError."""
  paths = []
  for part in (p.strip() for p in spec.split(",")):
    if not part:
      continue
    matches = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
    if not matches:
      raise DataError(f"{key}='{part}': no files match")
    for m in matches:
      if not os.path.isfile(m):
        raise DataError(f"{key}='{m}': {describe_not_a_file(m)}")
      paths.append(m)
  if not paths:
    raise DataError(f"{key}='{spec}': no files given")
  return paths


def _read_rows(path: str, key: str) -> tuple[list[tuple[int, Any]], str]:
  """((number, row) pairs, "line" or "row") of a JSONL/JSON/Parquet file.

  A row is the parsed value, None for invalid JSON, or NotUtf8.
  """
  ext = os.path.splitext(path)[1].lower()
  if ext == ".parquet":
    try:
      import pyarrow.parquet as pq
    except ImportError as e:
      raise MissingExtraError("reading Parquet data", "pyarrow", "cpu") from e
    try:
      return list(enumerate(pq.read_table(path).to_pylist(), 1)), "row"
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise DataError(f"{key}='{path}': not a readable Parquet file ({type(e).__name__}: {e})") from None
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise DataError(f"{key}='{path}': {e.strerror}") from None
  if raw.startswith(b"\xef\xbb\xbf"):
    raw = raw[3:]  # UTF-8 byte order mark (Windows editors write one)
  if ext == ".json" and raw.lstrip().startswith(b"["):
    try:
      rows = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise DataError(f"{key}='{path}': not UTF-8 (byte {e.start + 1})") from None
    except ValueError as e:
      raise DataError(f"{key}='{path}': invalid JSON ({e})") from None
    return list(enumerate(rows if isinstance(rows, list) else [rows], 1)), "row"
  # JSONL: split on "\n" only (str.splitlines would also cut at U+2028/U+0085 inside a valid row) and number
  # rows by file line, blank lines included, so ids and messages point at the line to fix.
  rows: list[tuple[int, Any]] = []
  for lineno, line in enumerate(raw.split(b"\n"), 1):
    if not line.strip():
      continue
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError:
      rows.append((lineno, NotUtf8()))
      continue
    try:
      rows.append((lineno, json.loads(text)))
    except ValueError:
      rows.append((lineno, None))
  return rows, "line"


def load_file_rows(spec: str, key: str) -> list[tuple[str, str, str, str]]:
  """Usable rows of local JSONL/JSON/Parquet file(s) named by config key `key`."""
  out = []
  for path in _expand_paths(spec, key):
    numbered, unit = _read_rows(path, key)
    rows, sk = rows_to_examples(numbered, os.path.basename(path), unit=unit)
    if not rows:
      raise DataError(
          f"{key}='{path}': no usable rows of {sk.rows} (expected JSON objects with 'question' and 'answer' "
          "ending in '#### N')"
      )
    out.extend(rows)
  return out


def load_hub_rows(
    dataset_name: str, subset: str, split: str, token: Optional[str] = None
) -> list[tuple[str, str, str, str]]:
  """Usable rows of a Hugging Face hub dataset split (`datasets.load_dataset(name, subset, split=split)`)."""
  try:
    import datasets
  except ImportError as e:
    raise MissingExtraError("loading datasets from the Hugging Face hub", "datasets", "cpu") from e
  kwargs = {"split": split}
  if token:
    kwargs["token"] = token
  try:
    ds = datasets.load_dataset(dataset_name, subset or None, **kwargs)
  except Exception as e:  # pylint: disable=broad-exception-caught  # network, auth, unknown split...
    msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    raise DataError(
        f"dataset_name='{dataset_name}' (hf_subset='{subset}', split='{split}'): could not load from the "
        "Hugging Face hub "
        f"({type(e).__name__}: {msg}); offline, use train_data_path=/eval_data_path= or dataset_name={SYNTHETIC}"
    ) from None
  rows, sk = rows_to_examples(iter(ds), f"{dataset_name}/{split}")
  if not rows:
    raise DataError(
        f"dataset_name='{dataset_name}' split '{split}': no usable rows of {sk.rows} (need 'question' and 'answer')"
    )
  return rows


# ----------------------------------------------------------------------------------------------------
# load_splits
# ----------------------------------------------------------------------------------------------------


def _max_prompt_tokens(config) -> Optional[int]:
  """The prompt token limit (max_prefill_predict_length), None when unset."""
  v = config.max_prefill_predict_length
  return int(v) if v and v > 0 else None


def _materialize(
    rows: list[tuple[str, str, str, str]], tokenizer, config, name: str, drop_questions: frozenset = frozenset()
) -> list[Example]:
  """Rows as Examples with built prompts, dropping eval questions and prompts over the token limit."""
  if drop_questions:
    kept = [r for r in rows if r[0] not in drop_questions]
    if not kept:  # train and eval are the same data: the user asked for it (e.g. a smoke test)
      logging.warning("%s: every question is also in the eval split; using it unchanged", name)
    elif len(kept) < len(rows):
      logging.warning("%s: dropped %d examples whose question is also in the eval split", name, len(rows) - len(kept))
      rows = kept
  prompts = [build_prompt(q, tokenizer, config) for q, _, _, _ in rows]
  keep = list(range(len(rows)))
  limit = _max_prompt_tokens(config)
  if limit and tokenizer is not None:
    lengths = prompt_lengths(tokenizer, prompts)
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
  return [Example(rows[i][0], rows[i][1], rows[i][2], prompts[i], rows[i][3]) for i in keep]


def _synthetic_cfg(config) -> SyntheticConfig:
  """The synthetic generator's settings from `config`; min_steps > max_steps is a ConfigError."""
  lo, hi = int(config.synthetic_min_steps), int(config.synthetic_max_steps)
  if hi < lo:
    raise ConfigError(f"invalid value for 'synthetic_max_steps'={hi}: must be >= synthetic_min_steps={lo}")
  return SyntheticConfig(
      int(config.synthetic_seed),
      lo,
      hi,
      int(config.synthetic_max_value),
      float(config.synthetic_teacher_error_rate or 0.0),
  )


def _rows_for(config, which: str) -> Optional[list[tuple[str, str, str, str]]]:
  """Rows of the train/eval source, or None when that source is synthetic."""
  path = getattr(config, f"{which}_data_path", "") or ""
  if path:
    return load_file_rows(path, f"{which}_data_path")
  name = config.dataset_name if which == "train" else (config.eval_dataset_name or config.dataset_name)
  if name == SYNTHETIC:
    return None
  split = getattr(config, "train_split" if which == "train" else "eval_split")
  return load_hub_rows(name, config.hf_subset or "", split, config.hf_access_token)


def load_splits(config, tokenizer) -> tuple[DatasetSplit, DatasetSplit]:
  """(train, eval) for the config. Train is shuffled by `data_shuffle_seed` and repeats over epochs;
  eval keeps its stored order, is finite, and shares no question with train."""
  max_tokens = _max_prompt_tokens(config)
  eval_rows = _rows_for(config, "eval")
  if eval_rows is None:
    eval_split: DatasetSplit = _synthetic_eval(
        _synthetic_cfg(config), int(config.synthetic_num_eval), tokenizer, config, max_tokens
    )
  else:
    eval_split = ListSplit(_materialize(eval_rows, tokenizer, config, "eval"), "eval")
  eval_questions = frozenset(e.question for e in eval_split)
  train_rows = _rows_for(config, "train")
  if train_rows is None:
    train_split: DatasetSplit = SyntheticSplit(
        _synthetic_cfg(config),
        "train",
        tokenizer,
        config,
        exclude=eval_questions,
        max_prompt_tokens=max_tokens,
        name="synthetic/train",
    )
  else:
    train_split = ListSplit(
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
