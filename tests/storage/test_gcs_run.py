"""train_rl with every output and its data in a bucket (issue 59): the README's command against a real GCS endpoint on
loopback (fake-gcs-server, tests/_gcs.py, started by the `gcs` fixture in tests/conftest.py).

One 2-step run writes its checkpoints, records, summary, plot, TensorBoard events, audit trail and owner marks to
gs:// and reads its training data from gs://; the tests around it resume it from the bucket, refuse a second run while
the first holds it, resume from the state a kill mid-step leaves there, and run it as two processes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import types

import _in_process as in_process
from _tiny import SMALL_VOCAB
import pytest

from maxtext_rl_plugin import storage
from maxtext_rl_plugin.aot import run as aot_run

REPO = pathlib.Path(__file__).resolve().parents[2]
FAST = ("num_test_batches=0", "eval_before_training=false", "eval_after_training=false", "checkpoint_period=1")


def _objects(prefix: str) -> list[str]:
  """Every object under a gs:// prefix (gcsfs's recursive listing; epath refuses `**` on GCS)."""
  import gcsfs  # pylint: disable=import-outside-toplevel  # the listing only

  return sorted("gs://" + p for p in gcsfs.GCSFileSystem().find(prefix[len("gs://") :]))


def _steps(path: str) -> list[int]:
  return [json.loads(line)["step"] for line in storage.read_text(path).splitlines() if line.strip()]


@pytest.fixture(name="bucket_run", scope="module")
def fixture_bucket_run(gcs):
  """The data uploaded, then `train_rl configs/cpu_tiny.yml base_output_directory=gs://... train_data_path=gs://...
  metrics_file=gs://...` for 2 steps, in this process."""
  root = f"gs://{gcs.bucket}/e2e-{time.time_ns()}"
  data = f"{root}/data/train.jsonl"
  storage.write_atomic(data, (REPO / "tests" / "data" / "gsm8k" / "train.jsonl").read_bytes())
  argv = [
      "configs/cpu_tiny.yml",
      f"base_output_directory={root}/rl",
      "run_name=grpo-tiny",
      f"train_data_path={data}",
      f"metrics_file={root}/logs/metrics.jsonl",  # outside the run directory: owned through its mark
      *SMALL_VOCAB,
      *FAST,
  ]
  p = in_process.train_rl([*argv, "num_batches=2"])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return types.SimpleNamespace(root=root, run=f"{root}/rl/grpo-tiny", argv=argv, metrics=f"{root}/logs/metrics.jsonl")


def test_every_output_lands_in_the_bucket(bucket_run):
  objects = _objects(bucket_run.run)
  run = bucket_run.run
  for step in (1, 2):
    assert f"{run}/checkpoints/{step}/meta/metadata" in objects
    assert any(o.startswith(f"{run}/checkpoints/{step}/params/") for o in objects)
  assert {f"{run}/summary.json", f"{run}/summary.png", f"{run}/batches.jsonl", f"{run}/.owner"} <= set(objects)
  assert any(o.startswith(f"{run}/tensorboard/events.out.tfevents.") for o in objects)
  assert f"{run}/.lock" not in objects  # released at the end
  assert storage.read_bytes(f"{run}/summary.png")[:8] == b"\x89PNG\r\n\x1a\n"
  assert _steps(bucket_run.metrics) == [1, 2] and _steps(f"{run}/batches.jsonl") == [1, 2]
  assert json.loads(storage.read_text(bucket_run.metrics + ".owner"))["run_dir"] == run
  meta = json.loads(storage.read_text(f"{run}/checkpoints/2/meta/metadata"))
  assert meta["metrics_file"] == bucket_run.metrics and meta["step"] == 2


def test_a_second_run_is_refused_while_the_first_holds_it(bucket_run):
  """A live holder on another host (its heartbeat fresh): one line naming it, after the path checks, before any model
  is built; nothing in the bucket changes."""
  lock = f"{bucket_run.run}/.lock"
  storage.write_atomic(lock, json.dumps({"host": "other-host", "pid": 4242, "launch_id": "", "heartbeat": time.time()}))
  before = _objects(bucket_run.run)
  try:
    p = in_process.train_rl([*bucket_run.argv, "num_batches=3"])
  finally:
    storage.remove(lock)
  assert p.returncode == 2 and "in use by pid 4242 on host other-host" in p.stderr, p.stderr[-2000:]
  assert "Traceback" not in p.stderr
  assert _objects(bucket_run.run) == [o for o in before if o != lock]


