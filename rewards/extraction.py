"""Locating the answer in a GSM8K-style completion: which text is the answer, found by which rule.

Everything here is pure Python with linear-time scans (`str.rfind`, regexes with bounded quantifiers),
because it runs on every completion of every RL step and must not stall on adversarial text
(100 KB of braces, thousands of unclosed tags). MaxText's `utils_rl.extract_answer` only looks inside
`<answer>` tags or `\\boxed{}`; models that answer in any other style score zero there. Here each
completion goes through an ordered list of rules and the rule that fired is recorded, so a reward
curve can be read together with *how* answers were found. A tagged, boxed or marked answer counts only if its span
reads WHOLE under a small grammar (`_read_answer`, `_box_context`, `_marked`; the word classes in answer_rule.py, the
grammar in docs/rewards.md "The answer grammar"): anything left over makes it ambiguous. Free text keeps the
last-number convention, reading whole numbers only (`_last_number`).

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

# Answer markers: "the answer is", "Answer:", "answer =", and "the answer <modal> be": a modal of possibility ("could",
# "might", "may", "can") makes the clause a guess (ambiguous); the others assert.
_ANSWER_MARK_RE = re.compile(
    r"answer(?:[ \t]{1,4}is|[ \t]{0,4}:|[ \t]{1,4}=|[ \t]{1,4}(?P<modal>could|might|may|can|would|will|should|must)"
    r"[ \t]{1,4}be)(?:[ \t]{0,4}:)?",
    re.IGNORECASE,
)
_GUESSING_MODALS = ("could", "might", "may", "can")
_A_COLON_RE = re.compile(r"(?:^|\n)[ \t]{0,8}(?:\*\*)?A(?:\*\*)?[ \t]{0,4}:")
_PLAIN_ANSWER_RE = re.compile(r"\\?\$?-?\d[\d,]*(?:\.\d*)?%?")
# Where a marked clause ends: a line break, a sentence end (a stop before a capital, a tag or the end: "ca. 5" and
# "5..6" go on), a tag, or a subordinate clause ("because", "since", "which").
_CLAUSE_END_RE = re.compile(
    r"[.!;]?[ \t]*\n|[.!;](?=[ \t]*(?:[A-Z<]|\Z))|<|\b(?:because|since|as|so|which|that|where|when)\b"
)
# Words of prose (two letters or more, not a LaTeX command): a body with them is read by its numbers, not sent whole to
# math_verify, which would take a piece of "779 (approx.)" or "5 (3 apples)".
_PROSE_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}")
_LIST_RE = re.compile(r"[,;][ \t]{1,4}[-\d.\\$]")
_LIST_SEP_RE = re.compile(r"[,;][ \t]{1,4}\S")  # "x = 5, y = 6": several equations, not one
_DIGIT_UNDERSCORE_RE = re.compile(r"\d_\d")  # "1_000": no grouping the grammar reads (Python's), never "1" or "000"
# A minus sign right before a box, and what comes before it: an operand (a digit, a closing bracket, a one-letter
# variable) makes it the operator of an expression ("10 - \\boxed{5}", "x - \\boxed{5}"); else it is the box's sign.
_SIGN_BEFORE_RE = re.compile(r"(?P<sign>" + ng.MINUS_CLASS + r")[ \t$]*\Z")
_OPERAND_BEFORE_RE = re.compile(r"(?:[\d)\]}]|(?<![A-Za-z])[A-Za-z])[ \t$]*\Z")
# Math delimiters around a box ("$\\boxed{5}$", "\\(\\boxed{5}\\)"): markup, not part of its value.
_DELIMS_RE = re.compile(r"\$|\\[()\[\]]")
# What joins one value to another right before a box in free text ("\\boxed{5} or \\boxed{6}", "5 then \\boxed{6}").
_JOINED_BEFORE_RE = re.compile(
    r"(?:\d|\}|\b(?i:or|and|then|to|nor|vs|versus|through|thru|between|from|plus|minus|times|than)|"
    r"\b(?i:could|might|may|can)[ \t]+be)[ \t,]*\Z"
)
_GLUED_BEFORE_RE = re.compile(r"\d(?:\\,|\{,\})\Z")
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


def _boxed_value(text: str, box: tuple[int, int, int], free: bool = False) -> tuple[str, Optional[str]]:
  """(answer, verdict) of a box in `text` (see `_read_answer`): a minus sign just before the box is its sign
  ("-\\boxed{5}" is -5); after an operand ("10 - \\boxed{5}") the box is part of an expression, not one value. What
  stands around the box must read too (`_box_context`): "2\\boxed{5}", "\\boxed{5}0", "\\boxed{5} or 6" do not."""
  content = text[box[1] : box[2]].strip()
  start, sign = box[0], ""
  m = _SIGN_BEFORE_RE.search(text, max(0, box[0] - 16), box[0])
  if m is not None:
    if _OPERAND_BEFORE_RE.search(text, max(0, m.start() - 16), m.start()):
      return text[max(0, box[0] - 40) : box[2] + 1].strip(), RULE_AMBIGUOUS
    start, sign = m.start(), "-"
  verdict = _box_context(text, start, box[2] + 1, free)
  if verdict is not None:
    return text[max(0, start - 40) : box[2] + 41].strip(), verdict
  return _read_answer(sign + content)


def _box_context(text: str, start: int, end: int, free: bool) -> Optional[str]:
  """The verdict on the text around a box at text[start:end] (None: the box is the answer). Nothing may be glued to
  it ("2\\boxed{5}", "\\boxed{5}^2", "\\boxed{3}\\frac12"); what follows it to the end of its clause must read as a
  span's tail (answer_rule.read_tail: "\\boxed{5} or 6", "$\\boxed{5}$ thousand" do not); what precedes it must read
  as a span's lead in a tag body, and in free text (`free`: working precedes it) must not join it to another value
  ("\\boxed{5} or \\boxed{6}") nor qualify it ("about \\boxed{5}")."""
  before, after = text[:start].rstrip(" \t$"), text[end:]
  if text[start - 1 : start].isalnum() or text[start - 1 : start] in ("}", "_", "^") or after[:1].isalnum():
    return RULE_AMBIGUOUS
  if after[:1] in ("^", "_", "{", "\\") and not after.startswith(("\\)", "\\]")):
    return RULE_AMBIGUOUS
  if free:
    stop = _CLAUSE_END_RE.search(after, 0, 200)
    after = after[: stop.start() if stop else 200]
  tail = answer_rule.read_tail(_DELIMS_RE.sub("", after), False)
  if tail is not None:
    return tail
  lead = _DELIMS_RE.sub("", before)
  if lead.rstrip().endswith("="):  # "3 + 2 = \\boxed{5}": the right-hand side; "x = 5, y = \\boxed{6}" is not one
    return RULE_AMBIGUOUS if _LIST_SEP_RE.search(lead[lead.rfind("\n") + 1 :]) else None
  if not free:
    return answer_rule.read_lead(lead, False)
  clause = re.split(r"[.!?;:\n]", lead[-200:])[-1]
  if _JOINED_BEFORE_RE.search(clause) or answer_rule.COMPARISON_SIGN_RE.search(clause[-3:]):
    return RULE_AMBIGUOUS
  if answer_rule.words_say_not_one_value(clause) or answer_rule.qualifier_before(clause):
    return RULE_AMBIGUOUS
  return None


def _read_body(body: str) -> tuple[str, Optional[str]]:
  """(answer, verdict) of an `<answer>` body or a box's content: its box, else the body read as one value. Boxes that
  disagree ("\\boxed{3} or \\boxed{5}") are not one value; boxes that agree ("\\boxed{5}, that is \\boxed{5}") are."""
  s = body.strip()
  boxes = _boxes(s, every=s.count(_BOXED) > 1)
  if not boxes:
    return _read_answer(s)
  outer, reach = [], -1
  for b in sorted(boxes):  # boxes not inside another box
    if b[0] > reach:
      outer.append(b)
      reach = b[2]
  if len(outer) > 1:
    values = {ng.normalize_answer(_read_answer(s[b[1] : b[2]])[0]) for b in outer[-16:]}
    if len(values) > 1:
      return s, RULE_AMBIGUOUS
    return _read_answer(s[outer[-1][1] : outer[-1][2]])
  return _boxed_value(s, outer[-1])


def _read_answer(s: str, marked: bool = False) -> tuple[str, Optional[str]]:
  """The answer rule (docs/rewards.md "The answer grammar"): (answer text, None) when the span `s` reads WHOLE as one
  value -- one number with its sign, separators, currency, scale and unit (number_grammar.py, answer_rule.py), with
  around it only what the span grammar allows (`answer_rule.read_lead`/`read_tail`: markup, a statement before it, a
  unit phrase after it, punctuation); an equation read at its last "=" ("3 * 6 = 18"); an expression for math_verify
  ("\\sqrt{64}"); a text answer without digits ("B") -- else (`s`, RULE_AMBIGUOUS) when anything is left over
  (several values, a range, a negation, a comparison, a hedge, a piece of a number), or (`s`, RULE_UNREADABLE) for a
  number whose meaning the grader does not hold ("5 squared", "5₂"). `marked`: the clause after an answer marker,
  where only asserting adverbs may precede the number ("clearly 5"; "ca. 5" is left over)."""
  s = s.strip()
  if marked:  # "the answer is 5, not 3": one value stated, another ruled out
    s = answer_rule.CORRECTION_RE.sub("", s)
  if len(s) > ng.MAX_ANSWER_CHARS or _PLAIN_ANSWER_RE.fullmatch(s):  # "1200", "$1,200", "72.00": one value, no more work
    return s, None
  if answer_rule.COMPARISON_SIGN_RE.search(s):  # before the number reader, which drops the "~" of "~5"
    return s, RULE_AMBIGUOUS
  if ng.to_number(s) is not None:
    return s, None
  cl = ng.clean(s)
  if answer_rule.words_say_not_one_value(cl):
    return s, RULE_AMBIGUOUS
  if ng.SUBSCRIPT_DIGIT_RE.search(cl) or _DIGIT_UNDERSCORE_RE.search(cl):
    return s, RULE_UNREADABLE
  if "=" in cl:  # "3 * 6 = 18", "x = 5": the right-hand side, read by the same rule; "x = 5, y = 6" is not one value
    lhs, rhs = cl.rsplit("=", 1)
    if rhs.strip():
      return (s, RULE_AMBIGUOUS) if _LIST_SEP_RE.search(lhs) else _read_answer(rhs)
  if marked and ":" in cl:  # "the answer is the sum of 3 and 2: 5": a colon marks the value again
    head, value = cl.rsplit(":", 1)
    if _PROSE_RE.search(head) and value.strip():
      return _read_answer(value, marked=True)
  if cl[:1] + cl[-1:] in ("()", "[]") and not any(c in "()[]" for c in cl[1:-1]):  # "(5)": its content, read
    return _read_answer(cl[1:-1], marked)
  expression = any(c in _MATH_CHARS for c in cl) and not _PROSE_RE.search(cl)
  if expression:  # math stays whole ("\\sqrt{64}", "2^3") for math_verify; a list is not one value
    return (s, RULE_AMBIGUOUS) if _LIST_RE.search(cl) else (s, None)
  nums = list(ng.BODY_NUM_RE.finditer(cl))
  if not nums:  # a text answer ("B"), or digits no number reads whole ("1,0000"): never a piece of them
    return (s, RULE_UNREADABLE) if any(c.isdigit() for c in cl) else (s, None)
  if len(nums) > 1:  # "3 or 5", "3-5", "3, 5", "3:30", "12 then 15 apples", "5..6", "5 & 6"
    return s, RULE_AMBIGUOUS
  m = nums[0]
  if cl.startswith("!", m.end()) and not cl.startswith("!=", m.end()):
    return m.group(0) + "!", None  # "5!" is 120 (math_verify), never 5
  value = m.group(0).rstrip(",")
  lead = answer_rule.read_lead(cl[: m.start()], marked)
  tail = answer_rule.read_tail(cl[m.end() :], ng.to_number(value) in (1, -1))
  if RULE_UNREADABLE in (lead, tail):  # "half of 10", "5 hundred thousand", "5 squared"
    return s, RULE_UNREADABLE
  if lead or tail:
    return s, RULE_AMBIGUOUS
  return value, None


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
    value, verdict = _boxed_value(text, box[0], free=True)
    return Extraction(value, verdict or RULE_BOXED, text[box[0][1] : box[0][2]].strip(), RULE_BOXED)
  k = text.rfind("####")
  while k >= 0:  # GSM8K's "#### N": the last such line holding digits is the answer, read as a tag body (as golds)
    end = text.find("\n", k + 4)
    line = text[k + 4 : end if 0 <= end < k + 4 + ng.MAX_ANSWER_CHARS else k + 5 + ng.MAX_ANSWER_CHARS].strip()
    if any(c.isdigit() for c in line):
      value, verdict = _read_answer(line)
      return Extraction(value, verdict or RULE_HASH, None, RULE_HASH)
    k = text.rfind("####", 0, k)
  if "nswer" in text or "NSWER" in text:
    e = _marked(text, _ANSWER_MARK_RE, RULE_ANSWER_IS)
    if e is not None:
      return e
  if "A" in text and ":" in text:
    e = _marked(text, _A_COLON_RE, RULE_A_COLON)
    if e is not None:
      return e
  return _last_number(text)


def _marked(text: str, marker: re.Pattern, rule: str) -> Optional[Extraction]:
  """The clause after the last answer marker whose clause holds digits (to its sentence's end, a line break or a
  "because"), read by the answer rule with only asserting adverbs before the number (`_read_answer(marked=True)`);
  None when no marker has one. A marker of possibility ("the answer could be 5") is a guess: ambiguous."""
  for m in reversed(list(marker.finditer(text))[-64:]):
    chunk = text[m.end() : m.end() + 2 * ng.MAX_ANSWER_CHARS]
    stop = _CLAUSE_END_RE.search(chunk)
    clause = chunk[: stop.start() if stop else ng.MAX_ANSWER_CHARS].strip().rstrip(",;:").rstrip()
    if not any(c.isdigit() for c in clause):
      continue
    if (m.groupdict().get("modal") or "").lower() in _GUESSING_MODALS:
      return Extraction(clause, RULE_AMBIGUOUS, None, rule)
    value, verdict = _read_answer(clause, marked=True)
    if verdict is None and ng.to_number(value) is not None:
      value = ng.clean(value)  # reported as the number ("$-4.5" is "-4.5")
    return Extraction(value, verdict or rule, None, rule)
  return None


def _last_number(text: str) -> Extraction:
  """The free-form fallback: MaxText's last-number rule, reading whole numbers only. A last number glued to a letter,
  an underscore or more digits ("0x10", "1_000") is a piece of a token no grammar reads: unreadable, never the piece."""
  m = _last_number_match(text)
  if m is None:
    return Extraction(None, RULE_NONE)
  before, after = text[m.start() - 1 : m.start()], text[m.end() : m.end() + 2]
  if (
      before.isalnum()
      or before == "_"
      or after[:1] == "_"
      or (after[:1] in ".," and after[1:2].isdigit())
      or _GLUED_BEFORE_RE.search(text, max(0, m.start() - 4), m.start())  # "1\\,5", "1{,}5": a broken grouping
  ):
    return Extraction(text[max(0, m.start() - 16) : m.end() + 16].strip(), RULE_UNREADABLE, None, RULE_LAST_NUMBER)
  return Extraction(m.group(0).rstrip(","), RULE_LAST_NUMBER)


def last_number(text: str) -> Optional[str]:
  """The last number written in `text` (scans the tail first, so long completions cost little)."""
  m = _last_number_match(text)
  return m.group(0).rstrip(",") if m else None


def _last_number_match(text: str) -> Optional[re.Match]:
  """The match of the last number in `text`, scanning the tail first (see `last_number`)."""
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
      found = m
    if found is not None or lo == 0:
      return found
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
