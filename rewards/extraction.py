"""Answer extraction and number normalization for GSM8K-style completions.

Everything here is pure Python with linear-time scans (`str.rfind`, regexes with bounded quantifiers),
because it runs on every completion of every RL step and must not stall on adversarial text
(100 KB of braces, thousands of unclosed tags). MaxText's `utils_rl.extract_answer` only looks inside
`<answer>` tags or `\\boxed{}`; models that answer in any other style score zero there. Here each
completion goes through an ordered list of rules and the rule that fired is recorded, so a reward
curve can be read together with *how* answers were found.
"""

from __future__ import annotations

from fractions import Fraction
import functools
import math
import re
from typing import NamedTuple, Optional

# Rule names, in priority order (recorded in ScoreResult.rule and the score CLI's output).
RULE_ANSWER_TAG = "answer_tag"
RULE_BOXED = "boxed"
RULE_HASH = "hash"
RULE_ANSWER_IS = "answer_is"
RULE_A_COLON = "a_colon"
RULE_LAST_NUMBER = "last_number"
RULE_NONE = "none"
# Not an extraction rule: the grader's verdict on an answer it cannot hold (gsm8k.py; `unreadable` below).
RULE_UNREADABLE = "unreadable"
RULES = (
    RULE_ANSWER_TAG,
    RULE_BOXED,
    RULE_HASH,
    RULE_ANSWER_IS,
    RULE_A_COLON,
    RULE_LAST_NUMBER,
    RULE_NONE,
    RULE_UNREADABLE,
)

DEFAULT_SOLUTION_START = "<answer>"  # MaxText rl.yml's solution tags; RewardConfig and the data prompts use these
DEFAULT_SOLUTION_END = "</answer>"

