"""The storage layer (maxtext_rl_plugin/storage.py) and what rests on it (run_dir.py's lock and owner marks), on local
disk and against a real GCS endpoint on loopback (fake-gcs-server, tests/_gcs.py), which enforces the generation
preconditions as GCS does."""

from __future__ import annotations

import json
import os
import time
import types

import pytest

from maxtext_rl_plugin import errors
from maxtext_rl_plugin import run_dir
from maxtext_rl_plugin.run import identity as run_identity
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config import load as config_lib


def _root(gcs, name: str) -> str:
  return f"gs://{gcs.bucket}/{name}-{time.time_ns()}"


@pytest.fixture(name="root", params=["local", "gcs"])
def fixture_root(request, tmp_path):
  if request.param == "local":
    return str(tmp_path)
  return _root(request.getfixturevalue("gcs"), "t")


def test_reads_and_writes_local_and_gs(root):
  d = os.path.join(root, "a", "b")
  storage.makedirs(d)
  f = os.path.join(d, "x.jsonl")
  storage.write_atomic(f, "one\n")
  storage.append_text(f, "two\n")
  assert storage.read_text(f) == "one\ntwo\n" and storage.isfile(f) and not storage.isdir(f)
  assert storage.isdir(d) and storage.listdir(d) == ["x.jsonl"]
  storage.write_atomic(os.path.join(d, "y.jsonl"), b"{}")
  assert [os.path.basename(p) for p in storage.glob(os.path.join(d, "*.jsonl"))] == ["x.jsonl", "y.jsonl"]
  with storage.open_write_bytes(os.path.join(d, "z.bin")) as buf:
    buf.write(b"\x00\x01")
  assert storage.read_bytes(os.path.join(d, "z.bin")) == b"\x00\x01" and storage.read_head(f, 3) == b"one"
  v = storage.version(f)
  storage.append_text(f, "three\n")
  assert storage.version(f) != v  # what a data file's digest is cached by
  storage.remove(f)
  storage.remove(f)  # missing: not an error
  assert not storage.exists(f)


def test_exclusive_create_and_conditional_replace(root):
  """What the lock rests on: of two creates one wins; a replace of a version that changed since it was read fails."""
  storage.makedirs(root)
  path = os.path.join(root, "lock")
  assert storage.create_exclusive(path, "first")
  assert not storage.create_exclusive(path, "second")
  text, v1 = storage.read_versioned(path)
  assert text == "first"
  assert storage.replace_if(path, "third", v1)
  assert not storage.replace_if(path, "fourth", v1)  # v1 is gone: someone (here: us) replaced it
  assert storage.read_versioned(path)[0] == "third"
  assert storage.read_versioned(os.path.join(root, "none")) is None


def test_run_lock_on_gs(gcs):
  """The run lock in a bucket: a live holder is refused in one line naming it; a stale one is taken over, and its old
  holder finds out at its next heartbeat instead of overwriting the new holder's lock."""
  run = _root(gcs, "lock") + "/run"
  a = run_dir.RunLock(run, launch_id="", host="host-a")
  a.acquire()
  b = run_dir.RunLock(run, launch_id="", host="host-b")
  with pytest.raises(run_dir.RunLockedError, match=r"in use by pid \d+ on host host-a") as e:
    b.acquire()
  assert "\n" not in str(e.value)
  a.stale_after_s = b.stale_after_s = 0.0  # host-a's heartbeat is now "old": host-b takes over
  time.sleep(0.01)
  b.acquire()
  assert json.loads(storage.read_text(b.path))["host"] == "host-b"
  assert not a.heartbeat(min_interval_s=0.0)  # host-a learns it lost the lock
  assert json.loads(storage.read_text(b.path))["host"] == "host-b"
  b.release()
  assert not storage.exists(b.path)


