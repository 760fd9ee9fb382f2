"""Reward stack: extraction rules, exact/numeric verification, MaxText-compatible reward values, the
math_verify pool's timeout path, user reward functions, and every real GSM8K gold solution."""

from fractions import Fraction
import json
import pickle
import random
import re
import types

import numpy as np
import pytest
from tunix.rl import reward_manager
from tunix.rl.grpo.grpo_learner import GRPOConfig

from maxtext_rl_plugin import rewards
from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rewards import extraction
from maxtext_rl_plugin.rewards import gsm8k
from maxtext_rl_plugin.rewards import loader
from maxtext_rl_plugin.rewards import number_grammar
from maxtext_rl_plugin.rewards import verify
from maxtext_rl_plugin.run import rewards as run_rewards

TUNIX_DEMO_WEIGHTS = {  # Tunix's GSM8K GRPO demo values: every term distinguishable
    "reward_exact_answer": 3.0,
    "reward_white_space_format_match": 1.5,
    "reward_exact_format_match": 3.0,
    "reward_partial_format_match": 0.5,
    "reward_ratio_guess_to_answer_high": 0.5,
    "reward_ratio_guess_to_answer_low": 0.25,
    "penalty_incorrect_format": -0.5,
    "penalty_incorrect_answer": -1.0,
}


def _ref_gold(answer_text: str) -> int:
  """Independent reference: GSM8K golds are integers after '####', sometimes with thousands commas."""
  return int(answer_text.split("####")[-1].strip().replace(",", ""))


def _pool_workers_started() -> int:
  return verify.pool_stats()["workers_started"]


@pytest.fixture(name="gsm8k_rows", scope="module", params=["fixture", "full"])
def gsm8k_rows_fixture(request, gsm8k_fixture_dir):
  """Real GSM8K rows: the 400 shipped in tests/data, then (full-size check) all 8,792 when ../shared has them."""
  d, n = (gsm8k_fixture_dir, 400) if request.param == "fixture" else (request.getfixturevalue("gsm8k_dir"), 8792)
  rows = []
  for split in ("train", "test"):
    with open(d / f"{split}.jsonl", encoding="utf-8") as f:
      rows += [json.loads(line) for line in f]
  assert len(rows) == n
  return rows


# ----------------------------------------------------------------------------------------------------
# Real GSM8K
# ----------------------------------------------------------------------------------------------------


def test_every_gsm8k_gold_solution_scores_correct_on_the_fast_path(gsm8k_rows):
  before = _pool_workers_started()
  golds = [rewards.parse_gold(r["answer"]) for r in gsm8k_rows]
  assert [int(g) for g in golds] == [_ref_gold(r["answer"]) for r in gsm8k_rows]
  raw = rewards.score_batch([r["answer"] for r in gsm8k_rows], golds)
  assert all(s.correct for s in raw), [r["answer"][-30:] for r, s in zip(gsm8k_rows, raw) if not s.correct][:3]
  assert {s.rule for s in raw} == {"hash"}
  # The same gold written the ways models write numbers, inside the answer tags.
  styles = (lambda n: f"{n:,}", lambda n: f"${n}", lambda n: f"{n}.00", lambda n: f"\\boxed{{{n}}}", lambda n: f" {n} ")
  tagged = [
      f"<reasoning>r</reasoning><answer>{styles[i % 5](_ref_gold(r['answer']))}</answer>"
      for i, r in enumerate(gsm8k_rows)
  ]
  res = rewards.score_batch(tagged, [r["answer"] for r in gsm8k_rows])  # gold given as the full solution
  assert all(s.correct and s.format_ok and s.rule == "answer_tag" for s in res)
  assert _pool_workers_started() == before, "GSM8K golds must never need math_verify"


def test_perturbed_gsm8k_answers_score_wrong(gsm8k_rows):
  rng = random.Random(0)
  comps, golds = [], []
  for r in gsm8k_rows[::7]:
    n = _ref_gold(r["answer"])
    wrong = rng.choice((n + 1, n - 1, n * 10 + 1, n + 100))
    comps.append(r["answer"].rsplit("####", 1)[0] + f"#### {wrong:,}")
    golds.append(str(n))
  res = rewards.score_batch(comps, golds)
  assert not any(s.correct for s in res)
  assert all(s.rule == "hash" for s in res)


# ----------------------------------------------------------------------------------------------------
# Extraction and numbers
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value, rule",
    [
        ("<reasoning>3+4</reasoning><answer>7</answer>", "7", "answer_tag"),
        ("<answer>1</answer> more <answer>\\boxed{12}</answer>", "12", "answer_tag"),
        ("<answer>He has 18 dollars</answer>", "18", "answer_tag"),
        ("<answer>3 * 6 = 18</answer>", "18", "answer_tag"),
        ("<answer>\\sqrt{64}</answer>", "\\sqrt{64}", "answer_tag"),
        # Boxes joined in one clause are several values (round six); on separate lines the last one wins.
        ("so \\boxed{\\frac{1}{2}} and \\boxed{x{y}z}", "so \\boxed{\\frac{1}{2}} and \\boxed{x{y}z}", "ambiguous"),
        ("\\boxed{5} then \\boxed{ 6 }", "\\boxed{5} then \\boxed{ 6 }", "ambiguous"),
        ("\\boxed{5}.\nNo, wait: \\boxed{ 6 }", "6", "boxed"),
        ("16 - 3 - 4 = 9\n#### 1,200", "1,200", "hash"),
        ("5-3 is 2. The answer is $-4.5.", "-4.5", "answer_is"),
        ("Final Answer: 42", "42", "answer_is"),
        ("Q: how many?\nA: 17\n", "17", "a_colon"),
        ("first 3 apples, then 5-2=3, so 12.", "12", "last_number"),
        ("no digits here", None, "none"),
        ("", None, "none"),
    ],
)
def test_extract_answer_rules(text, value, rule):
  assert rewards.extract_answer(text) == (value, rule)


