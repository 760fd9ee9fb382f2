"""Data pipeline: GSM8K files/hub, malformed rows, prompt templates and length filtering, synthetic
problems (checked by re-doing their arithmetic), deterministic resumable batches."""

import functools
import gzip
import json
import logging
import os
import re

import datasets
import maxtext
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer
import yaml

from maxtext_rl_plugin import rewards
from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.data import load
from maxtext_rl_plugin.data import prompts
from maxtext_rl_plugin.data import rows as rows_lib
from maxtext_rl_plugin.data import splits
from maxtext_rl_plugin.data import synthetic
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.errors import DataError


@pytest.fixture(name="tokenizer", scope="module")
def tokenizer_fixture():
  path = os.path.join(os.path.dirname(maxtext.__file__), "assets", "tokenizers", "qwen3-tokenizer")
  return AutoTokenizer.from_pretrained(path)


class _Overlay:
  """A loaded config with some keys replaced: one pydantic validation per module instead of per test."""

  def __init__(self, base, overrides):
    self._base, self._over = base, overrides

  def __getattr__(self, k):
    return self._over[k] if k in self._over else getattr(self._base, k)


@functools.lru_cache(maxsize=1)
def _base_config():
  return load_config(["configs/cpu_tiny.yml"])


def cfg(*overrides):
  """cpu_tiny.yml with `key=value` overrides (values parsed as YAML, like OmegaConf does)."""
  over = {}
  for a in overrides:
    k, v = a.split("=", 1)
    assert hasattr(_base_config(), k), f"unknown key {k}"
    over[k] = "" if v == "''" else yaml.safe_load(v) if v else ""
    if isinstance(over[k], (int, float)) and k.endswith(("_path", "_name", "_token")):
      over[k] = v
  return _Overlay(_base_config(), over)


def real_cfg(*overrides):
  return load_config(["configs/cpu_tiny.yml", *overrides])


def _ref_gold(answer_text: str) -> str:
  return str(int(answer_text.split("####")[-1].strip().replace(",", "")))


def _jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


# ----------------------------------------------------------------------------------------------------
# GSM8K files
# ----------------------------------------------------------------------------------------------------


def test_gsm8k_jsonl_splits(gsm8k_fixture_dir):
  d = gsm8k_fixture_dir
  c = cfg(f"train_data_path={d / 'train.jsonl'}", f"eval_data_path={d / 'test.jsonl'}", "use_chat_template=false")
  train, ev = load.load_splits(load.DataSettings.from_config(c), None)
  with open(d / "test.jsonl", encoding="utf-8") as f:
    test_rows = [json.loads(line) for line in f]
  assert len(ev) == len(test_rows) == 100
  assert len(train) == 300 and not train.unlimited
  # Eval keeps file order; golds match an independent parse; prompts are MaxText's template file.
  with open(
      os.path.join(
          os.path.dirname(os.path.dirname(os.path.abspath(__import__("maxtext").__file__))),
          "maxtext/examples/chat_templates/gsm8k_rl.json",
      ),
      encoding="utf-8",
  ) as f:
    tpl = json.load(f)
  for i in (0, 50, 99):
    e, r = ev[i], test_rows[i]
    assert (e.question, e.answer, e.solution, e.id) == (
        r["question"],
        _ref_gold(r["answer"]),
        r["answer"],
        f"test.jsonl:{i + 1}",
    )
    sp = tpl["SYSTEM_PROMPT"].format(
        reasoning_start_token="<reasoning>",
        reasoning_end_token="</reasoning>",
        solution_start_token="<answer>",
        solution_end_token="</answer>",
    )
    assert e.prompt == tpl["TEMPLATE"].format(system_prompt=sp, question=r["question"])
  # The SFT target of every eval example is well formed and scores correct.
  targets = [prompts.format_target(e, prompts.PromptSettings.from_config(c)) for e in ev]
  res = rewards.score_batch(targets, [e.answer for e in ev], rewards.RewardConfig.of(c))
  assert all(r.correct and r.format_ok and r.rule == "answer_tag" for r in res)
  assert not any("####" in t or "<<" in t for t in targets)


