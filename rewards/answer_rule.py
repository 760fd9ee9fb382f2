"""The answer rule's vocabulary and the word classes of its span grammar: Unicode numerals to ASCII, scale and
fraction words, units, the words of the grammar, and what may stand around an answer's number (`read_lead`,
`read_tail`).

A tagged answer (`<answer>...</answer>`, `\\boxed{}`, `#### N`, "the answer is N") is read as ONE value or not at all:
its span counts only if it reads whole, and anything left over makes it ambiguous.
RL learns whatever is rewarded, and hedging ("3 or 5", "at least 5", "3-5") is the cheapest thing to learn, so an
answer that states several values, a range, a negation or a comparison is wrong (rule `ambiguous`), never its last
number. Numbers are read with their whole meaning: a sign apart from its digits ("- 5", "-\\boxed{5}"), full-width and
Arabic separators ("1，234", "1٫5"), superscripts ("5²" is 5^2, "10⁻³" is 10^-3), vulgar fractions ("1½" is 1 1/2)
and scale words ("5 thousand", "$5M") are applied; what cannot be held exactly (a digit with a subscript, "5 hundred
thousand") is `unreadable`. Never a piece of a number. The grammar is in docs/rewards.md ("The answer grammar").

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

# A closed list: a word not here is never read as a multiplier (nor dropped: the span does not read whole).
SCALES = {
    "hundred": 100,
    "thousand": 1000,
    "grand": 1000,
    "million": 10**6,
    "billion": 10**9,
    "trillion": 10**12,
    "quadrillion": 10**15,
    "quintillion": 10**18,
    "sextillion": 10**21,
    "septillion": 10**24,
    "octillion": 10**27,
    "nonillion": 10**30,
    "decillion": 10**33,
    "dozen": 12,
    "lakh": 10**5,
    "crore": 10**7,
    "k": 1000,
    "m": 10**6,
    "mm": 10**6,  # written "MM" (finance); "mm" in lowercase is a millimetre and never matches the scale
    "b": 10**9,
    "bn": 10**9,
    "mn": 10**6,
    "\u767e": 100,  # 百
    "\u5343": 1000,  # 千
    "\u4e07": 10**4,  # 万
    "\u842c": 10**4,  # 萬
    "\u4ebf": 10**8,  # 亿
    "\u5104": 10**8,  # 億
}
# Fraction words after a number, in the plural: its denominator ("5 tenths" is 1/2, "3 fifths" is 3/5; the singular is
# an ordinal: "76 sixth graders"). Halves and quarters are not here: "5 quarters" is as often five coins as 5/4
# (MODIFIERS: unreadable).
FRACTION_WORDS = {
    "third": 3,
    "fourth": 4,
    "fifth": 5,
    "sixth": 6,
    "seventh": 7,
    "eighth": 8,
    "ninth": 9,
    "tenth": 10,
    "hundredth": 100,
    "thousandth": 1000,
}
_SCALE_WORDS = "hundred|thousand|grand|million|billion|trillion|quadrillion|quintillion|sextillion|septillion|octillion"
_SCALE_WORDS += "|nonillion|decillion|dozen|lakh|crore"
_FRACTION_WORDS = "|".join(FRACTION_WORDS)
_CJK_SCALES = "[\u767e\u5343\u4e07\u842c\u4ebf\u5104]"
# A scale after a number, as part of the number: a word ("5 thousand", "2 millions", "5 grand"), a fraction word ("5
# tenths"), a glued suffix ("5k", "$5M", "3bn", "5万"; a lowercase "m" alone is a metre unless a currency sign comes
# first, see `scaled_value`), "MM". Non-capturing.
SCALE_SUFFIX = (
    r"(?:[ \t]{1,2}(?i:" + _SCALE_WORDS + r")s?(?![A-Za-z])"
    r"|[ \t]{1,2}(?i:" + _FRACTION_WORDS + r")s(?![A-Za-z])"  # plural only: "76 sixth graders" is 76
    r"|[ \t]{0,2}MM(?![A-Za-z0-9])|[ \t]?" + _CJK_SCALES + r"|(?:[kKMB]|bn|mn)(?![A-Za-z0-9]))"
)
_SCALED_RE = re.compile(
    r"(?P<cur>\\?[$€£¥₹])?[ \t]{0,2}(?P<num>.*?[0-9.])[ \t]{0,2}"
    r"(?P<scale>(?i:" + _SCALE_WORDS + r")s?|(?i:" + _FRACTION_WORDS + r")s|[kKMB]|MM|bn|mn|m|" + _CJK_SCALES + r")"
    r"(?P<rest>[ \t]{1,4}[A-Za-z][A-Za-z ]{0,40})?\.?"
)


def scaled_value(text: str, read, currency: bool) -> Optional[Fraction]:
  """The value of "N scale [unit words]" ("5 thousand", "1.2 million", "5k", "5M", "3 dozen eggs", "5 tenths", "5万")
  with `read` the number reader for N, or None when `text` is not one. A lowercase "m" is a million only in an amount
  of money (`currency`: "$5m"); otherwise it is a metre ("5m")."""
  m = _SCALED_RE.fullmatch(text.strip())
  if m is None or (m["scale"] == "m" and not (currency or m["cur"])):
    return None
  if m["rest"] and read_tail(m["rest"], False) is not None:  # "5 hundred thousand", "5 thousand or more": not read
    return None
  v = read(m["num"])
  if v is None:
    return None
  key = m["scale"].lower()
  key = key[:-1] if key.endswith("s") and key[:-1] in SCALES | FRACTION_WORDS else key
  if key in FRACTION_WORDS:
    return v / FRACTION_WORDS[key]
  return v * SCALES[key]


# Words that change a number into another value whatever their place: scale words (applied only right after their
# number) and any "-illion" the list above does not hold ("5 zillion": unreadable, never 5).
SCALE_WORD_RE = re.compile(
    r"\b(?i:" + _SCALE_WORDS + r")s?\b|\b(?i:" + _FRACTION_WORDS + r")s\b|\b[A-Za-z]*illions?\b|\bMM\b|" + _CJK_SCALES
)

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
    r"[<>≤≥≦≧≠≈≃≅±∓⩽⩾?≲≳≪≫∼≍≊≒≶≷⪅⪆∝]|!=|(?<![\\a-zA-Z])~[ \t]{0,2}[0-9.$]|[0-9][ \t]{0,2}\+(?![ \t]{0,2}[\w(\\$])"
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


# ----------------------------------------------------------------------------------------------------------------------
# The span grammar: what may stand around an answer's one number (extraction.py reads the number; docs/rewards.md)
# ----------------------------------------------------------------------------------------------------------------------

# Units, a closed list: currencies, measures, time, percent (the plural of a count noun is read by its form, below).
UNITS = frozenset(
    """percent pct cent cents dollar dollars usd eur gbp inr jpy cad aud euro euros pound pounds yen yuan rupee rupees
    h hr hrs hour hours min mins minute minutes s sec secs second seconds day days week weeks month months yr yrs year
    years km m cm mm mi mile miles ft foot feet in inch inches yd yard yards meter meters metre metres kg g mg lb lbs
    oz ounce ounces gram grams kilogram kilograms ton tons tonne tonnes l ml liter liters litre litres gal gallon
    gallons cup cups mph kph km/h degree degrees sq square cubic""".split()
)
# English plurals not ending in "s".
_IRREGULAR_PLURALS = frozenset(
    "people children men women feet teeth mice geese sheep fish deer cattle oxen series species aircraft".split()
)
# Words of the grammar itself, never a unit: connectives and operators between values, bounds, hedges, pronouns and
# verbs. A phrase holding one is not a unit phrase ("5 and up", "5 max", "5 or so").
_RESERVED = frozenset(
    """and or nor to through thru than of vs versus plus minus over by per from between either then is are was
    were be been has have had does do did this that these those its his her their it he she they we you i yes no not
    never less more most least max min maximum minimum tops about around approx approximately roughly nearly almost
    under above below up down guess ish so maybe perhaps possibly probably likely thus hence plus also near like within
    beyond past toward towards""".split()
)
# Conjunctions: after a unit phrase they start another clause, which the span does not read ("5 apples and up").
_CLAUSE_JOINERS = frozenset("and or nor but if unless though although assuming give plus minus up to through".split())
# Words that may come before the noun of a unit phrase ("5 more apples", "5 extra cookies").
_NOUN_MODIFIERS = frozenset("more fewer extra additional whole full total".split())
# What may follow a bare number (no unit): where the value stands, not a bound ("5 each", "5 in total", "5 left").
_BARE_REST = frozenset(
    (
        "each",
        "apiece",
        "total",
        "in total",
        "in all",
        "altogether",
        "overall",
        "left",
        "remaining",
        "left over",
        "more",
        "fewer",
    )
)
# Adverbs that assert a value ("the answer is clearly 5", "it is exactly 5"): dropped before the number.
_ASSERTIVE = (
    "clearly|definitely|exactly|precisely|therefore|thus|hence|so|just|simply|only|now|then|still|indeed|actually"
    "|certainly|surely|really|also|finally|altogether|equal to|a total of|in total"
)
_ASSERTIVE_TAIL_RE = re.compile(r"(?:[ \t,]+(?i:" + _ASSERTIVE + r"))+[ \t,]*\Z")
# Verbs that state a value before it: a copula, a colon, or a finite verb ("needs", "earned"); "be" only after a
# modal that asserts ("will be"), never "could be", "might be".
_COPULAS = frozenset("is are was were am equals equal makes gives yields totals has have had got get need left".split())
_ASSERTING_MODALS = frozenset("will would should must shall to".split())
# Verbs of doubt: a statement holding one is a guess ("I think 5", "My guess is 5", "I'm not sure, 5").
_DOUBT_RE = re.compile(r"\b(?:think|thinking|guess|guessing|believe|suppose|estimate|assume|reckon|sure|unsure)\b", re.I)
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'’/-]*")
_MARKUP_RE = re.compile(r"\A[\s*_`\"'(\[{]+|[\s*_`\"')\]}]+\Z")
_TRAILING_PUNCT_RE = re.compile(r"[\s.,;:!)\]}*_`\"']+\Z")
# "5, not 3" (a correction: one value stated, another ruled out) and its variants.
CORRECTION_RE = re.compile(r"[ \t]*,[ \t]*(?:and[ \t]+)?not[ \t]+[-$\u2212]?\d[\d,.]*[.!]?[ \t]*\Z", re.IGNORECASE)


def _is_noun(word: str, singular: bool) -> bool:
  """Whether `word` can end a unit phrase: a unit, a plural by its form ("apples", "people"), or after the value 1
  any word of the grammar's open class ("1 apple")."""
  w = word.lower()
  if word in UNITS or w in UNITS:
    return True
  if w in _RESERVED or not w.isalpha() or len(w) < 3:
    return False
  if w in _IRREGULAR_PLURALS or (w.endswith("s") and not w.endswith(("ss", "us", "is"))):
    return True
  return singular


