"""Locating the answer in a GSM8K-style completion: which text is the answer, found by which rule.

Everything here is pure Python with linear-time scans (`str.rfind`, regexes with bounded quantifiers),
because it runs on every completion of every RL step and must not stall on adversarial text
(100 KB of braces, thousands of unclosed tags). MaxText's `utils_rl.extract_answer` only looks inside
`<answer>` tags or `\\boxed{}`; models that answer in any other style score zero there. Here each
completion goes through an ordered list of rules and the rule that fired is recorded, so a reward
curve can be read together with *how* answers were found. A tagged or marked answer must state one value
(`_read_answer`, `_marked`; the vocabulary in answer_rule.py, the table in docs/rewards.md "The answer rule"); free
text keeps the last-number convention.

What one number is (signs, separators, fractions, scales, exponents) and its value are in number_grammar.py: this
module decides where the answer is and whether it is one value, that one reads a piece of text as a number. Split so
that each stays one concern under 500 lines.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from maxtext_rl_plugin.rewards import answer_rule
from maxtext_rl_plugin.rewards import number_grammar as ng

# Rule names, in priority order (recorded in ScoreResult.rule and the score CLI's output).
RULE_ANSWER_TAG = "answer_tag"
RULE_BOXED = "boxed"
RULE_HASH = "hash"
RULE_ANSWER_IS = "answer_is"
RULE_A_COLON = "a_colon"
RULE_LAST_NUMBER = "last_number"
RULE_NONE = "none"
# Not an extraction rule: the grader's verdict on an answer it cannot hold (gsm8k.py; `number_grammar.unreadable`).
RULE_UNREADABLE = "unreadable"
# Not an extraction rule either: a tagged answer that is not one value (several values, a range, a negation, a
# comparison; answer_rule.py), scored wrong and counted.
RULE_AMBIGUOUS = "ambiguous"
RULES = (
    RULE_ANSWER_TAG,
    RULE_BOXED,
    RULE_HASH,
    RULE_ANSWER_IS,
    RULE_A_COLON,
    RULE_LAST_NUMBER,
    RULE_NONE,
    RULE_UNREADABLE,
    RULE_AMBIGUOUS,
)

DEFAULT_SOLUTION_START = "<answer>"  # MaxText rl.yml's solution tags; RewardConfig and the data prompts use these
DEFAULT_SOLUTION_END = "</answer>"

# A qualifier between an answer marker and its number ("the answer is not 5", "#### at least 5"): not one value.
_QUALIFIER = (
    r"(?P<q>(?:(?i:not|never|no|(?:less|fewer|more|greater)[ \t]+than|at[ \t]+(?:least|most)|up[ \t]+to|about|around"
    r"|approximately|approx\.?|roughly|nearly|almost|over|under|above|below|between|either|maybe|perhaps|possibly"
    r"|probably|likely|definitely|certainly|clearly|surely|exactly|precisely|really|actually|just|simply|then|thus"
    r"|therefore|so|now)[ \t]{1,4}){1,3}|(?:[<>]=?|!=|[~\u2264\u2265\u2248\u2260])[ \t]{0,2})?"
)
_MARKED_NUM = r"(?P<v>" + ng.SPACED_SIGN + ng.NUM + ")"
_OPEN = r"[\[(]?[ \t]{0,2}"  # "#### [3, 5]": a bracket opening a list (the tail then sees the list)
_HASH_RE = re.compile(r"####[ \t]{0,16}" + _QUALIFIER + _OPEN + r"\$?[ \t]{0,4}" + _MARKED_NUM)
_ANSWER_IS_RE = re.compile(
    r"answer(?:[ \t]{1,4}is|[ \t]{0,4}:|[ \t]{1,4}=)[ \t]{0,8}(?:\*\*)?[ \t]{0,4}"
    + _QUALIFIER
    + _OPEN
    + r"\\?\$?[ \t]{0,4}(?:\\boxed\{)?"
    + _MARKED_NUM,
    re.IGNORECASE,
)
# Every answer marker, with or without a number after it (the last one's clause is checked for hedges).
_ANSWER_MARK_RE = re.compile(r"answer(?:[ \t]{1,4}is|[ \t]{0,4}:|[ \t]{1,4}=)", re.IGNORECASE)
_A_COLON_RE = re.compile(
    r"(?:^|\n)[ \t]{0,8}(?:\*\*)?A(?:\*\*)?[ \t]{0,4}:[ \t]{0,8}" + _QUALIFIER + _OPEN + r"\\?\$?[ \t]{0,4}" + _MARKED_NUM
)
# What may follow a marked number and makes it one of several ("#### 3-5", "the answer is 3 or 5", "A: 3:30",
# "answer: 5 or more", "5+"): another number after a connective, a dash, colon or slash, a list comma, "or more".
_NUMBER_AHEAD = r"[ \t]{0,2}\(?(?:\\?\$)?[ \t]{0,2}(?:" + ng.MINUS_CLASS + r"[ \t]{0,2})?\.?\d"
_HEDGE_TAIL_RE = re.compile(
    r"[ \t]{0,4}\(?(?:"
    r"(?:,[ \t]{0,4})?(?i:or|to|and|through|thru|nor|vs\.?|versus)[ \t]{1,4}"
    + _NUMBER_AHEAD
    + r"|(?:,[ \t]{0,4})?(?i:or[ \t]{1,4}(?:more|less|fewer|so|above|below|over|under|greater|higher|lower))\b"
    + r"|[,;]"
    + _NUMBER_AHEAD
    + r"|[-\u2013\u2014\u2212~:/]"
    + _NUMBER_AHEAD
    + r"|\+(?![ \t]{0,4}[\d(\\.])"
    + r"|[ \t]{0,2}\?"
    + r"|-?(?i:ish)\b"
    + r"|(?:,[ \t]{0,4})?(?i:or)\b[^.\n]{0,40}?\d"
    + r")"
)
_PLAIN_ANSWER_RE = re.compile(r"\\?\$?-?\d[\d,]*(?:\.\d*)?%?")
_CLAUSE_END_RE = re.compile(r"[.!;]?(?:\s*\n|[.!;](?:\s|\Z|<))|<|\b(?:because|since|as|so|which|that|where|when)\b")
# Words of prose (two letters or more, not a LaTeX command): a body with them is read by its numbers, not sent whole to
# math_verify, which would take a piece of "779 (approx.)" or "5 (3 apples)".
_PROSE_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}")
_LIST_RE = re.compile(r"[,;][ \t]{1,4}[-\d.\\$]")
# A minus sign right before a box, and what comes before it: an operand (a digit, a closing bracket, a one-letter
# variable) makes it the operator of an expression ("10 - \\boxed{5}", "x - \\boxed{5}"); else it is the box's sign.
_SIGN_BEFORE_RE = re.compile(r"(?P<sign>" + ng.MINUS_CLASS + r")[ \t$]*\Z")
_OPERAND_BEFORE_RE = re.compile(r"(?:[\d)\]}]|(?<![A-Za-z])[A-Za-z])[ \t$]*\Z")
_BRACE_RE = re.compile(r"[{}]")
_BOXED = "\\boxed"
_MATH_CHARS = frozenset("\\^{}()*/+=<>|[]_")


class Extraction(NamedTuple):
  """What `extract_answer` found: the answer text (None if nothing), the rule, and the raw tag body."""

  value: Optional[str]
  rule: str
  raw: Optional[str] = None  # the unstripped text the value came from (answer tag body), for whitespace rewards
  found_by: Optional[str] = None  # the rule that found an answer judged RULE_AMBIGUOUS (gsm8k.py: non-numeric golds)


def _boxes(text: str, every: bool = False) -> list[tuple[int, int, int]]:
  """(start of `\\boxed`, content start, content end) of the box whose closing brace comes last, or of every balanced
  box when `every`; linear in len(text).

  One pass over the braces with a stack (MaxText's fixed version of the same idea): unclosed boxes are
  ignored, nested braces inside a box are kept.
  """
  if _BOXED not in text:
    return []
  found: list[tuple[int, int, int]] = []
  stack: list[int] = []
  for m in _BRACE_RE.finditer(text):
    i = m.start()
    if text[i] == "{":
      stack.append(i)
    elif stack:
      op = stack.pop()
      if op >= 6 and text.startswith(_BOXED, op - 6):
        found.append((op - 6, op + 1, i))
  if every:
    return found
  return [max(found, key=lambda b: b[2])] if found else []


def last_balanced_boxed(text: str) -> Optional[str]:
  """Content of the `\\boxed{...}` whose closing brace comes last (see `_boxes`)."""
  box = _boxes(text)
  return text[box[0][1] : box[0][2]].strip() if box else None


def last_tag_block(text: str, start: str, end: str) -> Optional[str]:
  """Body of the last complete `start ... end` block (the nearest `start` before the last `end`)."""
  j = text.rfind(end)
  if j < 0:
    return None
  # If the last `end` has no `start` before it, no earlier `end` has one either.
  i = text.rfind(start, 0, j)
  return text[i + len(start) : j] if i >= 0 else None


def _last_match(regex: re.Pattern, text: str) -> Optional[re.Match]:
  last = None
  for m in regex.finditer(text):
    last = m
  return last


def _boxed_value(text: str, box: tuple[int, int, int]) -> tuple[str, Optional[str]]:
  """(answer, verdict) of a box in `text` (see `_read_answer`): a minus sign just before the box is its sign
  ("-\\boxed{5}" is -5); after an operand ("10 - \\boxed{5}") the box is part of an expression, not one value."""
  content = text[box[1] : box[2]].strip()
  m = _SIGN_BEFORE_RE.search(text, max(0, box[0] - 16), box[0])
  if m is None:
    return _read_answer(content)
  if _OPERAND_BEFORE_RE.search(text, max(0, m.start() - 16), m.start()):
    return text[max(0, box[0] - 40) : box[2] + 1].strip(), RULE_AMBIGUOUS
  return _read_answer("-" + content)


def _read_body(body: str) -> tuple[str, Optional[str]]:
  """(answer, verdict) of an `<answer>` body or a box's content: its box, else the body read as one value. Boxes that
  disagree ("\\boxed{3} or \\boxed{5}") are not one value."""
  s = body.strip()
  boxes = _boxes(s, every=s.count(_BOXED) > 1)
  if not boxes:
    return _read_answer(s)
  outer, reach = [], -1
  for b in sorted(boxes):  # boxes not inside another box
    if b[0] > reach:
      outer.append(b)
      reach = b[2]
  if len(outer) > 1 and len({ng.normalize_answer(_boxed_value(s, b)[0]) for b in outer[-16:]}) > 1:
    return s, RULE_AMBIGUOUS
  return _boxed_value(s, outer[-1])


def _read_answer(s: str) -> tuple[str, Optional[str]]:
  """The answer rule (answer_rule.py; docs/rewards.md): (answer text, None) when `s` states one value -- one number
  (with its sign, unit words, scale), an equation's right-hand side ("x = 5"), an expression for math_verify
  ("\\sqrt{64}") or a text answer without digits ("B") -- else (`s`, RULE_AMBIGUOUS) for several values, a range, a
  negation or a comparison, or (`s`, RULE_UNREADABLE) for a number whose meaning the grader does not hold."""
  s = s.strip()
  if len(s) > ng.MAX_ANSWER_CHARS or _PLAIN_ANSWER_RE.fullmatch(s):  # "1200", "$1,200", "72.00": one value, no more work
    return s, None
  if answer_rule.COMPARISON_SIGN_RE.search(s):  # before the number reader, which drops the "~" of "~5"
    return s, RULE_AMBIGUOUS
  if ng.to_number(s) is not None:
    return s, None
  cl = ng.clean(s)
  if answer_rule.words_say_not_one_value(cl):
    return s, RULE_AMBIGUOUS
  if ng.SUBSCRIPT_DIGIT_RE.search(cl):
    return s, RULE_UNREADABLE
  if "=" in cl:  # "3 * 6 = 18", "x = 5": the right-hand side, read by the same rule
    rhs = cl.rsplit("=", 1)[1].strip()
    if rhs:
      return _read_answer(rhs)
  expression = any(c in _MATH_CHARS for c in cl) and not _PROSE_RE.search(cl)
  if expression:  # math stays whole ("\\sqrt{64}", "2^3") for math_verify; a list is not one value
    return (s, RULE_AMBIGUOUS) if _LIST_RE.search(cl) else (s, None)
  nums = list(ng.BODY_NUM_RE.finditer(cl))
  if not nums:
    return s, None
  if len(nums) > 1:  # "3 or 5", "3-5", "3, 5", "3:30", "12 then 15 apples"
    return s, RULE_AMBIGUOUS
  m = nums[0]
  if cl.startswith("!", m.end()) and not cl.startswith("!=", m.end()):
    return m.group(0) + "!", None  # "5!" is 120 (math_verify), never 5
  if answer_rule.qualifier_before(cl[: m.start()]):  # "less than 5", "about 5", "over 5"
    return s, RULE_AMBIGUOUS
  if answer_rule.words_change_the_value(cl[: m.start()] + " " + cl[m.end() :]):
    return s, RULE_UNREADABLE  # "half of 10", "5 hundred thousand"
  return m.group(0).rstrip(","), None


def extract_answer(
    text: str, solution_start: str = DEFAULT_SOLUTION_START, solution_end: str = DEFAULT_SOLUTION_END
) -> tuple[Optional[str], str]:
  """(answer text or None, rule that fired) for any model's completion.

  Rules, first that applies wins: the last `<answer>...</answer>` block (tokens configurable; a
  `\\boxed{}` inside it is taken; the body must state one value), the last balanced `\\boxed{}`, the last `#### N`,
  the last "the answer is N" / "Answer: N", the last line "A: N", and finally the last number. A tagged or marked
  answer that is not one value gives RULE_AMBIGUOUS (or RULE_UNREADABLE), never a piece of it.
  """
  e = extract(text, solution_start, solution_end)
  return e.value, e.rule


def extract(
    text: str, solution_start: str = DEFAULT_SOLUTION_START, solution_end: str = DEFAULT_SOLUTION_END
) -> Extraction:
  """`extract_answer` with the raw tag body kept (see `Extraction`)."""
  if not isinstance(text, str) or not text:
    return Extraction(None, RULE_NONE)
  body = last_tag_block(text, solution_start, solution_end) if solution_start and solution_end else None
  if body is not None and body.strip():
    value, verdict = _read_body(answer_rule.normalize(body))
    return Extraction(value, verdict or RULE_ANSWER_TAG, body, RULE_ANSWER_TAG)
  text = answer_rule.normalize(text)
  box = _boxes(text)
  if box and text[box[0][1] : box[0][2]].strip():
    value, verdict = _boxed_value(text, box[0])
    return Extraction(value, verdict or RULE_BOXED, text[box[0][1] : box[0][2]].strip(), RULE_BOXED)
  if "####" in text:
    k = text.rfind("####") + 4
    end = text.find("\n", k)
    line = text[k : end if 0 <= end < k + ng.MAX_ANSWER_CHARS else k + ng.MAX_ANSWER_CHARS + 1].strip()
    if any(c.isdigit() for c in line):  # GSM8K's "#### N": the line is the answer, read as a tag body (and as golds)
      value, verdict = _read_answer(line)
      return Extraction(value, verdict or RULE_HASH, None, RULE_HASH)
    m = _last_match(_HASH_RE, text)
    if m is not None:
      return _marked(text, m, RULE_HASH)
  lower_has_answer = "nswer" in text or "NSWER" in text
  if lower_has_answer:
    m = _last_match(_ANSWER_IS_RE, text)
    k = _last_match(_ANSWER_MARK_RE, text)
    if k is not None and (m is None or m.start() < k.start()) and _hedged_clause(text, k.end(), negations=True):
      clause = text[k.end() : k.end() + 80].split("\n", 1)[0].strip()  # "unclear, maybe 5"
      return Extraction(clause, RULE_AMBIGUOUS, None, RULE_ANSWER_IS)
    if m is not None:
      return _marked(text, m, RULE_ANSWER_IS)
  if "A" in text and ":" in text:
    m = _last_match(_A_COLON_RE, text)
    if m is not None:
      return _marked(text, m, RULE_A_COLON)
  v = last_number(text)
  if v is not None:
    return Extraction(v, RULE_LAST_NUMBER)
  return Extraction(None, RULE_NONE)


def _hedged_words(words: str) -> bool:
  """Whether the words between an answer marker and its number qualify it ("not", "at least", "about"); adverbs
  ("clearly", "therefore") do not."""
  return (
      answer_rule.words_say_not_one_value(words) or answer_rule.qualifier_before(words) or "no" in words.lower().split()
  )


def _hedged_clause(text: str, pos: int, negations: bool = False) -> bool:
  """Whether the clause from `pos` (to the end of its sentence or line, or a "because") bounds, approximates or doubts
  a number ("5 at most", "5 (approx.)", "5, maybe 6", "5 ± 1"). After a marked number a negation is about something
  else ("5, not 3"); right after the marker (`negations`) it is the answer's ("the answer is not clear, maybe 5")."""
  chunk = text[pos : pos + 80]
  end = _CLAUSE_END_RE.search(chunk)
  clause = chunk[: end.start()] if end else chunk
  if not clause.strip() or (negations and not any(c.isdigit() for c in clause)):
    return False
  words = answer_rule.words_say_not_one_value if negations else answer_rule.words_bound_or_doubt
  return bool(words(clause) or answer_rule.COMPARISON_SIGN_RE.search(clause))


def _marked(text: str, m: re.Match, rule: str) -> Extraction:
  """The number an answer marker (`#### N`, "the answer is N", "A: N") points at, or the marked clause with
  RULE_AMBIGUOUS when a qualifier comes before it ("not", "at least") or another value after it ("or 6", "-6")."""
  if not m["q"] and text[m.end() : m.end() + 1] in ("", "\n"):  # "#### 18" ending its line: nothing qualifies it
    return Extraction(m["v"], rule)
  q = m["q"] or ""
  qualified = q[:1] in tuple("<>!~\u2264\u2265\u2248\u2260") or _hedged_words(q)  # "not 5", ">= 5"; not "clearly 5"
  if qualified or _HEDGE_TAIL_RE.match(text, m.end()) or _hedged_clause(text, m.end()):
    start = m.start("q") if m["q"] else m.start("v")
    end = text.find("\n", m.end())
    clause = text[start : end if 0 <= end < start + 120 else start + 120].strip()
    return Extraction(clause, RULE_AMBIGUOUS, None, rule)
  return Extraction(m["v"], rule)


def last_number(text: str) -> Optional[str]:
  """The last number written in `text` (scans the tail first, so long completions cost little)."""
  n = len(text)
  window = 512
  while True:
    lo = max(0, n - window)
    # Back off to whitespace that does not follow a digit, so a number expression ("1 234", "\\frac{1}{2}",
    # "1e5") is never cut at the window edge.
    while lo > 0 and (not text[lo - 1].isspace() or (lo >= 2 and text[lo - 2].isdigit())):
      lo -= 1
    found = None
    for m in ng.NUM_RE.finditer(text, lo):
      found = m.group(0)
    if found is not None or lo == 0:
      return found.rstrip(",") if found else None
    window *= 8


def match_format_exact(
    text: str,
    reasoning_start: str,
    reasoning_end: str,
    solution_start: str,
    solution_end: str,
    reasoning_start_in_prompt: bool = False,
) -> bool:
  """True iff MaxText's format regex `RS.*?RE.*?SS(.+?)SE` (DOTALL) would match, in linear time.

  Earliest occurrences are optimal for this ordered-subsequence pattern, so four `str.find`s decide
  it exactly without the regex's quadratic backtracking on text with many unclosed tags.
  """
  pos = 0
  if not reasoning_start_in_prompt:
    i = text.find(reasoning_start)
    if i < 0:
      return False
    pos = i + len(reasoning_start)
  j = text.find(reasoning_end, pos)
  if j < 0:
    return False
  k = text.find(solution_start, j + len(reasoning_end))
  if k < 0:
    return False
  return text.find(solution_end, k + len(solution_start) + 1) >= 0
