"""The answer grammar, round six (issue 61 class 1; docs/rewards.md "The answer grammar"): an answer span counts only
if it reads WHOLE; anything left over makes it ambiguous (or unreadable when it changes the value).

Every expected verdict is written by hand from what the answer means (the reference), never read off the code: a
wrong answer scores 0, a right answer that reads whole scores 1. `PROBE` holds every form the issue's bad-input
probe listed, with its gold; on the code before this round 82 of its 194 rows rewarded a wrong answer and 33 missed
a right one. The training reward (`check_answer`) and the score CLI are checked to agree with `score_batch` on it.
"""

import io
import json

import pytest

from maxtext_rl_plugin import rewards
from maxtext_rl_plugin.data import rows as data_rows
from maxtext_rl_plugin.rewards import cli
from maxtext_rl_plugin.rewards import gsm8k
from maxtext_rl_plugin.rewards import verify

AMB, UNR, TAG, BOX, HASH, IS, LAST = "ambiguous", "unreadable", "answer_tag", "boxed", "hash", "answer_is", "last_number"


def tag(body: str) -> str:
  return f"<reasoning>r</reasoning>\n<answer>{body}</answer>"


def say(body: str) -> str:
  return f"The answer is {body}"


def _rows(forms, right, wrong):
  """(completion, gold, correct) for each form against each right and each wrong gold."""
  return [(f, g, True) for f in forms for g in right] + [(f, g, False) for f in forms for g in wrong]


# ----------------------------------------------------------------------------------------------------------------------
# The probe's forms (issue 61, class 1), each with its gold
# ----------------------------------------------------------------------------------------------------------------------

PROBE = [
    # An expression after a marker or in the tags: only "... = N", read at the last "=".
    *_rows(["The answer is 20 + 15 = 35.", tag("20 + 15 = 35")], ["35"], ["20", "15"]),
    *_rows(["A: 12 * 3 = 36", tag("12 * 3 = 36")], ["36"], ["12", "3"]),
    *_rows(["Answer: 4 x $5 = $20", tag("4 x $5 = $20")], ["20"], ["4", "5"]),
    *_rows([say("5 squared"), tag("5 squared"), "#### 5 squared"], [], ["5"]),
    *_rows([say("5 percent of 40"), tag("5 percent of 40"), "#### 5 percent of 40"], [], ["5", "40", "2"]),
    *_rows([say("5 and a half"), tag("5 and a half"), "#### 5 and a half"], [], ["5"]),
    *_rows(
        [say("5 dollars and 50 cents"), tag("5 dollars and 50 cents"), "#### 5 dollars and 50 cents"], [], ["5", "50"]
    ),
    # A box with more around it.
    *_rows([tag("\\boxed{5}0"), "so \\boxed{5}0"], [], ["5", "50"]),
    *_rows([tag("\\boxed{5}^2"), "so \\boxed{5}^2"], [], ["5"]),
    *_rows([tag("2\\boxed{5}"), "so 2\\boxed{5}"], [], ["5", "2"]),
    *_rows([tag("\\boxed{3}\\frac12"), "so \\boxed{3}\\frac12"], [], ["3"]),
    *_rows([tag("$\\boxed{5}$ thousand"), "so $\\boxed{5}$ thousand"], [], ["5"]),
    *_rows([tag("\\boxed{5} or 6"), "so \\boxed{5} or 6"], [], ["5", "6"]),
    *_rows(["\\boxed{5} or \\boxed{6}", tag("\\boxed{5} or \\boxed{6}")], [], ["5", "6"]),
    *_rows([tag("\\boxed{5}"), "so \\boxed{5}.", tag("The answer is \\boxed{5}.")], ["5"], ["6"]),
    # Hedges the old list lacked, several values, markers it did not know.
    *[
        row
        for b in ("5 (wait, no, 6)", "5 (guess)", "5, I think", "5 max", "5 and up", "5 & 6", "5..6", "\u2273 5", "ca. 5")
        for row in _rows([tag(b), say(b), f"#### {b}"], [], ["5", "6"] if "6" in b else ["5"])
    ],
    *_rows(
        ["The answer could be 5", "The answer might be 5.", "the answer may be 5", tag("The answer could be 5")],
        [],
        ["5"],
    ),
    # Scale words and numerals: their value, never the bare number.
    *[
        row
        for b, right in (
            ("5\u4e07", "50000"),
            ("5\u5343", "5000"),
            ("5 grand", "5000"),
            ("5 MM", "5000000"),
            ("5 quadrillion", "5000000000000000"),
            ("5 tenths", "0.5"),
        )
        for row in _rows([tag(b), say(b), f"#### {b}"], [right], ["5"])
    ],
    # A piece of a number.
    *_rows([tag("1_000"), say("1_000"), "so we get 1_000"], [], ["1", "0", "1000"]),
    *_rows(["The total is 1{,}500", "The total is 1\\,500", tag("1{,}500"), tag("1\\,500")], ["1500"], ["500", "1"]),
    # Signs: with any currency, across a line break; two signs are not one.
    *[
        row
        for cur in ("$", "\u20ac", "\u00a3", "\u00a5", "\u20b9")
        for row in _rows([tag(f"-{cur}5"), say(f"-{cur}5")], ["-5"], ["5"])
    ],
    *_rows([tag("-\n5")], ["-5"], ["5"]),
    *_rows([tag("--5"), say("--5")], [], ["5", "-5"]),
    # Several values.
    *_rows([tag("x = 5, y = 6"), say("x = 5, y = 6")], [], ["5", "6"]),
]


