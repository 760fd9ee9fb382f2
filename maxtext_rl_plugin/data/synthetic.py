"""The synthetic task: seeded arithmetic word problems with exact integer answers and worked solutions.

The CPU demo's data (no download): problem i of a stream is a pure function of (synthetic_seed, stream, i), and a
teacher that sometimes adds where it should not (`synthetic_teacher_error_rate`) gives the SFT warm-up a mode for RL
to correct.

`synthetic_task=products` is the task where a tool matters (rl.use_agentic_rollout): "What is 47 * 86?" with
multi-digit operands, which a tiny model cannot multiply in its head. Its SFT demonstrations answer from the head
(`47 * 86 = 4042`, right, but not learnable by the model) except a fraction `synthetic_tool_rate` that call the
calculator in the Qwen tool-call markup (`tool_demonstration`), so the warm start knows the format but rarely uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
import sys
from typing import Optional

from absl import logging

from maxtext_rl_plugin.data import prompts
from maxtext_rl_plugin.data import splits
from maxtext_rl_plugin import errors
from maxtext_rl_plugin.errors import DataError

SYNTHETIC = "synthetic"  # the dataset_name / eval_dataset_name of this task

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
class SyntheticSettings:
  """The synthetic task's keys (`synthetic_*`), built once by `load.DataSettings.from_config`."""

  seed: int = 1234
  min_steps: int = 1
  max_steps: int = 2
  max_value: int = 20
  teacher_error_rate: float = 0.0
  task: str = "word_problems"  # or "products"
  tool_rate: float = 0.0  # products: fraction of SFT demonstrations that call the calculator


def product_problem(rng: random.Random, settings: SyntheticSettings) -> tuple[str, int, str]:
  """(question, answer, solution) of "What is a * b?" with a, b in [10, max_value] (multi-digit when max_value >= 10)."""
  lo = min(10, settings.max_value)
  a, b = rng.randint(lo, settings.max_value), rng.randint(lo, settings.max_value)
  return f"What is {a} * {b}?", a * b, f"{a} * {b} = {a * b}\n#### {a * b}"


def tool_demonstration(question: str, answer: int, tags: dict[str, str]) -> str:
  """A products solution that asks the calculator (Tunix's CalculatorTool in Qwen's markup) and copies its answer.

  The `<tool_response>` part is what the environment appends at rollout time (never sampled there: the turn stops at
  `</tool_call>`); in the SFT target it is the text that follows the call.
  """
  a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
  call = json.dumps({"name": "calculator", "arguments": {"a": a, "b": b, "op": "*"}})
  return (
      f"{tags['reasoning_start_token']}<tool_call>{call}</tool_call><tool_response>{answer}</tool_response>\n"
      f"{tags['reasoning_end_token']}\n{tags['solution_start_token']}{answer}{tags['solution_end_token']}"
  )


def synthetic_problem(rng: random.Random, settings: SyntheticSettings) -> tuple[str, int, str]:
  """(question, answer, GSM8K-style solution ending in '#### N') with 1..N exact integer steps.

  Operands are in [1, max_value]; running values stay in [0, 5 * max_value] so the answer space stays
  small enough for a tiny model to learn. Division only when exact.
  """
  steps = rng.randint(settings.min_steps, max(settings.min_steps, settings.max_steps))
  mv = settings.max_value
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


class SyntheticSplit(splits.DatasetSplit):
  """Synthetic problems generated from (seed, stream, index): unlimited (train) or a fixed list (eval).

  Train problems whose question text appears in `exclude` (the eval questions) or whose prompt is
  longer than the limit are redrawn from (seed, stream, index, attempt), so item i is still a pure
  function of the seed.
  """

  def __init__(
      self,
      settings: SyntheticSettings,
      stream: str,
      tokenizer,
      prompt_settings: prompts.PromptSettings,
      exclude: frozenset = frozenset(),
      max_prompt_tokens: Optional[int] = None,
      name: str = "",
  ):
    self.settings, self.stream, self.tokenizer, self.prompt_settings = settings, stream, tokenizer, prompt_settings
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
    rng = random.Random(f"{self.settings.seed}:{self.stream}:{i}:{attempt}")
    if self.settings.task == "products":
      return product_problem(rng, self.settings)
    return synthetic_problem(rng, self.settings)

  @functools.lru_cache(maxsize=4096)  # noqa: B019
  def __getitem__(self, i: int) -> splits.Example:
    if i < 0:
      raise IndexError(i)
    for attempt in range(100):
      q, a, sol = self._draw(i, attempt)
      if q in self.exclude:
        self.redrawn_eval_overlap += 1
        continue
      prompt = prompts.build_prompt(q, self.tokenizer, self.prompt_settings)
      if (
          self.max_prompt_tokens
          and self.tokenizer is not None
          and prompts.prompt_lengths(self.tokenizer, [prompt])[0] > self.max_prompt_tokens
      ):
        self.filtered_long += 1
        if self.filtered_long in (1, 100, 10000):  # by design (the item count stays exact): a warning only if verbose
          _redraw_log()(
              "synthetic/%s: %d prompts longer than max_prefill_predict_length=%d redrawn so far",
              self.stream,
              self.filtered_long,
              self.max_prompt_tokens,
          )
        continue
      if (
          self.stream == "train"
          and self.settings.teacher_error_rate > 0
          and random.Random(f"{self.settings.seed}:teacher:{i}").random() < self.settings.teacher_error_rate
      ):
        sol = adding_teacher(sol)[0]  # wrong unless all steps add; the gold answer stays the true one
      if (
          self.settings.task == "products"
          and self.stream == "train"
          and random.Random(f"{self.settings.seed}:tool:{i}").random() < self.settings.tool_rate
      ):
        sol = tool_demonstration(q, a, prompts.tag_tokens(self.prompt_settings))
      return splits.Example(q, str(a), sol, prompt, f"synthetic-{self.stream}-{i}")
    raise DataError(
        f"no synthetic problem for item {i} after 100 draws: each was longer than max_prefill_predict_length="
        f"{self.max_prompt_tokens} ({self.filtered_long} so far: raise it or lower synthetic_max_steps) or an eval "
        f"question ({self.redrawn_eval_overlap} so far: raise synthetic_max_value or lower synthetic_num_eval)"
    )


def _redraw_log():
  """Redrawn over-long prompts are how the synthetic task meets the prompt budget (the split keeps its size and every
  item stays a pure function of its index), nothing to act on: absl INFO, a warning under MAXTEXT_RL_VERBOSE=1."""
  return logging.warning if errors.verbose() else logging.info


def synthetic_eval(
    settings: SyntheticSettings, n: int, tokenizer, prompt_settings: prompts.PromptSettings, max_tokens: Optional[int]
) -> splits.ListSplit:
  """`n` distinct synthetic problems from the eval stream (deduplicated on question text)."""
  gen = SyntheticSplit(settings, "eval", tokenizer, prompt_settings, max_prompt_tokens=max_tokens)
  seen: set[str] = set()
  out: list[splits.Example] = []
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
    _redraw_log()("synthetic eval: %d prompts over max_prefill_predict_length=%s redrawn", gen.filtered_long, max_tokens)
  return splits.ListSplit(out, "synthetic/eval")