def test_train_batches_deterministic_resumable_and_epoch_exact(gsm8k_fixture_dir):
  c = cfg(
      f"train_data_path={gsm8k_fixture_dir / 'train.jsonl'}",
      "eval_dataset_name=synthetic",
      "use_chat_template=false",
      "synthetic_num_eval=4",
      "data_shuffle_seed=7",
  )
  train, _ = load.load_splits(load.DataSettings.from_config(c), None)
  n, bs = len(train), 16
  per_epoch = n // bs
  full = [[e.id for e in b] for b in train.batches(bs, num_batches=2 * per_epoch + 3)]
  resumed = [[e.id for e in b] for b in train.batches(bs, start_batch=10, num_batches=2 * per_epoch + 3)]
  assert resumed == full[10:]
  assert [e.id for e in train.batch(per_epoch + 1, bs)] == full[per_epoch + 1]
  first_epoch = [i for b in full[:per_epoch] for i in b]
  assert len(set(first_epoch)) == len(first_epoch)  # no repeats within an epoch
  positions = [i for b in full for i in b]
  assert sorted(positions[:n]) == sorted(e.id for e in train)  # epoch 0 is a permutation of the split
  assert positions[:n] != [e.id for e in train]  # ... and shuffled
  assert len(positions) > n + 100
  assert positions[n:] != positions[: len(positions) - n]  # a new order each epoch
  other = load.load_splits(
      load.DataSettings.from_config(
          cfg(
              f"train_data_path={gsm8k_fixture_dir / 'train.jsonl'}",
              "eval_dataset_name=synthetic",
              "use_chat_template=false",
              "synthetic_num_eval=4",
              "data_shuffle_seed=8",
          )
      ),
      None,
  )[0]
  assert [e.id for e in other.batch(0, bs)] != full[0]


def test_malformed_rows_are_skipped_and_counted(tmp_path, caplog):
  rows = [
      {"question": "Q1?", "answer": "1 + 1 = 2\n#### 2"},
      "{not json",
      {"answer": "#### 3"},
      {"question": "  ", "answer": "#### 3"},
      {"question": "Q5?", "answer": "no final answer line"},
      {"question": "Q6?", "answer": "#### $1,234.50"},
      {"problem": "Q7?", "solution": "#### -4"},
      {"question": "Q8?", "answer": 12},
      [1, 2],
  ]
  path = _jsonl(tmp_path / "mixed.jsonl", rows)
  caplog.set_level(logging.WARNING)
  train, ev = load.load_splits(
      load.DataSettings.from_config(cfg(f"train_data_path={path}", f"eval_data_path={path}", "use_chat_template=false")),
      None,
  )
  assert [(e.question, e.answer) for e in ev] == [("Q1?", "2"), ("Q6?", "1234.5"), ("Q7?", "-4"), ("Q8?", "12")]
  assert [e.question for e in train] == [e.question for e in ev]  # same file for both: kept, with a warning
  msg = " ".join(r.getMessage() for r in caplog.records)
  assert (
      "mixed.jsonl: skipped 5 of 9 rows (invalid JSON: 1, JSON but not an object: 1, not UTF-8: 0, no question: 2, "
      "no parsable gold "
      "answer ('#### N'): 1); "
      "first at line 2"
  ) in msg


