"""`python -m maxtext_rl_plugin.rewards score`: one output row per input row, in order; bad rows get an
error and never stop the command."""

import json
import os
import subprocess
import sys

import pytest

from maxtext_rl_plugin.rewards import cli

ROWS = [
    {
        "id": "a",
        "completion": "<reasoning>9 * 2</reasoning><answer>18</answer>",
        "answer": "She makes 9 * 2 = $18.\n#### 18",
    },
    "this is not json",
    {"completion": "The answer is $1,200.", "answer": 1200, "question": "How much?"},
    {"completion": 5, "answer": "5"},
    {"id": 7, "completion": "#### 19", "answer": "18"},
    {"completion": "x"},
    {"completion": "<answer>\\frac{1}{2}</answer>", "answer": "0.5"},
    ["a", "list"],
    {"completion": "work", "answer": "a long\nsolution without a final answer"},
    {"completion": "Q: ?\nA: -3", "answer": "#### -3"},
]


def _write(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def _read(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _check(out):
  """The scored ROWS have the expected verdicts, rules and answers (shared by every input path)."""
  assert len(out) == len(ROWS)
  assert [r.get("correct") for r in out] == [True, False, True, False, False, False, True, False, False, True]
  assert [r.get("rule") for r in out] == [
      "answer_tag",
      "none",
      "answer_is",
      "none",
      "hash",
      "none",
      "answer_tag",
      "none",
      "none",
      "a_colon",
  ]
  assert out[0]["id"] == "a" and out[4]["id"] == 7
  assert out[0]["extracted"] == "18" and out[0]["format_ok"] is True and out[0]["reward"] == pytest.approx(1.1)
  assert out[2]["gold"] == "1200" and out[2]["reward"] == 1.0
  errors = {i: r["error"] for i, r in enumerate(out) if "error" in r}
  assert sorted(errors) == [1, 3, 5, 7, 8]
  assert errors[1].startswith("line 2: invalid JSON")
  assert errors[3] == "line 4: 'completion' must be a string"
  assert errors[5] == "line 6: 'answer' must be a string or number"
  assert errors[7] == "line 8: expected a JSON object, got list"
  assert errors[8].startswith("line 9: 'answer' has no parsable gold value")
  for r in out:
    assert set(r) >= {"correct", "reward", "extracted", "rule"}


def test_score_in_process(tmp_path, capsys):
  _write(tmp_path / "in.jsonl", ROWS)
  assert cli.main(["score", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]) == 0
  _check(_read(tmp_path / "out.jsonl"))
  assert "scored 10 rows: 4 correct (40.0%), 5 errors" in capsys.readouterr().err


def test_score_module_entry_point(tmp_path):
  _write(tmp_path / "in.jsonl", ROWS)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run(
      [
          sys.executable,
          "-m",
          "maxtext_rl_plugin.rewards",
          "score",
          "--input",
          str(tmp_path / "in.jsonl"),
          "--output",
          "-",
      ],
      capture_output=True,
      text=True,
      env=env,
      timeout=120,
      check=False,
  )
  assert p.returncode == 0, p.stderr
  _check([json.loads(line) for line in p.stdout.splitlines()])


def test_score_with_config_overrides(tmp_path):
  _write(tmp_path / "in.jsonl", ROWS[:1])
  argv = [
      "score",
      "--input",
      str(tmp_path / "in.jsonl"),
      "--output",
      str(tmp_path / "out.jsonl"),
      "reward_exact_answer=3.0",
      "reward_exact_format_match=0.5",
  ]
  assert cli.main(argv) == 0
  assert _read(tmp_path / "out.jsonl")[0]["reward"] == pytest.approx(3.5)


def test_missing_input_is_a_one_line_error(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["score", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o.jsonl")])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip() == f"error: --input '{tmp_path / 'nope.jsonl'}': No such file or directory"


@pytest.mark.parametrize("link", [False, True])
def test_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path, capsys, link):
  _write(tmp_path / "in.jsonl", ROWS)
  before = (tmp_path / "in.jsonl").read_bytes()
  out = tmp_path / "in.jsonl"
  if link:
    out = tmp_path / "link.jsonl"
    out.symlink_to(tmp_path / "in.jsonl")
  with pytest.raises(SystemExit) as e:
    cli.main(["score", "--input", str(tmp_path / "in.jsonl"), "--output", str(out)])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip() == f"error: --output '{out}' is the input file; write the scores to another file"
  assert (tmp_path / "in.jsonl").read_bytes() == before


def test_output_replaced_whole_through_a_symlink_with_no_temp_file_left(tmp_path):
  _write(tmp_path / "in.jsonl", ROWS)
  (tmp_path / "old.jsonl").write_text("stale\n" * 100, encoding="utf-8")
  (tmp_path / "old.jsonl").chmod(0o640)
  (tmp_path / "out.jsonl").symlink_to(tmp_path / "old.jsonl")
  assert cli.main(["score", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]) == 0
  assert (tmp_path / "out.jsonl").is_symlink()
  _check(_read(tmp_path / "old.jsonl"))
  assert (tmp_path / "old.jsonl").stat().st_mode & 0o777 == 0o640
  assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "old.jsonl", "out.jsonl"]


def test_one_output_row_per_input_line(tmp_path):
  """Blank lines, undecodable bytes, a BOM, CRLF and raw U+2028/U+0085 inside a row: output row N is input line N."""
  good = {"completion": "<answer>7</answer>", "answer": "#### 7"}
  inside = {"completion": "a\u2028b\u0085c <answer>7</answer>", "answer": "7"}
  lines = [
      b"\xef\xbb\xbf" + json.dumps(good).encode(),  # BOM on line 1
      b"",
      json.dumps(inside, ensure_ascii=False).encode(),  # raw U+2028 and U+0085 (str.splitlines cuts here)
      b"   ",
      b'{"completion": "\xff<answer>7</answer>", "answer": "7"}',  # not UTF-8
      json.dumps(good).encode() + b"\r",  # CRLF line ending
      json.dumps(good).encode(),
  ]
  (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  assert cli.main(["score", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]) == 0
  out = _read(tmp_path / "out.jsonl")
  assert [r["correct"] for r in out] == [True, False, True, False, False, True, True]
  assert out[1]["error"] == "line 2: blank line" and out[3]["error"] == "line 4: blank line"
  assert out[4]["error"] == "line 5: not valid UTF-8 (byte 17)"


def test_a_full_output_device_is_a_one_line_error(tmp_path, capsys):
  if not os.path.exists("/dev/full"):
    pytest.skip("no /dev/full on this system")
  src = tmp_path / "in.jsonl"
  src.write_text(json.dumps({"completion": "#### 5", "answer": "5"}) + "\n")
  with pytest.raises(SystemExit) as e:
    cli.main(["score", "--input", str(src), "--output", "/dev/full"])
  assert e.value.code == 2
  lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: --output '/dev/full': no space left on the device"), lines


def test_numbers_the_grader_cannot_hold_are_rows_scored_wrong_and_counted(tmp_path, capsys):
  # "1e400" raised OverflowError in the ratio bands and the file got no row at all; "1e999999999" was read as its
  # exponent's digits and scored correct against 999999999.
  rows = [
      {"completion": "<answer>1e400</answer>", "answer": "999"},
      {"completion": "<answer>1e999999999</answer>", "answer": "999999999"},
      {"completion": "<answer>18</answer>", "answer": "18"},
      {"completion": "The answer is 2e+77777", "answer": "#### 77777"},
  ]
  _write(tmp_path / "in.jsonl", rows)
  assert cli.main(["score", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]) == 0
  out = _read(tmp_path / "out.jsonl")
  assert [r["correct"] for r in out] == [False, False, True, False]
  assert [r["rule"] for r in out] == ["answer_tag", "unreadable", "answer_tag", "unreadable"]
  assert "4 rows: 1 correct (25.0%), 0 errors, 2 unreadable answers (scored wrong)" in capsys.readouterr().err


def test_a_row_the_grader_fails_on_is_an_error_row_and_the_file_goes_on(tmp_path, monkeypatch):
  real = cli.gsm8k.score_batch

  def fails_on_one(completions, golds, config=None):
    if "poison" in completions:
      raise RecursionError("maximum recursion depth exceeded")
    return real(completions, golds, config)

  monkeypatch.setattr(cli.gsm8k, "score_batch", fails_on_one)
  _write(
      tmp_path / "in.jsonl",
      [{"completion": "<answer>3</answer>", "answer": "3"}, {"completion": "poison", "answer": "1"}],
  )
  assert cli.main(["score", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]) == 0
  out = _read(tmp_path / "out.jsonl")
  assert out[0]["correct"] is True
  assert out[1]["error"] == "the grader could not score this row: RecursionError: maximum recursion depth exceeded"


def test_an_id_holding_nan_or_infinity_is_an_error_row_never_echoed(tmp_path):
  """Issue 61: Python's json reads `NaN` / `Infinity` ids and the output echoed them (not JSON: a strict reader refuses
  the file, and NaN joins no input row). Such a row is an error row naming its line, written without the id; output
  row N is still input line N, and finite ids (numbers, strings, lists) are echoed as they were."""
  good = '"completion": "<answer>7</answer>", "answer": "7"'
  lines = [
      f'{{"id": NaN, {good}}}',
      f'{{"id": Infinity, {good}}}',
      f'{{"id": [1, -Infinity], {good}}}',
      f'{{"id": {{"k": NaN}}, {good}}}',
      f'{{"id": 3, {good}}}',
      f'{{"id": "NaN", {good}}}',
      f'{{"id": [1, 2.5], {good}}}',
  ]
  (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
  assert cli.main(["score", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]) == 0
  text = (tmp_path / "out.jsonl").read_text(encoding="utf-8")

  def refuse(constant):
    raise AssertionError(f"{constant} in the output")

  out = [json.loads(line, parse_constant=refuse) for line in text.splitlines()]
  assert len(out) == len(lines)
  for i in range(4):
    assert "id" not in out[i] and out[i]["correct"] is False, out[i]
    assert (
        out[i]["error"]
        == f"line {i + 1}: 'id' holds NaN or Infinity, which are not JSON; give the id as a string or a finite number"
    )
  assert [r.get("id") for r in out[4:]] == [3, "NaN", [1, 2.5]] and all("error" not in r for r in out[4:])
