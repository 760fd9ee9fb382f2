"""The number grammar of answers: what one number is as written, and its exact value.

A number in an answer or a gold is read whole with its meaning: a sign (any dash, U+2212, "negative"), thousands
separators (also the Indian grouping), decimals, fractions (`3/4`, `\\frac{3}{4}`, mixed numbers), an exponent
(`1e5`, `2^3`), a scale (`5 thousand`, `$5M`), unit words after it; Unicode numerals are turned into ASCII first
(answer_rule.normalize). Values are exact `Fraction`s, so "72.00" == "72" and "0.5" == "1/2".

Split from extraction.py, which locates the answer in a completion (tags, `\\boxed{}`, `####`, "the answer is", the
last number) and uses the patterns here (`NUM`, `NUM_RE`, `BODY_NUM_RE`, `SPACED_SIGN`, `MINUS_CLASS`); golds
(`parse_gold`) and the verifier (verify.py, gsm8k.py) read values here too. Pure functions on strings.
"""

from __future__ import annotations

from fractions import Fraction
import functools
import math
import re
from typing import Optional

from maxtext_rl_plugin.rewards import answer_rule

# Minus signs as models and people type them (hyphen-minus, U+2212, hyphens, figure/en/em dash, small and
# full-width hyphen-minus) and thousands separators (comma, apostrophes, space, no-break/narrow/thin space): both
# are read the same way in gold answers and completions, so "-5" and "\u20135" or "1,234" and "1 234" are one value.
MINUS_SIGNS = "-\u2212\u2010\u2011\u2012\u2013\u2014\ufe63\uff0d"
GROUP_SEPARATORS = ",'\u2019 \u00a0\u202f\u2009"
MINUS_CLASS = "[" + re.escape(MINUS_SIGNS) + "]"
_SEP_CLASS = "[" + re.escape(GROUP_SEPARATORS) + "]"
_MINUS_TO_ASCII = str.maketrans({c: "-" for c in MINUS_SIGNS[1:]})
_SEPARATORS_OUT = str.maketrans({c: None for c in GROUP_SEPARATORS})
# LaTeX's thousands separators ("1{,}500", "1\\,500") are read as separators too (`_UNSIGNED`, `clean`).
# Separators that only ever group digits (a space also separates words, so it is not one of them).
_DIGIT_GLUE = ",'\u2019"
# One unsigned number: digits in groups of three ("1,234", "1 234 567"; a group is never followed by a 4th digit),
# the Indian grouping (lakh, crore: "1,00,000", "12,34,567") or plain digits, an optional decimal part, an optional
# exponent ("1e5", "2.5E-3"; not the "e" of a word). Never a fragment of a longer run of digits and separators: a
# number does not start right after a digit or a digit + comma/point, nor end before a digit or a comma/point + digit,
# so "1,0000", the European "3,5" or "1.000.000" is no number at all (flagged: no answer), never its last group.
_UNSIGNED = (
    r"(?<!\d)(?<!\d[." + re.escape(_DIGIT_GLUE) + r"])"
    r"(?:(?:\d{1,2}(?:,\d{2})+,\d{3}(?!\d)|\d{1,3}(?:(?:" + _SEP_CLASS + r"|\{,\}|\\,)\d{3}(?!\d))+|\d+)(?:\.\d+)?"
    r"|\.\d+)"
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
_FRAC_ARG = r"(?:\{[ \t]{0,4}" + MINUS_CLASS + r"?" + _UNSIGNED + r"[ \t]{0,4}\}|\d)"
_MIXED_ARG = r"(?:\{[ \t]{0,4}\d+[ \t]{0,4}\}|\d)"
_LATEX_GAP = r"(?:[ \t~$]|\\[ ,;:!()]){0,6}"
_FRAC = r"\\[dt]?frac" + _FRAC_ARG + _FRAC_ARG
_MIXED_FRAC = r"\d+" + _LATEX_GAP + r"\\[dt]?frac" + _MIXED_ARG + _MIXED_ARG
_SIGN = r"(?:(?<![\w)\].])" + MINUS_CLASS + r"|" + _WORD_SIGN + r")?"
_MIXED_SLASH = r"\d+[ \u00a0]\d+[ \t]{0,2}/[ \t]{0,2}\d+(?!\d|\.\d)"
_PLAIN = _UNSIGNED + r"(?:[ \t]{0,2}/[ \t]{0,2}\d+(?:\.\d+)?(?!\d|\.\d))?"
# What a number carries with it, read as part of it (never dropped, never left as a separate number): an exponent
# ("2^3", "10^{-3}", the "5²" of answer_rule.normalize), a subscript ("5_{2}": flagged unreadable) and a scale ("5
# thousand", "5k", "$5M": applied by to_number).
_NUM_SUFFIX = r"(?:\^(?:\{[-+]?\d{1,4}\}|[-+]?\d{1,4}(?![\d.]))|_\{[-+]?\d{1,4}\}|" + answer_rule.SCALE_SUFFIX + ")?"
NUM = _SIGN + r"(?:" + "|".join((_FRAC, _MIXED_FRAC, _MIXED_SLASH, _PLAIN)) + r")" + _NUM_SUFFIX
NUM_RE = re.compile(NUM)
# A sign apart from its digits ("- 5", "\u2212 5", "\u2014 5") where no operand comes before it: still its sign.
SPACED_SIGN = r"(?:(?<![\w)\].])" + MINUS_CLASS + r"[ \t]{1,2}(?=[\d.\\]))?"
# In an answer span (a tag body, a marked clause) the sign may stand on the line before its digits ("-\n5").
BODY_NUM_RE = re.compile(r"(?:(?<![\w)\].])" + MINUS_CLASS + r"[ \t\n]{1,3}(?=[\d.\\]))?" + NUM)
CURRENCY = "$\u20ac\u00a3\u00a5\u20b9"  # $ € £ ¥ ₹
SUBSCRIPT_DIGIT_RE = re.compile(r"\d_\{")

# Longest extracted answer we try to interpret; anything longer is not a GSM8K answer and would only
# feed math_verify a parsing problem.
MAX_ANSWER_CHARS = 1000

# Canonical numeric forms accepted without math_verify (after `clean` and the ASCII tables): one number (a trailing
# "." allowed), "a/b", a mixed number "w n/d", or `\frac{a}{b}`; signs inside fractions too.
_U = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_VALUE_RE = re.compile(
    r"(?P<neg>-\s{0,3})?(?:(?P<num>" + _U + r")"
    r"|(?P<fn>-?" + _U + r")\s{0,4}/\s{0,4}(?P<fd>-?" + _U + r")"
    r"|(?P<w>\d+)(?:\s(?P<mn>\d+)\s{0,2}/\s{0,2}(?P<md>\d+)"
    r"|[\s~]{0,4}\\[dt]?frac\{\s{0,4}(?P<xn>\d+)\s{0,4}\}\{\s{0,4}(?P<xd>\d+)\s{0,4}\})"
    r"|\\[dt]?frac\{\s{0,4}(?P<ln>-?" + _U + r")\s{0,4}\}\{\s{0,4}(?P<ld>-?" + _U + r")\s{0,4}\})"
)
_GROUPED_RE = re.compile(
    r"(?:-[ \t]{0,2})?(?:\d{1,3}(?:" + _SEP_CLASS + r"\d{3})+|\d{1,2}(?:,\d{2})+,\d{3})(?:\.\d*)?(?:[eE][-+]?\d+)?"
)
# The largest decimal exponent read as a value. Every number is an exact Fraction, and its text (format_number) must
# stay within Python's int<->str limit (4300 digits) with a 256-character mantissa: 10**1000 is held exactly; a larger
# exponent ("1e400" is fine, "1e999999999" is not) is read whole and flagged unreadable, never cut to its last digits.
MAX_EXPONENT = 1000
_EXPONENT_RE = re.compile(r"(?<=[\d.])[eE][-+]?(\d+)")
_NON_FINITE_RE = re.compile(r"[-+]?(?:nan|inf|infinity)", re.IGNORECASE)
_SHORT_FRAC_RE = re.compile(r"\\([dt]?frac)(?:\{([^{}]{1,64})\}|(\d))(?:\{([^{}]{1,64})\}|(\d))")
_THIN_SPACE_GROUP_RE = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")
_TEXT_CMD_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox|mathbf)\{([^{}]{0,64})\}")
_STRIP_TOKENS = (
    "\\$",
    "$",
    "\u20ac",
    "\u00a3",
    "\u00a5",
    "\u20b9",
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
_UNIT_WORD_RE = re.compile(r"^(" + NUM + r")[ \t]{0,4}[a-zA-Z(][a-zA-Z ()]{0,40}\.?$")


def clean(text: str) -> str:
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
  if "{,}" in s:
    s = s.replace("{,}", ",")
  if "\\," in s:  # LaTeX's thin space: a thousands separator between groups of three ("1\\,500"), else a space
    s = _THIN_SPACE_GROUP_RE.sub("", s).replace("\\,", " ")
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
  text = answer_rule.normalize(text)
  s = clean(text)
  if not s:
    return None
  if s[0] == "+":
    s = s[1:]
  elif s[0] in "nNmM":
    s = _WORD_SIGN_RE.sub("-", s, count=1) if _WORD_SIGN_RE.match(s) else s
  v = _number_value(s)
  if v is not None:
    return v
  if SUBSCRIPT_DIGIT_RE.search(s):
    return None
  v = answer_rule.scaled_value(s, to_number, currency=any(c in text for c in CURRENCY))
  if v is not None:  # "5 thousand", "$1.2 million", "5k", "3 dozen eggs": the multiplier applied
    return v
  m = _UNIT_WORD_RE.fullmatch(s)  # "18 dollars", "5 apples": the span grammar's tail; never "5 max", "5 grand"
  if m and m.group(1) != s:
    v = to_number(m.group(1))
    if v is None or answer_rule.read_tail(s[m.end(1) :], abs(v) == 1) is not None:
      return None
    return v
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
  """Whether an extracted answer holds a number the grader cannot hold exactly (an exponent beyond MAX_EXPONENT, a
  digit with a subscript: "5_{2}", "5₂"): it scores as wrong and is counted (`ScoreResult.unreadable`), never compared
  by its digits nor sent to math_verify (which reads "5_{2}" as 5)."""
  if not isinstance(text, str):
    return False
  text = answer_rule.normalize(text)
  return (("e" in text or "E" in text) and _exponent_too_large(text)) or SUBSCRIPT_DIGIT_RE.search(text) is not None


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
  s = clean(text)
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
  # A non-numeric answer (e.g. "\\frac{\\pi}{2}", "(3, 5)", "B") is kept only if asked for, a single short line, not a
  # non-finite number, and not a number that does not read whole: an expression holding a number we could not read
  # ("1/0"), digits glued to letters or underscores ("0x10", "1_000", "5..6"), digits among words ("5 max", "5 apples
  # and 3 pears"). Such a gold is refused (the row is skipped and counted), never compared by a piece of it.
  if numeric_only or "\n" in s or len(s) > 64 or _NON_FINITE_RE.fullmatch(clean(s)) or NUM_RE.fullmatch(clean(s)):
    return None
  if any(c.isdigit() for c in s) and _NOT_WHOLE_GOLD_RE.search(_LATEX_CMD_RE.sub(" ", s)):
    return None
  return s


# In a non-numeric gold: digits glued to a letter, an underscore or a second point, or a word of prose beside digits.
_NOT_WHOLE_GOLD_RE = re.compile(r"[A-Za-z_]\d|\d[A-Za-z_]|\d\.\.|\.\.\d|\d\.\d+\.|[A-Za-z]{2,}")
_LATEX_CMD_RE = re.compile(r"\\[A-Za-z]+")