# Minus signs as models and people type them (hyphen-minus, U+2212, hyphens, figure/en/em dash, small and
# full-width hyphen-minus) and thousands separators (comma, apostrophes, space, no-break/narrow/thin space): both
# are read the same way in gold answers and completions, so "-5" and "\u20135" or "1,234" and "1 234" are one value.
MINUS_SIGNS = "-\u2212\u2010\u2011\u2012\u2013\u2014\ufe63\uff0d"
GROUP_SEPARATORS = ",'\u2019 \u00a0\u202f\u2009"
_MINUS_CLASS = "[" + re.escape(MINUS_SIGNS) + "]"
_SEP_CLASS = "[" + re.escape(GROUP_SEPARATORS) + "]"
_MINUS_TO_ASCII = str.maketrans({c: "-" for c in MINUS_SIGNS[1:]})
_SEPARATORS_OUT = str.maketrans({c: None for c in GROUP_SEPARATORS})
# Separators that only ever group digits (a space also separates words, so it is not one of them).
_DIGIT_GLUE = ",'\u2019"
# One unsigned number: digits in groups of three ("1,234", "1 234 567"; a group is never followed by a 4th digit),
# the Indian grouping (lakh, crore: "1,00,000", "12,34,567") or plain digits, an optional decimal part, an optional
# exponent ("1e5", "2.5E-3"; not the "e" of a word). Never a fragment of a longer run of digits and separators: a
# number does not start right after a digit or a digit + comma/point, nor end before a digit or a comma/point + digit,
# so "1,0000", the European "3,5" or "1.000.000" is no number at all (flagged: no answer), never its last group.
_UNSIGNED = (
    r"(?<!\d)(?<!\d[." + re.escape(_DIGIT_GLUE) + r"])"
    r"(?:(?:\d{1,2}(?:,\d{2})+,\d{3}(?!\d)|\d{1,3}(?:" + _SEP_CLASS + r"\d{3}(?!\d))+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:[eE][-+]?\d+(?![\w]))?(?!\d|[." + re.escape(_DIGIT_GLUE) + r"]\d)"
)
# A sign written as a word ("negative 5", "minus 5"), read as "-" when it does not follow a number (then "minus" is
# the operator of "7 minus 2").
_WORD_SIGN = r"(?:(?<![\w)\]}])(?<![\d)\]}][ \t])(?:[Nn]egative|[Mm]inus|NEGATIVE|MINUS)[ \t]{1,2})"
_WORD_SIGN_RE = re.compile(r"(?:negative|minus)\s{1,2}(?=[\d.\\])", re.IGNORECASE)
# A number expression as written in text, read whole: `\frac{a}{b}`/`\dfrac`/`\tfrac`, a mixed number "1 1/2" or
# "3\frac{1}{3}", a fraction "3/4", or one number; an optional sign only when not glued to a preceding word/number,
# so the "-" of "5-3" is an operator. No capturing groups (findall returns whole matches).
# A `\frac` argument: braced, or (LaTeX's short form, `\frac12`) one digit; the gap between the whole part of a mixed
# number and its `\frac`: spaces, "~", LaTeX's spacing commands (`3\ \frac{1}{2}`, `3\,\frac12`) and math delimiters
# (`5 $\frac{3}{4}$`, `$5$ $\frac34$`, `5 \(\frac{3}{4}\)`: the fraction typeset as math after a plain whole part).
_FRAC_ARG = r"(?:\{[ \t]{0,4}" + _MINUS_CLASS + r"?" + _UNSIGNED + r"[ \t]{0,4}\}|\d)"
_MIXED_ARG = r"(?:\{[ \t]{0,4}\d+[ \t]{0,4}\}|\d)"
_LATEX_GAP = r"(?:[ \t~$]|\\[ ,;:!()]){0,6}"
_FRAC = r"\\[dt]?frac" + _FRAC_ARG + _FRAC_ARG
_MIXED_FRAC = r"\d+" + _LATEX_GAP + r"\\[dt]?frac" + _MIXED_ARG + _MIXED_ARG
_SIGN = r"(?:(?<![\w)\].])" + _MINUS_CLASS + r"|" + _WORD_SIGN + r")?"
_MIXED_SLASH = r"\d+[ \u00a0]\d+[ \t]{0,2}/[ \t]{0,2}\d+(?!\d|\.\d)"
_PLAIN = _UNSIGNED + r"(?:[ \t]{0,2}/[ \t]{0,2}\d+(?:\.\d+)?(?!\d|\.\d))?"
_NUM = _SIGN + r"(?:" + "|".join((_FRAC, _MIXED_FRAC, _MIXED_SLASH, _PLAIN)) + r")"
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####[ \t]{0,16}\$?[ \t]{0,4}(" + _NUM + ")")
_ANSWER_IS_RE = re.compile(
    r"answer(?:[ \t]{1,4}is|[ \t]{0,4}:|[ \t]{1,4}=)[ \t]{0,8}(?:\*\*)?[ \t]{0,4}\\?\$?[ \t]{0,4}(?:\\boxed\{)?("
    + _NUM
    + ")",
    re.IGNORECASE,
)
_A_COLON_RE = re.compile(r"(?:^|\n)[ \t]{0,8}(?:\*\*)?A(?:\*\*)?[ \t]{0,4}:[ \t]{0,8}\\?\$?[ \t]{0,4}(" + _NUM + ")")
_BRACE_RE = re.compile(r"[{}]")
_BOXED = "\\boxed"
_MATH_CHARS = frozenset("\\^{}()*/+=<>|[]_")

# Longest extracted answer we try to interpret; anything longer is not a GSM8K answer and would only
# feed math_verify a parsing problem.
MAX_ANSWER_CHARS = 1000