def test_extract_answer_custom_tags():
  assert rewards.extract_answer("<sol>4</sol> 9", "<sol>", "</sol>") == ("4", "answer_tag")
  assert rewards.extract_answer("<answer>4</answer> 9", "<sol>", "</sol>") == ("9", "last_number")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,200", Fraction(1200)),
        ("$18.00", Fraction(18)),
        ("-3.5", Fraction(-7, 2)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{8}", Fraction(-1, 8)),
        ("25%", Fraction(25)),
        ("72.", Fraction(72)),
        ("18 dollars", Fraction(18)),
        ("\\text{18}", Fraction(18)),
        ("\\$5", Fraction(5)),
        (".5", Fraction(1, 2)),
        ("2^3", None),
        ("1,2", None),
        ("x", None),
        ("", None),
        ("1/0", None),
    ],
)
def test_to_number(text, expected):
  assert rewards.to_number(text) == expected


@pytest.mark.parametrize(
    "pred, gold, ok",
    [
        ("72", "72", True),
        ("72.00", "72", True),
        ("$1,200", "1200", True),
        ("0.5", "1/2", True),
        ("\\frac{1}{2}", "0.5", True),
        ("-3", "-3", True),
        ("3", "-3", False),
        ("71", "72", False),
        ("7.2", "72", False),
        ("seventy", "72", False),
        (None, "72", False),
    ],
)
def test_fast_verdicts(pred, gold, ok):
  before = _pool_workers_started()
  assert rewards.is_correct(pred, gold) is ok
  assert _pool_workers_started() == before


def test_parse_gold():
  assert rewards.parse_gold("a\n#### 1,200") == "1200"
  assert rewards.parse_gold("#### -3.50") == "-3.5"
  assert rewards.parse_gold(18) == "18"
  assert rewards.parse_gold("no answer here") is None
  assert rewards.parse_gold("####") is None
  assert rewards.parse_gold("x+1", numeric_only=False) == "x+1"


def test_format_match_equals_maxtext_regex_on_random_texts():
  """The linear-time check against MaxText's own pattern (reproduced here) on tag soup."""
  pattern = re.compile(r"<reasoning>.*?</reasoning>.*?<answer>(.+?)</answer>", flags=re.MULTILINE | re.DOTALL)
  frags = ["<reasoning>", "</reasoning>", "<answer>", "</answer>", "x", "7", "\n", " ", "<answ", "er>"]
  rng = random.Random(1)
  for _ in range(3000):
    t = "".join(rng.choice(frags) for _ in range(rng.randint(0, 12)))
    want = pattern.search(t) is not None
    assert extraction.match_format_exact(t, "<reasoning>", "</reasoning>", "<answer>", "</answer>") == want, repr(t)


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("#### 1e5", "100000"),
        ("#### 2.5e3", "2500"),
        ("#### 1 1/2", "1.5"),
        ("#### 3/4", "0.75"),
        ("#### 1/0", None),
        ("#### 1 234", "1234"),
        ("#### 1\u00a0234", "1234"),
        ("#### 1'234", "1234"),
        ("#### \u20135", "-5"),
        ("#### \u22125", "-5"),
        (1e20, "100000000000000000000"),
        (float("nan"), None),
        (float("inf"), None),
        ("NaN", None),
        ("Infinity", None),
        ("-inf", None),
    ],
)
def test_gold_is_read_whole_or_refused(gold, expected):
  """Never a truncated gold ("#### 1e5" is not "1"); non-finite golds are refused, also where non-numeric ones are
  kept."""
  assert rewards.parse_gold(gold) == expected
  assert gsm8k.gold_alternatives(gold) == ((expected,) if expected is not None else ())


def test_gold_line_that_is_not_one_number_is_never_cut_to_one():
  """Training skips the row, and so does the score CLI (round six: digits among words do not read whole, so the gold is
  refused rather than kept as text math_verify would read a piece of); never read as its first number."""
  gold = "#### 5 apples and 3 pears"
  assert rewards.parse_gold(gold) is None
  assert gsm8k.gold_alternatives(gold) == ()
  assert [rewards.score(c, gold).correct for c in ("#### 5", "#### 3", "<answer>5</answer>")] == [False, False, False]


