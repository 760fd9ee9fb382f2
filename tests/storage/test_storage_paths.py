"""No module but the storage layer opens, creates, renames or removes a path a user gave (issue 59): every other file
call in the package is listed here with why it never sees a user's path, so a new `open()` on one fails this test
instead of failing a production run on gs://."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOTS = (REPO / "maxtext_rl_plugin", REPO / "rewards")
CALLS = re.compile(
    r"(?<![\w.])open\(|\bos\.(replace|makedirs|open|rename|remove|listdir|rmdir|mkdir)\(|"
    r"\bshutil\.(rmtree|move|copy\w*)\(|\bglob\.glob\("
)

# module (relative to the repo) -> (number of such calls, why none of them takes a user-given output or data path)
ALLOWED = {
    "maxtext_rl_plugin/storage.py": (None, "the storage layer itself"),
    "maxtext_rl_plugin/data/rows.py": (
        1,
        "the first pass's scan of a local JSONL file up to its first usable row (a file in a bucket is left to the "
        "loader, which reads it through storage)",
    ),
    "maxtext_rl_plugin/config/files.py": (
        3,
        "the yml chain and the shipped model files: pyconfig reads ymls with open(); the listing of a local tokenizer "
        "directory for its digest (tokenizers load from local directories or hub ids)",
    ),
    "maxtext_rl_plugin/aot/vllm_programs.py": (2, "config.json of a temporary model directory the compile makes"),
    "maxtext_rl_plugin/aot/low_precision.py": (
        5,
        "its local --out folder: each compile subprocess's log (a child's stdout needs a local file), its run record "
        "and the report compile_rl wrote there, read back for the table",
    ),
    "maxtext_rl_plugin/demo_tokenizer.py": (3, "regenerates the demo tokenizer shipped inside the package"),
    "maxtext_rl_plugin/bench/common.py": (2, "/proc/self/status and clear_refs: the process's own memory figures"),
    "maxtext_rl_plugin/bench/reshard.py": (1, "its own temporary directory"),
    "maxtext_rl_plugin/bench/gpu_common.py": (1, "a GPU harness part's JSON in the harness's local output folder"),
    "maxtext_rl_plugin/bench/gpu.py": (3, "the GPU harness's local output folder (the device tool copies it back)"),
    "maxtext_rl_plugin/bench/gpu_report.py": (2, "the GPU harness's local report"),
    "maxtext_rl_plugin/bench/packing.py": (1, "the GSM8K files shipped for the benchmark"),
    "maxtext_rl_plugin/bench/rewards.py": (1, "the GSM8K files shipped for the benchmark"),
    "rewards/cli.py": (
        3,
        "`rewards score` is a stream tool: stdin/stdout, FIFOs and local files (`gsutil cat gs://... | rewards score`)",
    ),
}


def _calls() -> dict[str, int]:
  """Forbidden calls per module (comments left out)."""
  found: dict[str, int] = {}
  for root in ROOTS:
    for path in sorted(root.rglob("*.py")):
      n = 0
      for line in path.read_text(encoding="utf-8").splitlines():
        code = line.split("#", 1)[0]
        n += len(CALLS.findall(code))
      if n:
        found[str(path.relative_to(REPO))] = n
  return found


def test_no_file_call_on_a_user_path_outside_the_storage_layer():
  found = _calls()
  unexpected = {m: n for m, n in found.items() if m not in ALLOWED}
  assert (
      not unexpected
  ), f"file calls outside maxtext_rl_plugin/storage.py (use storage, or allow here with why): {unexpected}"
  changed = {m: (n, ALLOWED[m][0]) for m, n in found.items() if ALLOWED[m][0] not in (None, n)}
  assert not changed, f"the allowed modules' call counts changed (found, allowed): {changed}"


def test_the_pattern_finds_what_it_forbids():
  """The check can fail: each forbidden form is caught, and a method named like one is not."""
  for line in ('with open(p, "w") as f:', "os.replace(a, b)", "os.makedirs(d)", "shutil.rmtree(d)", "glob.glob(p)"):
    assert CALLS.findall(line), line
  for line in ("storage.open_write_bytes(p)", "fs.open(p)", "mgr.close()"):
    assert not CALLS.findall(line), line
