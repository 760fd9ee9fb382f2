"""User docs stay true: the config reference is regenerated and compared, tutorial commands marked `bash test`
run here (dry runs), and links/paths the docs name exist."""

# xpk is optional (a separate environment): the test that checks the docs against its parser imports it.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import subprocess
import sys

from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR
import pytest
import yaml

from maxtext_rl_plugin.config import doc as config_doc

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
TOKEN = "hf_docs_test_SECRET_991"
# A filled-in version of the tutorial's "Set up environment variables" block.
EXAMPLE_ENV = {
    "HF_MODEL": "llama3.1-8b-Instruct",
    "MODEL": "llama3.1-8b",
    "TOKENIZER": "meta-llama/Llama-3.1-8B-Instruct",
    "HF_TOKEN": TOKEN,
    "BASE_OUTPUT_DIRECTORY": "gs://my-bucket/rl",
    "WORKLOAD": "llama-31-8b-grpo",
    "MAXTEXT_CKPT_PATH": "gs://my-bucket/rl/converted/llama3.1-8b/0/items",
    "TPU_TYPE": "v5p-128",
    "TPU_CLUSTER": "my-tpu-cluster",
    "PROJECT_ID": "my-project",
    "CLOUD_IMAGE_NAME": "maxtext-rl",
}


def test_config_reference_is_current():
  committed = (DOCS / "config_reference.md").read_text(encoding="utf-8")
  assert config_doc.render() == committed, f"docs/config_reference.md is stale; regenerate: {config_doc.REGENERATE}"


def test_config_reference_lists_every_key_with_a_meaning():
  rows = config_doc.rows()
  keys = [r[0] for r in rows]
  assert len(keys) == len(set(keys))
  # Independent reference: the keys of the two yml files themselves.

  expected = set()
  for path in (REPO / "configs" / "rl.yml", pathlib.Path(MAXTEXT_CONFIGS_DIR) / "post_train" / "rl.yml"):
    for k, v in yaml.safe_load(path.read_text()).items():
      if k == "base_config":
        continue
      if k in ("rl", "lora") and isinstance(v, dict):
        expected |= {f"{k}.{inner}" for inner in v}
      else:
        expected.add(k)
  assert set(keys) == expected
  assert all(meaning for _, _, meaning, _ in rows), [k for k, _, m, _ in rows if not m]
  by_key = {k: (d, m) for k, d, m, _ in rows}
  assert by_key["rl.kl_estimator"][0] == '`"k3"`' and "k3" in by_key["rl.kl_estimator"][1]
  assert by_key["rollout_engine"][0] == '`"auto"`'


def tutorial_test_blocks() -> list[str]:
  text = (DOCS / "tutorial.md").read_text(encoding="utf-8")
  return re.findall(r"^```bash test\n(.*?)^```", text, flags=re.S | re.M)


def test_tutorial_has_the_sections_a_seed_tutorial_user_expects():
  text = (DOCS / "tutorial.md").read_text(encoding="utf-8")
  headings = re.findall(r"^##+ (.+)$", text, flags=re.M)
  for needle in (
      "Prerequisites",
      "Set up environment variables",
      "Get your model checkpoint",
      "Build and upload",
      "Submit a GRPO workload",
      "Submit a GSPO workload",
      "via Ray",
      "TensorBoard",
      "Retry and resume",
      "Troubleshooting",
  ):
    assert any(needle in h for h in headings), needle
  assert "maxtext.checkpoint_conversion.to_maxtext" in text and "loss_algo=gspo-token" in text
  assert len(tutorial_test_blocks()) >= 5


def _xpk_parser():
  try:
    from xpk.parser.core import set_parser
  except ImportError:
    return None
  parser = argparse.ArgumentParser(prog="xpk")
  set_parser(parser)
  return parser


@pytest.mark.parametrize("index", range(len(tutorial_test_blocks())))
def test_tutorial_command_runs(index, tmp_path):
  block = tutorial_test_blocks()[index]
  env = {
      **os.environ,
      **EXAMPLE_ENV,
      "JAX_PLATFORMS": "cpu",
      "HOME": str(tmp_path),
      "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
  }
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      ["bash", "-euo", "pipefail", "-c", block],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )
  assert proc.returncode == 0, f"block {index} failed:\n{block}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
  assert TOKEN not in proc.stdout + proc.stderr
  assert proc.stdout.strip()
  parser = _xpk_parser()
  for line in proc.stdout.splitlines():
    if line.startswith("xpk ") and parser is not None:
      ns = parser.parse_args(shlex.split(line)[1:])  # SystemExit(2) if xpk would reject the printed command
      assert ns.cluster == EXAMPLE_ENV["TPU_CLUSTER"]
      assert (getattr(ns, "workload", None) or EXAMPLE_ENV["WORKLOAD"]).startswith(EXAMPLE_ENV["WORKLOAD"])
  if "print_config=true" in block:
    assert f"run_name: {EXAMPLE_ENV['WORKLOAD']}" in proc.stdout and "loss_algo: grpo" in proc.stdout
  if "gspo-token" in block:
    assert "loss_algo=gspo-token" in proc.stdout and f"--workload {EXAMPLE_ENV['WORKLOAD']}-gspo" in proc.stdout


@pytest.mark.parametrize("doc", ["tutorial.md", "architecture.md", "tpu_checklist.md", "rewards.md"])
def test_relative_links_and_repo_paths_exist(doc):
  text = (DOCS / doc).read_text(encoding="utf-8")
  for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
    assert (DOCS / target).exists(), f"{doc} links to missing {target}"
  for path in set(re.findall(r"`((?:maxtext_rl_plugin|dependencies|configs|tests)/[\w./-]+?)`", text)):
    assert (REPO / path).exists() or (REPO / "maxtext_rl_plugin" / path).exists(), f"{doc} names missing {path}"
  for mod in set(re.findall(r"\(`(\w+\.py)`", text)):
    assert (REPO / "maxtext_rl_plugin" / mod).exists(), f"{doc} names missing module {mod}"