def test_two_takeovers_of_one_stale_lock_one_wins(gcs):
  run = _root(gcs, "race") + "/run"
  storage.makedirs(run)
  storage.write_atomic(os.path.join(run, ".lock"), json.dumps({"host": "gone", "pid": 1, "heartbeat": 0}))
  found = storage.read_versioned(os.path.join(run, ".lock"))
  wins = [storage.replace_if(os.path.join(run, ".lock"), f"taker {i}", found[1]) for i in range(2)]
  assert wins == [True, False]


def test_no_credentials_is_one_line_naming_the_bucket(monkeypatch, tmp_path):
  """No emulator and no Google credentials: refused before any request, naming the bucket (NO_GCE_CHECK keeps
  google-auth from asking the GCE metadata server, a non-loopback address)."""
  for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setenv("NO_GCE_CHECK", "True")
  monkeypatch.setenv("HOME", str(tmp_path))
  with pytest.raises(run_dir.OutputError, match=r"no Google Cloud credentials for gs://prod-bucket") as e:
    run_dir.probe_dir("gs://prod-bucket/rl", "base_output_directory")
  assert "\n" not in str(e.value) and "STORAGE_EMULATOR_HOST" in str(e.value)


# --- ownership (issue 59 item 3), each case on local disk; the bucket takes the same calls ---------------------------


def test_a_metrics_file_claimed_by_one_run_is_refused_to_another(tmp_path):
  """Two runs given one absolute metrics_file, started together: the second is refused though the first has written
  no record yet (today both were accepted and their records mixed)."""
  mf = str(tmp_path / "shared" / "metrics.jsonl")
  storage.makedirs(os.path.dirname(mf))
  run_a, run_b = str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "b")
  assert not run_dir.claim(mf, run_a, "metrics_file")
  with pytest.raises(run_dir.OutputError, match=r"belongs to the run .*runs/a"):
    run_dir.check_owners(mf, run_b, {}, {})
  with pytest.raises(run_dir.OutputError, match=r"belongs to the run"):
    run_dir.claim(mf, run_b, "metrics_file")
  assert run_dir.claim(mf, run_a, "metrics_file")  # the same run again: its own


def test_a_rerun_after_a_crash_owns_its_absolute_metrics_file(tmp_path):
  """A run killed before its first checkpoint, rerun with the same command: its records (outside the run directory)
  are its own, dropped by the fresh start (today: 'already holds 2 record(s) of another run')."""
  mf = str(tmp_path / "metrics.jsonl")
  run = str(tmp_path / "runs" / "r")
  run_dir.claim(mf, run, "metrics_file")
  storage.write_atomic(mf, '{"step": 1}\n{"step": 2}\n')
  run_dir.check_fresh_metrics_file(mf, run)  # no refusal
  assert run_dir.prune_jsonl(mf, -1) == 2
  with pytest.raises(run_dir.OutputError, match="already holds 1 record"):
    storage.write_atomic(mf, '{"step": 1}\n')
    run_dir.check_fresh_metrics_file(mf, str(tmp_path / "runs" / "other"))


def test_nothing_is_written_into_another_runs_directory(tmp_path):
  """export_lora --output <run>/checkpoints and base_output_directory=<run>/checkpoints: refused (today the first
  wrote `0/` as a step of that run, the second had its directory renamed *.corrupt-* by that run's resume)."""
  other = tmp_path / "runs" / "a"
  (other / "checkpoints" / "1").mkdir(parents=True)
  run_dir.claim(str(other), str(other), "run_name", is_dir=True)
  with pytest.raises(run_dir.OutputError, match=r"'--output'.*lies inside .*runs/a, another run's directory"):
    run_dir.check_not_in_other_run(str(other / "checkpoints" / "0"), "--output", None)
  new_run = other / "checkpoints" / "new"
  with pytest.raises(run_dir.OutputError, match=r"'base_output_directory'.*another run's directory"):
    run_dir.check_owners(None, str(new_run), {}, {})
  run_dir.check_not_in_other_run(str(other / "checkpoints" / "9"), "x", str(other))  # its own: fine
  run_dir.check_owners(None, str(tmp_path / "runs" / "b"), {}, {})  # a sibling: fine


