"""`launch xpk`: the printed command is what xpk itself parses and turns into a Pathways JobSet.

References are xpk's own: its argparse parser (`xpk.parser.core.set_parser`), its name validator, its TPU table,
and `xpk workload create-pathways --dry-run --output-manifest-file` (offline with TELEMETRY_ENABLED=false and a
temporary HOME). Nothing here talks to a cluster.
"""

# xpk is optional (a separate environment): tests that check against its validators import it where installed.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

xpk_parser_core = pytest.importorskip("xpk.parser.core", reason="xpk==1.16.0 not installed (pip install xpk==1.16.0)")
yaml = pytest.importorskip("yaml")

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin import run_dir
from maxtext_rl_plugin.launch import xpk as xpk_lib

TOKEN = "hf_test_Zq9SECRETtoken42"
BASE = [
    "xpk",
    "--workload",
    "llama-grpo",
    "--cluster",
    "tpu-cluster",
    "--tpu-type",
    "v5p-128",
    "--project",
    "my-proj",
    "--docker-image",
    "gcr.io/my-proj/maxtext-rl:latest",
]
OVERRIDES = [
    "model_name=llama3.1-8b",
    "tokenizer_path=meta-llama/Llama-3.1-8B-Instruct",
    "load_parameters_path=gs://bucket/ckpt/0/items",
    "base_output_directory=gs://bucket/runs",
]


def xpk_parse(line: str) -> argparse.Namespace:
  """Parse a printed `xpk ...` line exactly as the xpk CLI would (SystemExit(2) on anything it rejects)."""
  argv = shlex.split(line)
  assert argv[0] == "xpk"
  parser = argparse.ArgumentParser(prog="xpk")
  xpk_parser_core.set_parser(parser)
  return parser.parse_args(argv[1:])


@pytest.fixture(name="token_env")
def token_env_fixture(monkeypatch):
  monkeypatch.setenv("HF_TOKEN", TOKEN)
  return TOKEN


def test_dry_run_prints_one_xpk_line_that_xpk_parses(token_env, launch_cli):
  rc, out, err = launch_cli([*BASE, "--num-slices", "2", "--priority", "high", "--dry-run", "--", *OVERRIDES])
  assert rc == 0, err
  lines = out.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("xpk "), out
  args = xpk_parse(lines[0])
  assert args.xpk_subcommands == "workload" and args.func.__name__ == "workload_create_pathways"
  assert (args.workload, args.cluster, args.tpu_type, args.project) == ("llama-grpo", "tpu-cluster", "v5p-128", "my-proj")
  assert (args.num_slices, args.priority, args.docker_image) == (2, "high", "gcr.io/my-proj/maxtext-rl:latest")
  container = shlex.split(args.command)
  env = dict(a.split("=", 1) for a in container[: container.index("python3")])
  # One launch id per submission (test_jobset_restart_keeps_the_launch_id_and_takes_over_its_lock_at_once).
  assert env.pop(run_dir.LAUNCH_ID_ENV).startswith("xpk:llama-grpo:")
  assert env == {
      "TF_CPP_MIN_LOG_LEVEL": "0",
      "JAX_PLATFORMS": "proxy",
      "JAX_BACKEND_TARGET": "grpc://127.0.0.1:29000",
      "ENABLE_PATHWAYS_PERSISTENCE": "1",
  }
  i = container.index("python3")
  assert container[i : i + 4] == ["python3", "-m", "maxtext_rl_plugin.train_rl", "configs/rl.yml"]
  train_args = container[i + 4 :]
  assert train_args[: len(OVERRIDES)] == OVERRIDES
  assert "run_name=llama-grpo" in train_args  # the workload name is the run name: resubmitting resumes
  # The token reaches the container as an env var and train_rl as a reference the container's shell expands.
  assert args.env == ["HF_TOKEN=$HF_TOKEN"]
  assert "hf_access_token=$HF_TOKEN" in train_args


def test_token_is_never_printed_but_reaches_xpk(token_env, launch_cli, tmp_path, monkeypatch):
  rc, out, err = launch_cli([*BASE, "--dry-run", "--", *OVERRIDES])
  assert rc == 0 and TOKEN not in out and TOKEN not in err
  assert 'HF_TOKEN="$HF_TOKEN"' in out
  # Without --dry-run the real xpk gets the value; a stand-in records its argv.
  record = tmp_path / "argv.json"
  fake = tmp_path / "fake_xpk.py"
  fake.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\nsys.exit(3)\n")
  monkeypatch.setenv(xpk_lib.XPK_BIN_ENV, f"{sys.executable} {fake}")
  rc, out, err = launch_cli([*BASE, "--", *OVERRIDES, "hf_access_token=" + TOKEN])
  assert rc == 3  # xpk's exit status is the launcher's
  assert TOKEN not in out and TOKEN not in err
  assert "hf_access_token=***" in err  # the echoed command shows an explicit token override redacted
  argv = json.loads(record.read_text())
  assert argv[:2] == ["workload", "create-pathways"]
  assert argv[argv.index("--env") + 1] == f"HF_TOKEN={TOKEN}"
  assert f"hf_access_token={TOKEN}" in shlex.split(argv[argv.index("--command") + 1])


