"""The install users run: a wheel (and an sdist) built from the checkout, installed non-editable, used from elsewhere.

Every other test imports the plugin from the checkout (the editable install of `.venv`), where `configs/` and
`rewards/` resolve through the editable finder; a wheel holds only what setup.py/setup.cfg list. This module builds
the sdist and the wheel from a copy of the checkout's files (what a fresh clone holds, local edits included), a second
wheel from the unpacked sdist, and installs the first into a virtual environment of its own. Its dependencies are
`.venv`'s site-packages, named by a `.pth` file: a folder added that way has its own `.pth` files ignored, so `.venv`'s
editable finder for the checkout is not loaded (checked below). Every command then runs from a directory outside the
checkout, with no PYTHONPATH, as after `pip install maxtext-rl-plugin`.
"""

from __future__ import annotations

import configparser
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable
TIMEOUT = 600


def _run(cmd, *, cwd, env=None, check=True, timeout=TIMEOUT) -> subprocess.CompletedProcess:
  p = subprocess.run(
      [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
  )
  if check and p.returncode != 0:
    raise AssertionError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
  return p


def package_dir() -> dict[str, str]:
  """setup.cfg's package_dir: installed package name -> source folder."""
  cfg = configparser.ConfigParser()
  cfg.read(REPO / "setup.cfg", encoding="utf-8")
  pairs = (line.split("=", 1) for line in cfg["options"]["package_dir"].splitlines() if "=" in line)
  return {name.strip(): folder.strip() for name, folder in pairs}


def checkout_files() -> list[str]:
  """The files a clone of this checkout holds, local changes included: git's tracked and untracked-not-ignored files
  that exist (a fresh clone in CI has exactly the tracked ones)."""
  p = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO)
  return sorted(f for f in p.stdout.split("\0") if f and (REPO / f).is_file())


def expected_package_files() -> set[str]:
  """Every file under the mapped source folders, at its installed path (`configs/rl.yml` ->
  `maxtext_rl_plugin/configs/rl.yml`): the sources and the data the package reads at run time."""
  out = set()
  mapping = package_dir()
  for f in checkout_files():
    for name, folder in sorted(mapping.items(), key=lambda kv: -len(kv[1])):
      if f.startswith(folder + "/"):
        out.add(name.replace(".", "/") + f[len(folder) :])
        break
  return out


def expected_modules() -> set[str]:
  return {
      f[: -len(".py")].replace("/", ".").removesuffix(".__init__") for f in expected_package_files() if f.endswith(".py")
  }


class Installed:
  """The built artifacts and the environment the wheel is installed in."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self.venv = root / "venv"
    self.python = self.venv / "bin" / "python"
    self.work = root / "work"  # cwd of every command: outside the checkout
    self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "PYTHONSAFEPATH")}
    self.env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONNOUSERSITE="1")
    self.env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{self.env.get('PATH', '')}"

  def run(self, *args, check=True, timeout=TIMEOUT):
    return _run([self.python, *args], cwd=self.work, env=self.env, check=check, timeout=timeout)

  @property
  def site_packages(self) -> pathlib.Path:
    return self.venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _build_wheel(src: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  # --no-build-isolation: the build runs on .venv's pinned setuptools (test extra), so no package index is needed.
  _run([PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, src], cwd=out.parent)
  (wheel,) = out.glob("maxtext_rl_plugin-*.whl")
  return wheel


@pytest.fixture(name="installed", scope="module")
def installed_fixture(tmp_path_factory) -> Installed:
  """The sdist and both wheels built, the wheel from the tree installed into its own venv."""
  inst = Installed(tmp_path_factory.mktemp("install"))
  root = inst.root
  src = root / "src"
  for f in checkout_files():
    (src / f).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / f, src / f)
  dist = root / "dist"
  dist.mkdir()
  # The sdist through setuptools' PEP 517 hook (what `python -m build --sdist` calls), then a wheel from the unpacked
  # sdist (what pip does with an sdist from the index), and one from the tree (`pip install .`, the image's way).
  sdist = _run(
      [PY, "-c", "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))", dist], cwd=src
  )
  sdist = dist / sdist.stdout.strip().splitlines()[-1]
  with tarfile.open(sdist) as tar:
    tar.extractall(root / "sdist", filter="data")
  (unpacked,) = (root / "sdist").iterdir()
  inst.wheel_from_sdist = _build_wheel(unpacked, root / "wheel_from_sdist")
  inst.wheel = _build_wheel(src, root / "wheel")
  # Its own environment: a fresh venv, the wheel alone installed into it, the dependencies from .venv via a .pth.
  _run([PY, "-m", "venv", "--without-pip", inst.venv], cwd=root)
  (inst.site_packages / "_maxtext_rl_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  _run([PY, "-m", "pip", "--python", inst.python, "install", "-q", "--no-deps", "--no-index", inst.wheel], cwd=root)
  inst.work.mkdir()
  return inst


def _wheel_files(wheel: pathlib.Path) -> set[str]:
  with zipfile.ZipFile(wheel) as z:
    return {n for n in z.namelist() if ".dist-info/" not in n}


def test_the_wheel_holds_every_source_and_data_file_and_the_sdist_builds_the_same(installed):
  """The wheel's package files are exactly the source tree's (every subpackage, every shipped yml/json/tokenizer);
  the wheel built from the sdist is the same, so the sdist lacks nothing either."""
  files = _wheel_files(installed.wheel)
  want = expected_package_files()
  assert {"maxtext_rl_plugin/configs/cpu_tiny.yml", "maxtext_rl_plugin/rewards/gsm8k.py"} <= want
  assert want - files == set(), "in the source tree, missing from the wheel"
  assert files - want == set(), "in the wheel, not in the source tree"
  assert _wheel_files(installed.wheel_from_sdist) == files


def test_every_module_imports_from_the_installed_wheel_outside_the_checkout(installed):
  code = """
