"""Rows from files (JSONL, JSON, Parquet) and the HF hub, decoded to (question, gold, solution, id).

Gold answers are parsed once here (`#### 1,200` -> "1200"). Malformed rows (no question, no parsable gold, bad JSON,
not UTF-8) are skipped and counted in one warning per source instead of failing a run hours in.
"""

# pyarrow (Parquet files) and datasets (the HF hub) are optional extras, imported where a config asks for them.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import Any, Iterable, Optional, Sequence

from absl import logging

from maxtext_rl_plugin import storage
from maxtext_rl_plugin.data import synthetic
from maxtext_rl_plugin.errors import DataError
from maxtext_rl_plugin.errors import describe_not_a_file
from maxtext_rl_plugin.errors import MissingExtraError
from maxtext_rl_plugin.rewards import number_grammar

_QUESTION_KEYS = ("question", "problem", "prompt")
_ANSWER_KEYS = ("answer", "solution", "expected_answer")


@dataclasses.dataclass
class _Skips:
  """Counts of the rows a file loses, by reason, for the one-line skip summary."""

  rows: int = 0
  bad_json: int = 0
  not_object: int = 0  # valid JSON that is not an object (a list, a number, a string)
  not_utf8: int = 0
  no_question: int = 0
  no_answer: int = 0
  first_bad: Optional[int] = None

  def bad(self, row: int, kind: str) -> None:
    setattr(self, kind, getattr(self, kind) + 1)
    if self.first_bad is None:
      self.first_bad = row

  @property
  def skipped(self) -> int:
    return self.bad_json + self.not_object + self.not_utf8 + self.no_question + self.no_answer

  def reasons(self, unit: str) -> str:
    """Why rows were lost, for a file that kept none (`2 not UTF-8, 1 with no question; first at line 1`)."""
    parts = [
        f"{n} {why}"
        for n, why in (
            (self.bad_json, "invalid JSON"),
            (self.not_object, "JSON but not an object"),
            (self.not_utf8, "not UTF-8"),
            (self.no_question, "with no question string"),
            (self.no_answer, "with no parsable gold answer"),
        )
        if n
    ]
    return f"{', '.join(parts)}; first at {unit or 'row'} {self.first_bad}" if parts else "the file is empty"


def _first(row: dict, keys: Sequence[str]) -> Any:
  for k in keys:
    if k in row and row[k] is not None:
      return row[k]
  return None


# Files that are readable but not UTF-8 text, named as what they are rather than counted as undecodable rows.
_NOT_TEXT = (
    (b"\x1f\x8b", "is gzip-compressed; decompress it (gunzip) and give the .jsonl"),
    (b"\xff\xfe", "is UTF-16 (a byte order mark FF FE); save it as UTF-8"),
    (b"\xfe\xff", "is UTF-16 (a byte order mark FE FF); save it as UTF-8"),
)


class NotUtf8:
  """Stands for a data-file line whose bytes are not UTF-8 (counted and skipped, never trained on as U+FFFD)."""


def _row_example(row: Any) -> tuple[str, str, str] | str:
  """(question, gold, answer) of a usable row, else why it is skipped (a `_Skips` counter's name)."""
  if isinstance(row, NotUtf8):
    return "not_utf8"
  if not isinstance(row, dict):
    return "bad_json" if row is None else "not_object"
  q = _first(row, _QUESTION_KEYS)
  if not isinstance(q, str) or not q.strip():
    return "no_question"
  a = _first(row, _ANSWER_KEYS)
  gold = number_grammar.parse_gold(a) if a is not None else None
  if gold is None:
    return "no_answer"
  return q.strip(), gold, str(a)