def test_no_token_no_env(monkeypatch, launch_cli):
  monkeypatch.delenv("HF_TOKEN", raising=False)
  rc, out, err = launch_cli([*BASE, "--dry-run", "--", *OVERRIDES])
  assert rc == 0
  args = xpk_parse(out.strip())
  assert args.env is None and "hf_access_token" not in args.command
  assert "HF_TOKEN is not set" in err


@pytest.mark.parametrize("name", ["Llama-grpo", "llama_grpo", "1llama", "llama-", "a" * 41, "llam\u00e4", "llama.grpo"])
def test_bad_workload_names_rejected_like_xpk(name, launch_cli):
  rc, out, err = launch_cli(["xpk", "--workload", name, *BASE[3:], "--dry-run"])
  assert rc == 2 and out == ""
  assert err.count("\n") == 1 and err.startswith("error: invalid --workload"), err
  with pytest.raises(argparse.ArgumentTypeError):  # the reference: xpk's own validator rejects it too
    from xpk.parser.validators import name_type

    name_type(name)


@pytest.mark.parametrize("name", ["a", "a" * 40, "llama-3-70b-grpo-retry1", "x0"])
def test_good_workload_names_accepted(name):
  assert xpk_lib.check_name("--workload", name) == name


def test_tpu_types_are_xpks_table():
  from xpk.core import system_characteristics as sc

  table = sc.UserFacingNameToSystemCharacteristics
  tpus = xpk_lib.tpu_types()
  assert set(tpus) == {k for k, v in table.items() if v.accelerator_type == sc.AcceleratorType.TPU}
  for t in ("v5p-128", "v6e-16", "v5litepod-16"):
    assert xpk_lib.check_tpu_type(t) == t
  gpu = next(k for k, v in table.items() if v.accelerator_type == sc.AcceleratorType.GPU)
  with pytest.raises(xpk_lib.LaunchError, match="unknown --tpu-type"):
    xpk_lib.check_tpu_type(gpu)  # a device xpk knows, but not a TPU: create-pathways would reject it


@pytest.mark.parametrize("tpu", ["v5p-127", "v9-8", "tpu-v5p-128"])
def test_unknown_tpu_type_one_line(tpu, launch_cli):
  argv = list(BASE)
  argv[argv.index("--tpu-type") + 1] = tpu
  rc, out, err = launch_cli([*argv, "--dry-run"])
  assert rc == 2 and out == "" and err.count("\n") == 1
  assert err.startswith(f"error: unknown --tpu-type '{tpu}'")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("rl.los_algo=grpo", "unknown config key 'rl.los_algo'"),
        ("loss_algo=ppo", "loss_algo'='ppo': expected one of"),  # rl.loss_algo or loss_algo, as the route resolves it
        ("num_generations_x=4", "unknown config key 'num_generations_x'"),
        ("model_name=llama9-1t", "'model_name'"),
        ("notkeyvalue", "not of the form key=value"),
    ],
)
def test_overrides_train_rl_would_reject_fail_before_printing(override, needle, launch_cli):
  rc, out, err = launch_cli([*BASE, "--dry-run", "--", *OVERRIDES, override])
  assert rc == 2 and out == ""
  assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_other_bad_flags_one_line(launch_cli):
  for argv in (
      [*BASE, "--priority", "urgent", "--dry-run"],
      [*BASE, "--num-slices", "0", "--dry-run"],
      ["xpk", "--workload", "w", "--dry-run"],
      [*BASE, "--bogus", "--dry-run"],
  ):
    rc, out, err = launch_cli(argv)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), (argv, err)


def test_resubmission_resumes_same_run(token_env, launch_cli):
  """Same workload -> the same command but for its launch id (a resubmission is a new launch) -> same
  run_name/base_output_directory -> same checkpoint dir."""
  first = launch_cli([*BASE, "--dry-run", "--", *OVERRIDES])[1]
  again = launch_cli([*BASE, "--dry-run", "--", *OVERRIDES])[1]
  ids = [re.search(rf"{run_dir.LAUNCH_ID_ENV}=(\S+)", c).group(1) for c in (first, again)]
  assert ids[0] != ids[1]
  assert first.replace(ids[0], "ID") == again.replace(ids[1], "ID")
  # An explicit run_name wins and is not duplicated.
  out = launch_cli([*BASE, "--dry-run", "--", *OVERRIDES, "run_name=exp7"])[1]
  train_args = shlex.split(xpk_parse(out.strip()).command)
  assert [a for a in train_args if a.startswith("run_name=")] == ["run_name=exp7"]


