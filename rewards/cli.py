"""`python -m maxtext_rl_plugin.rewards score --input IN.jsonl --output OUT.jsonl [config.yml] [key=value ...]`.

Grades completions offline with exactly the reward stack training uses: one output row per input row,
in order, `{"correct", "reward", "extracted", "rule", "format_ok", "partial", "gold"}` (+ `id` when the
input has one). A row that cannot be graded (bad JSON, missing `completion`/`answer`, unparsable gold)
gets `correct: false` and an `error` naming the line; the command never stops on a row. Reward
weights and tags come from MaxText's rl.yml defaults unless a config/overrides are given.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
from typing import Any, Iterator, Optional, TextIO

from maxtext_rl_plugin.errors import DataError, exit_on_user_error
from maxtext_rl_plugin.rewards import extraction as ex
from maxtext_rl_plugin.rewards import gsm8k

_CHUNK = 1024


def _parse_row(line: str, lineno: int) -> tuple[Optional[dict], Optional[str]]:
  """(row, None) or (None, error message)."""
  try:
    row = json.loads(line)
  except ValueError as e:
    return None, f"line {lineno}: invalid JSON ({e.msg})"
  if not isinstance(row, dict):
    return None, f"line {lineno}: expected a JSON object, got {type(row).__name__}"
  if not isinstance(row.get("completion"), str):
    return None, f"line {lineno}: 'completion' must be a string"
  ans = row.get("answer")
  if ans is None or isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
    return None, f"line {lineno}: 'answer' must be a string or number"
  if not gsm8k.gold_alternatives(ans if isinstance(ans, str) else str(ans)):
    return None, f"line {lineno}: 'answer' has no parsable gold value (a value, or a solution ending in '#### N')"
  return row, None


def _error_row(row: Any, err: str) -> dict:
  out = {"correct": False, "reward": 0.0, "extracted": None, "rule": ex.RULE_NONE, "format_ok": False, "partial": False, "error": err}
  if isinstance(row, dict) and "id" in row:
    out = {"id": row["id"], **out}
  return out


def score_stream(lines: Iterator[str], out: TextIO, config: Any = None) -> collections.Counter:
  """Score JSONL lines into `out`; returns counts (rows, correct, errors, rule:<name>)."""
  stats: collections.Counter = collections.Counter()
  buf: list[tuple[Optional[dict], Optional[str]]] = []

  def flush():
    good = [(i, r) for i, (r, e) in enumerate(buf) if e is None]
    results = gsm8k.score_batch(
        [r["completion"] for _, r in good],
        [r["answer"] if isinstance(r["answer"], str) else str(r["answer"]) for _, r in good],
        config,
    )
    by_pos = {i: res for (i, _), res in zip(good, results)}
    for i, (row, err) in enumerate(buf):
      stats["rows"] += 1
      if err is not None:
        stats["errors"] += 1
        rec = _error_row(row, err)
      else:
        res = by_pos[i]
        rec = {"correct": res.correct, "reward": res.reward, "extracted": res.extracted, "rule": res.rule,
               "format_ok": res.format_ok, "partial": res.partial,
               "gold": (gsm8k.gold_alternatives(row["answer"] if isinstance(row["answer"], str) else str(row["answer"])) or [None])[0]}
        if "id" in row:
          rec = {"id": row["id"], **rec}
        stats["correct"] += res.correct
        stats[f"rule:{res.rule}"] += 1
      out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    buf.clear()

  for lineno, line in enumerate(lines, 1):
    if not line.strip():
      continue
    buf.append(_parse_row(line, lineno))
    if len(buf) >= _CHUNK:
      flush()
  if buf:
    flush()
  return stats


@contextlib.contextmanager
def _open(path: str, mode: str):
  if path == "-":
    yield sys.stdin if "r" in mode else sys.stdout
    return
  try:
    f = open(path, mode, encoding="utf-8", errors="replace" if "r" in mode else "strict")  # pylint: disable=consider-using-with
  except OSError as e:
    raise DataError(f"{'--input' if 'r' in mode else '--output'} '{path}': {e.strerror}") from None
  with f:
    yield f


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m maxtext_rl_plugin.rewards", description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("score", help="grade completions in a JSONL file")
  p.add_argument("--input", required=True, help='JSONL rows {"completion": str, "answer": str, "question"?: str} ("-" = stdin)')
  p.add_argument("--output", required=True, help='JSONL output, one row per input row ("-" = stdout)')
  p.add_argument("config", nargs="*", help="optional: a config yml then key=value overrides (reward_*, penalty_*, *_token, ...)")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  with exit_on_user_error():
    config = None
    if args.config:
      from maxtext_rl_plugin.config import load_config  # pylint: disable=import-outside-toplevel

      argv_cfg = args.config if not args.config[0].count("=") else ["configs/rl.yml", *args.config]
      config = gsm8k.RewardConfig.of(load_config(argv_cfg))
    t0 = time.perf_counter()
    with _open(args.input, "r") as fin, _open(args.output, "w") as fout:
      stats = score_stream(fin, fout, config)
    dt = time.perf_counter() - t0
    rows = stats["rows"]
    rules = ", ".join(f"{k[5:]}={v}" for k, v in sorted(stats.items()) if k.startswith("rule:"))
    print(
        f"scored {rows} rows: {stats['correct']} correct ({100 * stats['correct'] / max(rows, 1):.1f}%), "
        f"{stats['errors']} errors; rules: {rules or '-'}; {rows / max(dt, 1e-9):,.0f} rows/s",
        file=sys.stderr,
    )
  return 0
