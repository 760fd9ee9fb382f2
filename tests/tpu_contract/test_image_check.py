"""The TPU image's build-time checks (dependencies/Dockerfile step 3), run in the environment with its pins."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_dockerfile_import_check_passes_with_the_image_pins(tmp_path):
  text = (REPO / "dependencies" / "Dockerfile").read_text().replace("\\\n", "")
  checks = [c for c in re.findall(r'python3 -c "([^"]*)"', text) if "tpu_inference" in c]
  assert len(checks) == 1, "the Dockerfile's build check no longer imports vllm / tpu_inference"
  code = checks[0]
  assert re.search(r"\bvllm\b", code.replace("rollout.vllm", ""))
  r = subprocess.run(
      [sys.executable, "-c", code],
      capture_output=True,
      text=True,
      check=False,
      timeout=300,
      # The installed plugin (scripts/tpu_contract_venv.sh installs it as the image does), from a directory without
      # the checkout's sources, as the image's check runs once its copy of them is removed.
      cwd=tmp_path,
      env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "TPU_ACCELERATOR_TYPE": "v5litepod-1"},
  )
  assert r.returncode == 0, r.stderr[-3000:]


def test_only_vllm_tpu_owns_the_vllm_directory():
  sys.path.insert(0, str(REPO / "dependencies" / "scripts"))
  import verify_pins  # pylint: disable=import-outside-toplevel  # a script directory, on sys.path only here

  assert verify_pins.package_owners("vllm") == ["vllm-tpu"]
  assert verify_pins.shared_package_dirs() == []