def test_jsonl_rows_split_on_newlines_only_numbered_by_file_line(tmp_path, caplog):
  """A raw U+2028/U+0085/U+2029 inside a row keeps the row whole; a BOM is accepted; ids and messages name file lines
  (blank lines included); a line that is not UTF-8 is skipped and counted, never trained on as U+FFFD."""
  odd = {"question": "Q3\u2028a\u0085b\u2029c?", "answer": "#### 3"}
  lines = [
      b"\xef\xbb\xbf" + json.dumps({"question": "Q1?", "answer": "#### 1"}).encode(),
      b"",
      json.dumps(odd, ensure_ascii=False).encode(),
      b'{"question": "Q\xe9?", "answer": "#### 4"}',  # Latin-1, not UTF-8
      b"",
      json.dumps({"question": "Q6?", "answer": "#### 6"}).encode() + b"\r",
  ]
  (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  caplog.set_level(logging.WARNING)
  rows = rows_lib.load_file_rows(str(tmp_path / "d.jsonl"), "eval_data_path")
  assert [(q, g, i) for q, g, _, i in rows] == [
      ("Q1?", "1", "d.jsonl:1"),
      (odd["question"], "3", "d.jsonl:3"),
      ("Q6?", "6", "d.jsonl:6"),
  ]
  assert (
      "d.jsonl: skipped 1 of 4 rows (invalid JSON: 0, JSON but not an object: 0, not UTF-8: 1, no question: 0, "
      "no parsable gold answer "
      "('#### N'): 0); "
      "first at line 4"
  ) in caplog.text


def test_json_array_with_bom_and_non_utf8_json_refused(tmp_path):
  (tmp_path / "a.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([{"question": "Q?", "answer": "#### 2"}]).encode())
  assert [r[:2] for r in rows_lib.load_file_rows(str(tmp_path / "a.json"), "train_data_path")] == [("Q?", "2")]
  (tmp_path / "b.json").write_bytes(b'[{"question": "Q\xe9?", "answer": "#### 2"}]')
  with pytest.raises(DataError, match=r"train_data_path='.*b.json': not UTF-8 \(byte 17\)"):
    rows_lib.load_file_rows(str(tmp_path / "b.json"), "train_data_path")


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("#### 1e5", "100000"),
        ("#### 2.5e3", "2500"),
        ("#### 1 1/2", "1.5"),
        ("#### 1/0", None),
        ("#### 1 234", "1234"),
        ("#### \u20135", "-5"),
        (1e20, "100000000000000000000"),
        (float("nan"), None),
        ("Infinity", None),
        ("NaN", None),
        ("#### 5 apples and 3 pears", None),
    ],
)
def test_gold_answers_are_read_whole_or_the_row_is_skipped(tmp_path, answer, gold):
  """Never train against a truncated gold ("#### 1e5" is not "1"); an unreadable one skips the row."""
  path = _jsonl(tmp_path / "g.jsonl", [{"question": "Q?", "answer": answer}, {"question": "R?", "answer": "#### 7"}])
  rows = rows_lib.load_file_rows(path, "train_data_path")
  assert [r[1] for r in rows] == ([gold] if gold is not None else []) + ["7"]


def test_batch_larger_than_the_split_is_reported_once(tmp_path, caplog):
  path = _jsonl(tmp_path / "s.jsonl", [{"question": f"Q{i}?", "answer": f"#### {i}"} for i in range(5)])
  train, _ = load.load_splits(
      load.DataSettings.from_config(
          cfg(f"train_data_path={path}", "eval_dataset_name=synthetic", "synthetic_num_eval=4", "use_chat_template=false")
      ),
      None,
  )
  caplog.set_level(logging.WARNING)
  batches = [train.batch(k, 8) for k in range(3)]
  assert all(len(b) == 8 and len({e.id for e in b}) == 5 for b in batches)  # the repeats the warning is about
  assert caplog.text.count("split 'train' has 5 examples, fewer than batch_size=8: every batch repeats prompts") == 1
  train.batch(0, 4)
  assert caplog.text.count("fewer than batch_size") == 1


def test_train_questions_in_eval_are_dropped(tmp_path):
  a = _jsonl(tmp_path / "a.jsonl", [{"question": f"Q{i}", "answer": f"#### {i}"} for i in range(10)])
  b = _jsonl(tmp_path / "b.jsonl", [{"question": f"Q{i}", "answer": f"#### {i}"} for i in range(8, 12)])
  train, ev = load.load_splits(
      load.DataSettings.from_config(cfg(f"train_data_path={a}", f"eval_data_path={b}", "use_chat_template=false")), None
  )
  assert sorted(e.question for e in train) == [f"Q{i}" for i in range(8)]
  assert len(ev) == 4


