"""GSM8K reward functions, answer extraction and verification, and the offline `score` CLI.

Installed as `maxtext_rl_plugin.rewards` (setup.cfg maps the top-level rewards/ directory into the
package). Public API:

* `reward_fns(RewardSelection.of(config), RewardConfig.of(config), timeout_s)` -> Tunix reward functions
  (`fn(prompts, completions, answer, **kw)`; the run's, its config bound for MaxText-style ones: run/rewards.py);
* `score(completion, gold, settings=None)` / `score_batch(...)` (`settings`: `RewardConfig.of(config)`) ->
  `ScoreResult` (correct, reward, extracted, rule, format_ok, partial);
* `extract_answer(text)` -> (value | None, rule); `is_correct(pred, gold)` -> bool;
* `python -m maxtext_rl_plugin.rewards score --input IN.jsonl --output OUT.jsonl`.
"""

from maxtext_rl_plugin.rewards.extraction import RULES, extract, extract_answer
from maxtext_rl_plugin.rewards.gsm8k import (
    DEFAULT_STACK,
    RewardConfig,
    ScoreResult,
    check_answer,
    check_numbers,
    match_format_approximately,
    match_format_exactly,
    score,
    score_batch,
)
from maxtext_rl_plugin.rewards.loader import RewardFn, RewardSelection, reward_fns
from maxtext_rl_plugin.rewards.number_grammar import normalize_answer, parse_gold, to_number
from maxtext_rl_plugin.rewards.verify import fast_verdict, is_correct, verify_batch

__all__ = [
    "DEFAULT_STACK",
    "RULES",
    "RewardConfig",
    "RewardFn",
    "RewardSelection",
    "ScoreResult",
    "check_answer",
    "check_numbers",
    "extract",
    "extract_answer",
    "fast_verdict",
    "is_correct",
    "match_format_approximately",
    "match_format_exactly",
    "normalize_answer",
    "parse_gold",
    "reward_fns",
    "score",
    "score_batch",
    "to_number",
    "verify_batch",
]