@pytest.mark.parametrize(
    "completion, gold, correct",
    [
        # Outside the tags, the whole number expression is read: a fraction is not its numerator ...
        ("The answer is 1/2.", "1", False),
        ("The answer is 1/2.", "0.5", True),
        ("#### 3/4", "3", False),
        ("#### 3/4", "3/4", True),
        # ... nor `\frac{1}{2}` its denominator, nor "1e3" its exponent, nor a mixed number its whole part.
        ("The answer is $\\frac{1}{2}$", "2", False),
        ("The answer is $\\frac{1}{2}$", "0.5", True),
        ("so it is 1e3", "3", False),
        ("so it is 1e3", "1000", True),
        ("<answer>1e3</answer>", "1000", True),
        ("The answer is 2 1/2", "2", False),
        ("Answer: 2 1/2 cups", "2.5", True),
        ("The answer is 3\\frac{1}{3}", "3", False),
        ("The answer is 3\\frac{1}{3}", "10/3", True),
        # Thousands grouped by space, no-break/thin space or apostrophe: one number, in tags and outside.
        ("<answer>1 234</answer>", "234", False),
        ("<answer>1 234</answer>", "1234", True),
        ("<answer>1\u202f234\u202f567</answer>", "1234567", True),
        ("The answer is 1'234", "1234", True),
        ("The answer is 1\u00a0234", "234", False),
        # Dash variants of the minus sign are a minus sign, not a decoration.
        ("<answer>\u20135</answer>", "5", False),
        ("<answer>\u20135</answer>", "-5", True),
        ("The answer is \u22125", "-5", True),
        ("#### \u20147", "7", False),
        # ... but a dash between numbers stays an operator or a range.
        ("5-3 = 2", "2", True),
        ("pages 5\u20137", "7", True),
        # A JSON float gold that is an integer matches the integer answer.
        ("<answer>100000000000000000000</answer>", 1e20, True),
        # A non-finite gold is never matched.
        ("<answer>nan</answer>", "NaN", False),
        ("<answer>inf</answer>", float("inf"), False),
    ],
)
def test_number_expressions_are_read_whole(completion, gold, correct):
  assert rewards.score(completion, gold).correct is correct


def test_last_number_never_cut_at_the_scan_window():
  """`last_number` scans the tail first; a number expression straddling the window edge is read whole."""
  for tail in ("1 234", "\\frac{1}{2}", "1e5", "3/4"):
    for pad in range(505, 520):
      text = "x" * pad + " " + tail
      assert rewards.to_number(extraction.last_number(text)) == rewards.to_number(tail), (pad, tail)


# ----------------------------------------------------------------------------------------------------
# MaxText's reward unit tests, as cases
# ----------------------------------------------------------------------------------------------------
# Inputs and expected verdicts from MaxText's tests/post_training/unit/rl_utils_test.py (AI-Hypercomputer/maxtext,
# Apache-2.0; the version for 0.2.5's utils_rl/evaluate_rl), run against the plugin's reward functions with the same
# weights. Where the plugin deliberately differs the MaxText value is kept in the table and the reason given.

MAXTEXT_TEST_WEIGHTS = {
    "reward_exact_answer": 3.0,
    "reward_exact_format_match": 2.0,
    "reward_partial_format_match": 0.5,
    "reward_white_space_format_match": 1.5,
    "reward_ratio_guess_to_answer_high": 1.0,
    "reward_ratio_guess_to_answer_low": 0.5,
    "penalty_incorrect_format": -0.5,
    "penalty_incorrect_answer": -0.5,
}


@pytest.mark.parametrize(
    "completion, gold, correct, partial, format_ok",
    [  # TestScoreResponses
        (
            "<reasoning>Need to use <reasoning> and </reasoning>, <answer> and "
            "</answer></reasoning><answer>11/3</answer>",
            "11/3",
            True,
            True,
            True,
        ),
        (
            "<reasoning>This is the sum of the cost of the suits, the pants, and the shirts: $7500 + $1500 + "
            "$1800 = $10800."
            "\n\n</reasoning>\n<answer>10800</answer><end_of_turn>",
            "10,800",
            True,
            True,
            True,
        ),
        ("<reasoning>The item costs $16.<answer>$16</answer>", "16", True, True, False),
        ("<reasoning>The answer is 3\\frac{1}{3}.<answer>3\\frac{1}{3}</answer>", "3\\frac{1}{3}", True, True, False),
        ("<reasoning>The answer is B.<answer>B</answer>", "B", True, True, False),
        # Not ported: MaxText maps a multiple-choice letter to its option's value via the question text
        # (test_for_mcq_when_model_responds_with_value/_option); the plugin's GSM8K stack has no MCQ mapping.
    ],
)
def test_maxtext_score_responses_cases(completion, gold, correct, partial, format_ok):
  s = rewards.score(completion, gold, rewards.RewardConfig(**MAXTEXT_TEST_WEIGHTS))
  assert (s.correct, s.partial, s.format_ok) == (correct, partial, format_ok)


@pytest.mark.parametrize(
    "completions, expected",
    [  # TestMatchFormatApproximatelyScores
        (["<reasoning>think</reasoning><answer>42</answer>"], [2.0]),
        (["The answer is 42."], [-2.0]),
        (["<answer>42</answer>"], [0.0]),
        (["<reasoning><reasoning>think</reasoning><answer>42</answer>"], [1.0]),
        (["<reasoning>think</reasoning><answer>42</answer>", "no tags here"], [2.0, -2.0]),
    ],
)
def test_maxtext_match_format_approximately_cases(completions, expected):
  cfg = rewards.RewardConfig(**MAXTEXT_TEST_WEIGHTS)
  assert rewards.match_format_approximately(None, completions, tmvp_config=cfg) == expected


