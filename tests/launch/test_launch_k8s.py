"""The shipped KubeRay manifests: valid YAML, self-consistent, and their entrypoint is a valid launcher command."""

from __future__ import annotations

import json
import pathlib
import re
import shlex

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray.train.v2.jax", reason="ray[train] not installed")

import configparser

from maxtext_rl_plugin.launch import __main__ as launch_main

K8S = pathlib.Path(__file__).resolve().parents[2] / "dependencies" / "k8s"
VALUES = {
    "RUN_NAME": "qwen3-8b-grpo-ray",
    "DOCKER_IMAGE": "us-docker.pkg.dev/p/r/maxtext-rl-ray:latest",
    "KSA_NAME": "rl-ksa",
    "GS_BUCKET": "my-bucket",
    "MODEL": "qwen3-8b",
    "TOKENIZER": "Qwen/Qwen3-8B",
    "MAXTEXT_CKPT_PATH": "gs://my-bucket/qwen3-8b/0/items",
}


def load(name: str) -> dict:
  text = (K8S / name).read_text()
  placeholders = set(re.findall(r"\$\{(\w+)\}", text))
  assert placeholders <= set(VALUES), placeholders - set(VALUES)  # every variable is documented in the header
  # envsubst semantics for the ${VAR} placeholders (the $VAR mentions are in comments).
  return yaml.safe_load(re.sub(r"\$\{(\w+)\}", lambda m: VALUES[m.group(1)], text))


def test_rayjob_entrypoint_is_a_valid_launch_matching_the_pod_specs(capsys):
  job = load("rayjob-tpu.yaml")
  assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["spec"]["backoffLimit"] >= 1
  argv = shlex.split(job["spec"]["entrypoint"])
  assert argv[:4] == ["python", "-m", "maxtext_rl_plugin.launch", "ray"]
  flags = argv[3:]
  cut = flags.index("--")
  rc = launch_main.main([*flags[:cut], "--dry-run", *flags[cut:]])
  out, err = capsys.readouterr()
  assert rc == 0, err
  scaling = json.loads(re.search(r"scaling=(\{.*?\}) worker_env", out).group(1))
  workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
  assert len(workers) == 1
  group = workers[0]
  pod = group["template"]["spec"]
  container = pod["containers"][0]
  assert scaling["num_workers"] == group["numOfHosts"] * group["replicas"]
  assert scaling["topology"] == pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
  assert str(scaling["resources_per_worker"]["TPU"]) == container["resources"]["limits"]["google.com/tpu"]
  assert (
      scaling["accelerator_type"] == "TPU-V6E"
      and pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
  )
  # The HF token comes from a Secret, never from the manifest text.
  env = {e["name"]: e for e in container["env"]}
  assert "secretKeyRef" in env["HF_TOKEN"]["valueFrom"] and "value" not in env["HF_TOKEN"]
  assert "run_name=qwen3-8b-grpo-ray" in out and "base_output_directory=gs://my-bucket/runs" in out


def test_raycluster_is_the_rayjob_cluster():
  cluster = load("raycluster-tpu.yaml")
  job = load("rayjob-tpu.yaml")
  assert cluster["kind"] == "RayCluster"
  assert cluster["spec"] == job["spec"]["rayClusterSpec"]


def test_one_ray_version_everywhere():
  """setup.cfg's launch pin, the image's Ray and the manifests' rayVersion must agree (KubeRay needs the
  cluster's Ray to match the image's)."""
  cfg = configparser.ConfigParser()
  cfg.read(K8S.parents[1] / "setup.cfg")
  pins = re.findall(r"ray\[[\w,]+\]==([\d.]+)", cfg["options.extras_require"]["launch"])
  image = re.findall(r"ray\[[\w,]+\]==([\d.]+)", (K8S / "Dockerfile.ray").read_text())
  versions = {
      load(n)["spec"].get("rayVersion") or load(n)["spec"]["rayClusterSpec"]["rayVersion"]
      for n in ("raycluster-tpu.yaml", "rayjob-tpu.yaml")
  }
  assert len(pins) == 1 and image == pins and versions == set(pins)
