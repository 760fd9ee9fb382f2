"""`python -m maxtext_rl_plugin.bench rewards`: reward-stack throughput, plugin vs MaxText 0.2.5, same rows.

Rows are built from GSM8K gold solutions (test split by default):
* gold:  `<reasoning>steps</reasoning><answer>N</answer>` with N written as a model might ("1,200",
  "$1,200", "1200.00", "\\boxed{1200}", rotating per row);
* wrong: the same with a perturbed N (+-1, +-10%, x10, digits swapped), written the same ways;
* raw:   the untouched GSM8K solution ending in "#### N" (plugin only: MaxText's extraction finds no
  answer in it, which is reported, not timed against).
Both stacks (format-exact + format-approx + answer check) run on the same batches in this process;
MaxText's math_verify pool gets `math_verify_num_procs` workers (default 1, "one core"). Verdicts are
compared wherever MaxText can extract an answer. Ends with one JSON line.
"""

# MaxText's RL utilities are imported inside the functions that run them: they pull in MaxText's and Tunix's whole
# training stack, which `--skip-maxtext` (plugin only) never needs.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import sys
import time
import types
from typing import Any, Optional

# Reward stacks need no accelerator: JAX (imported below through tunix_compat, and by MaxText) stays off any TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from maxtext_rl_plugin.bench import common
from maxtext_rl_plugin.config import schema as config_types
from maxtext_rl_plugin import rewards
from maxtext_rl_plugin import tunix_compat
from maxtext_rl_plugin.rewards import gsm8k
from maxtext_rl_plugin.rewards import number_grammar
from maxtext_rl_plugin.rewards import verify

_CALC = re.compile(r"<<[^<>]*>>")


def _find_gsm8k(path: Optional[str]) -> pathlib.Path:
  """The GSM8K directory: --data-dir, $GSM8K_DIR, then the shared data folder next to the checkout."""
  here = pathlib.Path(__file__).resolve()
  cands = [
      path,
      os.environ.get("GSM8K_DIR"),
      here.parents[3] / "shared" / "data" / "gsm8k",
      pathlib.Path.cwd().parent / "shared" / "data" / "gsm8k",
      pathlib.Path("../shared/data/gsm8k"),
  ]
  for c in cands:
    if c and (pathlib.Path(c) / "test.jsonl").is_file():
      return pathlib.Path(c)
  raise SystemExit("error: GSM8K not found; pass --data-dir DIR containing test.jsonl/train.jsonl (or set GSM8K_DIR)")


def _render(value: str, style: int) -> str:
  """The answer as a model might write it: plain, with '$' and thousands commas, with '.00', boxed."""
  n = int(value) if re.fullmatch(r"-?\d+", value) else None
  if n is None:
    return value
  return (str(n), f"${n:,}", f"{n}.00", f"\\boxed{{{n}}}")[style % 4]