@pytest.mark.parametrize(
    "completion, gold, maxtext, plugin",
    [  # TestCheckNumbers: MaxText's check_numbers value, and the plugin's check_answer value where it differs
        ("<reasoning>40 + 2 = 42</reasoning><answer>42</answer>", "42", 3.0, 3.0),
        # The plugin grades answers written outside the tags too (format is rewarded by the two format functions).
        ("The answer is 42.", "42", 0.0, 3.0),
        ("<answer>42</answer>", "42", 3.0, 3.0),
        ("<reasoning>The answer is 42.</reasoning>", "42", 0.0, 3.0),
        ("<reasoning>thinking</reasoning><answer>7</answer>", "7", 3.0, 3.0),
        ("just 7", "7", 0.0, 3.0),
        ("<reasoning>simple</reasoning><answer>100</answer>", "100", 3.0, 3.0),
        # A wrong answer earns the configured penalty_incorrect_answer (MaxText's check_numbers leaves 0.0).
        ("<reasoning>wrong path</reasoning><answer>99</answer>", "42", 0.0, -0.5),
        ("<reasoning>cost calculation</reasoning><answer>1,000</answer>", "1000", 3.0, 3.0),
        ("<reasoning>price is $16</reasoning><answer>$16</answer>", "16", 3.0, 3.0),
        ("<reasoning>thinking</reasoning><answer>blue</answer>", "red", 0.0, -0.5),
    ],
)
def test_maxtext_check_numbers_cases(completion, gold, maxtext, plugin):
  del maxtext  # documented above; the plugin's value is what is checked
  cfg = rewards.RewardConfig(**MAXTEXT_TEST_WEIGHTS)
  assert rewards.check_answer(None, [completion], [gold], tmvp_config=cfg) == [plugin]


@pytest.mark.parametrize(
    "text, gold",
    [  # TestExtractHashAnswer (MaxText returns the raw text after the first "####"; the plugin a canonical number
        # after the last one, and None where MaxText returns "" -- such a row has no gold and is skipped)
        ("The answer is #### 42", "42"),
        ("Some reasoning ####   123.45  ", "123.45"),
        ("####", None),
        ("The answer is 42", None),
        ("", None),
    ],
)
def test_maxtext_extract_hash_answer_cases(text, gold):
  assert rewards.parse_gold(text) == gold


# ----------------------------------------------------------------------------------------------------
# Reward values (MaxText semantics, non-default weights so every term is visible)
# ----------------------------------------------------------------------------------------------------


def test_reward_values_with_partial_credit_and_penalties():
  cfg = rewards.RewardConfig(**TUNIX_DEMO_WEIGHTS)
  comps = [
      "<reasoning>r</reasoning><answer>72</answer>",  # exact
      "<reasoning>r</reasoning><answer> 72 </answer>",  # whitespace only
      "<reasoning>r</reasoning><answer>75</answer>",  # within 10%
      "<reasoning>r</reasoning><answer>84</answer>",  # within 20%
      "<reasoning>r</reasoning><answer>100</answer>",  # wrong
      "I do not know.",  # no answer at all
      "<reasoning>a</reasoning><reasoning>b</reasoning> #### 72",  # correct, bad format
  ]
  gold = ["72"] * len(comps)
  p = [""] * len(comps)
  assert rewards.check_answer(p, comps, gold, tmvp_config=cfg) == [3.0, 1.5, 0.5, 0.25, -1.0, -0.5, 3.0]
  assert rewards.match_format_exactly(p, comps, tmvp_config=cfg) == [3.0] * 5 + [0.0, 0.0]
  # MaxText counts each of the four tags: +0.5 if seen exactly once, else -0.5.
  assert rewards.match_format_approximately(p, comps, tmvp_config=cfg) == [2.0] * 5 + [-2.0, -2.0]
  s = rewards.score(comps[2], "72", cfg)
  assert (s.correct, s.partial, s.format_ok, s.reward) == (False, True, True, 3.0 + 2.0 + 0.5)
  assert rewards.score(comps[3], "72", cfg).partial is False


def test_maxtext_json_list_golds_and_reasoning_prefilled():
  assert rewards.score("<answer>B</answer>", json.dumps(["10", "B"])).correct
  cfg = rewards.RewardConfig(reasoning_start_token_in_prompt=True)
  s = rewards.score("steps</reasoning><answer>5</answer>", "5", cfg)
  assert s.format_ok and s.correct


# ----------------------------------------------------------------------------------------------------
# math_verify pool: slow path, per-item timeout, recovery
# ----------------------------------------------------------------------------------------------------


def test_math_verify_slow_path_timeout_and_recovery():
  pool = verify.get_pool(1)
  cfg = rewards.RewardConfig(reward_item_timeout_seconds=2.0, math_verify_num_procs=1)
  comps = [
      "<answer>2^3</answer>",
      "<answer>\\sqrt{64}</answer>",
      "<answer>\\sqrt{63}</answer>",
      "<answer>9^{9^{9^{9^{9}}}}</answer>",
      "<answer>2^{3}</answer>",
  ]
  timeouts_before = pool.stats["killed_timeout"]
  res = rewards.score_batch(comps, ["8"] * len(comps), cfg)
  assert [r.correct for r in res] == [True, True, False, False, True]
  assert pool.stats["killed_timeout"] == timeouts_before + 1  # the tower was killed, not awaited
  # The pool came back: a new expression after the kill is still verified.
  assert rewards.score("<answer>4 \\cdot 2</answer>", "8", cfg).correct