# Canonical numeric forms accepted without math_verify (after `_clean` and the ASCII tables): one number (a trailing
# "." allowed), "a/b", a mixed number "w n/d", or `\frac{a}{b}`; signs inside fractions too.
_U = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_VALUE_RE = re.compile(
    r"(?P<neg>-)?(?:(?P<num>" + _U + r")"
    r"|(?P<fn>-?" + _U + r")\s{0,4}/\s{0,4}(?P<fd>-?" + _U + r")"
    r"|(?P<w>\d+)(?:\s(?P<mn>\d+)\s{0,2}/\s{0,2}(?P<md>\d+)"
    r"|[\s~]{0,4}\\[dt]?frac\{\s{0,4}(?P<xn>\d+)\s{0,4}\}\{\s{0,4}(?P<xd>\d+)\s{0,4}\})"
    r"|\\[dt]?frac\{\s{0,4}(?P<ln>-?" + _U + r")\s{0,4}\}\{\s{0,4}(?P<ld>-?" + _U + r")\s{0,4}\})"
)
_GROUPED_RE = re.compile(
    r"-?(?:\d{1,3}(?:" + _SEP_CLASS + r"\d{3})+|\d{1,2}(?:,\d{2})+,\d{3})(?:\.\d*)?(?:[eE][-+]?\d+)?"
)
# The largest decimal exponent read as a value. Every number is an exact Fraction, and its text (format_number) must
# stay within Python's int<->str limit (4300 digits) with a 256-character mantissa: 10**1000 is held exactly; a larger
# exponent ("1e400" is fine, "1e999999999" is not) is read whole and flagged unreadable, never cut to its last digits.
MAX_EXPONENT = 1000
_EXPONENT_RE = re.compile(r"(?<=[\d.])[eE][-+]?(\d+)")
_NON_FINITE_RE = re.compile(r"[-+]?(?:nan|inf|infinity)", re.IGNORECASE)
_SHORT_FRAC_RE = re.compile(r"\\([dt]?frac)(?:\{([^{}]{1,64})\}|(\d))(?:\{([^{}]{1,64})\}|(\d))")
_TEXT_CMD_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox|mathbf)\{([^{}]{0,64})\}")
_STRIP_TOKENS = (
    "\\$",
    "$",
    "\\%",
    "%",
    "\\!",
    "~",
    "\\,",
    "\\;",
    "\\ ",
    "^\\circ",
    "^{\\circ}",
    "\u00b0",
    "**",
    "\\left",
    "\\right",
)
_UNIT_WORD_RE = re.compile(r"^(" + _NUM + r")[ \t]{0,4}[a-zA-Z][a-zA-Z ]{0,40}\.?$")


class Extraction(NamedTuple):
  """What `extract_answer` found: the answer text (None if nothing), the rule, and the raw tag body."""

  value: Optional[str]
  rule: str
  raw: Optional[str] = None  # the unstripped text the value came from (answer tag body), for whitespace rewards


def _clean(text: str) -> str:
  """Strip decoration around a value: `$`, `%`, `\\text{units}`, `\\(`...`\\)`, a trailing period."""
  s = text.strip()
  if not s:
    return s
  if "\\" in s or "{" in s:
    s = _TEXT_CMD_RE.sub(r" \1", s)
    if "frac" in s:  # LaTeX's short arguments: `\frac12` and `\frac1{2}` are `\frac{1}{2}`
      s = _SHORT_FRAC_RE.sub(lambda m: f"\\{m[1]}{{{m[2] or m[3]}}}{{{m[4] or m[5]}}}", s)
    for a, b in (("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", "")):
      s = s.replace(a, b)
  for tok in _STRIP_TOKENS:
    if tok in s:
      s = s.replace(tok, "")
  s = s.strip().rstrip(".").strip()
  if len(s) >= 2 and s[0] == "{" and s[-1] == "}":
    s = s[1:-1].strip()
  return s


def to_number(text: Optional[str]) -> Optional[Fraction]:
  """Exact value of a plainly written number ("1,234", "$18.00", "-3.5", "3/4", "\\frac{3}{4}", "25%").

  Returns None for anything that needs a math parser (expressions, sets, words); those go to
  math_verify. Exact `Fraction`s, so "72.00" == "72" and "0.5" == "1/2" without float error.
  """
  if text is None:
    return None
  if len(text) <= 256:
    return _to_number_cached(text)
  # Longer: the canonical text of a large value (format_number of "1e400" has 401 digits) reads back; not cached.
  return _to_number_uncached(text) if len(text) <= _MAX_CANONICAL_CHARS else None


# The longest canonical number text (format_number): a fraction of two integers of up to 256 + MAX_EXPONENT digits.
_MAX_CANONICAL_CHARS = 2 * (256 + MAX_EXPONENT) + 2


@functools.lru_cache(maxsize=65536)
def _to_number_cached(text: str) -> Optional[Fraction]:
  """`to_number` for a short string, cached: rewards parse the same golds and answers again every batch."""
  return _to_number_uncached(text)


def _to_number_uncached(text: str) -> Optional[Fraction]:
  """`to_number` without the cache (long canonical texts are read once)."""
  s = _clean(text)
  if not s:
    return None
  if s[0] == "+":
    s = s[1:]
  elif s[0] in "nNmM":
    s = _WORD_SIGN_RE.sub("-", s, count=1) if _WORD_SIGN_RE.match(s) else s
  v = _number_value(s)
  if v is not None:
    return v
  m = _UNIT_WORD_RE.fullmatch(s)  # "18 dollars", "3.5 hours"
  if m and m.group(1) != s:
    return to_number(m.group(1))
  return None