def test_the_probe_leaves_no_run_directory_and_names_a_long_run_name(tmp_path):
  run = tmp_path / "base" / "r"
  run_dir.check_writable(str(run), None)
  assert (tmp_path / "base").is_dir() and not run.exists()  # a run refused after this leaves nothing behind
  with pytest.raises(run_dir.OutputError, match=r"'run_name': 300 bytes"):
    run_dir.check_writable(str(tmp_path / "base" / ("x" * 300)), None)


def test_home_is_expanded(monkeypatch, tmp_path):
  monkeypatch.setenv("HOME", str(tmp_path))
  assert storage.absolute("~/runs") == str(tmp_path / "runs")
  assert run_dir.resolve_metrics_file("~/m.jsonl", "/elsewhere/r") == str(tmp_path / "m.jsonl")
  assert storage.expand("gs://b/x/") == "gs://b/x"


def test_a_finished_run_without_checkpoints_is_not_replaced_unless_asked(tmp_path):
  """enable_checkpointing=false rerun of a finished run (its summary.json): refused (today it started over and replaced
  its records, summary, plot and batches); overwrite_run=true asks for it; a directory without a summary starts."""
  run = tmp_path / "r"
  run.mkdir()
  config = types.SimpleNamespace(enable_checkpointing=False, overwrite_run=False)
  run_identity.check_overwrite(config, str(run))  # nothing finished there yet
  (run / "summary.json").write_text("{}")
  with pytest.raises(errors.CheckpointError, match=r"holds a finished run .* overwrite_run=true") as e:
    run_identity.check_overwrite(config, str(run))
  assert "\n" not in str(e.value)
  run_identity.check_overwrite(types.SimpleNamespace(enable_checkpointing=False, overwrite_run=True), str(run))


def test_data_in_a_bucket_has_a_digest_a_resume_compares(gcs):
  """A resume on other data is refused by the checkpoint's data digest: now for files in a bucket too (it was None)."""
  path = _root(gcs, "digest") + "/train.jsonl"
  storage.write_atomic(path, '{"question": "q", "answer": "#### 1"}\n')
  first = run_identity.data_digest(path)
  assert first and run_identity.data_digest(path) == first
  storage.write_atomic(path, '{"question": "q", "answer": "#### 2"}\n')
  assert run_identity.data_digest(path) not in (None, first)


def test_a_missing_bucket_is_one_line_and_never_created(gcs):
  """gcsfs's mkdir would create a missing bucket in the default project: the layer checks it exists instead."""
  with pytest.raises(run_dir.OutputError, match=r"the bucket gs://no-such-bucket does not exist") as e:
    run_dir.probe_dir("gs://no-such-bucket/rl", "base_output_directory")
  assert "\n" not in str(e.value) and "'base_output_directory'" in str(e.value)
  assert not storage.exists("gs://no-such-bucket")
  assert gcs.bucket


def test_home_in_a_path_key_is_expanded_before_maxtext_derives_the_run_directories(monkeypatch, tmp_path):
  """`base_output_directory=~/runs` made a literal `./~/runs`: the typed config holds the expanded path, and MaxText's
  checkpoint_dir and tensorboard_dir derive from it."""
  monkeypatch.setenv("HOME", str(tmp_path))
  config = config_lib.load_config(["configs/cpu_tiny.yml", "base_output_directory=~/runs", "run_name=r"])
  assert config.base_output_directory == str(tmp_path / "runs")
  assert str(config.checkpoint_dir).startswith(str(tmp_path / "runs" / "r")) and "~" not in str(config.tensorboard_dir)


def test_one_variable_points_every_client_at_an_emulator(monkeypatch):
  """STORAGE_EMULATOR_HOST alone: the first bucket path also points TensorStore (Orbax's arrays) at the emulator."""
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
  monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
  storage.check_credentials("gs://b/rl")
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:4443"
  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "http://127.0.0.1:9")  # a user's own value is kept
  storage.check_credentials("gs://b/rl")
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:9"