def test_the_probe_forms_score_what_they_mean():
  before = verify.pool_stats()["verified"]
  res = rewards.score_batch([c for c, _, _ in PROBE], [g for _, g, _ in PROBE])
  assert verify.pool_stats()["verified"] == before  # the grammar decides every row; none needs math_verify
  assert len(PROBE) == 194
  assert [(c, g) for (c, g, ok), r in zip(PROBE, res) if r.correct and not ok] == []  # wrong answers rewarded
  assert [(c, g) for (c, g, ok), r in zip(PROBE, res) if ok and not r.correct] == []  # right answers missed


def test_the_training_reward_and_the_score_cli_agree_on_the_probe():
  """`check_answer` (what the trainer calls) and `rewards score` (offline) give every probe row the same verdict."""
  comps, golds = [c for c, _, _ in PROBE], [g for _, g, _ in PROBE]
  want = [ok for _, _, ok in PROBE]
  assert [r == 1.0 for r in gsm8k.check_answer([""] * len(PROBE), comps, golds)] == want
  out = io.StringIO()
  lines = [json.dumps({"completion": c, "answer": g}).encode() for c, g in zip(comps, golds)]
  cli.score_stream(lines, out)
  assert [json.loads(line)["correct"] for line in out.getvalue().splitlines()] == want


# ----------------------------------------------------------------------------------------------------------------------
# One test per grammar rule: (completion, gold, correct, rule)
# ----------------------------------------------------------------------------------------------------------------------

