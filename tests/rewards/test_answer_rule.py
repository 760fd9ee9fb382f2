"""The answer rule (rewards/answer_rule.py, docs/rewards.md): a tagged or marked answer reads as ONE value.

Each table row carries its expected verdict, written by hand from what the answer means (the reference): a hedge
("3 or 5"), a range, a negation or a comparison is wrong and counted as `ambiguous`; a sign apart from its number is
its sign; Unicode numerals and scale words mean what they say, or the row is `unreadable`; honest single values keep
scoring 1, on the real GSM8K fixture and the synthetic task too.
"""

import json
import random
import types

import pytest

from maxtext_rl_plugin import rewards
from maxtext_rl_plugin.data import prompts
from maxtext_rl_plugin.data import splits
from maxtext_rl_plugin.data import synthetic
from maxtext_rl_plugin.rewards import answer_rule
from maxtext_rl_plugin.rewards import cli
from maxtext_rl_plugin.rewards import gsm8k
from maxtext_rl_plugin.rewards import verify


def tag(body: str) -> str:
  return f"<reasoning>r</reasoning>\n<answer>{body}</answer>"


AMB, TAG, UNR = "ambiguous", "answer_tag", "unreadable"

# (completion, gold, correct, rule)
HEDGES = [
    # Several values, ranges, negations, comparisons in a tagged answer: wrong, counted as `ambiguous`.
    (tag("3 or 5"), "5", False, AMB),
    (tag("not 5"), "5", False, AMB),
    (tag("3-5"), "5", False, AMB),
    (tag("3 to 5"), "5", False, AMB),
    (tag("between 3 and 5"), "5", False, AMB),
    (tag("less than 5"), "5", False, AMB),
    (tag("at least 5"), "5", False, AMB),
    (tag("3, 5"), "5", False, AMB),
    (tag("3:30"), "30", False, AMB),
    (tag("3:2"), "2", False, AMB),
    (tag("5 or more"), "5", False, AMB),
    (tag("5 or so"), "5", False, AMB),
    (tag("about 5"), "5", False, AMB),
    (tag("~5"), "5", False, AMB),
    (tag("\u2248 5"), "5", False, AMB),
    (tag("x \\geq 5"), "5", False, AMB),
    (tag("x <= 5"), "5", False, AMB),
    (tag("5+"), "5", False, AMB),
    (tag("5?"), "5", False, AMB),
    (tag("5ish"), "5", False, AMB),
    (tag("it isn't 5"), "5", False, AMB),
    (tag("up to 5"), "5", False, AMB),
    (tag("3 \\pm 2"), "5", False, AMB),
    (tag("(3, 5)"), "5", False, AMB),
    (tag("\\text{3 or 5}"), "5", False, AMB),
    (tag("12 then 5 apples"), "5", False, AMB),
    (tag("\\boxed{3} or \\boxed{5}"), "5", False, AMB),
    ("so \\boxed{3 or 5}", "5", False, AMB),
    # "5!" is five factorial (math_verify's reading), never 5.
    (tag("5!"), "5", False, TAG),
    # The same rule after an answer marker: a qualifier before the number, another value after it.
    ("#### 3 or 5", "5", False, AMB),
    ("#### 3-5", "5", False, AMB),
    ("#### 3, 5", "5", False, AMB),
    ("The answer is not 5.", "5", False, AMB),
    ("The answer is at least 5", "5", False, AMB),
    ("The answer is 3 or 5.", "3", False, AMB),
    ("Answer: 5 or more", "5", False, AMB),
    ("Q: how many?\nA: 3:30", "30", False, AMB),
    ("The answer is 5 or maybe 3", "5", False, AMB),
    ("The answer is 5?", "5", False, AMB),
    ("The answer is >= 5", "5", False, AMB),
    ("The answer is definitely not 5", "5", False, AMB),
    ("#### about 5", "5", False, AMB),
    ("#### 5, maybe 6", "5", False, AMB),
    ("#### not really sure, maybe 5", "5", False, AMB),  # the line after "####" is read whole, as a gold is
    ("The answer is 3. Hmm, the answer is unclear, maybe 5", "5", False, AMB),  # the last marker's clause
    ("The answer is 5 \u00b1 1", "5", False, AMB),
    ("Answer: 5 (approx.)", "5", False, AMB),
    ("The answer is 5 at most.", "5", False, AMB),
    ("The answer is [3, 5]", "5", False, AMB),
    (tag("The answer is 5+."), "5", False, AMB),
    (tag("5 (3 apples)"), "5", False, AMB),  # prose with brackets is read by its numbers, not sent to math_verify
    # One value, as models write it: kept.
    (tag("5"), "5", True, TAG),
    (tag("$5"), "5", True, TAG),
    (tag("5.0"), "5", True, TAG),
    (tag("5 apples"), "5", True, TAG),
    (tag("1,234"), "1234", True, TAG),
    (tag("-5"), "-5", True, TAG),
    (tag("5%"), "5", True, TAG),
    (tag("\\frac{1}{2}"), "0.5", True, TAG),
    (tag("x = 5"), "5", True, TAG),
    (tag("3 * 6 = 18"), "18", True, TAG),
    (tag("The answer is 5."), "5", True, TAG),
    (tag("He needs 5 more apples"), "5", True, TAG),
    (tag("She has 5 more apples than Tom"), "5", True, TAG),  # "than" after the number is the question's word
    (tag("5 apples left over"), "5", True, TAG),
    (tag("The most she can buy is 5"), "5", True, TAG),
    (tag("5 (dollars)"), "5", True, TAG),
    ("<reasoning>The answer is 5.</reasoning>", "5", True, "answer_is"),
    (tag("more than 5"), "5", False, AMB),  # ... before it, a comparison
    (tag("over 5 apples"), "5", False, AMB),
    (tag("\\boxed{5}, that is \\boxed{5}"), "5", True, TAG),
    ("#### 5", "5", True, "hash"),
    ("The answer is 5.", "5", True, "answer_is"),
    ("The answer is clearly 5.", "5", True, "answer_is"),
    ("#### 18 dollars", "18", True, "hash"),
    ("#### 3 * 6 = 18", "18", True, "hash"),
    ("The answer is the sum of 3 and 2: 5", "5", True, "answer_is"),  # a colon marks the value again (round six)
    ("The answer is 5, not 3.", "5", True, "answer_is"),
    ("The answer is 18, since 3 * 6 = 18.", "18", True, "answer_is"),
    # Free-form completions without a tag or marker keep the field's last-number convention.
    ("I think 3 or 5", "5", True, "last_number"),
]