def test_parquet_and_globs_equal_jsonl(tmp_path):
  rows = [{"question": f"Q{i}?", "answer": f"s\n#### {i * 1000:,}"} for i in range(6)]
  pq.write_table(pa.Table.from_pylist(rows[:3]), tmp_path / "p1.parquet")
  pq.write_table(pa.Table.from_pylist(rows[3:]), tmp_path / "p2.parquet")
  j = _jsonl(tmp_path / "all.jsonl", rows)
  _, ev_pq = load.load_splits(
      load.DataSettings.from_config(
          cfg(f"train_data_path={j}", f"eval_data_path={tmp_path}/p*.parquet", "use_chat_template=false")
      ),
      None,
  )
  assert [(e.question, e.answer) for e in ev_pq] == [(r["question"], str(i * 1000)) for i, r in enumerate(rows)]


@pytest.mark.parametrize(
    "override, err, fragment",
    [
        ("train_data_path=/nonexistent/x.jsonl", DataError, "train_data_path='/nonexistent/x.jsonl': file not found"),
        ("eval_data_path=/nonexistent/*.jsonl", DataError, "no files match"),
        ("data_template_path=/nonexistent/t.json", ConfigError, "data_template_path"),
    ],
)
def test_user_errors_are_one_line(override, err, fragment):
  with pytest.raises(err) as e:
    load.load_splits(load.DataSettings.from_config(cfg(*override.split(), "use_chat_template=false")), None)
  assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_directory_or_fifo_given_as_a_data_file_is_named_as_such(tmp_path):
  fifo = tmp_path / "pipe.jsonl"
  os.mkfifo(fifo)
  for path, fragment in ((tmp_path, "is a directory, not a data file"), (fifo, "is a FIFO (named pipe)")):
    with pytest.raises(DataError) as e:
      load.load_splits(load.DataSettings.from_config(cfg(f"train_data_path={path}", "use_chat_template=false")), None)
    assert f"train_data_path='{path}': {fragment}" in str(e.value), str(e.value)


def test_rows_that_are_json_but_not_objects_are_counted_as_such(tmp_path, caplog):
  f = tmp_path / "mixed.jsonl"
  good = {"question": "q?", "answer": "#### 4"}
  f.write_text("\n".join([json.dumps(good), "[1, 2]", "7", "{not json", json.dumps(good)]) + "\n")
  with caplog.at_level(logging.WARNING):
    rows = rows_lib.load_file_rows(str(f), "train_data_path")
  assert len(rows) == 2
  assert "invalid JSON: 1, JSON but not an object: 2," in caplog.text, caplog.text


def test_no_usable_rows_is_an_error(tmp_path):
  bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "none"}] * 3)
  with pytest.raises(DataError, match=r"bad.jsonl': no usable rows of 3"):
    load.load_splits(load.DataSettings.from_config(cfg(f"eval_data_path={bad}", "use_chat_template=false")), None)


# ----------------------------------------------------------------------------------------------------
# HF hub (datasets.load_dataset monkeypatched: no network here)
# ----------------------------------------------------------------------------------------------------


def test_hub_loading_calls_load_dataset(monkeypatch):
  calls = []

  def fake_load_dataset(name, subset=None, **kwargs):
    calls.append((name, subset, kwargs))
    n = 5 if kwargs["split"] == "train" else 3
    return datasets.Dataset.from_list(
        [{"question": f"{kwargs['split']} q{i}", "answer": f"work\n#### {i + 10}"} for i in range(n)]
    )

  monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
  train, ev = load.load_splits(
      load.DataSettings.from_config(
          real_cfg("dataset_name=openai/gsm8k", "eval_dataset_name=openai/gsm8k", "use_chat_template=false")
      ),
      None,
  )
  assert calls == [("openai/gsm8k", "main", {"split": "test"}), ("openai/gsm8k", "main", {"split": "train"})]
  assert len(train) == 5 and [e.answer for e in ev] == ["10", "11", "12"]
  assert ev[0].id == "openai/gsm8k/test:1"