def test_another_run_on_the_same_metrics_file_is_refused(bucket_run):
  p = in_process.train_rl(
      [*[a.replace("run_name=grpo-tiny", "run_name=other") for a in bucket_run.argv], "num_batches=2"]
  )
  assert p.returncode == 2 and f"belongs to the run {bucket_run.run}" in p.stderr, p.stderr[-2000:]


def test_resumes_from_the_state_a_kill_mid_step_leaves(bucket_run):
  """What a SIGKILL during step 3 leaves in the bucket: the lock of a process that is gone, step 3's records written
  (the last one torn), and Orbax's temporary directory of the step-3 checkpoint. The same command resumes from step 2,
  trains step 3 once and ends on a complete checkpoint 3 (the real kill: tests/test_reliability.py, on local disk)."""
  run = bucket_run.run
  dead = subprocess.run(
      [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
  )
  storage.write_atomic(
      f"{run}/.lock", json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout), "heartbeat": time.time()})
  )
  storage.append_text(bucket_run.metrics, '{"step": 3, "loss": 0.5}\n{"step": 3, "lo')
  storage.append_text(f"{run}/batches.jsonl", '{"step": 3, "ids": ["x"]}\n')
  storage.write_atomic(f"{run}/checkpoints/3.orbax-checkpoint-tmp-1/params/_METADATA", "{}")
  p = in_process.train_rl([*bucket_run.argv, "num_batches=3"])
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert "step 3/3" in p.stdout
  assert _steps(bucket_run.metrics) == [1, 2, 3] and _steps(f"{run}/batches.jsonl") == [1, 2, 3]
  assert f"{run}/checkpoints/3/meta/metadata" in _objects(run)
  assert json.loads(storage.read_text(f"{run}/checkpoints/3/meta/metadata"))["step"] == 3


def test_no_credentials_is_one_line_naming_the_bucket(tmp_path):
  """The README's command with no emulator and no credentials: one `error:` line naming the bucket, no traceback, no
  request to the service (NO_GCE_CHECK keeps google-auth off the metadata server's non-loopback address)."""
  env = {"STORAGE_EMULATOR_HOST": "", "GOOGLE_APPLICATION_CREDENTIALS": "", "NO_GCE_CHECK": "True"}
  env["HOME"] = str(tmp_path)
  p = in_process.train_rl(
      ["configs/cpu_tiny.yml", "base_output_directory=gs://prod-bucket/rl", "run_name=grpo-tiny", "num_batches=1"],
      env=env,
  )
  err = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert p.returncode == 2 and len(err) == 1 and "no Google Cloud credentials for gs://prod-bucket" in err[0], p.stderr
  assert "Traceback" not in p.stderr


def test_compile_rl_writes_its_report_to_the_bucket(gcs):
  """compile_rl's report path: beside the run directory in the bucket, probed before anything compiles."""
  base = f"gs://{gcs.bucket}/aot-{time.time_ns()}"
  config = types.SimpleNamespace(compile_topology="v5p-128", base_output_directory=base, run_name="r")
  path = aot_run.report_path(config)
  assert path == f"{base}/r.aot-v5p-128.json"
  storage.write_atomic(path, "{}")  # what run() writes at the end, through the same layer
  assert json.loads(storage.read_text(path)) == {}


@pytest.mark.solo
@pytest.mark.extended  # ~120 s of the serial solo pass; the default tier's bucket runs above are one process
@pytest.mark.timeout(600)
def test_two_processes_write_one_bucket_run(gcs, tmp_path):
  """One JAX program of two processes (scripts/mp_run.py: gloo collectives, as a Ray CPU worker runs it) on a gs://
  run: process 0 writes the lock, records and summary, every process joins the checkpoints (Orbax writes each
  process's shards); a second launch resumes it from the bucket."""
  del tmp_path
  root = f"gs://{gcs.bucket}/mp-{time.time_ns()}"
  argv = ["configs/cpu_tiny.yml", f"base_output_directory={root}", "run_name=mp", "metrics_file=metrics.jsonl"]
  argv += [*SMALL_VOCAB, *FAST]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  for n in (1, 2):
    p = subprocess.run(
        [sys.executable, "scripts/mp_run.py", "--num-processes", "2", "--", *argv, f"num_batches={n}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  run = f"{root}/mp"
  objects = _objects(run)
  assert f"{run}/checkpoints/2/meta/metadata" in objects and f"{run}/.lock" not in objects
  assert _steps(f"{run}/metrics.jsonl") == [1, 2]  # process 0 alone writes: each step once