def clear_number_cache() -> None:
  """Forget every parsed number: a benchmark's timed pass then pays for parsing as a fresh batch would."""
  _to_number_cached.cache_clear()


def _number_value(s: str) -> Optional[Fraction]:
  """Exact value of one whole number expression (see `_VALUE_RE`), or None (also for a zero denominator)."""
  s = s.translate(_MINUS_TO_ASCII)
  # Grouping separators are removed only where they group thousands ("1 234", not the "1 1/2" of a mixed number).
  s = s.translate(_SEPARATORS_OUT) if _GROUPED_RE.fullmatch(s) else s.replace("\u00a0", " ")
  m = _VALUE_RE.fullmatch(s)
  if m is None or _exponent_too_large(s):
    return None
  g = m.groupdict()
  try:
    if g["num"] is not None:
      v = Fraction(g["num"].rstrip(".") or "0")
    elif g["fn"] is not None:
      v = Fraction(g["fn"]) / Fraction(g["fd"])
    elif g["w"] is not None:
      num, den = (g["mn"], g["md"]) if g["mn"] is not None else (g["xn"], g["xd"])
      v = int(g["w"]) + Fraction(int(num), int(den))
    else:
      v = Fraction(g["ln"]) / Fraction(g["ld"])
  except (ValueError, ZeroDivisionError):
    return None
  return -v if g["neg"] else v


def _exponent_too_large(s: str) -> bool:
  """Whether `s` writes a decimal exponent beyond `MAX_EXPONENT` (leading zeros ignored; no int() of a long string)."""
  for m in _EXPONENT_RE.finditer(s):
    digits = m.group(1).lstrip("0")
    if len(digits) > 4 or (digits and int(digits) > MAX_EXPONENT):
      return True
  return False


def unreadable(text: Optional[str]) -> bool:
  """Whether an extracted answer holds a number the grader cannot hold exactly (an exponent beyond MAX_EXPONENT): it
  scores as wrong and is counted (`ScoreResult.unreadable`), never compared by its digits nor sent to math_verify."""
  return isinstance(text, str) and ("e" in text or "E" in text) and _exponent_too_large(text)


def format_number(value: Fraction) -> str:
  """Canonical text of a number: "72", "-3.5", "1/3" (non-terminating decimals stay fractions)."""
  if value.denominator == 1:
    return str(value.numerator)
  den = value.denominator
  while den % 2 == 0:
    den //= 2
  while den % 5 == 0:
    den //= 5
  if den != 1:
    return f"{value.numerator}/{value.denominator}"
  # Terminating decimal: exact digits, no float rounding.
  sign = "-" if value < 0 else ""
  v = abs(value)
  whole = v.numerator // v.denominator
  frac = v - whole
  digits = ""
  while frac:
    frac *= 10
    d = frac.numerator // frac.denominator
    digits += str(d)
    frac -= d
  return f"{sign}{whole}.{digits}"


def normalize_answer(text: Optional[str]) -> Optional[str]:
  """Canonical string of an answer: the number's canonical text, else the cleaned text (None if empty)."""
  if text is None:
    return None
  v = to_number(text)
  if v is not None:
    return format_number(v)
  s = _clean(text)
  return s or None


def parse_gold(text, numeric_only: bool = True) -> Optional[str]:
  """Gold answer of a GSM8K row: the value after the last `#### `, else the whole text if it is one value.

  Parsed once per row at load time; returns the canonical string ("1,200" -> "1200", "$18.00" -> "18",
  "1e5" -> "100000", "1 1/2" -> "3/2") or None when there is no usable answer: the row is then skipped and
  counted by the data loader. A gold is never cut short ("#### 1e5" is not "1"): a line holding anything but
  one number expression (after `$`, units, a trailing period) is refused, and so are NaN/Infinity.
  `numeric_only=False` also keeps a short non-numeric answer ("\\frac{\\pi}{2}"), for the score CLI.
  """
  if text is None or isinstance(text, bool):
    return None
  if isinstance(text, (int, float)):
    if not math.isfinite(text):
      return None
    text = str(text)  # "1e+20" for a JSON 1e20: read exactly below
  if not isinstance(text, str):
    return None
  if "####" in text:
    tail = text.rsplit("####", 1)[1].strip()
    if not tail:
      return None
    s = tail.split("\n", 1)[0].strip()
  else:
    s = text.strip()
    if not s or len(s) > MAX_ANSWER_CHARS:
      return None
  v = to_number(s)
  if v is not None:
    return format_number(v)
  # A non-numeric answer (e.g. "\\frac{\\pi}{2}") is kept only if asked for, a single short line, not a
  # non-finite number, and not an expression holding a number we could not read whole ("1/0").
  if numeric_only or "\n" in s or len(s) > 64 or _NON_FINITE_RE.fullmatch(_clean(s)) or _NUM_RE.fullmatch(_clean(s)):
    return None
  return s