def test_hub_failure_is_a_data_error(monkeypatch):
  def offline(*a, **k):
    raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

  monkeypatch.setattr(datasets, "load_dataset", offline)
  with pytest.raises(DataError, match=r"dataset_name='openai/gsm8k'.*ConnectionError.*train_data_path"):
    load.load_splits(
        load.DataSettings.from_config(cfg("dataset_name=openai/gsm8k", "eval_dataset_name=openai/gsm8k")), None
    )


# ----------------------------------------------------------------------------------------------------
# Prompts: chat template, tokens, length filter
# ----------------------------------------------------------------------------------------------------


def test_chat_template_prompt_with_configured_tokens(tokenizer):
  c = cfg(
      "reasoning_start_token=<think>",
      "reasoning_end_token=</think>",
      "solution_start_token=<ans>",
      "solution_end_token=</ans>",
  )
  p = prompts.build_prompt("What is 2+2?", tokenizer, prompts.PromptSettings.from_config(c))
  assert p.startswith("<|im_start|>system\n") and p.endswith("<|im_start|>assistant\n")
  system = p.split("<|im_end|>")[0]
  assert all(t in system for t in ("<think>", "</think>", "<ans>", "</ans>")) and "<reasoning>" not in system
  assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in p
  ex = splits.Example("q", "4", "2+2=4\n#### 4", p, "x")
  assert prompts.format_target(ex, prompts.PromptSettings.from_config(c)) == "<think>2+2=4</think>\n<ans>4</ans>"
  prefilled = cfg("reasoning_start_token_in_prompt=true")
  assert prompts.build_prompt("q", tokenizer, prompts.PromptSettings.from_config(prefilled)).endswith(
      "assistant\n<reasoning>"
  )
  assert prompts.format_target(ex, prompts.PromptSettings.from_config(prefilled)).startswith("2+2=4</reasoning>")


def test_template_without_system_role_falls_back_to_user_turn():
  class NoSystemTokenizer:
    chat_template = "x"

    def apply_chat_template(self, msgs, add_generation_prompt, tokenize):
      assert add_generation_prompt and not tokenize
      if any(m["role"] == "system" for m in msgs):
        raise ValueError("System role not supported")
      return "".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<model>"

  p = prompts.build_prompt("Q?", NoSystemTokenizer(), prompts.PromptSettings.from_config(cfg()))
  assert p.startswith("<user>") and p.endswith("\n\nQ?<model>") and "<answer>" in p


def test_long_prompts_filtered_with_count(gsm8k_fixture_dir, tokenizer, tmp_path, caplog):
  with open(gsm8k_fixture_dir / "train.jsonl", encoding="utf-8") as f:
    rows = [json.loads(line) for _, line in zip(range(200), f)]
  path = _jsonl(tmp_path / "t.jsonl", rows)
  c = cfg("dataset_name=synthetic", f"eval_data_path={path}", "max_prefill_predict_length=150")
  lengths = [
      len(tokenizer(prompts.build_prompt(r["question"], tokenizer, prompts.PromptSettings.from_config(c)))["input_ids"])
      for r in rows
  ]
  want = [r["question"] for r, n in zip(rows, lengths) if n <= 150]
  assert 0 < len(want) < len(rows)  # the limit really bites
  caplog.set_level(logging.WARNING)
  _, ev = load.load_splits(load.DataSettings.from_config(c), tokenizer)
  assert [e.question for e in ev] == want
  assert (
      f"eval: filtered {len(rows) - len(want)} of 200 prompts longer than max_prefill_predict_length=150" in caplog.text
  )


# ----------------------------------------------------------------------------------------------------
# Synthetic
# ----------------------------------------------------------------------------------------------------

_STEP = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+)$")


def _check_solution(e: splits.Example, max_value: int, min_steps: int, max_steps: int):
  """A synthetic solution is well formed: step count in range, every step's arithmetic right, values bounded."""
  lines = e.solution.splitlines()
  assert lines[-1] == f"#### {e.answer}"
  steps = lines[:-1]
  assert min_steps <= len(steps) <= max_steps, e
  prev = None
  for ln in steps:
    a, op, b, r = _STEP.match(ln).groups()
    a, b, r = int(a), int(b), int(r)
    assert {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else None}[op] == r, ln
    assert 0 <= r <= 5 * max_value
    if prev is not None:
      assert a == prev  # each step continues from the previous result
    else:
      assert a <= max_value
    assert op == "*" and b <= max(5, max_value) or b <= max_value
    prev = r
  assert str(prev) == e.answer
  for n in map(int, re.findall(r"\d+", e.question)):
    assert n <= max_value


