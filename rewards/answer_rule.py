"""The answer rule's vocabulary: Unicode numerals to ASCII, scale words, and what makes an answer more than one value.

A tagged answer (`<answer>...</answer>`, `\\boxed{}`, `#### N`, "the answer is N") is read as ONE value or not at all.
RL learns whatever is rewarded, and hedging ("3 or 5", "at least 5", "3-5") is the cheapest thing to learn, so an
answer that states several values, a range, a negation or a comparison is wrong (rule `ambiguous`), never its last
number. Numbers are read with their whole meaning: a sign apart from its digits ("- 5", "-\\boxed{5}"), full-width and
Arabic separators ("1，234", "1٫5"), superscripts ("5²" is 5^2, "10⁻³" is 10^-3), vulgar fractions ("1½" is 1 1/2)
and scale words ("5 thousand", "$5M") are applied; what cannot be held exactly (a digit with a subscript, "5 hundred
thousand") is `unreadable`. Never a piece of a number. The table is in docs/rewards.md ("The answer rule").

Pure functions on strings; `extraction.py` applies them and `number_grammar.py` holds the number grammar.
"""

from __future__ import annotations

from fractions import Fraction
import re
import unicodedata
from typing import Optional

# ----------------------------------------------------------------------------------------------------------------------
# Unicode numerals -> what they mean in ASCII
# ----------------------------------------------------------------------------------------------------------------------

_SUPERSCRIPTS = dict(zip("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻", "0123456789+-"))
_SUBSCRIPTS = dict(zip("₀₁₂₃₄₅₆₇₈₉₊₋", "0123456789+-"))
# A superscript run after a digit (or a closing bracket) is an exponent: "5²" -> "5^{2}", "10⁻³" -> "10^{-3}".
_SUP_AFTER_NUMBER_RE = re.compile(r"(?<=[0-9)\]])([⁺⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+)")
# A subscript run after a digit ("5₂": a base? a footnote?) has no one reading: "_{2}", which the grader flags.
_SUB_AFTER_NUMBER_RE = re.compile(r"(?<=[0-9])([₊₋]?[₀₁₂₃₄₅₆₇₈₉]+)")
# Vulgar fractions; after a digit they are the fraction of a mixed number ("1½" -> "1 1/2").
_VULGAR_RE = re.compile(r"([0-9]?)([¼½¾⅐⅑⅒⅓⅔⅕⅖⅗⅘⅙⅚⅛⅜⅝⅞↉])")  # the characters of _VULGAR
# Characters NFKC would turn into digits where they are not numbers (the "²" of "m²", the "₂" of "CO₂"), and the
# fractions read below: kept out of NFKC through private-use stand-ins, so "25 m²" still ends in 25.
_VULGAR = "¼½¾⅐⅑⅒⅓⅔⅕⅖⅗⅘⅙⅚⅛⅜⅝⅞↉"
_PROTECTED = "".join(_SUPERSCRIPTS) + "".join(_SUBSCRIPTS) + "ⁿ" + _VULGAR
_TO_PRIVATE = str.maketrans({c: chr(0xF0000 + i) for i, c in enumerate(_PROTECTED)})  # plane 15: private use
_FROM_PRIVATE = str.maketrans({chr(0xF0000 + i): c for i, c in enumerate(_PROTECTED)})
# Separators NFKC leaves alone: the Arabic decimal and thousands separators, the fraction and division slashes.
_SEPARATORS = str.maketrans({"\u066b": ".", "\u066c": ",", "\u2044": "/", "\u2215": "/"})
_NON_ASCII_DIGIT = r"(?=[^\x00-\x7f])\d"  # a digit of another script ("١٢٣")
_NON_ASCII_DIGIT_RE = re.compile(_NON_ASCII_DIGIT)
# What `normalize` changes in NFKC-normal text: the separators above and the digits of other scripts.
_KEPT_BY_NFKC_RE = re.compile(r"[\u066b\u066c\u2044\u2215]|" + _NON_ASCII_DIGIT)