SIGNS = [
    # A sign apart from its number is still its sign: wrong against 5, right against -5.
    *[(tag(b), "5", False, TAG) for b in ("- 5", "\u22125", "\u2212 5", "\u2014 5", "-\\boxed{5}", "\u2212\\boxed{5}")],
    *[(tag(b), "-5", True, TAG) for b in ("- 5", "\u22125", "\u2212 5", "\u2014 5", "-\\boxed{5}", "\u2212\\boxed{5}")],
    ("The answer is -\\boxed{5}", "5", False, "boxed"),
    ("The answer is -\\boxed{5}", "-5", True, "boxed"),
    ("#### - 5", "5", False, "hash"),
    ("#### - 5", "-5", True, "hash"),
    ("The answer is \u2212 5.", "-5", True, "answer_is"),
    # After an operand the minus is an operator: the box is part of an expression, not one value.
    ("so 10 - \\boxed{5}", "5", False, AMB),
    (tag("x - \\boxed{5}"), "5", False, AMB),
    (tag("8 - 3"), "5", False, AMB),
]

UNICODE = [
    # Full-width and Arabic separators and digits: the whole number, never its last group.
    (tag("1\uff0c234"), "1234", True, TAG),
    (tag("1\uff0c234"), "234", False, TAG),
    (tag("1\uff0e5"), "1.5", True, TAG),
    (tag("1\uff0e5"), "5", False, TAG),
    (tag("1\u066b5"), "1.5", True, TAG),
    (tag("1\u066b5"), "5", False, TAG),
    (tag("1\u066c234"), "1234", True, TAG),
    (tag("1\u066c234"), "234", False, TAG),
    (tag("\uff11\uff12"), "12", True, TAG),
    (tag("\u0661\u0662\u0663"), "123", True, TAG),
    ("#### 1\uff0c200", "1200", True, "hash"),
    # Superscripts are exponents, vulgar fractions their value, the fraction slash a slash.
    (tag("5\u00b2"), "25", True, TAG),
    (tag("5\u00b2"), "5", False, TAG),
    (tag("10\u207b\u00b3"), "0.001", True, TAG),
    (tag("10\u207b\u00b3"), "10", False, TAG),
    (tag("1\u00bd"), "1.5", True, TAG),
    (tag("1\u00bd"), "1", False, TAG),
    (tag("3\u00bc"), "3.25", True, TAG),
    (tag("-1\u00bd"), "-1.5", True, TAG),
    (tag("\u00be"), "0.75", True, TAG),
    (tag("1\u20442"), "0.5", True, TAG),
    (tag("1\u20442"), "2", False, TAG),
    ("so it is 10\u207b\u00b3", "10", False, "last_number"),
    # A digit with a subscript has no one reading: unreadable, never its digits.
    (tag("5\u2082"), "5", False, UNR),
    ("the total is 5\u2082", "5", False, UNR),
    # A superscript or subscript after a letter is a unit or a name, not a number.
    ("the area is 25 m\u00b2", "25", True, "last_number"),
    ("CO\u2082 makes 5", "5", True, "last_number"),
]