def _unit_phrase(words: list[str], singular: bool) -> int:
  """How many of `words` form the unit phrase after a number (0 if none): up to three words, the last a noun
  (`_is_noun`), the others modifiers or open-class words ("more apples", "red apples", "dollars")."""
  for k in (3, 2, 1):
    if len(words) < k or not _is_noun(words[k - 1], singular):
      continue
    if all(w.lower() in _NOUN_MODIFIERS or (w.lower() not in _RESERVED and w.isalpha()) for w in words[: k - 1]):
      return k
  return 0


def read_tail(text: str, singular: bool) -> Optional[str]:
  """The verdict on what follows an answer's number (None: it reads whole; "ambiguous"; "unreadable"): trailing
  punctuation, a unit phrase in or out of brackets and then the rest of the sentence, or after a bare number one of
  `_BARE_REST`; a correction ", not 3". Anything else is left over: "5 max", "5 (guess)", "5, I think", "5 and up"."""
  t = CORRECTION_RE.sub("", text)
  if any(c.isdigit() for c in t):
    return "ambiguous"
  if words_change_the_value(t) or _MODIFIER_RE.search(t):
    return "unreadable"
  t = _TRAILING_PUNCT_RE.sub("", t).strip()
  if not t:
    return None
  if COMPARISON_SIGN_RE.search(t):
    return "ambiguous"
  if t.startswith("(") and t.count("(") == 1:  # "5 (dollars)": a unit phrase in brackets, nothing else
    words = t[1:].split()
    return None if words and _unit_phrase(words, singular) == len(words) else "ambiguous"
  words = t.split()
  if t.lower() in _BARE_REST or (len(words) == 2 and words[0].lower() in ("per", "a", "an", "each", "every")):
    return None  # "5 in total", "5 per hour", "5 a day"
  k = _unit_phrase(words, singular) if _WORD_RE.fullmatch(words[0]) else 0
  if k == 0:
    return "ambiguous"
  rest = " ".join(words[k:])
  if rest and (words_bound_or_doubt(rest) or re.search(r"[^\w\s,'’-]", rest) or rest[:1] == ","):
    return "ambiguous"
  if rest and words[k].lower() in _CLAUSE_JOINERS:  # "5 apples and up", "5 apples if I'm right": another clause
    return "ambiguous"
  return None