def normalize(text: str) -> str:
  """`text` with Unicode numerals as ASCII: NFKC (full-width digits and separators, circled digits), then the
  Arabic separators, other scripts' digits, vulgar fractions, superscript exponents and subscripts after a digit.

  ASCII text is returned as it is (the common case costs one `isascii`). Signs stay as written: the minus table
  (`number_grammar.MINUS_SIGNS`) reads U+2212 and the dashes wherever a number is read.
  """
  if text.isascii() or (unicodedata.is_normalized("NFKC", text) and not _KEPT_BY_NFKC_RE.search(text)):
    return text  # ASCII, or nothing to change ("’", "–", "×": NFKC's quick check in C, then one scan)
  s = unicodedata.normalize("NFKC", text.translate(_TO_PRIVATE)).translate(_FROM_PRIVATE).translate(_SEPARATORS)
  if not s.isascii():
    s = _NON_ASCII_DIGIT_RE.sub(lambda m: str(unicodedata.decimal(m[0])), s)
  s = _VULGAR_RE.sub(_vulgar, s)
  s = _SUP_AFTER_NUMBER_RE.sub(lambda m: "^{" + "".join(_SUPERSCRIPTS[c] for c in m[1]) + "}", s)
  s = _SUB_AFTER_NUMBER_RE.sub(lambda m: "_{" + "".join(_SUBSCRIPTS[c] for c in m[1]) + "}", s)
  return s


def _vulgar(m: re.Match) -> str:
  """ "½" -> "1/2"; "1½" -> "1 1/2" (a mixed number, which the number grammar reads whole)."""
  frac = unicodedata.normalize("NFKC", m[2]).replace("\u2044", "/")
  return f"{m[1]} {frac}" if m[1] else frac


# ----------------------------------------------------------------------------------------------------------------------
# Scale words: applied, never dropped
# ----------------------------------------------------------------------------------------------------------------------

SCALES = {
    "hundred": 100,
    "thousand": 1000,
    "million": 10**6,
    "billion": 10**9,
    "trillion": 10**12,
    "dozen": 12,
    "lakh": 10**5,
    "crore": 10**7,
    "k": 1000,
    "m": 10**6,
    "b": 10**9,
    "bn": 10**9,
    "mn": 10**6,
}
# A scale after a number, as part of the number: a word ("5 thousand", "2 millions") or a glued suffix ("5k", "$5M",
# "3bn"; a lowercase "m" alone is a metre unless a currency sign comes first, see `scaled_value`). Non-capturing.
SCALE_SUFFIX = (
    r"(?:[ \t]{1,2}(?i:hundred|thousand|million|billion|trillion|dozen|lakh|crore)s?(?![A-Za-z])"
    r"|(?:[kKMB]|bn|mn)(?![A-Za-z0-9]))"
)
_SCALED_RE = re.compile(
    r"(?P<cur>\\?[$€£¥])?[ \t]{0,2}(?P<num>.*?[0-9.])[ \t]{0,2}"
    r"(?P<scale>(?i:hundred|thousand|million|billion|trillion|dozen|lakh|crore)s?|[kKMB]|bn|mn|m)"
    r"(?P<rest>[ \t]{1,4}[A-Za-z][A-Za-z ]{0,40})?\.?"
)


def scaled_value(text: str, read, currency: bool) -> Optional[Fraction]:
  """The value of "N scale [unit words]" ("5 thousand", "1.2 million", "5k", "5M", "3 dozen eggs") with `read` the
  number reader for N, or None when `text` is not one. A lowercase "m" is a million only in an amount of money
  (`currency`: "$5m"); otherwise it is a metre ("5m")."""
  m = _SCALED_RE.fullmatch(text.strip())
  if m is None or (m["scale"] == "m" and not (currency or m["cur"])):
    return None
  if m["rest"] and words_say_not_one_value(m["rest"]):
    return None
  if m["rest"] and words_change_the_value(m["rest"]):  # "5 hundred thousand": a compound scale, not read
    return None
  v = read(m["num"])
  if v is None:
    return None
  key = m["scale"].lower()
  key = key[:-1] if key.endswith("s") and key[:-1] in SCALES else key
  return v * SCALES[key]


