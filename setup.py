"""The package list, derived from the tree; every other setting is in setup.cfg.

setup.cfg's `package_dir` installs two top-level folders inside the package (`configs/` as
`maxtext_rl_plugin.configs`, `rewards/` as `maxtext_rl_plugin.rewards`). setuptools' `packages = find:` searches one
folder and names what it finds relative to it, so it cannot produce those mapped names, and the list was kept by hand:
it stopped growing and four subpackages (agentic, data, resharding, run) were missing from the wheel (issue 42). Here
each `package_dir` entry is searched with `find_packages`, so a new subpackage (a folder with an `__init__.py`) ships
without an edit. tests/test_install.py builds the wheel and compares its modules with the source tree.
"""

import configparser
import os

from setuptools import find_packages
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def package_dir() -> dict[str, str]:
  """setup.cfg's `[options] package_dir`: package name -> folder (relative to this file)."""
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(HERE, "setup.cfg"), encoding="utf-8")
  pairs = (line.split("=", 1) for line in cfg["options"]["package_dir"].splitlines() if "=" in line)
  return {name.strip(): folder.strip() for name, folder in pairs}


def packages(mapping: dict[str, str]) -> list[str]:
  """Each mapped package and every package below its folder, under the mapped name."""
  out = set()
  for name, folder in mapping.items():
    out.add(name)
    out.update(f"{name}.{sub}" for sub in find_packages(where=os.path.join(HERE, folder)))
  return sorted(out)


setup(packages=packages(package_dir()))
