"""The GSM8K reward stack MaxText users know, on the plugin's extraction and verification.

`match_format_exactly`, `match_format_approximately` and `check_answer` keep the names, config keys
(`reward_*`, `penalty_*`, `*_token`) and calling convention of MaxText 0.2.5's `utils_rl` (they accept
`tmvp_config=`), so a MaxText recipe's numbers carry over. What differs, and why:

* answers are found by the ordered rules of `extraction.py` (not only inside `<answer>`/`\\boxed{}`), so a
  model that writes "#### 18" or "The answer is 18" is graded on its answer; formatting is rewarded by
  the two format functions, not by zeroing the answer reward; every rule reads the whole number expression
  ("1/2", "1 1/2", "\\frac{1}{2}", "1e3", "1 234", "\u20135"), the same way for golds and completions;
* a tagged, boxed or marked answer counts only if its span reads whole as one value under a small grammar: "3 or
  5", "3-5", "not 5", "5 max", "\\boxed{5}0" score as wrong (rule `ambiguous`, counted) before any comparison, where
  MaxText leaves the verdict to math_verify's parser (docs/rewards.md, "The answer grammar");
* numbers are compared exactly in-process; math_verify only sees what is not a plain number, in
  killable workers with a per-item deadline (`verify.py`);
* partial credit: a wrong numeric answer within 10% of the gold earns `reward_ratio_guess_to_answer_high`,
  within 20% `reward_ratio_guess_to_answer_low` (the bands of MaxText's/Tunix's GSM8K recipes and of
  MaxText's `check_correctness`), anything else `penalty_incorrect_answer`; no answer at all earns
  `penalty_incorrect_format`.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
import functools
import json
from typing import Any, Optional, Sequence

from maxtext_rl_plugin.rewards import extraction as ex
from maxtext_rl_plugin.rewards import number_grammar as ng
from maxtext_rl_plugin.rewards import verify

_EPS = Fraction(1, 10**6)
_BANDS = ((Fraction(9, 10), Fraction(11, 10)), (Fraction(8, 10), Fraction(12, 10)))


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """The reward keys of a MaxText/plugin config, as a small picklable value (defaults: MaxText's rl.yml)."""

  reasoning_start_token: str = "<reasoning>"
  reasoning_end_token: str = "</reasoning>"
  solution_start_token: str = ex.DEFAULT_SOLUTION_START
  solution_end_token: str = ex.DEFAULT_SOLUTION_END
  reasoning_start_token_in_prompt: bool = False
  reward_exact_answer: float = 1.0
  reward_white_space_format_match: float = 1.0
  reward_exact_format_match: float = 0.1
  reward_partial_format_match: float = 0.0
  reward_ratio_guess_to_answer_high: float = 0.0
  reward_ratio_guess_to_answer_low: float = 0.0
  penalty_incorrect_format: float = 0.0
  penalty_incorrect_answer: float = 0.0
  reward_item_timeout_seconds: float = verify.DEFAULT_TIMEOUT_SECONDS
  math_verify_num_procs: Optional[int] = None

  @classmethod
  def of(cls, config: Any = None) -> "RewardConfig":
    """From a MaxText HyperParameters / pydantic config / RewardConfig / None (defaults)."""
    if config is None:
      return _DEFAULT
    if isinstance(config, cls):
      return config
    hit = _OF_CACHE.get(id(config))
    if hit is not None and hit[0] is config:  # configs are read-only for a run: convert once
      return hit[1]
    kwargs = {}
    for f in dataclasses.fields(cls):
      v = getattr(config, f.name, None)
      if v is not None:
        kwargs[f.name] = v
    rc = cls(**kwargs)
    if len(_OF_CACHE) > 16:
      _OF_CACHE.clear()
    _OF_CACHE[id(config)] = (config, rc)
    return rc


_DEFAULT = RewardConfig()
_OF_CACHE: dict[int, tuple[Any, RewardConfig]] = {}


@dataclasses.dataclass(frozen=True)
class ScoreResult:
  """One completion graded against one gold answer.

  `reward` is what the default stack (the three functions below) sums to; `partial` is MaxText's
  partial correctness (within 10% of the gold, or correct).
  """

  correct: bool
  reward: float
  extracted: Optional[str]
  rule: str
  format_ok: bool
  partial: bool
  format_reward: float = 0.0
  answer_reward: float = 0.0
  unreadable: bool = False  # the answer holds a number the grader cannot hold (number_grammar.unreadable): scored wrong
  ambiguous: bool = False  # a tagged/marked answer that is not one value ("3 or 5", "at least 5"): scored wrong

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def format_exact_ok(completion: str, rc: RewardConfig) -> bool:
  return ex.match_format_exact(
      completion,
      rc.reasoning_start_token,
      rc.reasoning_end_token,
      rc.solution_start_token,
      rc.solution_end_token,
      rc.reasoning_start_token_in_prompt,
  )


def match_format_exactly(
    prompts: Sequence[str], completions: Sequence[str], tmvp_config: Any = None, **kwargs: Any
) -> list[float]:
  """`reward_exact_format_match` when the completion has `<reasoning>..</reasoning>..<answer>X</answer>`."""
  del prompts, kwargs
  rc = RewardConfig.of(tmvp_config)
  w = rc.reward_exact_format_match
  return [w if isinstance(c, str) and format_exact_ok(c, rc) else 0.0 for c in completions]


def match_format_approximately(
    prompts: Sequence[str], completions: Sequence[str], tmvp_config: Any = None, **kwargs: Any
) -> list[float]:
  """Per tag seen exactly once `reward_partial_format_match`, else `penalty_incorrect_format` (MaxText's)."""
  del prompts, kwargs
  rc = RewardConfig.of(tmvp_config)
  good, bad = rc.reward_partial_format_match, rc.penalty_incorrect_format
  rs, re_, ss, se = rc.reasoning_start_token, rc.reasoning_end_token, rc.solution_start_token, rc.solution_end_token
  skip_rs = rc.reasoning_start_token_in_prompt
  out = []
  for c in completions:  # one expression, no per-tag helper calls: this runs for every completion of every step
    if not isinstance(c, str):
      c = ""
    out.append(
        (good if (skip_rs or c.count(rs) == 1) else bad)
        + (good if c.count(re_) == 1 else bad)
        + (good if c.count(ss) == 1 else bad)
        + (good if c.count(se) == 1 else bad)
    )
  return out


@functools.lru_cache(maxsize=65536)
def gold_alternatives(gold: Any) -> tuple[str, ...]:
  """Acceptable answers for a gold: a bare value, a GSM8K solution ending in `#### N`, or MaxText's
  JSON-encoded list of acceptable answers (`'["72", "72"]'`)."""
  if not isinstance(gold, str):
    g = ng.parse_gold(gold, numeric_only=False)
    return (g,) if g is not None else ()
  s = gold.strip()
  if s.startswith("[") and s.endswith("]"):
    try:
      items = json.loads(s)
      if isinstance(items, list):
        return tuple(dict.fromkeys(a for a in (ng.parse_gold(str(i), numeric_only=False) for i in items) if a))
    except ValueError:
      pass
  g = ng.parse_gold(s, numeric_only=False)
  return (g,) if g is not None else ()


def _ratio_band(pred: Optional[str], golds: tuple[str, ...]) -> int:
  """2 if the prediction is within 10% of a gold number, 1 if within 20%, else 0.

  Exact (Fractions): a float conversion overflows on "1e400" (OverflowError: one sampled completion ended a run) and
  rounds huge values together."""
  p = ng.to_number(pred)
  if p is None:
    return 0
  best = 0
  for g in golds:
    gv = ng.to_number(g)
    if gv is None or gv + _EPS == 0:
      continue
    r = (p + _EPS) / (gv + _EPS)
    if _BANDS[0][0] <= r <= _BANDS[0][1]:
      return 2
    if _BANDS[1][0] <= r <= _BANDS[1][1]:
      best = 1
  return best


# (key, result): a step grades one batch for the reward and again for metrics. One tuple, replaced whole, so a reader
# in another thread (rollouts ahead of the trainer, evaluation) never pairs one batch's key with another's result.
_LAST_GRADED: tuple = (None, None)


def _grade(
    completions: Sequence[str], answers: Sequence[Any], rc: RewardConfig
) -> list[tuple[ex.Extraction, bool, float, bool]]:
  """(extraction, correct, answer reward, partial) per completion; the last batch is memoised."""
  try:
    key = (tuple(completions), tuple(answers), rc)
    hash(key)
  except TypeError:
    return _grade_uncached(completions, answers, rc)
  global _LAST_GRADED
  last_key, result = _LAST_GRADED
  if last_key != key:
    result = _grade_uncached(completions, answers, rc)
    _LAST_GRADED = (key, result)
  return list(result)


RULE_UNREADABLE = ex.RULE_UNREADABLE
RULE_AMBIGUOUS = ex.RULE_AMBIGUOUS
# Answers that are never compared with the gold: scored `penalty_incorrect_answer`, as a wrong answer, and counted.
_NOT_ONE_VALUE = (RULE_UNREADABLE, RULE_AMBIGUOUS)


def _extract_safely(c: Any, rc: RewardConfig) -> ex.Extraction:
  """The completion's extraction, or RULE_UNREADABLE when the grader cannot hold its answer: an exponent beyond
  number_grammar.MAX_EXPONENT, or any error reading it (one sampled text must never end a run or a scoring file)."""
  if not isinstance(c, str):
    return ex.Extraction(None, ex.RULE_NONE)
  try:
    e = ex.extract(c, rc.solution_start_token, rc.solution_end_token)
    ng.to_number(e.value)
  except (ValueError, OverflowError, ArithmeticError, RecursionError, MemoryError):
    return ex.Extraction(None, RULE_UNREADABLE)
  return ex.Extraction(e.value, RULE_UNREADABLE, e.raw) if ng.unreadable(e.value) else e


def _band_safely(value: str, golds: tuple[str, ...]) -> int:
  try:
    return _ratio_band(value, golds)
  except (ValueError, OverflowError, ArithmeticError):
    return 0


def _no_number(golds: tuple[str, ...]) -> bool:
  return bool(golds) and all(ng.to_number(g) is None for g in golds)


def _grade_uncached(
    completions: Sequence[str], answers: Sequence[Any], rc: RewardConfig
) -> list[tuple[ex.Extraction, bool, float, bool]]:
  """(extraction, correct, answer reward, partial) per completion; slow verifications run in parallel. An answer the
  grader cannot hold (RULE_UNREADABLE) or that is not one value (RULE_AMBIGUOUS) scores `penalty_incorrect_answer`, as
  a wrong answer, and never reaches the comparison (nor math_verify, which would read a piece of it)."""
  exts = [_extract_safely(c, rc) for c in completions]
  golds = [gold_alternatives(a) for a in answers]
  # The answer rule reads "one value" against a numeric gold; a gold that is not one number ("(3, 5)", "3:30" in the
  # score CLI) sets its own shape, so such an answer is compared with it as found.
  exts = [
      ex.Extraction(e.value, e.found_by, e.raw) if e.rule == RULE_AMBIGUOUS and e.found_by and _no_number(g) else e
      for e, g in zip(exts, golds)
  ]
  pairs, owners = [], []
  for i, (e, g) in enumerate(zip(exts, golds)):
    if e.value is not None and e.rule not in _NOT_ONE_VALUE:
      for alt in g:
        pairs.append((e.value, alt))
        owners.append(i)
  verdicts = verify.verify_batch(pairs, rc.reward_item_timeout_seconds, rc.math_verify_num_procs)
  correct = [False] * len(completions)
  for i, v in zip(owners, verdicts):
    correct[i] = correct[i] or v
  out = []
  for e, g, ok in zip(exts, golds, correct):
    if e.rule in _NOT_ONE_VALUE:
      out.append((e, False, rc.penalty_incorrect_answer, False))
    elif e.value is None:
      out.append((e, False, rc.penalty_incorrect_format, False))
    elif ok:
      raw = e.raw
      ws_only = raw is not None and raw != raw.strip() and raw.strip() in g
      out.append((e, True, rc.reward_white_space_format_match if ws_only else rc.reward_exact_answer, True))
    else:
      band = _band_safely(e.value, g)
      r = (rc.penalty_incorrect_answer, rc.reward_ratio_guess_to_answer_low, rc.reward_ratio_guess_to_answer_high)[band]
      out.append((e, False, r, band == 2))
  return out


def check_answer(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any] = (), tmvp_config: Any = None, **kwargs: Any
) -> list[float]:
  """Answer correctness with partial credit and penalties (see module docstring); MaxText's `check_numbers` role."""
  del prompts, kwargs
  if len(answer) != len(completions):
    raise ValueError(f"check_answer: got {len(answer)} answers for {len(completions)} completions")
  return [g[2] for g in _grade(completions, answer, RewardConfig.of(tmvp_config))]


