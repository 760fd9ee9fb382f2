"""`python -m maxtext_rl_plugin.rewards score --input IN.jsonl --output OUT.jsonl [config.yml] [key=value ...]`.

Grades completions offline with exactly the reward stack training uses: one output row per input row,
in order, `{"correct", "reward", "extracted", "rule", "format_ok", "partial", "gold"}` (+ `id` when the
input has one). Input lines are split on "\n" only (a row may hold U+2028); a line that cannot be graded
(blank, not UTF-8, bad JSON, missing `completion`/`answer`, unparsable gold) gets `correct: false` and an
`error` naming its line, so output row N is always input line N; the command never stops on a row. The
output is written beside its destination and renamed into place, so a crash never leaves half a file and
an output that is the input is refused rather than truncated. Reward
weights and tags come from MaxText's rl.yml defaults unless a config/overrides are given.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Iterable, Iterator, Optional, TextIO

from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.errors import DataError
from maxtext_rl_plugin.errors import exit_on_user_error
from maxtext_rl_plugin.rewards import extraction as ex
from maxtext_rl_plugin.rewards import gsm8k

_CHUNK = 1024


def _parse_row(raw: bytes, lineno: int) -> tuple[Optional[dict], Optional[str]]:
  """(row, None) or (None, error message) for one input line (bytes, without its "\n")."""
  if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
    raw = raw[3:]  # UTF-8 byte order mark
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return None, f"line {lineno}: not valid UTF-8 (byte {e.start + 1})"
  if not line.strip():
    return None, f"line {lineno}: blank line"
  try:
    row = json.loads(line)
  except ValueError as e:
    return None, f"line {lineno}: invalid JSON ({e.msg})"
  if not isinstance(row, dict):
    return None, f"line {lineno}: expected a JSON object, got {type(row).__name__}"
  if "id" in row and not _finite_id(row["id"]):
    return None, (
        f"line {lineno}: 'id' holds NaN or Infinity, which are not JSON; give the id as a string or a finite number"
    )
  if not isinstance(row.get("completion"), str):
    return None, f"line {lineno}: 'completion' must be a string"
  ans = row.get("answer")
  if ans is None or isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
    return None, f"line {lineno}: 'answer' must be a string or number"
  if not gsm8k.gold_alternatives(ans if isinstance(ans, str) else str(ans)):
    return None, f"line {lineno}: 'answer' has no parsable gold value (a value, or a solution ending in '#### N')"
  return row, None


def _finite_id(value: Any) -> bool:
  """Whether an input row's `id` holds no NaN/Infinity (Python's json reads them; JSON has neither). Such a row is an
  error row without its id, rather than one whose id is echoed: an id is what an output row is joined back to its
  input on, and NaN never equals itself (so it joins nothing), a string 'NaN' is another id than the input's, and
  echoing it writes NaN into the output, which strict JSON readers refuse."""
  if isinstance(value, float):
    return math.isfinite(value)
  if isinstance(value, list):
    return all(_finite_id(v) for v in value)
  if isinstance(value, dict):
    return all(_finite_id(v) for v in value.values())
  return True


def _error_row(row: Any, err: str) -> dict:
  """The output row of an input that could not be scored: zero reward and the error."""
  out = {
      "correct": False,
      "reward": 0.0,
      "extracted": None,
      "rule": ex.RULE_NONE,
      "format_ok": False,
      "partial": False,
      "error": err,
  }
  if isinstance(row, dict) and "id" in row:
    out = {"id": row["id"], **out}
  return out


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
  """Lines of a byte stream split on b"\n" only ("\r\n" endings dropped, no empty last line after a final "\n")."""
  for raw in chunks:
    yield raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw


def _score_rows(good: list[tuple[int, dict]], settings: Optional[gsm8k.RewardConfig]) -> dict[int, Any]:
  """Each good row's ScoreResult by position, scored as one batch; should the grader fail on the batch, each row alone,
  and a row it still cannot score gets its error text: one row never stops a file (output row N is input line N)."""
  completions = [r["completion"] for _, r in good]
  answers = [r["answer"] if isinstance(r["answer"], str) else str(r["answer"]) for _, r in good]
  try:
    return {i: res for (i, _), res in zip(good, gsm8k.score_batch(completions, answers, settings))}
  except Exception:  # pylint: disable=broad-exception-caught  # isolate the row below
    pass
  out: dict[int, Any] = {}
  for (i, _), c, a in zip(good, completions, answers):
    try:
      out[i] = gsm8k.score_batch([c], [a], settings)[0]
    except Exception as e:  # pylint: disable=broad-exception-caught  # an error row, never a stopped file
      out[i] = f"the grader could not score this row: {type(e).__name__}: {str(e)[:200]}"
  return out


def score_stream(
    lines: Iterable[bytes], out: TextIO, settings: Optional[gsm8k.RewardConfig] = None
) -> collections.Counter:
  """Score JSONL lines (bytes, one per input line) into `out`; returns counts (rows, correct, errors, rule:<name>)."""
  stats: collections.Counter = collections.Counter()
  buf: list[tuple[Optional[dict], Optional[str]]] = []

  def flush():
    """Score the buffered rows in one batch and write them in input order (bad rows as error rows)."""
    good = [(i, r) for i, (r, e) in enumerate(buf) if e is None]
    by_pos = _score_rows(good, settings)
    for i, (row, err) in enumerate(buf):
      stats["rows"] += 1
      if err is None and isinstance(by_pos[i], str):
        err = by_pos[i]
      if err is not None:
        stats["errors"] += 1
        rec = _error_row(row, err)
      else:
        res = by_pos[i]
        rec = {
            "correct": res.correct,
            "reward": res.reward,
            "extracted": res.extracted,
            "rule": res.rule,
            "format_ok": res.format_ok,
            "partial": res.partial,
            "gold": (
                gsm8k.gold_alternatives(row["answer"] if isinstance(row["answer"], str) else str(row["answer"])) or [None]
            )[0],
        }
        if "id" in row:
          rec = {"id": row["id"], **rec}
        stats["correct"] += res.correct
        stats["unreadable"] += res.unreadable
        stats["ambiguous"] += res.ambiguous
        stats[f"rule:{res.rule}"] += 1
      out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    buf.clear()

  for lineno, line in enumerate(lines, 1):
    buf.append(_parse_row(line, lineno))
    if len(buf) >= _CHUNK:
      flush()
  if buf:
    flush()
  return stats


@contextlib.contextmanager
def _input(path: str):
  """The input as a binary stream (its lines are split on b"\n" only and decoded per line)."""
  if path == "-":
    yield sys.stdin.buffer
    return
  try:
    f = open(path, "rb")  # pylint: disable=consider-using-with
  except OSError as e:
    raise DataError(f"--input '{path}': {e.strerror}") from None
  with f:
    yield f


def _same_file(a: str, b: str) -> bool:
  if os.path.realpath(a) == os.path.realpath(b):
    return True
  try:
    return os.path.samefile(a, b)
  except OSError:
    return False


def _new_file_mode(path: str) -> int:
  try:
    return os.stat(path).st_mode & 0o7777
  except OSError:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def _output(path: str, input_path: str):
  """A text stream whose content replaces `path` only when the block succeeds (temp file + rename).

  The real path of a symlinked output is replaced, so the link keeps pointing at the new file; a device or
  FIFO (`/dev/stdout`) is written directly.
  """
  if path == "-":
    yield sys.stdout
    return
  if input_path != "-" and _same_file(path, input_path):
    raise DataError(f"--output '{path}' is the input file; write the scores to another file")
  target = os.path.realpath(path)
  if os.path.exists(target) and not os.path.isfile(target):  # /dev/stdout, a FIFO: nothing to replace, write through
    try:
      f = open(target, "w", encoding="utf-8")  # pylint: disable=consider-using-with
    except OSError as e:
      raise DataError(f"--output '{path}': {e.strerror}") from None
    with f:
      yield f
    return
  try:
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=os.path.dirname(target))
  except OSError as e:
    raise DataError(f"--output '{path}': {e.strerror}") from None
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      yield f
    os.chmod(tmp, _new_file_mode(target))  # mkstemp creates 0600; keep what a plain open() would give
    os.replace(tmp, target)
  except BaseException:
    os.unlink(tmp)
    raise


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m maxtext_rl_plugin.rewards", description=__doc__.split("\n\n", maxsplit=1)[0]
  )
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("score", help="grade completions in a JSONL file")
  p.add_argument(
      "--input", required=True, help='JSONL rows {"completion": str, "answer": str, "question"?: str} ("-" = stdin)'
  )
  p.add_argument("--output", required=True, help='JSONL output, one row per input row ("-" = stdout)')
  p.add_argument(
      "config", nargs="*", help="optional: a config yml then key=value overrides (reward_*, penalty_*, *_token, ...)"
  )
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  with exit_on_user_error():
    settings = None
    if args.config:
      argv_cfg = args.config if not args.config[0].count("=") else ["configs/rl.yml", *args.config]
      settings = gsm8k.RewardConfig.of(load_config(argv_cfg))
    t0 = time.perf_counter()
    try:
      with _input(args.input) as fin, _output(args.output, args.input) as fout:
        stats = score_stream(split_lines(fin), fout, settings)
    except OSError as e:  # a full or failing output device (--output /dev/full): one line, not a traceback
      raise DataError(f"--output '{args.output}': {storage.describe_error(e, args.output)}") from None
    dt = time.perf_counter() - t0
    rows = stats["rows"]
    rules = ", ".join(f"{k[5:]}={v}" for k, v in sorted(stats.items()) if k.startswith("rule:"))
    print(
        f"scored {rows} rows: {stats['correct']} correct ({100 * stats['correct'] / max(rows, 1):.1f}%), "
        f"{stats['errors']} errors, {stats['unreadable']} unreadable answers (scored wrong), "
        f"{stats['ambiguous']} answers not one value (ambiguous, scored wrong); rules: {rules or '-'}; "
        f"{rows / max(dt, 1e-9):,.0f} rows/s",
        file=sys.stderr,
    )
  return 0