def read_lead(text: str, marked: bool) -> Optional[str]:
  """The verdict on what precedes an answer's number (None, "ambiguous", "unreadable"): markup; after an answer marker
  (`marked`) only asserting adverbs ("clearly"); in a tag body also a statement whose last word is not one of the
  grammar's ("He needs", "It will take", "The answer is", "Total:"; "be" only after a modal that asserts). Anything
  else is left over: "ca. 5", "≳ 5", "could be 5", "about 5", "-" of "--5"."""
  if any(c.isdigit() for c in text):
    return "ambiguous"
  if words_change_the_value(text) or _MODIFIER_RE.search(text):
    return "unreadable"
  t = _MARKUP_RE.sub("", text)
  if not t:
    return None
  if re.search(r"[^\w\s,:'’]", t) or words_say_not_one_value(t) or qualifier_before(t):
    return "ambiguous"
  t = _ASSERTIVE_TAIL_RE.sub("", " " + t).strip(" \t,")
  if not t:
    return None
  if marked:
    return "ambiguous"
  if _DOUBT_RE.search(t):
    return "ambiguous"
  words = t.split()
  last = words[-1].lower()
  if last.endswith(":") or last.endswith(("'s", "’s")) or last in _COPULAS:
    return None
  if last == "be":
    return None if len(words) > 1 and words[-2].lower() in _ASSERTING_MODALS else "ambiguous"
  return None if last.isalpha() and last not in _RESERVED else "ambiguous"