def test_adversarial_inputs_never_reach_math_verify():
  before = _pool_workers_started()
  pool_verified = verify.pool_stats()["verified"]
  evil = [
      "{" * 100_000,
      "\\boxed{" * 15_000,
      "<answer>" * 10_000,
      "</answer>" * 10_000,
      "<answer>" + "\\frac{1}{" * 500 + "2" + "}" * 500 + "</answer>",
      "9" * 100_000,
      "-" * 100_000 + "1",
  ]
  res = rewards.score_batch(evil, ["7"] * len(evil))
  assert not any(r.correct for r in res)
  assert res[-1].extracted.endswith("1")
  assert _pool_workers_started() == before
  assert verify.pool_stats()["verified"] == pool_verified


# ----------------------------------------------------------------------------------------------------
# run/rewards.configured_reward_fns (rewards/loader.reward_fns with the config bound): built-ins, user functions, errors
# ----------------------------------------------------------------------------------------------------


def _cfg(**kw):
  base = {
      "reward_functions": "",
      "reward_functions_path": "",
      "reward_call_timeout_seconds": 30.0,
      **rewards.RewardConfig().__dict__,
  }
  base.update(kw)
  return types.SimpleNamespace(**base)


def test_default_stack_names_and_tunix_call():
  fns = run_rewards.configured_reward_fns(_cfg(**TUNIX_DEMO_WEIGHTS))
  assert [f.__name__ for f in fns] == ["match_format_exactly", "match_format_approximately", "check_answer"]
  comps = ["<reasoning>r</reasoning><answer>72</answer>", "#### 7"]
  # Exactly how Tunix's reward manager calls them: keywords, the batch's columns as extra kwargs.
  out = [f(prompts=["p", "p"], completions=comps, answer=["72", "72"], question=["q", "q"], mode="train") for f in fns]
  assert out == [[3.0, 0.0], [2.0, -2.0], [3.0, -1.0]]
  clone = pickle.loads(pickle.dumps(fns[2]))
  assert clone(prompts=["p"], completions=comps[:1], answer=["72"]) == [3.0]


def test_a_weight_count_that_differs_is_the_same_line_from_both_passes():
  """rl.reward_weights with one weight too few: the first pass (`loader.check` on `RewardSelection.of`) and the run's
  builder refuse it in the same line; a config without an rl: block (the scoring CLI's) has no weights to check."""
  want = (
      "invalid value for 'rl.reward_weights'=[1.0, 0.5]: 2 weights for 3 reward functions (reward_functions: "
      "match_format_exactly, match_format_approximately, check_answer); give one weight per reward_functions entry, in "
      "its order"
  )
  config = _cfg(rl=types.SimpleNamespace(reward_weights=[1.0, 0.5]))
  for build in (
      lambda: loader.check(loader.RewardSelection.of(config)),
      lambda: run_rewards.configured_reward_fns(config),
  ):
    with pytest.raises(ConfigError) as e:
      build()
    assert str(e.value) == want
  selection = loader.RewardSelection.of(_cfg())
  assert selection == loader.RewardSelection(tuple(rewards.DEFAULT_STACK), "", None)
  loader.check(selection)


def test_tunix_sequence_reward_manager_sums_our_functions():
  fns = run_rewards.configured_reward_fns(_cfg(**TUNIX_DEMO_WEIGHTS))
  mgr = reward_manager.SequenceRewardManager(fns, GRPOConfig())
  info = mgr(
      prompts=["p", "p"], completions=["<reasoning>r</reasoning><answer>72</answer>", "nothing"], answer=["72", "72"]
  )
  assert list(info["rewards"]) == [3.0 + 2.0 + 3.0, 0.0 - 2.0 - 0.5]


USER_FILE = """
def tunix_style(prompts, completions, answer, **kwargs):
  return [float(len(c)) for c in completions]

def maxtext_style(prompts, completions, tmvp_config, **kwargs):
  return [tmvp_config.bonus] * len(completions)

def no_kwargs(prompts, completions):
  return [0.0] * len(completions)

def needs_extra(prompts, completions, temperature, **kwargs):
  return [0.0] * len(completions)

def bad_length(prompts, completions, **kwargs):
  return [1.0]

NOT_A_FUNCTION = 3
"""


@pytest.fixture(name="user_file")
def user_file_fixture(tmp_path):
  p = tmp_path / "my_rewards.py"
  p.write_text(USER_FILE)
  return str(p)


def test_user_reward_functions_both_signatures(user_file):
  cfg = _cfg(reward_functions="tunix_style, maxtext_style,check_numbers", reward_functions_path=user_file, bonus=0.25)
  fns = run_rewards.configured_reward_fns(cfg)
  assert [f.__name__ for f in fns] == ["tunix_style", "maxtext_style", "check_answer"]
  out = [f(prompts=["p", "p"], completions=["abc", "#### 5"], answer=["5", "5"]) for f in fns]
  assert out == [[3.0, 6.0], [0.25, 0.25], [0.0, 1.0]]