SCALES = [
    (tag("5 thousand"), "5000", True, TAG),
    (tag("5 thousand"), "5", False, TAG),
    (tag("2 million"), "2000000", True, TAG),
    (tag("2 million"), "2", False, TAG),
    (tag("3 dozen"), "36", True, TAG),
    (tag("3 dozen"), "3", False, TAG),
    (tag("5k"), "5000", True, TAG),
    (tag("5k"), "5", False, TAG),
    (tag("$5M"), "5000000", True, TAG),
    (tag("$5M"), "5", False, TAG),
    (tag("$1.2 million"), "1200000", True, TAG),
    (tag("$1.2 million"), "1.2", False, TAG),
    (tag("$5m"), "5000000", True, TAG),
    (tag("5m"), "5", True, TAG),  # without a currency sign a lowercase m is a metre
    (tag("3 dozen eggs"), "36", True, TAG),
    (tag("He earns 5 thousand dollars"), "5000", True, TAG),
    ("The answer is $5M", "5000000", True, "answer_is"),
    ("so he earns 5 thousand dollars", "5000", True, "last_number"),
    ("so he earns 5 thousand dollars", "5", False, "last_number"),
    # What the rule does not compute is unreadable, never the number without its multiplier.
    (tag("5 hundred thousand"), "500", False, UNR),
    (tag("half of 10"), "10", False, UNR),
    (tag("5 squared"), "5", False, UNR),
]


def _verdicts(rows):
  res = rewards.score_batch([r[0] for r in rows], [r[1] for r in rows])
  return [(r[0], r[1], s.correct, s.rule) for r, s in zip(rows, res)]  # the table's own rows, verdicts measured


@pytest.mark.parametrize("table", [HEDGES, SIGNS, UNICODE, SCALES], ids=["hedges", "signs", "unicode", "scales"])
def test_each_row_gets_its_verdict(table):
  assert _verdicts(table) == table


def test_a_gold_that_is_not_one_number_sets_its_own_shape():
  """The score CLI keeps non-numeric golds: an answer shaped like one ("(3, 5)", "3:30") is compared with it."""
  golds = ["(3, 5)", "3:30", "(3, 5)", "5"]
  comps = [tag("(3, 5)"), tag("3:30"), tag("(3, 6)"), tag("(3, 5)")]
  res = rewards.score_batch(comps, golds)
  assert [(r.correct, r.rule) for r in res] == [(True, TAG), (True, TAG), (False, TAG), (False, AMB)]


def test_an_answer_that_is_not_one_value_is_scored_wrong_counted_and_never_verified(monkeypatch):
  """ambiguous/unreadable rows earn penalty_incorrect_answer (not the format penalty, not partial credit), set their
  flags, and no piece of them reaches the comparison (math_verify reads "5_{2}" as 5)."""
  sent = []
  real = verify.verify_batch
  monkeypatch.setattr(verify, "verify_batch", lambda pairs, *a: sent.extend(pairs) or real(pairs, *a))
  gsm8k._LAST_GRADED = (None, None)  # pylint: disable=protected-access
  cfg = rewards.RewardConfig(
      penalty_incorrect_answer=-1.0, penalty_incorrect_format=-0.5, reward_ratio_guess_to_answer_high=0.5
  )
  comps = [tag("4 or 5"), tag("at least 5"), tag("5\u2082"), tag("5 hundred thousand"), tag("5")]
  res = rewards.score_batch(comps, ["5"] * len(comps), cfg)
  assert [(r.answer_reward, r.ambiguous, r.unreadable) for r in res] == [
      (-1.0, True, False),
      (-1.0, True, False),
      (-1.0, False, True),
      (-1.0, False, True),
      (1.0, False, False),
  ]
  assert sent == [("5", "5")]
  assert gsm8k.check_answer([""] * 5, comps, ["5"] * 5, tmvp_config=cfg) == [r.answer_reward for r in res]