GRAMMAR = {
    "number": [  # one number, read whole with its separators (LaTeX's too); never a piece of one
        (tag("1{,}500"), "1500", True, TAG),
        (tag("1\\,500"), "500", False, TAG),
        (tag("1_000"), "1", False, UNR),
        (tag("1\\,5"), "15", False, AMB),  # a thin space that groups no thousands: two numbers, never 15
        (tag("5..6"), "6", False, AMB),
        (tag("5 & 6"), "6", False, AMB),
    ],
    "sign": [  # one sign, apart from its digits or not; two signs are left over
        (tag("-\n5"), "-5", True, TAG),
        (tag("-\n5"), "5", False, TAG),
        (tag("--5"), "-5", False, AMB),
        (tag("- 5"), "-5", True, TAG),
    ],
    "currency": [  # $, €, £, ¥, ₹ before or after the sign
        (tag("-\u20ac5"), "-5", True, TAG),
        (tag("-\u20ac5"), "5", False, TAG),
        (tag("\u20b91,200"), "1200", True, TAG),
        (tag("$-4.50"), "-4.5", True, TAG),
    ],
    "scale": [  # a closed list of scale words, applied; an -illion it does not hold is unreadable
        (tag("5 grand"), "5000", True, TAG),
        (tag("5 MM"), "5", False, TAG),
        (tag("5 mm"), "5", True, TAG),  # lowercase: millimetres
        (tag("5\u4e07"), "50000", True, TAG),
        (tag("3 fifths"), "0.6", True, TAG),
        (tag("5 zillion"), "5", False, UNR),
        (tag("5 hundred thousand"), "500000", False, UNR),
    ],
    "unit": [  # a closed list of units, or a count noun (plural by its form; any noun after 1), then the sentence
        (tag("5 kg"), "5", True, TAG),
        (tag("5 apples"), "5", True, TAG),
        (tag("1 apple"), "1", True, TAG),
        (tag("5 more apples than Tom"), "5", True, TAG),
        (tag("$5 per hour"), "5", True, TAG),
        (tag("5 (dollars)"), "5", True, TAG),
        (tag("5 max"), "5", False, AMB),
        (tag("5 (guess)"), "5", False, AMB),
        (tag("5 and up"), "5", False, AMB),
        (tag("5 apples and up"), "5", False, AMB),
        (tag("5, I think"), "5", False, AMB),
    ],
    "punctuation": [  # trailing punctuation and markup; a question mark is a doubt
        (tag("5."), "5", True, TAG),
        (tag("**5**"), "5", True, TAG),
        (tag("(5)"), "5", True, TAG),
        (tag("5?"), "5", False, AMB),
    ],
    "lead": [  # before the number: markup, or a statement; a qualifier, a symbol or a guess is left over
        (tag("It will take 5 hours."), "5", True, TAG),
        (tag("He will be 5"), "5", True, TAG),
        (tag("ca. 5"), "5", False, AMB),
        (tag("\u2273 5"), "5", False, AMB),
        (tag("It could be 5"), "5", False, AMB),
        (tag("somewhere near 5"), "5", False, AMB),
        (tag("My guess is 5"), "5", False, AMB),
        (tag("I think it's 5"), "5", False, AMB),
    ],
    "equation": [  # an expression only as "... = N", read at the last "="; several equations are several values
        (tag("20 + 15 = 35"), "35", True, TAG),
        (tag("20 + 15 = 35"), "20", False, TAG),
        (tag("x = 5, y = 6"), "6", False, AMB),
        ("The answer is 20 + 15 = 35.", "35", True, IS),
    ],
    "box": [  # nothing glued to a box, nothing joined to it; in the tags its surroundings read as a span
        (tag("\\boxed{5}0"), "5", False, AMB),
        (tag("2\\boxed{5}"), "5", False, AMB),
        (tag("$\\boxed{5}$ thousand"), "5", False, UNR),
        ("\\boxed{5} or \\boxed{6}", "6", False, AMB),
        ("so 3 + 2 = \\boxed{5}.", "5", True, BOX),
        ("\\boxed{5}.\nNo, wait: \\boxed{6}", "6", True, BOX),  # separate sentences: the last box
    ],
    "marker": [  # after a marker only asserting adverbs before the number; a modal of possibility is a guess
        (say("ca. 5"), "5", False, AMB),
        (say("clearly 5."), "5", True, IS),
        ("The answer could be 5", "5", False, AMB),
        ("The answer will be 5 dollars.", "5", True, IS),
        ("The answer is 5, not 3.", "5", True, IS),
        ("The answer is 5 (guess)", "5", False, AMB),
        ("#### 5 max", "5", False, AMB),
    ],
    "free_form": [  # no tag, no marker: the last number, read whole only
        ("so we get 1_000", "0", False, UNR),
        ("the code is 0x10", "10", False, UNR),
        ("The total is 1{,}500", "1500", True, LAST),
        ("so 1{,}5", "5", False, UNR),
        ("so 1\\,5", "5", False, UNR),
        ("so she has 5 apples", "5", True, LAST),
    ],
}


@pytest.mark.parametrize("rule", sorted(GRAMMAR))
def test_each_grammar_rule(rule):
  rows = GRAMMAR[rule]
  res = rewards.score_batch([r[0] for r in rows], [r[1] for r in rows])
  assert [(c, g, r.correct, r.rule) for (c, g, _, _), r in zip(rows, res)] == rows