@pytest.mark.parametrize(
    "names, path_needed, fragment",
    [
        ("tunix_style,nope", True, "'nope' is not defined in"),
        ("no_kwargs", True, "without **kwargs"),
        ("needs_extra", True, "requires temperature"),
        ("NOT_A_FUNCTION", True, "not a function"),
        ("nope", False, "built-ins: check_answer"),
        ("check_answer,check_answer", False, "twice"),
    ],
)
def test_user_reward_function_errors(user_file, names, path_needed, fragment):
  with pytest.raises(ConfigError) as e:
    run_rewards.configured_reward_fns(
        _cfg(reward_functions=names, reward_functions_path=user_file if path_needed else "")
    )
  assert fragment in str(e.value)
  assert "\n" not in str(e.value)


def test_user_reward_function_file_errors(tmp_path, user_file):
  with pytest.raises(ConfigError, match="file not found"):
    run_rewards.configured_reward_fns(_cfg(reward_functions="x", reward_functions_path=str(tmp_path / "missing.py")))
  broken = tmp_path / "broken.py"
  broken.write_text("def f(:\n")
  with pytest.raises(ConfigError, match="importing it failed: SyntaxError"):
    run_rewards.configured_reward_fns(_cfg(reward_functions="f", reward_functions_path=str(broken)))
  with pytest.raises(ConfigError, match="reward_functions is empty"):
    run_rewards.configured_reward_fns(_cfg(reward_functions_path=user_file))
  (fn,) = run_rewards.configured_reward_fns(_cfg(reward_functions="bad_length", reward_functions_path=user_file))
  with pytest.raises(ConfigError, match="returned 1 values for 2 completions"):
    fn(prompts=["p", "p"], completions=["a", "b"], answer=["1", "1"])


def test_reward_keys_from_a_real_config():
  cfg = load_config(
      [
          "configs/rl.yml",
          "reward_exact_answer=2.5",
          "solution_start_token=<sol>",
          "solution_end_token=</sol>",
          "reward_functions=check_answer",
      ]
  )
  (fn,) = run_rewards.configured_reward_fns(cfg)
  assert fn(prompts=["p"], completions=["<sol>4</sol> then 9"], answer=["4"]) == [2.5]
  assert rewards.score("<sol>4</sol> then 9", "4", rewards.RewardConfig.of(cfg)).rule == "answer_tag"


# ----------------------------------------------------------------------------------------------------------------------
# A user's reward function cannot hang the run, fake success or end it in a traceback
# ----------------------------------------------------------------------------------------------------------------------

HOSTILE_FILE = """
import sys, threading

def hangs(prompts, completions, **kwargs):
  threading.Event().wait()  # never returns

def exits(prompts, completions, **kwargs):
  sys.exit(0)

def raises(prompts, completions, **kwargs):
  return [1.0 / 0.0 for _ in completions]

def gives_nan(prompts, completions, **kwargs):
  return [float("nan")] * len(completions)

def gives_inf(prompts, completions, **kwargs):
  return [0.0, float("inf")]

def gives_nones(prompts, completions, **kwargs):
  return [None] * len(completions)

def gives_text(prompts, completions, **kwargs):
  return "1.0"

def gives_numpy(prompts, completions, **kwargs):
  import numpy as np
  return np.ones(len(completions), np.float32)
"""


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("hangs", "did not return within reward_call_timeout_seconds=0.5 s"),
        ("exits", "called sys.exit(0); a reward function must return its rewards"),
        ("raises", "raised ZeroDivisionError at "),
        ("gives_nan", "returned nan for completion 0"),
        ("gives_inf", "returned inf for completion 1"),
        ("gives_nones", "returned a list whose item 0 is None"),
        ("gives_text", "returned str '1.0'"),
    ],
)
def test_hostile_reward_functions_end_in_one_line_naming_function_and_file(tmp_path, name, fragment):
  path = tmp_path / "hostile.py"
  path.write_text(HOSTILE_FILE)
  cfg = _cfg(reward_functions=name, reward_functions_path=str(path), reward_call_timeout_seconds=0.5)
  (fn,) = run_rewards.configured_reward_fns(cfg)
  with pytest.raises(ConfigError) as e:
    fn(prompts=["p", "p"], completions=["a", "b"], answer=["1", "1"])
  msg = str(e.value)
  assert fragment in msg and f"'{name}' ({path}:" in msg and "\n" not in msg, msg


def test_a_numpy_array_of_rewards_is_accepted(tmp_path):
  path = tmp_path / "hostile.py"
  path.write_text(HOSTILE_FILE)
  (fn,) = run_rewards.configured_reward_fns(_cfg(reward_functions="gives_numpy", reward_functions_path=str(path)))
  assert fn(prompts=["p", "p"], completions=["a", "b"], answer=["1", "1"]) == [1.0, 1.0]