def rows_to_examples(
    rows: Iterable[Any], source: str, unit: str = "", log: bool = True
) -> tuple[list[tuple[str, str, str, str]], _Skips]:
  """(question, gold, solution, id) per usable row; malformed rows are counted, not raised.

  A row is a dict with `question` (or `problem`/`prompt`) and `answer` (or `solution`/`expected_answer`)
  whose gold is the value after `####`, or the whole answer if it is a plain number. `None` rows stand
  for lines that were not valid JSON, `NotUtf8` for lines that were not UTF-8. With a `unit` ("line", "row"),
  `rows` holds (number, row) pairs, so ids and messages name file lines; else rows are counted from 1.
  """
  out = []
  sk = _Skips()
  for n, row in rows if unit else enumerate(rows, 1):
    sk.rows += 1
    example = _row_example(row)
    if isinstance(example, str):
      sk.bad(n, example)
      continue
    out.append((*example, f"{source}:{n}"))
  if sk.skipped and log:
    logging.warning(
        "%s: skipped %d of %d rows (invalid JSON: %d, JSON but not an object: %d, not UTF-8: %d, no question: %d, "
        "no parsable gold answer ('#### N'): %d); first at %s %d",
        source,
        sk.skipped,
        sk.rows,
        sk.bad_json,
        sk.not_object,
        sk.not_utf8,
        sk.no_question,
        sk.no_answer,
        unit or "row",
        sk.first_bad,
    )
  return out, sk


def expand_paths(spec: str, key: str) -> list[str]:
  """The files a comma-separated path/glob spec names; a part matching nothing is a DataError."""
  paths = []
  for part in (p.strip() for p in spec.split(",")):
    if not part:
      continue
    try:
      storage.check_credentials(part)
      matches = storage.glob(part) if any(c in part for c in "*?[") else [part]
      if not matches:
        raise DataError(f"{key}='{part}': no files match")
      for m in matches:
        if not storage.isfile(m):
          why = "file not found (no such object)" if storage.is_remote(m) else describe_not_a_file(m)
          raise DataError(f"{key}='{m}': {why}")
        paths.append(m)
    except storage.StorageError as e:  # no credentials, an unreachable bucket: one line naming it
      raise DataError(f"{key}='{part}': {e.strerror}") from None
  if not paths:
    raise DataError(f"{key}='{spec}': no files given")
  return paths


def _read_rows(path: str, key: str) -> tuple[list[tuple[int, Any]], str]:
  """((number, row) pairs, "line" or "row") of a JSONL/JSON/Parquet file.

  A row is the parsed value, None for invalid JSON, or NotUtf8.
  """
  ext = os.path.splitext(path)[1].lower()
  if ext == ".parquet":
    try:
      import pyarrow as pa
      import pyarrow.parquet as pq
    except ImportError as e:
      raise MissingExtraError("reading Parquet data", "pyarrow", "cpu") from e
    try:
      source = io.BytesIO(storage.read_bytes(path)) if storage.is_remote(path) else path
      return list(enumerate(pq.read_table(source).to_pylist(), 1)), "row"
    except (pa.ArrowException, OSError, ValueError, TypeError) as e:  # pyarrow's errors; OSError: unreadable
      raise DataError(f"{key}='{path}': not a readable Parquet file ({type(e).__name__}: {e})") from None
  try:
    raw = storage.read_bytes(path)
  except OSError as e:
    raise DataError(f"{key}='{path}': {e.strerror or e}") from None
  if raw.startswith(b"\xef\xbb\xbf"):
    raw = raw[3:]  # UTF-8 byte order mark (Windows editors write one)
  for magic, what in _NOT_TEXT:
    if raw.startswith(magic):
      raise DataError(f"{key}='{path}': {what}")
  if ext == ".json" and raw.lstrip().startswith(b"["):
    try:
      rows = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise DataError(f"{key}='{path}': not UTF-8 (byte {e.start + 1})") from None
    except ValueError as e:
      raise DataError(f"{key}='{path}': invalid JSON ({e})") from None
    return list(enumerate(rows if isinstance(rows, list) else [rows], 1)), "row"
  # JSONL: split on "\n" only (str.splitlines would also cut at U+2028/U+0085 inside a valid row) and number
  # rows by file line, blank lines included, so ids and messages point at the line to fix.
  rows: list[tuple[int, Any]] = []
  for lineno, line in enumerate(raw.split(b"\n"), 1):
    if not line.strip():
      continue
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError:
      rows.append((lineno, NotUtf8()))
      continue
    try:
      rows.append((lineno, json.loads(text)))
    except ValueError:
      rows.append((lineno, None))
  return rows, "line"