def test_synthetic_problems_are_exact_and_reproducible(tokenizer):
  c = cfg(
      "synthetic_seed=5",
      "synthetic_min_steps=1",
      "synthetic_max_steps=3",
      "synthetic_max_value=12",
      "synthetic_num_eval=64",
      "data_template_path=''",
  )
  train, ev = load.load_splits(load.DataSettings.from_config(c), tokenizer)
  assert train.unlimited and len(ev) == 64
  items = [train[i] for i in range(300)]
  for e in items + list(ev):
    _check_solution(e, 12, 1, 3)
  assert {len(e.solution.splitlines()) - 1 for e in items} == {1, 2, 3}
  eval_q = {e.question for e in ev}
  assert len(eval_q) == 64 and not eval_q & {e.question for e in items}  # deduped, disjoint
  train2, ev2 = load.load_splits(load.DataSettings.from_config(c), tokenizer)
  assert [train2[i] for i in range(50)] == items[:50] and list(ev2) == list(ev)
  other, _ = load.load_splits(
      load.DataSettings.from_config(cfg("synthetic_seed=6", "synthetic_max_value=12", "data_template_path=''")), tokenizer
  )
  assert [other[i].question for i in range(20)] != [e.question for e in items[:20]]
  # Short prompts for the CPU demo's tiny model, and SFT targets that the reward stack accepts.
  lengths = prompts.prompt_lengths(tokenizer, [e.prompt for e in items])
  assert max(lengths) <= 100
  res = rewards.score_batch(
      [prompts.format_target(e, prompts.PromptSettings.from_config(c)) for e in items],
      [e.answer for e in items],
      rewards.RewardConfig.of(c),
  )
  assert all(r.correct and r.format_ok for r in res)
  assert [e.id for e in train.batch(3, 4)] == [f"synthetic-train-{i}" for i in range(12, 16)]
  assert [[e.id for e in b] for b in train.batches(4, start_batch=2, num_batches=4)] == [
      [f"synthetic-train-{i}" for i in range(k * 4, k * 4 + 4)] for k in (2, 3)
  ]


def test_synthetic_eval_batches_are_finite(tokenizer):
  _, ev = load.load_splits(load.DataSettings.from_config(cfg("synthetic_num_eval=10")), tokenizer)
  got = list(ev.batches(4))
  assert [len(b) for b in got] == [4, 4, 2]
  assert [e.id for b in got for e in b] == [e.id for e in ev]
  with pytest.raises(IndexError):
    ev.batch(3, 4)


def test_adding_teacher_reads_every_step_as_an_addition():
  assert synthetic.adding_teacher("7 * 3 = 21\n#### 21") == ("7 + 3 = 10\n#### 10", 10)
  assert synthetic.adding_teacher("12 / 4 = 3\n3 * 2 = 6\n6 - 1 = 5\n#### 5") == (
      "12 + 4 = 16\n16 + 2 = 18\n18 + 1 = 19\n#### 19",
      19,
  )
  assert synthetic.adding_teacher("2 + 3 = 5\n#### 5") == ("2 + 3 = 5\n#### 5", 5)
  with pytest.raises(ValueError):
    synthetic.adding_teacher("no steps here")