# ----------------------------------------------------------------------------------------------------------------------
# The number grammar: read whole or flagged, never a fragment
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        # Mixed numbers with a LaTeX fraction after a space, a LaTeX space, or in LaTeX's short form.
        ("3 \\frac12", Fraction(7, 2)),
        ("3\\ \\frac{1}{2}", Fraction(7, 2)),
        ("3\\,\\frac{1}{2}", Fraction(7, 2)),
        ("3~\\frac{1}{2}", Fraction(7, 2)),
        ("3   \\frac{1}{2}", Fraction(7, 2)),
        ("\\frac12", Fraction(1, 2)),
        ("\\dfrac1{4}", Fraction(1, 4)),
        # The Indian grouping (lakh, crore), alongside thousands.
        ("1,00,000", 100000),
        ("12,34,567", 1234567),
        ("1,23,45,678.5", Fraction(246913570, 20)),
        ("1,234,567", 1234567),
        # Signs written as words.
        ("negative 5", -5),
        ("minus 5", -5),
        ("Negative 2.5", Fraction(-5, 2)),
        # Groupings that are neither: flagged (no value), never their last group.
        ("1,0000", None),
        ("3,5", None),
        ("1,000,00", None),
        ("12,5", None),  # never its "1" (a shorter run of the same digits)
        ("1.000.000", None),
        ("2.0.1", None),
    ],
)
def test_number_grammar_reads_whole_or_flags(text, value):
  assert number_grammar.to_number(text) == (None if value is None else Fraction(value))


@pytest.mark.parametrize(
    "completion, gold, correct",
    [
        ("So she has 3\\ \\frac{1}{2} cups left.", "3.5", True),
        ("So she has 3\\ \\frac{1}{2} cups left.", "0.5", False),  # the old reading: the fraction alone
        ("The answer is 3 \\frac12", "3.5", True),
        ("The answer is 3 \\frac12", "12", False),  # the old reading: "12"
        ("He saved 1,00,000 rupees.", "100000", True),
        ("He saved 1,00,000 rupees.", "0", False),  # the old reading: "000"
        ("Total: 12,34,567", "567", False),
        ("The answer is negative 5.", "-5", True),
        ("The answer is negative 5.", "5", False),  # the old reading: "5"
        ("The temperature fell to minus 12 degrees.", "-12", True),
        ("7 minus 2 is 5", "5", True),  # "minus" after a number is the operator
        ("The answer is 1,0000.", "0", False),  # irregular grouping: flagged, not its last group
        ("The total is 1.000.000 euros", "0", False),  # dotted groups: flagged, not ".000" / "000"
        ("It rose 12,5%", "1", False),
    ],
)
def test_completions_with_these_numbers_are_scored_whole(completion, gold, correct):
  assert rewards.score(completion, gold).correct is correct, rewards.score(completion, gold)


# ----------------------------------------------------------------------------------------------------------------------
# Numbers the grader cannot hold: read whole or flagged, scored wrong and counted, never a stopped run
# ----------------------------------------------------------------------------------------------------------------------

_PARTIAL = rewards.RewardConfig(
    reward_ratio_guess_to_answer_high=0.5, reward_ratio_guess_to_answer_low=0.25, penalty_incorrect_answer=-1.0
)


@pytest.mark.parametrize(
    "completion, gold, correct, answer_reward, unreadable",
    [
        # Magnitudes beyond a float: compared exactly (a float conversion raised OverflowError in the ratio bands).
        ("<answer>1e400</answer>", "999", False, -1.0, False),
        ("<answer>-1e400</answer>", "5", False, -1.0, False),
        ("<answer>1.05e400</answer>", "1e400", False, 0.5, False),  # within 10% of a gold no float holds
        ("<answer>1e400</answer>", "1e400", True, 1.0, False),
        ("The answer is 10**400 or 1e308 * 1e10", "5", False, -1.0, False),
        ("<answer>1e-400</answer>", "1e-400", True, 1.0, False),
        # Exponents beyond MAX_EXPONENT: read whole and flagged, never their last digits ("999999999").
        ("<answer>1e999999999</answer>", "999999999", False, -1.0, True),
        ("The answer is 1e999999999", "999999999", False, -1.0, True),
        ("#### 2E+123456", "123456", False, -1.0, True),
        ("<answer>\\boxed{5e-99999}</answer>", "99999", False, -1.0, True),
        ("so 3 * 4 = 1e00000000012", "12", False, -1.0, False),  # leading zeros: the exponent is 12, read whole
        ("so 3 * 4 = 1.2e1", "12", True, 1.0, False),
    ],
)
def test_numbers_the_grader_cannot_hold_score_wrong_and_are_counted(completion, gold, correct, answer_reward, unreadable):
  (r,) = rewards.score_batch([completion], [gold], _PARTIAL)
  assert (r.correct, r.answer_reward, r.unreadable) == (correct, answer_reward, unreadable), r
  # check_answer, the reward the trainer calls, returns the same value instead of raising.
  assert gsm8k.check_answer([""], [completion], [gold], tmvp_config=_PARTIAL) == [answer_reward]


def test_an_unreadable_answer_never_reaches_math_verify(monkeypatch):
  sent = []
  real = verify.verify_batch
  monkeypatch.setattr(verify, "verify_batch", lambda pairs, *a: sent.extend(pairs) or real(pairs, *a))
  gsm8k._LAST_GRADED = (None, None)  # pylint: disable=protected-access
  rewards.score_batch(["<answer>7e99999</answer>", "<answer>7</answer>"], ["7", "7"])
  assert all("99999" not in p for p, _ in sent), sent