def test_max_restarts_passed_and_warned(launch_cli):
  rc, out, err = launch_cli([*BASE, "--max-restarts", "3", "--dry-run", "--", *OVERRIDES])
  assert rc == 0 and xpk_parse(out.strip()).max_restarts == "3"
  assert "--max-restarts" in err and "resubmit" in err


def test_delete_and_list_parse(launch_cli):
  rc, out, _ = launch_cli(
      ["xpk-delete", "--workload", "llama-grpo", "--cluster", "tpu-cluster", "--project", "p", "--force", "--dry-run"]
  )
  args = xpk_parse(out.strip())
  assert rc == 0 and args.func.__name__ == "workload_delete" and args.workload == "llama-grpo" and args.force
  rc, out, _ = launch_cli(
      ["xpk-list", "--cluster", "tpu-cluster", "--project", "p", "--workload", "llama-grpo", "--dry-run"]
  )
  args = xpk_parse(out.strip())
  assert rc == 0 and args.func.__name__ == "workload_list" and args.filter_by_job == "llama-grpo"
  rc, _, err = launch_cli(["xpk-delete", "--workload", "Bad", "--cluster", "c", "--dry-run"])
  assert rc == 2 and "invalid --workload" in err


def test_xpk_dry_run_writes_pathways_jobset(token_env, tmp_path, launch_cli):
  """xpk's own --dry-run --output-manifest-file on our command: the JobSet runs train_rl with our env."""
  rc, _, _ = launch_cli([*BASE, "--zone", "us-east5-a", "--dry-run", "--", *OVERRIDES])
  assert rc == 0
  cmd = xpk_lib.build_create(
      workload="llama-grpo",
      cluster="tpu-cluster",
      tpu_type="v5p-128",
      project="my-proj",
      zone="us-east5-a",
      docker_image="gcr.io/my-proj/maxtext-rl:latest",
      overrides=OVERRIDES,
      max_restarts=2,
      environ={"HF_TOKEN": TOKEN},
      validate=False,
  )
  manifest = tmp_path / "jobset.yaml"
  home = tmp_path / "home"
  home.mkdir()
  env = {**os.environ, "HOME": str(home), "TELEMETRY_ENABLED": "false"}
  proc = subprocess.run(
      [sys.executable, "-m", "xpk.main", *cmd.argv, "--dry-run", "--output-manifest-file", str(manifest)],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  jobset = yaml.safe_load(manifest.read_text())
  assert jobset["kind"] == "JobSet" and jobset["metadata"]["name"] == "llama-grpo"
  head = next(j for j in jobset["spec"]["replicatedJobs"] if j["name"] == "pathways-head")
  main = next(c for c in head["template"]["spec"]["template"]["spec"]["containers"] if c["name"] == "jax-tpu")
  assert main["image"] == "gcr.io/my-proj/maxtext-rl:latest"
  script = main["command"][-1]
  assert "python3 -m maxtext_rl_plugin.train_rl configs/rl.yml" in script and "run_name=llama-grpo" in script
  assert "JAX_BACKEND_TARGET=grpc://127.0.0.1:29000" in script and "ENABLE_PATHWAYS_PERSISTENCE=1" in script
  assert {"name": "HF_TOKEN", "value": TOKEN} in main["env"]
  # Measured fact documented in docs/tutorial.md: xpk 1.16.0 drops --max-restarts for Pathways JobSets, so
  # recovery is by resubmission. If xpk starts honouring it, update the docs and this assertion.
  assert "maxRestarts" not in jobset["spec"].get("failurePolicy", {})


def _container_train_argv(cmd: xpk_lib.Command) -> list[str]:
  container = shlex.split(cmd.argv[cmd.argv.index("--command") + 1])
  i = container.index("python3")
  return container[i + 3 :]  # [yml, overrides...] after `python3 -m maxtext_rl_plugin.train_rl`


def test_resubmission_targets_the_same_checkpoint_directory(tmp_path):
  """What train_rl inside the container resolves from the command: <base_output_directory>/<workload>."""
  dirs = set()
  for _ in range(2):
    cmd = xpk_lib.build_create(
        workload="llama-grpo",
        cluster="c",
        tpu_type="v5p-8",
        project="p",
        docker_image="i",
        overrides=OVERRIDES,
        environ={},
    )
    cfg = config_lib.load_config(_container_train_argv(cmd))
    dirs.add(os.path.join(cfg.base_output_directory, cfg.run_name, "checkpoints"))
  assert dirs == {"gs://bucket/runs/llama-grpo/checkpoints"}


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("MAXTEXT_RL_TEST_E2E_RESUME"),
    reason="~5 min on 2 cores; set MAXTEXT_RL_TEST_E2E_RESUME=1 to run the container command twice",
)
def test_container_command_resumes_when_resubmitted(tmp_path):
  """The container command xpk would run, executed on CPU: a 'preempted' 1-step run, then the resubmission
  (same workload, 2 steps) restores step 1 and trains only step 2."""
  base = tmp_path / "runs"

  def submit(num_batches: int) -> subprocess.CompletedProcess:
    """Run the container command xpk would start, with `num_batches`, against the same run directory."""
    cmd = xpk_lib.build_create(
        workload="resume-e2e",
        cluster="c",
        tpu_type="v5p-8",
        project="p",
        docker_image="i",
        config="configs/cpu_tiny.yml",
        overrides=[
            f"num_batches={num_batches}",
            f"base_output_directory={base}",
            "checkpoint_period=1",
            "eval_before_training=false",
            "eval_after_training=false",
        ],
        environ={},
        allow_local_output=True,  # this host's disk stands for a volume every pod mounts
    )
    script = cmd.argv[cmd.argv.index("--command") + 1]
    # Same command, CPU instead of the Pathways proxy.
    script = script.replace("JAX_PLATFORMS=proxy", "JAX_PLATFORMS=cpu").replace("python3 -m", f"{sys.executable} -m")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        ["bash", "-c", script],
        cwd=pathlib.Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )

  first = submit(1)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  ckpt = base / "resume-e2e" / "checkpoints"
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [1]
  again = submit(2)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  out = again.stdout + again.stderr
  assert "from checkpoint step 1" in out and "step 2/2" in out and "step 1/2" not in out
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [1, 2]