# MaxText's name for the same role, so `reward_functions=check_numbers` keeps working.
check_numbers = check_answer

BUILTIN_REWARD_FNS = {
    "match_format_exactly": match_format_exactly,
    "match_format_approximately": match_format_approximately,
    "check_answer": check_answer,
    "check_numbers": check_answer,
}
DEFAULT_STACK = ("match_format_exactly", "match_format_approximately", "check_answer")


def score_batch(
    completions: Sequence[str], golds: Sequence[Any], settings: Optional[RewardConfig] = None
) -> list[ScoreResult]:
  """Grade many completions at once (the slow path runs in parallel); per-completion eval metrics. `settings`: the
  reward keys (`RewardConfig.of(config)`, read once per config); None = MaxText's rl.yml defaults."""
  if settings is not None and not isinstance(settings, RewardConfig):
    raise TypeError(f"score_batch takes a RewardConfig (RewardConfig.of(config)), not {type(settings).__name__}")
  rc = settings or _DEFAULT
  graded = _grade(completions, golds, rc)
  approx = match_format_approximately((), completions, rc)
  out = []
  for c, (e, ok, answer_r, partial), approx_r in zip(completions, graded, approx):
    fmt = isinstance(c, str) and format_exact_ok(c, rc)
    format_r = (rc.reward_exact_format_match if fmt else 0.0) + approx_r
    unreadable, ambiguous = e.rule == RULE_UNREADABLE, e.rule == RULE_AMBIGUOUS
    out.append(
        ScoreResult(ok, format_r + answer_r, e.value, e.rule, fmt, partial, format_r, answer_r, unreadable, ambiguous)
    )
  return out


def score(completion: str, gold: Any, settings: Optional[RewardConfig] = None) -> ScoreResult:
  """Grade one completion against a gold (bare value or GSM8K solution ending in `#### N`)."""
  return score_batch([completion], [gold], settings)[0]