@pytest.mark.parametrize(
    "completion, gold, correct",
    [
        # A whole part, then its fraction typeset as math (`$...$`, `\(...\)`): one mixed number.
        ("The answer is 5 $\\frac{3}{4}$", "23/4", True),
        ("The answer is 5 $\\frac{3}{4}$", "5", False),  # the old reading: the whole part alone
        ("She walked 5 $\\frac{3}{4}$ miles.", "5.75", True),
        ("She walked 5 $\\frac{3}{4}$ miles.", "3/4", False),
        ("$5$ $\\frac34$", "23/4", True),
        ("It takes 2 \\(\\frac{1}{2}\\) hours.", "2.5", True),
        ("It takes 2 \\(\\frac{1}{2}\\) hours.", "2", False),
        ("<answer>5 $\\dfrac{3}{4}$</answer>", "23/4", True),
        ("#### 5$\\tfrac{1}{4}$", "21/4", True),
    ],
)
def test_a_fraction_in_math_delimiters_after_its_whole_part_is_one_number(completion, gold, correct):
  assert rewards.score(completion, gold).correct is correct, rewards.score(completion, gold)


INPLACE_FILE = """
def rewrites(prompts, completions, answer, **kwargs):
  for i in range(len(completions)):
    completions[i] = "<answer>" + answer[i] + "</answer>"
  return [0.0] * len(completions)

def pops(prompts, completions, answer, **kwargs):
  completions.pop()
  answer.pop()
  return [0.0] * len(completions)

def clears_kwargs(prompts, completions, **kwargs):
  kwargs["answer"].clear()
  prompts.append("extra")
  return [0.0] * 2

def too_big(prompts, completions, **kwargs):
  return [1e308, 0.0]

def huge_int(prompts, completions, **kwargs):
  return [10**400, 0]
"""


def test_each_reward_function_gets_its_own_copies_of_the_batch(tmp_path):
  path = tmp_path / "inplace.py"
  path.write_text(INPLACE_FILE)
  fns = run_rewards.configured_reward_fns(
      _cfg(reward_functions="rewrites,clears_kwargs,check_answer", reward_functions_path=str(path))
  )
  completions, answers, prompts = ["<answer>1</answer>", "<answer>2</answer>"], ["5", "6"], ["p", "q"]
  out = [fn(prompts=prompts, completions=completions, answer=answers) for fn in fns]
  # check_answer scores the sampled completions (both wrong), not the first function's rewrites.
  assert out[2] == [0.0, 0.0] and completions == ["<answer>1</answer>", "<answer>2</answer>"]
  assert answers == ["5", "6"] and prompts == ["p", "q"]


def test_a_function_that_changes_its_inputs_length_is_one_line(tmp_path):
  path = tmp_path / "inplace.py"
  path.write_text(INPLACE_FILE)
  (fn,) = run_rewards.configured_reward_fns(_cfg(reward_functions="pops", reward_functions_path=str(path)))
  with pytest.raises(ConfigError) as e:
    fn(prompts=["p", "q"], completions=["a", "b"], answer=["1", "2"])
  assert "returned 1 values for 2 completions" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name, fragment",
    [("too_big", "returned 1e+308 for completion 0, beyond the float32 range"), ("huge_int", "beyond any float")],
)
def test_rewards_beyond_float32_are_one_line(tmp_path, name, fragment):
  path = tmp_path / "inplace.py"
  path.write_text(INPLACE_FILE)
  (fn,) = run_rewards.configured_reward_fns(_cfg(reward_functions=name, reward_functions_path=str(path)))
  with pytest.raises(ConfigError) as e:
    fn(prompts=["p", "q"], completions=["a", "b"], answer=["1", "2"])
  assert fragment in str(e.value) and f"'{name}' ({path}:" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("import sys\nsys.exit(0)\n", "importing it called sys.exit(0)"),
        ("raise SystemExit('bye')\n", "importing it called sys.exit('bye')"),
        ("import os\nx = 1\nraise KeyError('k')\n", "importing it failed (line 3): KeyError"),
    ],
)
def test_a_reward_module_that_exits_at_import_is_one_line(tmp_path, body, fragment):
  path = tmp_path / "exits_at_import.py"
  path.write_text(body + "def f(prompts, completions, **kwargs):\n  return [0.0] * len(completions)\n")
  with pytest.raises(ConfigError) as e:
    run_rewards.configured_reward_fns(_cfg(reward_functions="f", reward_functions_path=str(path)))
  assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rewards_whose_sum_overflows_float32_are_one_line():
  # Each function returns values within float32; their sum is not (3e38 + 3e38): one line naming the functions.
  from maxtext_rl_plugin.run import experience  # pylint: disable=import-outside-toplevel  # imports JAX and Tunix

  def big(prompts, completions, **kwargs):
    del prompts, kwargs
    return [3e38] * len(completions)

  def bigger(prompts, completions, **kwargs):
    del prompts, kwargs
    return [0.0, 3e38]

  with pytest.raises(ConfigError) as e:
    experience.sum_rewards([big, bigger], ["p", "p"], ["a", "b"])
  assert str(e.value).startswith("the rewards of completion 1 (big + bigger) sum to 6e+38, beyond the float32 range")
  assert list(experience.sum_rewards([big], ["p"], ["a"])) == [np.float32(3e38)]