def test_real_gsm8k_golds_in_the_formats_templates_ask_for_score_1_and_their_hedges_0(gsm8k_fixture_dir):
  """Every gold of the shipped GSM8K fixture (400 rows): the single-value forms models write score 1 on the fast path;
  the same gold hedged, qualified or given a separate sign scores 0 as `ambiguous` (or wrong, for the sign)."""
  golds = []
  for split in ("train", "test"):
    with open(gsm8k_fixture_dir / f"{split}.jsonl", encoding="utf-8") as f:
      golds += [int(json.loads(line)["answer"].rsplit("####", 1)[1].strip().replace(",", "")) for line in f]
  assert len(golds) == 400
  full_width = str.maketrans("0123456789,", "\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19\uff0c")
  honest, hedged, signed = [], [], []
  for n in golds:
    forms = [f"{n}", f"{n:,}", f"${n:,}", f"\\boxed{{{n}}}", f"{n}.00", f"The answer is {n}.", f"x = {n}"]
    forms += [f"{n} apples", f"{n:,}".translate(full_width), f"{n:,}".replace(",", "\u066c")]
    if n and n % 1000 == 0:
      forms.append(f"{n // 1000} thousand")
    honest += [(tag(b), str(n)) for b in forms]
    m = n + 1
    for b in (f"{m} or {n}", f"{m}-{n}", f"{m} to {n}", f"{m}, {n}", f"at least {n}", f"not {n}", f"{m}:{n}"):
      hedged.append((tag(b), str(n)))
    if n:
      signed += [(tag(f"- {n}"), str(n)), (tag(f"\u2212 {n}"), str(n))]
  before = verify.pool_stats()["workers_started"]
  res = rewards.score_batch([c for c, _ in honest], [g for _, g in honest])
  assert [c for (c, _), r in zip(honest, res) if not (r.correct and r.rule == TAG)] == []
  res = rewards.score_batch([c for c, _ in hedged], [g for _, g in hedged])
  assert [c for (c, _), r in zip(hedged, res) if r.correct or r.rule != AMB] == []
  res = rewards.score_batch([c for c, _ in signed], [g for _, g in signed])
  assert [c for (c, _), r in zip(signed, res) if r.correct] == []
  assert verify.pool_stats()["workers_started"] == before, "GSM8K golds and their hedges must never need math_verify"


def test_the_synthetic_task_answers_keep_scoring_and_their_hedges_do_not():
  """The CPU demo's data: SFT targets (format_target) of both synthetic tasks score 1; the same answer hedged scores 0."""
  cfg = synthetic.SyntheticSettings(seed=7, max_steps=3)
  config = types.SimpleNamespace(
      **prompts.tag_tokens(prompts.PromptSettings.from_config(rewards.RewardConfig())),
      reasoning_start_token_in_prompt=False,
  )
  rng = random.Random(0)
  examples = []
  for i in range(200):
    make = synthetic.product_problem if i % 2 else synthetic.synthetic_problem
    q, a, sol = make(rng, cfg)
    examples.append(splits.Example(question=q, answer=str(a), solution=sol, prompt=q, id=str(i)))
  targets = [prompts.format_target(e, prompts.PromptSettings.from_config(config)) for e in examples]
  res = rewards.score_batch(targets, [e.answer for e in examples])
  assert all(r.correct and r.rule == TAG for r in res)
  hedged = [t.replace(f">{e.answer}<", f">{int(e.answer) + 1} or {e.answer}<") for t, e in zip(targets, examples)]
  res = rewards.score_batch(hedged, [e.answer for e in examples])
  assert not any(r.correct for r in res) and all(r.rule == AMB for r in res)


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("#### 1\uff0c234", "1234"),
        ("#### 1\u066b5", "1.5"),
        ("#### \u2212 5", "-5"),
        ("#### 5 thousand", "5000"),
        ("#### 1\u00bd", "1.5"),
        ("#### 5 or more", None),
        ("#### 5 hundred thousand", None),
    ],
)
def test_golds_are_read_by_the_same_rule(gold, expected):
  """A gold and a completion are read the same way: its Unicode numerals and scale whole, a hedged gold refused."""
  assert rewards.parse_gold(gold) == expected


def test_normalize_keeps_ascii_and_is_idempotent():
  rng = random.Random(3)
  chars = "0123456789 ,.-/xm\u00b2\u207b\u2082\u00bd\u2044\uff10\uff0c\u066b\u066c\u2212"
  for _ in range(2000):
    t = "".join(rng.choice(chars) for _ in range(rng.randint(0, 10)))
    once = answer_rule.normalize(t)
    assert answer_rule.normalize(once) == once, repr(t)
  assert answer_rule.normalize("plain 1,234 text") == "plain 1,234 text"


def test_the_score_cli_counts_answers_that_are_not_one_value(tmp_path, capsys):
  rows = [
      {"completion": tag("3 or 5"), "answer": "5"},
      {"completion": tag("at least 5"), "answer": "5"},
      {"completion": tag("5"), "answer": "5"},
  ]
  src = tmp_path / "in.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  assert cli.main(["score", "--input", str(src), "--output", str(tmp_path / "out.jsonl")]) == 0
  out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
  assert [(r["correct"], r["rule"], r["extracted"]) for r in out] == [
      (False, AMB, "3 or 5"),
      (False, AMB, "at least 5"),
      (True, TAG, "5"),
  ]
  err = capsys.readouterr().err
  assert "1 correct (33.3%)" in err and "2 answers not one value (ambiguous, scored wrong)" in err
  assert "ambiguous=2" in err
