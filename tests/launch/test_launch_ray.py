"""`launch ray`: JaxTrainer wiring, and a real 2-worker local Ray cluster running one colocated GRPO step.

The 2-worker test is one 2-process JAX program (jax.distributed + gloo, set up by the launcher because Ray's JAX
backend does nothing on CPU): the batch is sharded over both processes, the gradient is all-reduced across them,
and both workers must report the same loss as a single-process run of the same step. Set
MAXTEXT_RL_TEST_RAY_ENTRY=train_rl to run `train_rl configs/cpu_tiny.yml num_batches=1` on the 2 workers instead.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin.config import validation
from maxtext_rl_plugin.launch import smoke
from maxtext_rl_plugin.launch import ray as ray_lib  # imports ray lazily: the skip below still applies

pytest.importorskip("ray.train.v2.jax", reason="ray[train] not installed (pip install 'maxtext-rl-plugin[launch]')")
ray_config = pytest.importorskip("ray.train.v2.api.config")

TOKEN = "hf_test_RAYsecret_77"


def test_cpu_workers_never_inherit_forced_devices():
  inherited = {"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8", "HF_TOKEN": TOKEN}
  env = ray_lib.RayLaunch(num_workers=2, overrides=[]).worker_env(inherited)
  assert env["JAX_PLATFORMS"] == "cpu" and env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
  assert env["HF_TOKEN"] == TOKEN  # passed through to workers, like the XPK path
  env = ray_lib.RayLaunch(num_workers=2, overrides=[], cpu_devices_per_worker=2).worker_env(inherited)
  assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", "--xla_force_host_platform_device_count=2"]


def test_launch_id_is_one_per_launch_and_kept_by_its_restarts():
  launch = ray_lib.RayLaunch(num_workers=2, overrides=["run_name=r1"])
  key = run_dir_lib.LAUNCH_ID_ENV
  # Every restart of the worker group gets the same runtime env, hence the same id; another launch gets another id.
  assert launch.worker_env({})[key] == launch.worker_env({})[key] == f"ray:r1:{launch.launch_id}"
  assert ray_lib.RayLaunch(num_workers=2, overrides=["run_name=r1"]).worker_env({})[key] != launch.worker_env({})[key]


def test_tpu_trainer_matches_the_ray_tutorial(monkeypatch):
  monkeypatch.setenv("HF_TOKEN", TOKEN)
  launch = ray_lib.RayLaunch(
      num_workers=4,
      overrides=["run_name=rayjob-grpo", "base_output_directory=/data/"],
      tpu_topology="4x4",
      accelerator_type="TPU-V6E",
      chips_per_worker=4,
  )
  launch.validate()
  trainer = ray_lib.build_trainer(launch)
  sc = trainer.scaling_config
  assert (sc.num_workers, sc.use_tpu, sc.topology, sc.accelerator_type) == (4, True, "4x4", "TPU-V6E")
  assert sc.resources_per_worker == {"TPU": 4} and sc.placement_strategy == "SPREAD"
  assert trainer.run_config.name == "rayjob-grpo"
  env = trainer.run_config.worker_runtime_env["env_vars"]
  assert env["JAX_PLATFORMS"] == "tpu" and env["ENABLE_PJRT_COMPATIBILITY"] == "true" and env["HF_TOKEN"] == TOKEN
  assert trainer.train_loop_per_worker is ray_lib.train_loop_per_worker
  assert trainer.train_loop_config["argv"] == [
      "configs/rl.yml",
      "run_name=rayjob-grpo",
      "base_output_directory=/data/",
      "use_pathways=false",
  ]  # multi-controller JAX, not a Pathways client
  assert TOKEN not in launch.describe()


def test_dry_run_and_one_line_errors(monkeypatch, launch_cli):
  monkeypatch.setenv("HF_TOKEN", TOKEN)
  rc, out, err = launch_cli(
      [
          "ray",
          "--num-workers",
          "4",
          "--tpu-topology",
          "4x4",
          "--accelerator-type",
          "TPU-V6E",
          "--name",
          "grpo-ray",
          "--dry-run",
          "--",
          "loss_algo=gspo-token",
      ]
  )
  assert rc == 0 and out.startswith("ray JaxTrainer name=grpo-ray") and TOKEN not in out + err
  assert '"run_name=grpo-ray"' in out  # --name becomes the run_name, so a rerun resumes
  for argv, needle in [
      (["ray", "--num-workers", "4", "--tpu-topology", "4x4", "--dry-run"], "--accelerator-type"),
      (
          ["ray", "--num-workers", "3", "--tpu-topology", "4x4", "--accelerator-type", "TPU-V6E", "--dry-run"],
          "Ray rejected the scaling config",
      ),
      (["ray", "--num-workers", "0", "--dry-run"], "--num-workers"),
      (["ray", "--num-workers", "2", "--dry-run", "--", "rl.kl_estimatr=k1"], "unknown config key"),
  ]:
    rc, out, err = launch_cli(argv)
    assert rc == 2 and out == "" and err.count("\n") == 1 and needle in err, (argv, err)
  # Issue 62: multi-turn episodes, dynamic sampling and rollouts ahead of the trainer run across processes (each alone
  # and together; tests/run/test_multiprocess_rollouts.py trains them), so several workers accept them.
  features = ["rl.use_agentic_rollout=true", "rl.dynamic_sampling=true", "rl.off_policy_steps=1"]
  assert not validation.SINGLE_PROCESS
  for keys in [[f] for f in features] + [features]:
    rc, out, err = launch_cli(["ray", "--num-workers", "2", "--dry-run", "--", *keys])
    assert rc == 0 and out.startswith("ray JaxTrainer"), (keys, err)


def test_max_failures_is_rays_failure_config(launch_cli):
  """--max-failures N is Ray Train's FailureConfig(max_failures=N) (the group restart the multi-process test
  exercises); default 0 (no restart), -1 forever, below that one line."""
  for n in (0, 3, -1):
    trainer = ray_lib.build_trainer(ray_lib.RayLaunch(num_workers=2, overrides=["run_name=ft"], max_failures=n))
    fc = trainer.run_config.failure_config
    assert isinstance(fc, ray_config.FailureConfig) and fc.max_failures == n
  rc, out, _ = launch_cli(["ray", "--num-workers", "2", "--max-failures", "2", "--dry-run", "--", "run_name=ft"])
  assert rc == 0 and 'failure={"max_failures": 2}' in out
  rc, out, err = launch_cli(["ray", "--num-workers", "2", "--max-failures", "-2", "--dry-run"])
  assert rc == 2 and out == "" and err.count("\n") == 1 and "--max-failures" in err


def test_every_numeric_flag_is_range_checked(launch_cli):
  """Issue 51: `--cpus-per-worker -2` was accepted (the check covered only --cpu-devices-per-worker). Every numeric
  field of RayLaunch has a bound in NUMERIC_FLAGS (a new one without fails here), and each bad value is one line."""
  numeric = {f.name for f in dataclasses.fields(ray_lib.RayLaunch) if f.type in ("int", "float", "int | None")}
  assert numeric == set(ray_lib.NUMERIC_FLAGS)
  for flag, value in [
      ("--cpus-per-worker", "-2"),
      ("--cpus-per-worker", "0"),
      ("--cpus-per-worker", "nan"),
      ("--num-cpus", "0"),
      ("--cpu-devices-per-worker", "0"),
      ("--chips-per-worker", "-1"),
  ]:
    rc, out, err = launch_cli(["ray", "--num-workers", "2", flag, value, "--dry-run"])
    assert rc == 2 and out == "" and err.count("\n") == 1 and f"{flag} must be" in err, (flag, value, err)
  rc, out, err = launch_cli(["ray", "--num-workers", "2", "--cpus-per-worker", "0.5", "--num-cpus", "2", "--dry-run"])
  assert rc == 0 and out.startswith("ray JaxTrainer"), err


def test_hf_access_token_override_travels_in_the_environment_never_argv(monkeypatch, launch_cli):
  monkeypatch.delenv("HF_TOKEN", raising=False)
  secret = "hf_overrideSECRET123456"
  rc, out, err = launch_cli(
      ["ray", "--num-workers", "2", "--name", "tok", "--dry-run", "--", f"hf_access_token={secret}"]
  )
  assert rc == 0 and secret not in out + err, out + err
  launch = ray_lib.RayLaunch(num_workers=2, overrides=[f"hf_access_token={secret}", "run_name=tok"])
  assert all(secret not in a for a in launch.train_argv()) and launch.worker_env({})["HF_TOKEN"] == secret
  assert secret not in launch.describe() and secret not in json.dumps(launch.loop_config())


@pytest.mark.parametrize(
    "address, env, needle",
    [
        ("not-an-address:xx", None, "--address 'not-an-address:xx' is not a Ray address"),
        ("10.0.0.2", None, "--address '10.0.0.2' is not a Ray address"),
        ("127.0.0.1:0", None, "is not a Ray address"),
        ("127.0.0.1:70000", None, "is not a Ray address"),
        ("ray://", None, "is not a Ray address"),
        ("http://127.0.0.1:8265", None, "is not a Ray address"),  # the dashboard's job-submission address
        (None, "head:port", "RAY_ADDRESS 'head:port' is not a Ray address"),
        ("auto", "nope", "RAY_ADDRESS 'nope' is not a Ray address"),  # ray.init reads RAY_ADDRESS for auto
    ],
)
def test_a_malformed_address_is_one_line_also_in_dry_run(address, env, needle, monkeypatch, launch_cli):
  """Issue 61: `--address not-an-address:xx` was a ValueError traceback from inside ray.init, and --dry-run accepted
  it. The form is checked with the other flags, before --dry-run returns."""
  if env is None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
  else:
    monkeypatch.setenv("RAY_ADDRESS", env)
  argv = ["ray", "--num-workers", "1", "--entry", "smoke", "--dry-run"]
  rc, out, err = launch_cli(argv + (["--address", address] if address else []))
  assert rc == 2 and out == "" and err.count("\n") == 1 and needle in err, err
  assert "ray://host:port" in err  # the forms Ray takes


def test_well_formed_addresses_pass_the_dry_run(monkeypatch, launch_cli):
  monkeypatch.delenv("RAY_ADDRESS", raising=False)
  for address in ("auto", "local", "10.0.0.2:6379", "ray://head-svc.ns.svc.cluster.local:10001", "[::1]:6379"):
    rc, out, err = launch_cli(["ray", "--num-workers", "1", "--entry", "smoke", "--dry-run", "--address", address])
    assert rc == 0 and out.startswith("ray JaxTrainer"), (address, err)
  assert ray_lib.head_address("ray://[::1]:10001") == ("::1", 10001)


@pytest.fixture(name="no_ray_init")
def _no_ray_init(monkeypatch):
  """ray.init must never be reached for an unreachable head (it retried for minutes); the probe is shortened."""
  ray = pytest.importorskip("ray")

  def init(**kwargs):
    raise AssertionError(f"ray.init reached with {kwargs}")

  monkeypatch.setattr(ray, "init", init)
  monkeypatch.setattr(ray_lib, "PROBE_TIMEOUT_S", 0.5, raising=False)  # absent before the probe existed
  monkeypatch.delenv("RAY_ADDRESS", raising=False)
  monkeypatch.delenv("RAY_USE_TLS", raising=False)


def _launch_smoke(launch_cli, address):
  t0 = time.monotonic()
  rc, out, err = launch_cli(["ray", "--num-workers", "1", "--entry", "smoke", "--address", address])
  return rc, out, err, time.monotonic() - t0


def test_a_closed_port_is_one_line_in_seconds(no_ray_init, launch_cli):
  """Issue 61: `--address 127.0.0.1:1` hung past 120 s inside ray.init. A port bound and not listening (loopback
  only) refuses the connection: one line before ray.init."""
  del no_ray_init
  with socket.socket() as closed:
    closed.bind(("127.0.0.1", 0))  # held, not listening: no other process can take the port during the test
    port = closed.getsockname()[1]
    rc, _, err, seconds = _launch_smoke(launch_cli, f"127.0.0.1:{port}")
  assert rc == 2 and err.count("\n") == 1, err
  assert err.startswith(f"error: cannot reach the Ray head at 127.0.0.1:{port}: Connection refused"), err
  assert seconds < 15, seconds  # the ray.train import of build_trainer included


def test_a_head_that_accepts_and_never_answers_is_one_line_in_seconds(no_ray_init, launch_cli):
  """A listening socket that never speaks (the kernel completes the handshake; nobody reads or writes) stands for
  an unreachable or hung head node: the probe's answer timeout ends it in one line."""
  del no_ray_init
  with socket.socket() as silent:
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
      rc, _, err, seconds = _launch_smoke(launch_cli, address)
      assert rc == 2 and err.count("\n") == 1, err
      assert err.startswith(f"error: the Ray head at 127.0.0.1:{port} did not answer within 0.5 s"), err
      assert seconds < 15, seconds