def last_balanced_boxed(text: str) -> Optional[str]:
  """Content of the `\\boxed{...}` whose closing brace comes last; linear in len(text).

  One pass over the braces with a stack (MaxText's fixed version of the same idea): unclosed boxes are
  ignored, nested braces inside a box are kept.
  """
  if _BOXED not in text:
    return None
  best = None
  best_end = -1
  stack: list[int] = []
  for m in _BRACE_RE.finditer(text):
    i = m.start()
    if text[i] == "{":
      stack.append(i)
    elif stack:
      op = stack.pop()
      if i > best_end and op >= 6 and text.startswith(_BOXED, op - 6):
        best, best_end = (op + 1, i), i
  if best is None:
    return None
  return text[best[0] : best[1]].strip()


def last_tag_block(text: str, start: str, end: str) -> Optional[str]:
  """Body of the last complete `start ... end` block (the nearest `start` before the last `end`)."""
  j = text.rfind(end)
  if j < 0:
    return None
  # If the last `end` has no `start` before it, no earlier `end` has one either.
  i = text.rfind(start, 0, j)
  return text[i + len(start) : j] if i >= 0 else None


def _last_match(regex: re.Pattern, text: str) -> Optional[str]:
  last = None
  for m in regex.finditer(text):
    last = m
  return last.group(1) if last else None


def _value_from_body(body: str) -> str:
  """The answer inside an `<answer>` body: a boxed value, the body if it is one value, or its last number."""
  boxed = last_balanced_boxed(body)
  if boxed is not None:
    body = boxed
  s = body.strip()
  if to_number(s) is not None or len(s) > MAX_ANSWER_CHARS:
    return s
  if "=" in s:  # "3 * 6 = 18"
    rhs = s.rsplit("=", 1)[1].strip()
    if to_number(rhs) is not None:
      return rhs
  nums = _NUM_RE.findall(s)
  # Words around numbers ("18 dollars", "12 then 15 apples") -> the last number; math stays whole
  # ("\\sqrt{64}", "2^3") for math_verify.
  if nums and not any(c in _MATH_CHARS for c in s):
    return nums[-1].rstrip(",")
  return s


def extract_answer(
    text: str, solution_start: str = DEFAULT_SOLUTION_START, solution_end: str = DEFAULT_SOLUTION_END
) -> tuple[Optional[str], str]:
  """(answer text or None, rule that fired) for any model's completion.

  Rules, first that applies wins: the last `<answer>...</answer>` block (tokens configurable; a
  `\\boxed{}` or a single number inside it is taken), the last balanced `\\boxed{}`, the last `#### N`,
  the last "the answer is N" / "Answer: N", the last line "A: N", and finally the last number.
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
    return Extraction(_value_from_body(body), RULE_ANSWER_TAG, body)
  boxed = last_balanced_boxed(text)
  if boxed:
    return Extraction(_value_from_body(boxed), RULE_BOXED, boxed)
  if "####" in text:
    v = _last_match(_HASH_RE, text)
    if v is not None:
      return Extraction(v, RULE_HASH)
  lower_has_answer = "nswer" in text or "NSWER" in text
  if lower_has_answer:
    v = _last_match(_ANSWER_IS_RE, text)
    if v is not None:
      return Extraction(v, RULE_ANSWER_IS)
  if "A" in text and ":" in text:
    v = _last_match(_A_COLON_RE, text)
    if v is not None:
      return Extraction(v, RULE_A_COLON)
  v = last_number(text)
  if v is not None:
    return Extraction(v, RULE_LAST_NUMBER)
  return Extraction(None, RULE_NONE)


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
    for m in _NUM_RE.finditer(text, lo):
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