def test_flawed_teacher_changes_sft_demonstrations_only(tokenizer):
  """synthetic_teacher_error_rate: that fraction of non-addition training solutions are the adding teacher's;
  questions, gold answers and the eval split are the clean generator's."""
  knobs = (
      "synthetic_seed=5",
      "synthetic_max_steps=2",
      "synthetic_max_value=10",
      "synthetic_num_eval=32",
      "data_template_path=''",
  )
  clean_train, clean_eval = load.load_splits(load.DataSettings.from_config(cfg(*knobs)), tokenizer)
  train, ev = load.load_splits(load.DataSettings.from_config(cfg(*knobs, "synthetic_teacher_error_rate=0.75")), tokenizer)
  assert list(ev) == list(clean_eval)
  flawed = non_add = 0
  for i in range(400):
    e, c = train[i], clean_train[i]
    assert (e.question, e.answer, e.prompt) == (c.question, c.answer, c.prompt)
    _check_solution(c, 10, 1, 2)
    if all(" + " in ln for ln in c.solution.splitlines()[:-1]):
      assert e.solution == c.solution  # the adding teacher gets all-addition problems right
      continue
    non_add += 1
    if e.solution != c.solution:
      flawed += 1
      sol, value = synthetic.adding_teacher(c.solution)
      assert e.solution == sol
      demo = rewards.score(prompts.format_target(e, prompts.PromptSettings.from_config(cfg(*knobs))), e.answer)
      assert demo.extracted == str(value) and demo.correct == (str(value) == e.answer)  # 2 * 2 = 2 + 2
  assert non_add > 200 and abs(flawed / non_add - 0.75) < 0.08
  assert str(load_config_error("synthetic_teacher_error_rate=1.5")).count("\n") == 0


def load_config_error(override):
  with pytest.raises(ConfigError) as e:
    load_config(["configs/cpu_tiny.yml", override])
  assert "synthetic_teacher_error_rate" in str(e.value)
  return e.value


def test_prompt_tags_default_to_the_reward_stacks_which_are_maxtext_rl_yml():
  """One place for tag defaults: a config without tag keys prompts for exactly the tags the rewards grade."""
  with open(os.path.join(os.path.dirname(maxtext.__file__), "configs", "post_train", "rl.yml"), encoding="utf-8") as f:
    rl_yml = yaml.safe_load(f)
  keys = ("reasoning_start_token", "reasoning_end_token", "solution_start_token", "solution_end_token")
  bare = type("Bare", (), {"data_template_path": ""})()
  assert prompts.tag_tokens(prompts.PromptSettings.from_config(bare)) == {k: rl_yml[k] for k in keys}
  assert all(rl_yml[k] in prompts.system_prompt(prompts.PromptSettings.from_config(bare)) for k in keys)


@pytest.mark.parametrize(
    "content, fragment",
    [
        # mtime=0: the gzip header's timestamp would differ between pytest-xdist workers' collections (and fail them)
        (gzip.compress(b'{"question": "q?", "answer": "#### 4"}\n', mtime=0), "is gzip-compressed; decompress it"),
        ('{"question": "q?", "answer": "#### 4"}\n'.encode("utf-16"), "is UTF-16 (a byte order mark FF FE)"),
        (b"", "no usable rows of 0 (the file is empty;"),
        (b"\xef\xbb\xbf", "no usable rows of 0 (the file is empty;"),
        (
            b'{"question": "q?", "answer": null}\n',
            "no usable rows of 1 (1 with no parsable gold answer; first at line 1;",
        ),
        (b'\n{"prompt_text": "q?", "completion": "4"}\n', "(1 with no question string; first at line 2;"),
        (b'{"question": {"text": "q?"}, "answer": "#### 4"}\n', "(1 with no question string; first at line 1;"),
        (b'[1]\n"x"\n\xff\n', "(2 JSON but not an object, 1 not UTF-8; first at line 1;"),
    ],
    ids=["gzip", "utf16", "empty", "bom-only", "no-gold", "no-question", "question-not-string", "not-objects"],
)
def test_a_file_with_no_usable_row_says_why(tmp_path, content, fragment):
  # Each file is readable but holds nothing to train on: the one line names what it is or why every row was lost.
  f = tmp_path / "d.jsonl"
  f.write_bytes(content)
  with pytest.raises(DataError) as e:
    rows_lib.load_file_rows(str(f), "train_data_path")
  assert f"train_data_path='{f}': " in str(e.value) and fragment in str(e.value), str(e.value)