SCALE_WORD_RE = re.compile(r"\b(?i:hundred|thousand|million|billion|trillion|dozen|lakh|crore)s?\b")

# ----------------------------------------------------------------------------------------------------------------------
# More than one value: negation, comparison, approximation, alternatives, ranges
# ----------------------------------------------------------------------------------------------------------------------

# Words that make an answer more than one value wherever they stand ("not 5", "5 or more", "maybe 5", "5, at least").
NEGATIONS = ("not", "never", "neither", "nor", "none", "cannot")
ALTERNATIVES = ("or", "either", "maybe", "perhaps", "possibly", "probably", "likely")
BOUNDS = ("between", "minimum", "maximum", "exceeds", "exceeding", "at least", "at most", "up to", "upto")
APPROXIMATIONS = ("approximately", "approx", "roughly", "circa", "give or take", "or so")
# Words that compare or approximate only when they come before the number ("less than 5", "about 5", "over 5"); after
# it they are the question's words ("5 more apples than Tom", "5 apples left over", "a story about 5 friends" aside).
QUALIFIERS = (
    "than",
    "about",
    "around",
    "nearly",
    "almost",
    "over",
    "under",
    "above",
    "below",
    "within",
)
# Words that change a number into another value the rule does not compute ("half of 10", "twice 5", "5 squared").
MODIFIERS = ("half", "halves", "quarter", "quarters", "twice", "thrice", "double", "triple", "squared", "cubed")


def _words_re(words) -> str:
  return r"\b(?:" + "|".join(w.replace(" ", r"[ \t]+") for w in words) + r")\b"


_HEDGE_WORD_RE = re.compile(_words_re(NEGATIONS + ALTERNATIVES + BOUNDS + APPROXIMATIONS) + r"|[a-z]n't\b", re.IGNORECASE)
_BOUND_WORD_RE = re.compile(_words_re(ALTERNATIVES + BOUNDS + APPROXIMATIONS), re.IGNORECASE)
_QUALIFIER_BEFORE_RE = re.compile(_words_re(QUALIFIERS) + r"[^a-z0-9]*\Z", re.IGNORECASE)
_MODIFIER_RE = re.compile(r"\b(?:" + "|".join(MODIFIERS) + r")\b", re.IGNORECASE)
# Comparison, approximation and doubt, in signs and LaTeX ("≤ 5", "x > 4", "\\geq 5", "\\approx 5", "3 \\pm 2", "~5",
# "5+": five or more, "5ish", "5?").
COMPARISON_SIGN_RE = re.compile(
    r"[<>≤≥≦≧≠≈≃≅±∓⩽⩾?]|!=|(?<![\\a-zA-Z])~[ \t]{0,2}[0-9.$]|[0-9][ \t]{0,2}\+(?![ \t]{0,2}[\w(\\$])"
    r"|[0-9][ \t-]{0,2}ish\b"
    r"|\\(?:le|ge|leq|geq|leqslant|geqslant|lt|gt|ne|neq|approx|sim|simeq|pm|mp|lesssim|gtrsim)(?![a-zA-Z])"
)


def words_say_not_one_value(text: str) -> bool:
  """Whether the words of an answer negate, bound or offer alternatives ("not", "isn't", "or", "maybe", "at least",
  "between", "up to"), wherever they stand."""
  return _HEDGE_WORD_RE.search(text.replace("\u2019", "'")) is not None


def words_bound_or_doubt(text: str) -> bool:
  """`words_say_not_one_value` without the negations: for the words after an answer, where "not" is about something
  else ("5, not 3")."""
  return _BOUND_WORD_RE.search(text) is not None


def qualifier_before(text: str) -> bool:
  """Whether `text`, the words before an answer's number, ends in a comparison or approximation ("less than",
  "about", "over", "nearly")."""
  return _QUALIFIER_BEFORE_RE.search(text) is not None


def words_change_the_value(text: str) -> bool:
  """Whether the words of an answer turn its number into another value the grader does not compute ("half of 10")."""
  return _MODIFIER_RE.search(text) is not None or SCALE_WORD_RE.search(text) is not None