def _no_usable_rows(key: str, path: str, sk: _Skips, unit: str) -> DataError:
  return DataError(
      f"{key}='{path}': no usable rows of {sk.rows} ({sk.reasons(unit)}; expected JSON objects with 'question' "
      "and 'answer' ending in '#### N')"
  )


def load_file_rows(spec: str, key: str) -> list[tuple[str, str, str, str]]:
  """Usable rows of local JSONL/JSON/Parquet file(s) named by config key `key`."""
  out = []
  for path in expand_paths(spec, key):
    numbered, unit = _read_rows(path, key)
    rows, sk = rows_to_examples(numbered, os.path.basename(path), unit=unit)
    if not rows:
      raise _no_usable_rows(key, path, sk, unit)
    out.extend(rows)
  return out


def _has_usable_jsonl_row(path: str) -> bool:
  """Whether a local JSONL file holds a usable row, read line by line up to the first one (a good file costs a line)."""
  with open(path, "rb") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row = json.loads(line.decode("utf-8").removeprefix("\ufeff"))
      except (UnicodeDecodeError, ValueError):
        continue
      if not isinstance(_row_example(row), str):
        return True
  return False


def check_file_rows(spec: str, key: str) -> None:
  """The data loader's refusals of `load_file_rows` for files that exist, before the schema's imports (the first pass):
  every file holds a usable row. A local JSONL file is read up to its first usable row; a file without one (or another
  format: JSON arrays, Parquet) is read whole, as the loader would, for its one-line reason. Objects in a bucket are
  left to the loader (one read of each)."""
  for path in expand_paths(spec, key):
    if storage.is_remote(path):
      continue
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".parquet"):
      try:
        if _has_usable_jsonl_row(path):
          continue
      except OSError:
        pass  # unreadable: _read_rows says so in its words
    numbered, unit = _read_rows(path, key)
    rows, sk = rows_to_examples(numbered, os.path.basename(path), unit=unit, log=False)
    if not rows:
      raise _no_usable_rows(key, path, sk, unit)


def load_hub_rows(
    dataset_name: str, subset: str, split: str, token: Optional[str] = None
) -> list[tuple[str, str, str, str]]:
  """Usable rows of a Hugging Face hub dataset split (`datasets.load_dataset(name, subset, split=split)`)."""
  try:
    import datasets
  except ImportError as e:
    raise MissingExtraError("loading datasets from the Hugging Face hub", "datasets", "cpu") from e
  kwargs = {"split": split}
  if token:
    kwargs["token"] = token
  try:
    ds = datasets.load_dataset(dataset_name, subset or None, **kwargs)
  except Exception as e:  # pylint: disable=broad-exception-caught  # network, auth, unknown split...
    msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    raise DataError(
        f"dataset_name='{dataset_name}' (hf_subset='{subset}', split='{split}'): could not load from the "
        "Hugging Face hub "
        f"({type(e).__name__}: {msg}); offline, use train_data_path=/eval_data_path= or "
        f"dataset_name={synthetic.SYNTHETIC}"
    ) from None
  rows, sk = rows_to_examples(iter(ds), f"{dataset_name}/{split}")
  if not rows:
    raise DataError(
        f"dataset_name='{dataset_name}' split '{split}': no usable rows of {sk.rows} (need 'question' and 'answer')"
    )
  return rows