import importlib, json, pkgutil, sys
import maxtext_rl_plugin
mods = {"maxtext_rl_plugin": maxtext_rl_plugin.__file__}
for m in pkgutil.walk_packages(maxtext_rl_plugin.__path__, "maxtext_rl_plugin."):
  mods[m.name] = importlib.import_module(m.name).__file__
finders = [type(f).__module__ + "." + type(f).__name__ for f in sys.meta_path]
from maxtext_rl_plugin import configs
print(json.dumps({"modules": mods, "finders": finders, "cpu_tiny": configs.cpu_tiny_yml}))
"""
  p = installed.run("-c", code)
  out = json.loads(p.stdout.strip().splitlines()[-1])
  site = str(installed.site_packages)
  # The checkout's editable finder (.venv's __editable__ .pth) was not loaded: nothing resolves into the checkout.
  assert not [f for f in out["finders"] if "editable" in f.lower()], out["finders"]
  assert set(out["modules"]) == expected_modules()
  assert all(f.startswith(site + os.sep) for f in out["modules"].values()), out["modules"]
  assert out["cpu_tiny"] == os.path.join(site, "maxtext_rl_plugin", "configs", "cpu_tiny.yml")


def test_train_rl_prints_the_config_and_trains_one_step_from_the_installed_configs(installed):
  tiny = str(installed.site_packages / "maxtext_rl_plugin" / "configs" / "cpu_tiny.yml")
  runs = installed.work / "runs"
  p = installed.run("-m", "maxtext_rl_plugin.train_rl", tiny, "print_config=true", f"base_output_directory={runs}")
  assert "model_name: qwen3-0.6b" in p.stdout and "checkpoint_storage_use_ocdbt: false" in p.stdout, p.stdout[-2000:]
  p = installed.run(
      "-m",
      "maxtext_rl_plugin.train_rl",
      tiny,
      f"base_output_directory={runs}",
      "run_name=one",
      "num_batches=1",
      "checkpoint_period=1",
      "eval_before_training=false",
      "eval_after_training=false",
  )
  assert "step 1/1" in p.stdout, p.stdout[-3000:]
  step = runs / "one" / "checkpoints" / "1"
  assert (step / "params" / "_METADATA").is_file() and (step / "meta").is_dir()
  # MaxText's RL default storage (checkpoint_storage_use_ocdbt: false) in a real run: plain arrays, no OCDBT.
  assert not (step / "params" / "manifest.ocdbt").exists()


def test_the_other_entry_points_run_from_the_installed_wheel(installed):
  rows = installed.work / "in.jsonl"
  rows.write_text(
      json.dumps({"completion": "<reasoning>9 * 2</reasoning><answer>18</answer>", "answer": "18"})
      + "\n"
      + json.dumps({"completion": "<reasoning>9 * 2</reasoning><answer>19</answer>", "answer": "18"})
      + "\n"
  )
  scored = installed.work / "out.jsonl"
  installed.run("-m", "maxtext_rl_plugin.rewards", "score", "--input", rows, "--output", scored)
  assert [json.loads(l)["correct"] for l in scored.read_text().splitlines()] == [True, False]
  p = installed.run("-m", "maxtext_rl_plugin.export_lora", "--help")
  assert "--output" in p.stdout
  p = installed.run("-m", "maxtext_rl_plugin.launch", "--help")
  assert "xpk" in p.stdout and "ray" in p.stdout
  # The console script and the entry-point groups of the installed metadata (registry.describe loads each one).
  p = _run([installed.venv / "bin" / "maxtext-rl", "list"], cwd=installed.work, env=installed.env)
  assert "grpo" in p.stdout and "check_answer" in p.stdout and "vllm" in p.stdout, p.stdout