# Right answers as models write them, in the tags and outside: each reads whole and scores 1.
RIGHT = [
    *[
        (tag(b), g)
        for b, g in (
            ("She has 5 apples left.", "5"),
            ("Janet makes $18 every day.", "18"),
            ("18 dollars a day", "18"),
            ("He went 5 times", "5"),
            ("5 in total", "5"),
            ("\u22127 degrees", "-7"),
            ("1,234 miles", "1234"),
            ("5 \\text{ apples}", "5"),
            ("2 1/2 cups", "2.5"),
            ("12 \\times 3 = 36", "36"),
            ("\\(\\boxed{18}\\)", "18"),
            ("Therefore \\boxed{18}", "18"),
        )
    ],
    ("The final answer is $18.", "18"),
    ("**Answer:** 18", "18"),
    ("So the answer is 42 because 6 * 7 = 42.", "42"),
    ("The answer is 42. Hope this helps!", "42"),
    ("The answer is 42 eggs, which is plenty.", "42"),
    ("In total, the answer is \\boxed{18}.", "18"),
    ("Final answer: \\(\\boxed{18}\\)", "18"),
    ("She gets 3 * 6 = 18 dollars.\nFinal answer: 18", "18"),
    ("So the final answer is 12 cookies in total.", "12"),
    ("The answer is the sum of 3 and 2: 5", "5"),
]


def test_right_answers_that_read_whole_score_1():
  res = rewards.score_batch([c for c, _ in RIGHT], [g for _, g in RIGHT])
  assert [(c, g, r.rule) for (c, g), r in zip(RIGHT, res) if not r.correct] == []


# ----------------------------------------------------------------------------------------------------------------------
# Golds: the same grammar; a gold that does not read whole is refused (training skips the row, the CLI errs it)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("#### 0x10", None),
        ("#### 1_000", None),
        ("#### 5..6", None),
        ("#### 5 max", None),
        ("#### 5 (guess)", None),
        ("#### 5 squared", None),
        ("#### 5 tenths", "0.5"),
        ("#### 5 grand", "5000"),
        ("#### 5\u4e07", "50000"),
        ("#### 1{,}500", "1500"),
        ("#### -\u20ac5", "-5"),
    ],
)
def test_a_gold_reads_whole_or_is_refused(gold, expected):
  assert rewards.parse_gold(gold) == expected
  assert gsm8k.gold_alternatives(gold) == ((expected,) if expected else ())  # the score CLI keeps no piece either


def test_a_refused_gold_is_an_error_row_of_the_score_cli_and_counted():
  out = io.StringIO()
  rows = [
      {"completion": "<answer>0</answer>", "answer": "#### 0x10"},
      {"completion": "<answer>5</answer>", "answer": "5"},
  ]
  stats = cli.score_stream([json.dumps(r).encode() for r in rows], out)
  got = [json.loads(line) for line in out.getvalue().splitlines()]
  assert [r["correct"] for r in got] == [False, True] and "no parsable gold value" in got[0]["error"]
  assert stats["errors"] == 1


def test_the_text_golds_the_score_cli_keeps_still_set_their_own_shape():
  """Golds without a number to read ("B", "\\frac{\\pi}{2}") or shaped as several ("(3, 5)", "3:30") are kept."""
  for gold in ("B", "\\frac{\\pi}{2}", "(3, 5)", "3:30"):
    assert gsm8k.gold_alternatives(gold) == (gold,)


def test_training_data_skips_a_gold_that_does_not_read_whole_counts_it_and_says_so_once(caplog):
  """The data loader reads golds with the same grammar (`number_grammar.parse_gold`): such rows are skipped, counted
  as "no parsable gold answer", in one warning for the source."""
  golds = ["#### 0x10", "#### 5 max", "#### 1_000", "#### 5 grand", "#### 18"]
  examples, skips = data_rows.rows_to_examples([{"question": "q", "answer": a} for a in golds], "probe.jsonl")
  assert [e[1] for e in examples] == ["5000", "18"]
  assert (skips.no_answer, skips.skipped) == (3, 3)
  warnings = [r.getMessage() for r in caplog.records if "probe.jsonl: skipped" in r.getMessage()]
  assert len(warnings) == 1 and "no parsable gold answer ('#### N'): 3" in warnings[0]
