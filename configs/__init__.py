"""Shipped yml configs (installed as package data of `maxtext_rl_plugin.configs`)."""

import os

_DIR = os.path.dirname(os.path.abspath(__file__))

rl_yml = os.path.join(_DIR, "rl.yml")
cpu_tiny_yml = os.path.join(_DIR, "cpu_tiny.yml")
cpu_demo_yml = os.path.join(_DIR, "cpu_demo.yml")