def test_the_probe_passes_a_real_grpc_server():
  """The reference for "answers": a gRPC server (what the head's GCS and Ray Client server are), on loopback."""
  grpc = pytest.importorskip("grpc")
  server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  try:
    t0 = time.monotonic()
    ray_lib.probe_head("127.0.0.1", port, timeout_s=5)
    assert time.monotonic() - t0 < 5
  finally:
    server.stop(None)


@pytest.mark.solo
@pytest.mark.timeout(600)
def test_two_cpu_workers_run_one_grpo_step_as_one_jax_program(tmp_path):
  entry = os.environ.get("MAXTEXT_RL_TEST_RAY_ENTRY", "smoke")
  results = tmp_path / "results"
  argv = [
      sys.executable,
      "-m",
      "maxtext_rl_plugin.launch",
      "ray",
      "--num-workers",
      "2",
      "--num-cpus",
      "2",
      "--entry",
      entry,
      "--storage-path",
      str(tmp_path / "ray"),
      "--result-dir",
      str(results),
  ]
  if entry == "train_rl":
    argv += [
        "--config",
        "configs/cpu_tiny.yml",
        "--",
        "num_batches=1",
        f"base_output_directory={tmp_path / 'runs'}",
        "run_name=ray2",
        "eval_before_training=false",
        "eval_after_training=false",
    ]
  # The driver's environment forces 8 host devices (as the multidevice test pass does): workers must not inherit it.
  env = {
      **os.environ,
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
      "RAY_DEDUP_LOGS": "0",
      "RAY_USAGE_STATS_ENABLED": "0",
  }
  env.pop("RAY_ADDRESS", None)
  proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=580, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  if entry == "train_rl":
    assert (tmp_path / "runs" / "ray2" / "checkpoints").is_dir()
    return
  ranks = [json.loads((results / f"rank{r}.json").read_text()) for r in (0, 1)]
  assert [m["process_index"] for m in ranks] == [0, 1]
  assert all(m["process_count"] == 2 and m["global_devices"] == 2 for m in ranks)
  # Both workers hold the same replicated result of the cross-process computation.
  assert ranks[0]["loss"] == ranks[1]["loss"] and ranks[0]["loss_after_step"] == ranks[1]["loss_after_step"]
  assert ranks[0]["grad_norm"] == ranks[1]["grad_norm"] and ranks[0]["grad_norm"] > 0
  # Reference: the same step in this single process (all shards local). A missing or doubled gradient all-reduce
  # would change grad_norm and the post-update loss.
  ref = smoke.grpo_step()
  for key in ("loss", "loss_after_step", "grad_norm", "reward_mean"):
    assert ranks[0][key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
  assert ranks[0]["loss_after_step"] < ranks[0]["loss"]  # one SGD step on the surrogate descends