def _launch_env(cmd: xpk_lib.Command) -> dict[str, str]:
  """The env prefix of the container command (`K=V ... python3 -m ...`), as the container's shell sets it."""
  container = shlex.split(cmd.argv[cmd.argv.index("--command") + 1])
  return dict(part.split("=", 1) for part in container[: container.index("python3")])


def test_jobset_restart_keeps_the_launch_id_and_takes_over_its_lock_at_once(tmp_path, monkeypatch):
  """A JobSet restart reruns the pod template, so the restarted process has the submission's MAXTEXT_RL_LAUNCH_ID and
  takes over the lock its dead previous attempt (another pod, fresh heartbeat) left, at once; a resubmission of the
  same workload is a new launch with a new id and still waits for the lock to go stale."""
  kw = {"workload": "llama-grpo", "cluster": "c", "tpu_type": "v5p-8", "project": "p", "docker_image": "i"}
  first = xpk_lib.build_create(**kw, environ={}, validate=False)
  resubmitted = xpk_lib.build_create(**kw, environ={}, validate=False)
  launch_id = _launch_env(first)[run_dir.LAUNCH_ID_ENV]
  assert launch_id.startswith("xpk:llama-grpo:") and launch_id in first.shown
  assert _launch_env(resubmitted)[run_dir.LAUNCH_ID_ENV] != launch_id

  run = tmp_path / "run"
  run.mkdir()
  run_dir.RunLock(str(run), launch_id=launch_id, host="attempt-0-pod").acquire()  # then the pod dies
  monkeypatch.setenv(run_dir.LAUNCH_ID_ENV, launch_id)  # what the container's env prefix sets
  restarted = run_dir.RunLock(str(run), host="attempt-1-pod")
  restarted.acquire()
  assert restarted.held and json.loads((run / ".lock").read_text())["host"] == "attempt-1-pod"
  other = run_dir.RunLock(str(run), launch_id=_launch_env(resubmitted)[run_dir.LAUNCH_ID_ENV], host="other-pod")
  with pytest.raises(run_dir.RunLockedError, match="in use by pid"):
    other.acquire()


def test_a_local_or_missing_output_directory_is_refused(launch_cli):
  """Outputs inside a pod are lost with it (today a warning only): a local or missing base_output_directory is one
  line, exit 2, unless --allow-local-output says the path is a volume every pod mounts."""
  local = [o for o in OVERRIDES if not o.startswith("base_output_directory=")]
  for overrides in (local, [*local, "base_output_directory=/tmp/runs"]):
    rc, out, err = launch_cli([*BASE, "--dry-run", "--", *overrides])
    assert rc == 2 and not out and "error: base_output_directory is" in err and "--allow-local-output" in err, err
  rc, out, _ = launch_cli([*BASE, "--dry-run", "--allow-local-output", "--", *local, "base_output_directory=/mnt/runs"])
  assert rc == 0 and "create-pathways" in out