def _perturb(value: str, rng: random.Random) -> str:
  """A wrong answer close to `value` (off by one, by 10%, x10, digits reversed): what a model gets wrong."""
  n = int(value)
  for _ in range(10):
    kind = rng.randrange(4)
    m = (n + rng.choice((-1, 1)), n + max(1, abs(n) // 10), n * 10 + (0 if n else 10), int(str(abs(n))[::-1] or 0) + 1)[
        kind
    ]
    if m != n:
      return str(m)
  return str(n + 1)


def _tagged(steps: str, value: str) -> str:
  """A completion in the plugin's (and MaxText's) answer format."""
  return f"<reasoning>{steps}</reasoning>\n<answer>{value}</answer>"


def build_rows(data_dir: pathlib.Path, split: str, limit: int, seed: int = 0) -> list[dict[str, Any]]:
  """Three rows per GSM8K problem (gold, wrong, raw; see the module docstring) from the first `limit` of `split`."""
  rng = random.Random(seed)
  rows = []
  with open(data_dir / f"{split}.jsonl", encoding="utf-8") as f:
    for i, line in enumerate(f):
      if limit and i >= limit:
        break
      r = json.loads(line)
      raw_gold = r["answer"].rsplit("####", 1)[1].strip()
      gold = rewards.parse_gold(r["answer"])
      steps = _CALC.sub("", r["answer"].rsplit("####", 1)[0]).strip()
      rows.append(
          {
              "kind": "gold",
              "question": r["question"],
              "gold": gold,
              "mt_gold": raw_gold,
              "completion": _tagged(steps, _render(gold, i)),
              "expect": True,
          }
      )
      rows.append(
          {
              "kind": "wrong",
              "question": r["question"],
              "gold": gold,
              "mt_gold": raw_gold,
              "completion": _tagged(steps, _render(_perturb(gold, rng), i + 1)),
              "expect": False,
          }
      )
      rows.append(
          {
              "kind": "raw",
              "question": r["question"],
              "gold": gold,
              "mt_gold": raw_gold,
              "completion": r["answer"],
              "expect": True,
          }
      )
  return rows


def _batches(rows, bs):
  for s in range(0, len(rows), bs):
    yield rows[s : s + bs]


def _plugin_config() -> types.SimpleNamespace:
  """The default reward stack's keys as a config (rl.yml's defaults: the reward weights and the per-call timeout)."""
  timeout = config_types.PluginKeys.model_construct().reward_call_timeout_seconds
  return types.SimpleNamespace(
      reward_functions="", reward_functions_path="", reward_call_timeout_seconds=timeout, **vars(rewards.RewardConfig())
  )


def run_plugin(rows, bs: int) -> tuple[float, float, list[float]]:
  """(wall seconds, CPU seconds) for the plugin's default stack over `rows`; per-row summed reward.

  The stack runs in this process only (the math_verify pool is not touched by these rows), so CPU
  seconds of this process are its single-core cost even when other jobs share the cores.
  """
  config = _plugin_config()
  fns = rewards.reward_fns(
      rewards.RewardSelection.of(config), rewards.RewardConfig.of(config), config.reward_call_timeout_seconds
  )
  # Cold caches: every timed pass pays for number parsing and gold parsing as a fresh batch would.
  number_grammar.clear_number_cache()
  gsm8k.gold_alternatives.cache_clear()
  out: list[float] = []
  t, c = time.perf_counter(), time.process_time()
  for b in _batches(rows, bs):
    prompts = [r["question"] for r in b]
    comps = [r["completion"] for r in b]
    golds = [r["gold"] for r in b]
    tot = [0.0] * len(b)
    for fn in fns:
      for j, v in enumerate(fn(prompts=prompts, completions=comps, answer=golds, question=prompts)):
        tot[j] += v
    out.extend(tot)
  return time.perf_counter() - t, time.process_time() - c, out


def _maxtext_config(num_procs: int):
  """MaxText 0.2.5 rl.yml's reward/format keys (the same values as the plugin's defaults)."""
  return types.SimpleNamespace(
      reasoning_start_token="<reasoning>",
      reasoning_end_token="</reasoning>",
      solution_start_token="<answer>",
      solution_end_token="</answer>",
      reasoning_start_token_in_prompt=False,
      reward_exact_answer=1.0,
      reward_white_space_format_match=1.0,
      reward_exact_format_match=0.1,
      reward_partial_format_match=0.0,
      reward_ratio_guess_to_answer_high=0.0,
      reward_ratio_guess_to_answer_low=0.0,
      penalty_incorrect_format=0.0,
      penalty_incorrect_answer=0.0,
      math_verify_timeout=300,
      math_verify_num_procs=num_procs,
      debug=False,
  )


def run_maxtext(rows, bs: int, num_procs: int) -> tuple[float, list[float], list[float]]:
  """Seconds for MaxText's stack over `rows`; per-row summed reward and check_numbers score."""
  from maxtext.trainers.post_train.rl import utils_rl  # after tunix_compat: it loads multiprocessing.pool first

  cfg = _maxtext_config(num_procs)
  # Warm the spawn pool outside the timing (the plugin's fast path never starts its pool here).
  utils_rl.check_numbers(
      prompts=["q"],
      completions=["<answer>2+2</answer>"],
      answer=[json.dumps(["4", "4"])],
      tmvp_config=cfg,
      question=["q"],
  )
  totals: list[float] = []
  checks: list[float] = []
  t = time.perf_counter()
  try:
    _maxtext_loop(utils_rl, cfg, rows, bs, totals, checks)
  finally:
    secs = time.perf_counter() - t
    # Tear the spawn pool down now: left to interpreter exit, its finalizer can block on orphaned locks.
    tunix_compat.shutdown_maxtext_math_verify_pool()
  return secs, totals, checks


def _maxtext_loop(utils_rl, cfg, rows, bs, totals, checks) -> None:
  """MaxText's three reward functions over `rows` in batches of `bs`, as its RL trainer calls them."""
  for b in _batches(rows, bs):
    prompts = [r["question"] for r in b]
    comps = [r["completion"] for r in b]
    answers = [json.dumps([r["mt_gold"], r["mt_gold"]]) for r in b]  # what MaxText's process_data emits
    a = utils_rl.match_format_exactly(prompts, comps, cfg)
    c = utils_rl.match_format_approximately(prompts, comps, cfg)
    n = utils_rl.check_numbers(prompts, comps, answers, cfg, question=prompts)
    totals.extend(x + y + z for x, y, z in zip(a, c, n))
    checks.extend(n)


def adversarial_latency() -> list[tuple[str, float, bool]]:
  """Seconds the plugin takes on inputs built to be slow (huge, deeply nested, unbounded towers): (name, s, verdict)."""
  cases = {
      "100KB of '{'": "{" * 100_000,
      "100KB nested \\boxed{": "\\boxed{" * 15_000,
      "10K unclosed <answer>": "<answer>" * 10_000 + "7",
      "tower 9^9^9^9^9 in <answer>": "<reasoning>x</reasoning><answer>9^{9^{9^{9^{9}}}}</answer>",
      "deep \\frac nesting": "<answer>" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "</answer>",
  }
  out = []
  for name, text in cases.items():
    t = time.perf_counter()
    r = rewards.score(text, "7")
    out.append((name, time.perf_counter() - t, r.correct))
  return out


def _parse_args(argv) -> argparse.Namespace:
  """The command line (`argv`, or sys.argv[1:] when None)."""
  ap = common.ArgumentParser(
      prog="python -m maxtext_rl_plugin.bench rewards", description=__doc__.split("\n\n", maxsplit=1)[0]
  )
  ap.add_argument(
      "--data-dir", default=None, help="directory with GSM8K test.jsonl/train.jsonl (default ../shared/data/gsm8k)"
  )
  ap.add_argument("--split", default="test", choices=("test", "train"))
  ap.add_argument("--limit", type=common.non_negative_int, default=0, help="first N problems (0 = all)")
  ap.add_argument(
      "--batch-size", type=common.positive_int, default=64, help="completions per reward call (one RL step's batch)"
  )
  ap.add_argument("--maxtext-procs", type=common.positive_int, default=1, help="math_verify_num_procs for MaxText's pool")
  ap.add_argument(
      "--repeat", type=common.positive_int, default=5, help="timed passes of the plugin stack; the fastest is reported"
  )
  ap.add_argument("--skip-maxtext", action="store_true", help="plugin only")
  ap.add_argument("--skip-adversarial", action="store_true")
  return ap.parse_args(sys.argv[1:] if argv is None else argv)


def time_plugin(tagged, raw, bs: int, repeat: int) -> tuple[float, dict[str, Any]]:
  """Best-of-`repeat` throughput of the plugin's stack on tagged and raw rows (the usual guard against other
  processes on shared cores), wall and CPU; prints the table's plugin lines. Returns the tagged rows' best wall
  seconds (the speedup's denominator) and the JSON fields."""
  run_plugin(tagged[:bs], bs)  # warm-up (first-call imports)
  secs, cpu, _ = min(run_plugin(tagged, bs) for _ in range(repeat))
  secs_raw, cpu_raw, _ = min(run_plugin(raw, bs) for _ in range(repeat))
  print(f"{'stack':<28}{'rows':>8}{'wall s':>9}{'cpu s':>9}{'completions/s':>15}{'per cpu-s':>12}")
  for name, n, wall, cpu_s in (
      ("plugin (tagged gold+wrong)", len(tagged), secs, cpu),
      ("plugin (raw #### N)", len(raw), secs_raw, cpu_raw),
  ):
    print(f"{name:<28}{n:>8}{wall:>9.3f}{cpu_s:>9.3f}{n / wall:>15,.0f}{n / cpu_s:>12,.0f}")
  return secs, {
      "plugin_completions_per_s": round(len(tagged) / secs, 1),
      "plugin_completions_per_cpu_s": round(len(tagged) / max(cpu, 1e-9), 1),
      "plugin_raw_completions_per_s": round(len(raw) / secs_raw, 1),
      "plugin_raw_completions_per_cpu_s": round(len(raw) / max(cpu_raw, 1e-9), 1),
  }


def plugin_verdicts(rows) -> tuple[list, dict[str, Any]]:
  """The plugin's verdict per row and how many match each row's expectation, by kind."""
  verdicts = rewards.score_batch([r["completion"] for r in rows], [r["gold"] for r in rows])
  by_kind: dict[str, list[bool]] = {}
  for r, v in zip(rows, verdicts):
    by_kind.setdefault(r["kind"], []).append(v.correct == r["expect"])
  return verdicts, {
      "plugin_gold_correct": f"{sum(by_kind['gold'])}/{len(by_kind['gold'])}",
      "plugin_wrong_rejected": f"{sum(by_kind['wrong'])}/{len(by_kind['wrong'])}",
      "plugin_raw_correct": f"{sum(by_kind['raw'])}/{len(by_kind['raw'])}",
      "plugin_math_verify_workers_started": verify.pool_stats()["workers_started"],
  }


def compare_maxtext(rows, tagged, raw, verdicts, plugin_secs: float, bs: int, procs: int) -> dict[str, Any]:
  """MaxText 0.2.5's stack on the same tagged rows: throughput, speedup, and every verdict that differs."""
  mt_secs, _, checks = run_maxtext(tagged, bs, procs)
  _, _, raw_checks = run_maxtext(raw[: min(len(raw), 256)], bs, procs)
  cfg = _maxtext_config(procs)
  ours = {id(r): v for r, v in zip(rows, verdicts)}
  disagree = [(r, c) for r, c in zip(tagged, checks) if (c >= cfg.reward_exact_answer) != ours[id(r)].correct]
  print(
      f"{'maxtext 0.2.5 (same rows)':<28}{len(tagged):>8}{mt_secs:>9.3f}{'-':>9}{len(tagged) / mt_secs:>15,.0f}{'-':>12}"
  )
  for r, c in disagree[:5]:
    print(f"  verdict differs: kind={r['kind']} gold={r['mt_gold']!r} answer={r['completion'][-40:]!r} maxtext={c}")
  return {
      "maxtext_completions_per_s": round(len(tagged) / mt_secs, 1),
      "maxtext_math_verify_procs": procs,
      "speedup": round(mt_secs / plugin_secs, 1),
      "verdicts_compared": len(tagged),
      "verdict_disagreements": len(disagree),
      "maxtext_raw_correct": f"{sum(c >= cfg.reward_exact_answer for c in raw_checks)}/{len(raw_checks)}",
  }


# The answer rule's table (docs/rewards.md), as <answer> bodies: (body, gold, whether the answer is right). The
# expectation is what the body means, by hand: a hedge, range, negation or comparison is wrong; a number is its
# whole value (sign, Unicode numerals, scale).
ANSWER_RULE_ROWS = (
    *((b, "5", False) for b in ("3 or 5", "not 5", "3-5", "3 to 5", "between 3 and 5", "less than 5", "at least 5")),
    *((b, "5", False) for b in ("3, 5", "5!", "5 or more", "about 5", "x <= 5", "\\boxed{3} or \\boxed{5}", "8 - 3")),
    ("3:30", "30", False),
    ("3:2", "2", False),
    *((b, "5", False) for b in ("- 5", "\u22125", "\u2212 5", "\u2014 5", "-\\boxed{5}", "5 squared")),
    *((b, "-5", True) for b in ("- 5", "\u22125", "\u2212 5", "\u2014 5", "-\\boxed{5}")),
    ("1\uff0c234", "1234", True),
    ("1\uff0e5", "1.5", True),
    ("1\u066b5", "1.5", True),
    ("1\u066c234", "1234", True),
    ("5\u00b2", "25", True),
    ("10\u207b\u00b3", "0.001", True),
    ("1\u00bd", "1.5", True),
    ("3\u00bc", "3.25", True),
    ("1\u20442", "0.5", True),
    ("5 thousand", "5000", True),
    ("2 million", "2000000", True),
    ("3 dozen", "36", True),
    ("5k", "5000", True),
    ("$5M", "5000000", True),
    ("$1.2 million", "1200000", True),
    *((b, "5", True) for b in ("5", "$5", "5.0", "5 apples", "x = 5", "The answer is 5.", "5%")),
    ("1,234", "1234", True),
    ("\\frac{1}{2}", "0.5", True),
)


def answer_rule_table(with_maxtext: bool, procs: int) -> dict[str, Any]:
  """Each ANSWER_RULE_ROWS body in <answer> tags, graded by the plugin (and MaxText 0.2.5's check_numbers): how many
  wrong answers each rewards and how many right ones each misses; prints the rows where a stack errs."""
  comps = [_tagged("r", b) for b, _, _ in ANSWER_RULE_ROWS]
  ours = [v.correct for v in rewards.score_batch(comps, [g for _, g, _ in ANSWER_RULE_ROWS])]
  theirs = [None] * len(comps)
  if with_maxtext:
    from maxtext.trainers.post_train.rl import utils_rl

    cfg = _maxtext_config(procs)
    answers = [json.dumps([g, g]) for _, g, _ in ANSWER_RULE_ROWS]
    try:
      scores = utils_rl.check_numbers(["q"] * len(comps), comps, answers, cfg, question=["q"] * len(comps))
    finally:
      tunix_compat.shutdown_maxtext_math_verify_pool()
    theirs = [sc >= cfg.reward_exact_answer for sc in scores]
  print(f"{'answer rule row (<answer> body)':<34}{'gold':>9}{'right':>7}{'plugin':>8}{'maxtext':>9}")
  for (body, gold, want), p, m in zip(ANSWER_RULE_ROWS, ours, theirs):
    if p != want or (m is not None and m != want):
      print(f"{body!r:<34}{gold:>9}{want!s:>7}{p!s:>8}{'-' if m is None else str(m):>9}")
  out = {
      "answer_rule_rows": len(ANSWER_RULE_ROWS),
      "answer_rule_plugin_rewarded_wrong": sum(p and not w for p, (_, _, w) in zip(ours, ANSWER_RULE_ROWS)),
      "answer_rule_plugin_missed_right": sum(w and not p for p, (_, _, w) in zip(ours, ANSWER_RULE_ROWS)),
  }
  if with_maxtext:
    out["answer_rule_maxtext_rewarded_wrong"] = sum(m and not w for m, (_, _, w) in zip(theirs, ANSWER_RULE_ROWS))
    out["answer_rule_maxtext_missed_right"] = sum(w and not m for m, (_, _, w) in zip(theirs, ANSWER_RULE_ROWS))
  return out


def report_adversarial() -> dict[str, Any]:
  """Print the adversarial latencies; the slowest one for the JSON line."""
  adv = adversarial_latency()
  print(f"{'adversarial input':<34}{'seconds':>10}  correct")
  for name, s, ok in adv:
    print(f"{name:<34}{s:>10.3f}  {ok}")
  return {"adversarial_max_seconds": round(max(s for _, s, _ in adv), 3)}


def main(argv=None) -> int:
  """Build the rows, time the plugin, check its verdicts, compare with MaxText, probe adversarial inputs; prints one
  JSON line."""
  args = _parse_args(argv)
  rows = build_rows(_find_gsm8k(args.data_dir), args.split, args.limit)
  tagged = [r for r in rows if r["kind"] != "raw"]
  raw = [r for r in rows if r["kind"] == "raw"]
  res: dict[str, Any] = {
      "bench": "rewards",
      "split": args.split,
      "problems": len(raw),
      "batch_size": args.batch_size,
      "plugin_repeats": args.repeat,
      "loadavg_1m": round(os.getloadavg()[0], 2),
  }
  plugin_secs, timing = time_plugin(tagged, raw, args.batch_size, args.repeat)
  res.update(timing)
  verdicts, checks = plugin_verdicts(rows)
  res.update(checks)
  if not args.skip_maxtext:
    res.update(compare_maxtext(rows, tagged, raw, verdicts, plugin_secs, args.batch_size, args.maxtext_procs))
  res.update(answer_rule_table(not args.skip_maxtext, args.maxtext_procs))
  if not args.skip_adversarial:
    res.update(report_adversarial())
  print(common.finite_json(res))
  return 0


if __name__ == "__main__":
  sys.exit(main())
