"""Nothing a user has is lost: reruns of finished runs, resume records, corrupt checkpoints, signals, locks, outputs.

Each end-to-end case is a real `train_rl` subprocess on configs/cpu_tiny.yml (docs/reliability.md lists which test
proves which guarantee). References: file hashes before/after, the step numbers in the metrics file and
batches.jsonl, Orbax's step directories, exit codes and the single `error:` line.
"""

import hashlib
import json
import math
import os
import pathlib
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import types

import pytest

from maxtext_rl_plugin import metrics as metrics_lib
from maxtext_rl_plugin import run_dir as run_dir_lib

import _in_process as in_process
from _tiny import SMALL_VOCAB

REPO = pathlib.Path(__file__).resolve().parents[1]
FAST = ["num_test_batches=1", "eval_batch_size=2", "checkpoint_period=1", "eval_interval=0", "metrics_file=metrics.jsonl"]


def _cmd(out, *overrides):
  return [
      sys.executable,
      "-m",
      "maxtext_rl_plugin.train_rl",
      "configs/cpu_tiny.yml",
      f"base_output_directory={out}",
      "run_name=r",
      *SMALL_VOCAB,
      *FAST,
      *overrides,
  ]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("XLA_FLAGS", None)
  return env


def _train(out, *overrides, check=True):
  """train_rl in this process (tests/_in_process.py); the signal, kill and lock tests start their own processes."""
  p = in_process.train_rl(_cmd(out, *overrides)[3:])
  if check:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p


def _steps(path):
  return [json.loads(l)["step"] for l in pathlib.Path(path).read_text(encoding="utf-8").splitlines() if l.strip()]


def _digest(*paths):
  return [hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest() for p in paths]


def _tree(root):
  """Every file under `root` with its content digest: 'changes no byte' compared whole."""
  return {str(p.relative_to(root)): _digest(p)[0] for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------------------------------------
# Units
# ----------------------------------------------------------------------------------------------------------------------


def _tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
  """What TensorBoard shows of `logdir`'s event files, read from the bytes: TFRecords (u64 length, u32 crc, an `Event`
  proto, u32 crc) in file-name (= creation time) order, and TensorBoard's restart rule (its EventAccumulator): a
  SessionLog START event at step s hides every event read before it whose step is >= s."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel  # the proto only, for reading

  scalars: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(pathlib.Path(logdir).glob("events.out.tfevents.*")):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos : pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
      pos += 12 + n + 4
      if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
        scalars = {tag: [(s, v) for s, v in pts if s < event.step] for tag, pts in scalars.items()}
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
  """An attempt logs steps 1-4 and dies after its checkpoint at step 2; the resumed run logs steps 3-4 again. The
  event files on disk hold both attempts; TensorBoard must show steps 1, 2 from the first and 3, 4 from the second."""
  tb = tmp_path / "tensorboard"
  first = metrics_lib.RunLogger(str(tb), None, total_steps=4)
  for step in range(1, 5):
    first.log_step(step, {"loss": float(step)})
  first.close()
  time.sleep(1.1)  # event file names carry the creation second: the resumed run's file sorts after the first's
  resumed = metrics_lib.RunLogger(str(tb), None, total_steps=4, start_step=2)
  for step in (3, 4):
    resumed.log_step(step, {"loss": 10.0 * step})
  resumed.close()
  assert _tensorboard_scalars(tb)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_prune_jsonl_drops_later_steps_and_a_torn_line(tmp_path):
  f = tmp_path / "m.jsonl"
  f.write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x"')
  assert run_dir_lib.prune_jsonl(str(f), 2) == 2  # step 3 and the torn step-4 line
  assert _steps(f) == [0, 1, 2]
  assert f.read_text().endswith("\n")
  assert run_dir_lib.prune_jsonl(str(f), 2) == 0  # idempotent, file untouched


def test_lock_names_a_live_holder_and_takes_over_a_dead_one(tmp_path):
  lock = run_dir_lib.RunLock(str(tmp_path))
  (tmp_path / ".lock").write_text(
      json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "heartbeat": time.time()})
  )
  with pytest.raises(run_dir_lib.RunLockedError, match=f"in use by pid {os.getppid()} on host"):
    lock.acquire()
  with subprocess.Popen([sys.executable, "-c", "pass"]) as dead:
    pass  # leaving the block waits for it: its pid is then free
  (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "heartbeat": time.time()}))
  lock.acquire()
  assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
  lock.release()
  assert not (tmp_path / ".lock").exists()
  # Another host's lock that stopped beating for longer than stale_after_s is taken over too.
  (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "heartbeat": time.time() - 3600}))
  run_dir_lib.RunLock(str(tmp_path), stale_after_s=600).acquire()


_HOLDER = """
import sys, time
from maxtext_rl_plugin import run_dir
lock = run_dir.RunLock(sys.argv[1], stale_after_s=1.0, launch_id=sys.argv[2], host="pod-a")
lock.acquire()
lock.start_heartbeat(interval_s=0.1)
print("held", flush=True)
time.sleep(600)  # one long step: only the heartbeat thread keeps the lock fresh
"""


def _lock_info(path):
  return json.loads((path / ".lock").read_text())


def test_lock_heartbeat_thread_and_takeover_by_the_same_launch(tmp_path):
  with subprocess.Popen(
      [sys.executable, "-c", _HOLDER, str(tmp_path), "job-1"], cwd=REPO, stdout=subprocess.PIPE, text=True
  ) as holder:
    _takeover_while_the_holder_runs(tmp_path, holder)


def _takeover_while_the_holder_runs(tmp_path, holder):
  """The holder keeps its lock fresh from its heartbeat thread; a restart of its own launch takes it over at once."""
  try:
    assert holder.stdout.readline().strip() == "held"
    first = _lock_info(tmp_path)["heartbeat"]
    time.sleep(2.5)  # > stale_after_s: the holder's main thread never refreshed the lock, its heartbeat thread did
    assert _lock_info(tmp_path)["heartbeat"] > first + 1.5
    # Another launch (even on another host, where liveness cannot be probed) is refused while the heartbeat is fresh.
    with pytest.raises(run_dir_lib.RunLockedError, match=f"in use by pid {holder.pid} on host pod-a"):
      run_dir_lib.RunLock(str(tmp_path), stale_after_s=1.0, launch_id="job-2", host="pod-b").acquire()
    # A restart of the same launch on another host takes over at once: the holder is its own previous attempt.
    t = time.time()
    restart = run_dir_lib.RunLock(str(tmp_path), stale_after_s=600.0, launch_id="job-1", host="pod-b")
    restart.acquire()
    assert time.time() - t < 1.0
    time.sleep(0.5)  # the old holder's heartbeat thread sees the lock is no longer its own and leaves it alone
    info = _lock_info(tmp_path)
    assert (info["host"], info["pid"], info["launch_id"]) == ("pod-b", os.getpid(), "job-1")
    assert holder.poll() is None  # the previous attempt still runs (a zombie pod) and did not steal it back
    restart.release()
    assert not (tmp_path / ".lock").exists()
  finally:
    holder.kill()
    holder.wait()


def test_lock_launch_id_comes_from_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv(run_dir_lib.LAUNCH_ID_ENV, "ray:run:abc")
  lock = run_dir_lib.RunLock(str(tmp_path))
  lock.acquire()
  assert _lock_info(tmp_path)["launch_id"] == "ray:run:abc" and lock.stale_after_s == 60.0
  lock.release()
  monkeypatch.delenv(run_dir_lib.LAUNCH_ID_ENV)
  # Without a launch id nothing proves a live-looking holder is a previous attempt: an empty id matches nothing.
  (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "launch_id": "", "heartbeat": time.time()}))
  with pytest.raises(run_dir_lib.RunLockedError):
    run_dir_lib.RunLock(str(tmp_path)).acquire()


def test_unwritable_outputs_fail_before_any_model_is_built(tmp_path):
  (tmp_path / "afile").write_text("x")
  for override, needle in (
      (f"base_output_directory={tmp_path / 'afile'}", "base_output_directory"),
      ("base_output_directory=/proc/x", "base_output_directory"),
      (f"metrics_file={tmp_path}", "metrics_file"),
  ):
    t = time.time()
    cmd = [sys.executable, "-m", "maxtext_rl_plugin.train_rl", "configs/cpu_tiny.yml", override]
    if not override.startswith("base_output_directory"):
      cmd.append(f"base_output_directory={tmp_path / 'runs'}")
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=300, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert lines[-1].startswith(f"error: invalid value for '{needle}'"), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert time.time() - t < 60  # no model was built


# ----------------------------------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_finished_rerun_lock_and_corrupt_checkpoint(tmp_path):
  _train(tmp_path, "num_batches=3")
  run = tmp_path / "r"
  files = [run / "summary.json", run / "summary.png", run / "metrics.jsonl", run / "batches.jsonl"]
  before = _digest(*files)
  # 1. Rerunning a finished run reports it and changes nothing.
  p = _train(tmp_path, "num_batches=3")
  assert "already finished all 3 RL steps" in p.stdout and "eval accuracy" in p.stdout
  assert _digest(*files) == before
  # 1b. A rerun asked to stop before where the run already is says so and changes no byte (it used to resume,
  # rewrite summary.json with start_step 3 / total_steps 2 and replace summary.png).
  tree = _tree(run)
  p = _train(tmp_path, "num_batches=2", check=False)
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert p.stderr.strip().splitlines()[-1].startswith(f"error: {run} already trained 3 RL steps"), p.stderr[-2000:]
  assert _tree(run) == tree
  # 1c. A resume whose data or model would differ is refused in one line, before any model is built.
  for override, needle in (
      ("synthetic_max_steps=3", "synthetic_seed=1234, synthetic_min_steps=1, synthetic_max_steps=2"),
      ("synthetic_seed=7", "synthetic_seed=1234"),
      ("model_name=qwen3-1.7b", "model_name='qwen3-0.6b'"),
  ):
    p = _train(tmp_path, "num_batches=4", override, check=False)
    errs = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert p.returncode == 2 and len(errs) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert errs[0].startswith(f"error: cannot resume {run}: its checkpoints were written with") and needle in errs[0]
    assert _tree(run) == tree
  # 2. A live holder of the run directory: the second process gets one line naming it.
  (run / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}))
  p = _train(tmp_path, "num_batches=4", check=False)
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: run directory")
  assert f"pid {os.getpid()}" in p.stderr and "Traceback" not in p.stderr
  (run / ".lock").unlink()
  # 3. The newest checkpoint is corrupt (a truncated array file): resume from step 2, keep the corrupt one aside.
  victim = max(
      (f for f in (run / "checkpoints" / "3" / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size
  )
  victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
  p = _train(tmp_path, "num_batches=4")
  assert "skipped checkpoint step 3" in p.stdout and "resuming" in p.stdout and "from checkpoint step 2" in p.stdout
  assert list((run / "checkpoints").glob("3.corrupt-*"))
  assert sorted(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit())[-2:] == [3, 4]
  # Every step appears once in the records, although step 3 was trained twice (its first record was dropped).
  steps = [s for s in _steps(run / "metrics.jsonl") if s > 0]
  assert sorted(set(steps)) == [1, 2, 3, 4] and steps.count(3) <= 2  # step 3: one train record (+ its eval)
  train_steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in l]
  assert train_steps == [1, 2, 3, 4]
  assert _steps(run / "batches.jsonl") == [1, 2, 3, 4]


@pytest.mark.slow
def test_sigterm_checkpoints_and_resumes(tmp_path):
  with subprocess.Popen(
      _cmd(tmp_path, "num_batches=60", "checkpoint_period=1000"),
      cwd=REPO,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  ) as proc:
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
      if metrics.exists() and any('"reward/mean"' in l for l in metrics.read_text().splitlines()):
        break
      time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
  assert proc.returncode == 143, (out[-2000:], err[-2000:])
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: stopped by SIGTERM after step ") and "resume from checkpoint step" in last, err[-2000:]
  assert "Traceback" not in err
  stopped_at = int(last.split("after step ")[1].split("/")[0])
  assert (tmp_path / "r" / "checkpoints" / str(stopped_at)).is_dir()  # written although checkpoint_period=1000
  p = _train(tmp_path, f"num_batches={stopped_at + 1}", "checkpoint_period=1000")
  assert f"from checkpoint step {stopped_at}" in p.stdout
  assert _steps(tmp_path / "r" / "batches.jsonl") == list(range(1, stopped_at + 2))


def test_a_fresh_run_refuses_another_runs_metrics_file(tmp_path):
  shared = tmp_path / "shared.jsonl"
  shared.write_text('{"step": 1, "reward/mean": 0.5}\n')
  with pytest.raises(run_dir_lib.OutputError, match="already holds 1 record"):
    run_dir_lib.check_fresh_metrics_file(str(shared), str(tmp_path / "runs" / "b"))
  assert shared.read_text() == '{"step": 1, "reward/mean": 0.5}\n'
  own = tmp_path / "runs" / "b" / "metrics.jsonl"
  own.parent.mkdir(parents=True)
  own.write_text('{"step": 1}\n')
  run_dir_lib.check_fresh_metrics_file(str(own), str(tmp_path / "runs" / "b"))  # this run's own: no error


_EXITING_REWARD = """
import sys

def quits(prompts, completions, **kwargs):
  sys.exit(0)
"""


@pytest.mark.slow
def test_a_reward_function_that_exits_ends_the_run_with_one_line_not_success(tmp_path):
  # sys.exit(0) inside a user's reward function used to end the run with exit code 0 and no step trained; once
  # training has started, tensorboardX's exit handler also printed a second traceback after any error.
  reward = tmp_path / "hostile.py"
  reward.write_text(_EXITING_REWARD)
  p = _train(tmp_path, "num_batches=2", "reward_functions=quits", f"reward_functions_path={reward}", check=False)
  assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
  errs = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert len(errs) == 1 and errs[0].startswith(f"error: reward function 'quits' ({reward}:4) called sys.exit(0)"), errs
  assert "Traceback" not in p.stderr and "can't create new thread" not in p.stderr, p.stderr[-3000:]
  assert not (tmp_path / "r" / "summary.json").exists()


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_step(tmp_path, monkeypatch, caplog):
  # A real Orbax save of a small tree; the fake is at Orbax's file-write boundary (serialization's
  # async_serialize_from_host, which TensorStore writes through): ENOSPC for step 2's arrays. Orbax's write threads
  # log the failure with its traceback before the save raises; the run shows only its own line.
  import errno  # pylint: disable=import-outside-toplevel
  import logging  # pylint: disable=import-outside-toplevel

  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint._src.serialization import serialization  # pylint: disable=import-outside-toplevel

  from maxtext_rl_plugin import checkpointing  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.errors import CheckpointError  # pylint: disable=import-outside-toplevel

  params = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4)}
  opt = {"mu": jnp.ones(3, jnp.float32)}
  ckpt = checkpointing.RunCheckpointer(str(tmp_path / "checkpoints"), period=1)
  ckpt.save(1, params, opt, {"step": 1})

  async def disk_full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(serialization, "async_serialize_from_host", disk_full)
  caplog.set_level(logging.ERROR)
  with pytest.raises(CheckpointError) as e:
    ckpt.save(2, {"w": params["w"] + 1}, opt, {"step": 2})
  assert "checkpoint step 2 was not written: no space left on the device" in str(e.value), str(e.value)
  assert "the run can resume from step 1" in str(e.value) and "\n" not in str(e.value)
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage()[:200] for r in caplog.records]
  monkeypatch.undo()
  restored, _, meta = ckpt.restore(1, params, opt)
  assert np.array_equal(np.asarray(restored["w"]), np.arange(12, dtype=np.float32).reshape(3, 4))
  assert meta == {"step": 1}
  ckpt.close()


def test_orbax_errors_a_save_does_not_explain_are_still_logged(caplog):
  # The held records come back when the failure is not one the run turns into its own line.
  import logging  # pylint: disable=import-outside-toplevel

  from maxtext_rl_plugin import checkpointing  # pylint: disable=import-outside-toplevel

  record = logging.LogRecord("absl", logging.ERROR, "/x/orbax/checkpoint/f.py", 1, "thread failed", None, None)
  caplog.set_level(logging.ERROR)
  with checkpointing._OrbaxErrorLogs():  # pylint: disable=protected-access
    logging.getLogger("absl").handle(record)
    assert not caplog.records
  assert [r.getMessage() for r in caplog.records] == ["thread failed"]


def _unraisable(exc: BaseException) -> types.SimpleNamespace:
  return types.SimpleNamespace(
      exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__, err_msg=None, object=None
  )


def test_a_restore_that_fails_leaves_no_event_loop_tracebacks(tmp_path, monkeypatch):
  """Issue 61: a checkpoint with one array folder deleted resumed from the step before, but printed 9-13
  `RuntimeError: Event loop is closed` tracebacks around the "skipped" line: Orbax's restore fails on the missing
  array at once and closes its event loop while TensorStore still reads the others, whose callbacks then fail
  (unraisable, so Python prints them). Reference: a recorder installed as sys.unraisablehook before the restores sees
  every unraisable exception they leave. Each fresh copy of the step is one chance for the race (on 2 cores about one
  in three showed it before the fix; ten copies)."""
  import asyncio  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin import checkpointing  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.errors import CheckpointError  # pylint: disable=import-outside-toplevel

  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
  params = {f"w{i:03d}": jnp.full((8, 8), float(i)) for i in range(256)}
  opt_state = {"count": jnp.zeros((), jnp.int32)}
  ckpt = checkpointing.RunCheckpointer(str(tmp_path / "src"), period=1)
  ckpt.save(1, params, opt_state, {"step": 1})
  ckpt.close()
  for copy in range(10):
    shutil.copytree(tmp_path / "src", tmp_path / f"copy{copy}")
    shutil.rmtree(tmp_path / f"copy{copy}" / "1" / "params" / "w200")
    ckpt = checkpointing.RunCheckpointer(str(tmp_path / f"copy{copy}"), period=1)
    with pytest.raises(CheckpointError, match="NOT_FOUND"):
      ckpt.restore(1, params, opt_state)
    time.sleep(0.2)  # the abandoned reads finish
    ckpt.close()
  assert not seen, f"{len(seen)} unraisable exceptions, e.g. {seen[0]!r}"
  # Only those are dropped: any other unraisable exception reaches the hook the restore found.
  sys.unraisablehook(_unraisable(RuntimeError("Event loop is closed")))  # not raised by asyncio's callback
  sys.unraisablehook(_unraisable(ValueError("something else")))
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError as e:
    sys.unraisablehook(_unraisable(e))  # what TensorStore's callback raises: dropped
  assert [repr(e) for e in seen] == ["RuntimeError('Event loop is closed')", "ValueError('something else')"]


def test_a_step_directory_without_metadata_neither_refuses_nor_decides_a_rerun(tmp_path):
  # An empty `5/` (a tampered or torn checkpoint) beside a real step 2: a rerun asking for 3 steps is not told the run
  # "already trained 5 steps" (the restore sets 5 aside and resumes from 2); step 2's metadata is what is compared.
  from maxtext_rl_plugin.config import load as config_lib  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.run import identity as run_identity  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.run import meta as run_meta  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.errors import CheckpointError  # pylint: disable=import-outside-toplevel

  config = config_lib.load_config(["configs/cpu_tiny.yml", f"base_output_directory={tmp_path}"])
  run_dir = os.path.join(str(tmp_path), config.run_name)
  ckpts = pathlib.Path(run_identity.checkpoint_dir(config, run_dir))
  (ckpts / "2" / "meta").mkdir(parents=True)
  (ckpts / "5").mkdir()
  meta = run_identity.identity(config)
  (ckpts / "2" / "meta" / "metadata").write_text(json.dumps(meta))
  run_meta.check_rerun(config, run_dir, 3)  # resumes from 2
  with pytest.raises(CheckpointError, match=r"already trained 2 RL steps \(checkpoint step 2"):
    run_meta.check_rerun(config, run_dir, 1)
  (ckpts / "2" / "meta" / "metadata").write_text(json.dumps({**meta, "model_name": "qwen3-8b"}))
  with pytest.raises(CheckpointError, match="written with model_name='qwen3-8b'"):
    run_meta.check_rerun(config, run_dir, 3)


_SIGTERM_WHILE_LOADING = """
import os, signal, sys
from maxtext_rl_plugin import train_rl
from maxtext_rl_plugin.config import precheck as config_precheck
first_pass = config_precheck.precheck
def precheck(argv):
  os.kill(os.getpid(), signal.SIGTERM)  # delivered while the config loads, deterministically
  return first_pass(argv)
config_precheck.precheck = precheck
sys.exit(train_rl.main(sys.argv[1:]))
"""


def test_sigterm_while_the_config_loads_is_one_line_and_exit_143(tmp_path):
  # Before the trainer installs its handlers (config loading, ~10 s of imports), SIGTERM used to kill the process
  # with no line; now it is the same line and exit code as a SIGTERM during the model build.
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  p = subprocess.run(
      [
          sys.executable,
          "-c",
          _SIGTERM_WHILE_LOADING,
          os.path.join(REPO, "configs/cpu_tiny.yml"),
          f"base_output_directory={tmp_path}",
      ],
      capture_output=True,
      text=True,
      env=env,
      timeout=120,
      check=False,
  )
  assert p.returncode == 143, (p.returncode, p.stderr[-2000:])
  assert p.stderr.splitlines() == ["error: stopped by SIGTERM before training started; nothing was written"], p.stderr
  assert not os.listdir(tmp_path)


# ----------------------------------------------------------------------------------------------------------------------
# One file, one owner; a resume that changes the math says so; a resume that changes the examples is refused
# ----------------------------------------------------------------------------------------------------------------------


def _tiny(tmp_path, *overrides):
  from maxtext_rl_plugin.config import load as config_lib  # pylint: disable=import-outside-toplevel

  return config_lib.load_config(["configs/cpu_tiny.yml", f"base_output_directory={tmp_path}", "run_name=r", *overrides])


def _write_checkpoint_meta(config, tmp_path, step, **changes):
  """Step `step`'s metadata as resume.save writes it (run/meta.checkpoint_meta: the same function), without a model."""
  from maxtext_rl_plugin.run import meta as run_meta  # pylint: disable=import-outside-toplevel

  meta_dir = pathlib.Path(tmp_path) / "r" / "checkpoints" / str(step) / "meta"
  meta_dir.mkdir(parents=True, exist_ok=True)
  meta = {**run_meta.checkpoint_meta(config, step), **changes}
  (meta_dir / "metadata").write_text(json.dumps(meta))
  return meta


@pytest.mark.parametrize(
    "metrics_file, needle",
    [
        ("summary.json", "is the name of a file every run writes itself (summary.json)"),
        ("batches.jsonl", "(batches.jsonl)"),
        ("summary.png", "(summary.png)"),
        ("{tmp}/other/summary.json", "(summary.json)"),  # another run's output of the same name
        ("checkpoints/m.jsonl", "lies inside checkpoint_dir="),
        ("tensorboard/m.jsonl", "lies inside tensorboard_dir="),
        ("{tmp}/train.jsonl", "is the run's input train_data_path"),
        ("{tmp}/template.json", "is the run's input data_template_path"),
    ],
)
def test_metrics_file_never_names_another_output_or_an_input_of_the_run(tmp_path, metrics_file, needle):
  from maxtext_rl_plugin.run import identity as run_identity  # pylint: disable=import-outside-toplevel

  (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
  (tmp_path / "template.json").write_text('{"SYSTEM_PROMPT": "s", "TEMPLATE": "{question}"}')
  overrides = [
      f"metrics_file={metrics_file.format(tmp=tmp_path)}",
      f"train_data_path={tmp_path / 'train.jsonl'}",
      f"data_template_path={tmp_path / 'template.json'}",
  ]
  config = _tiny(tmp_path, *overrides)
  with pytest.raises(run_dir_lib.OutputError, match=re.escape(needle)):
    run_identity.check_outputs(config)
  # The first pass (the config as written, before the schema's imports) refuses it too.
  from maxtext_rl_plugin.config import precheck as config_precheck  # pylint: disable=import-outside-toplevel

  with pytest.raises(run_dir_lib.OutputError, match=re.escape(needle)):
    run_identity.check_outputs(
        config_precheck.precheck(["configs/cpu_tiny.yml", f"base_output_directory={tmp_path}", "run_name=r", *overrides])
    )
  assert not (tmp_path / "r" / "summary.json").exists()


def test_a_resume_refuses_another_runs_metrics_file(tmp_path):
  # Run r's checkpoints wrote to their own metrics file; a resume given run b's file (with records) used to prune and
  # overwrite b's records. The fresh-run refusal now holds on resume too; r's own file and a new empty file pass.
  from maxtext_rl_plugin.run import meta as run_meta  # pylint: disable=import-outside-toplevel

  own = tmp_path / "r_metrics.jsonl"
  config = _tiny(tmp_path, f"metrics_file={own}", "num_batches=3")
  _write_checkpoint_meta(config, tmp_path, 1)
  other = tmp_path / "b" / "metrics.jsonl"
  other.parent.mkdir()
  other.write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.7}\n')
  before = other.read_bytes()
  with pytest.raises(run_dir_lib.OutputError, match=r"holds 2 record\(s\) of another run; .* resumes from step 1, whose"):
    run_meta.check_rerun(_tiny(tmp_path, f"metrics_file={other}", "num_batches=3"), str(tmp_path / "r"), 3)
  assert other.read_bytes() == before
  own.write_text('{"step": 1}\n')
  run_meta.check_rerun(config, str(tmp_path / "r"), 3)
  run_meta.check_rerun(_tiny(tmp_path, f"metrics_file={tmp_path / 'new.jsonl'}", "num_batches=3"), str(tmp_path / "r"), 3)


@pytest.mark.parametrize(
    "override, key",
    [
        ("batch_size=4", "batch_size=2"),
        ("rl.num_generations=4", "num_generations=2"),
        ("data_shuffle_seed=9", "data_shuffle_seed="),
        ("synthetic_max_value=99|synthetic_task=products synthetic_max_value=99", "synthetic_task='word_problems'"),
        ("synthetic_num_eval=64", "synthetic_num_eval=256"),
        ("use_chat_template=false", "use_chat_template=True"),
        ("solution_start_token=<ans>", "solution_start_token='<answer>'"),
        ("data_template_path={tmp}/template.json", "template_digest="),
        ("eval_data_path={tmp}/eval.jsonl", "eval_data_path content digest None"),
    ],
)
def test_a_resume_that_changes_the_examples_is_refused_before_any_model(tmp_path, override, key):
  from maxtext_rl_plugin.run import meta as run_meta  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.errors import CheckpointError  # pylint: disable=import-outside-toplevel

  (tmp_path / "template.json").write_text('{"SYSTEM_PROMPT": "s", "TEMPLATE": "{question}"}')
  (tmp_path / "eval.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
  before, _, after = override.rpartition("|")  # the checkpoint's overrides | the resume's
  _write_checkpoint_meta(_tiny(tmp_path, "num_batches=3", *before.split()), tmp_path, 1)
  with pytest.raises(CheckpointError) as e:
    run_meta.check_rerun(_tiny(tmp_path, "num_batches=3", *after.format(tmp=tmp_path).split()), str(tmp_path / "r"), 3)
  assert f"cannot resume {tmp_path / 'r'}: its checkpoints were written with" in str(e.value) and key in str(e.value)


def test_a_resume_that_changes_the_update_says_so_in_one_note_per_key(tmp_path):
  from maxtext_rl_plugin.run import meta as run_meta  # pylint: disable=import-outside-toplevel

  meta = _write_checkpoint_meta(_tiny(tmp_path, "num_batches=3"), tmp_path, 2)
  resumed = _tiny(tmp_path, "num_batches=3", "learning_rate=5e-5", "rl.grpo_beta=0.5", "decode_sampling_temperature=0.7")
  run_meta.check_rerun(resumed, str(tmp_path / "r"), 3)  # accepted
  assert run_meta.update_changes(resumed, meta) == [
      "note: resuming with learning_rate=5e-05, not the 0.0001 of the checkpoint's steps (1-2): the steps from here "
      "use the new value",
      "note: resuming with rl.grpo_beta=0.5, not the 0.08 of the checkpoint's steps (1-2): the steps from here use "
      "the new value",
      "note: resuming with decode_sampling_temperature=0.7, not the 1.0 of the checkpoint's steps (1-2): the steps "
      "from here use the new value",
  ]
  assert not run_meta.update_changes(_tiny(tmp_path, "num_batches=3"), meta)
  assert not run_meta.update_changes(resumed, {k: v for k, v in meta.items() if k != "update_keys"})  # older ckpt
  # Every key of the table is a key of the schema (a renamed key would silently stop being compared).
  assert set(run_meta.update_values(resumed)) == set(run_meta.UPDATE_KEYS)


# ----------------------------------------------------------------------------------------------------------------------
# Finite inputs, non-finite training: stopped before the update is applied or saved
# ----------------------------------------------------------------------------------------------------------------------


def test_a_batch_whose_rewards_overflow_float32_statistics_stops_before_the_update():
  import numpy as np  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.algorithms import advantages as advantages_lib  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.run import step as step_lib  # pylint: disable=import-outside-toplevel

  def batch(rewards):
    r = np.asarray(rewards, np.float32)
    with np.errstate(all="ignore"):
      return types.SimpleNamespace(rewards=r, advantages=advantages_lib.group_advantages(r, 2, "group_std", "grpo"))

  step_lib.check_batch(4, batch([0.0, 1.0, 1.0, 1.0]), 2)  # ordinary rewards pass
  for rewards, needle in (
      ([3e38, -3e38, 0.0, 1.0], "step 4: the rewards of group 0 ([3e+38, -3e+38]) spread beyond float32"),
      ([0.0, 1.0, 2e38, 3e38], "step 4: the rewards of group 1 ([2e+38, 3e+38]) spread beyond float32"),
      ([0.0, 1.0, np.inf, 1.0], "step 4: the rewards of group 1"),
  ):
    with pytest.raises(step_lib.NonFiniteError, match=re.escape(needle)):
      step_lib.check_batch(4, batch(rewards), 2)
  nan_adv = types.SimpleNamespace(rewards=np.zeros(4, np.float32), advantages=np.asarray([0, np.nan, 0, 0], np.float32))
  with pytest.raises(step_lib.NonFiniteError, match=r"step 2: the advantage of completion 1 is nan"):
    step_lib.check_batch(2, nan_adv, 2)


def test_a_non_finite_loss_or_gradient_norm_stops_the_step_and_is_kept_in_the_records():
  from maxtext_rl_plugin.run import step as step_lib  # pylint: disable=import-outside-toplevel

  tee = metrics_lib.TunixTee()
  tee.log_scalar("actor/train/loss", 0.5)
  tee.log_scalar("actor/train/grad_norm", 1.5)
  step_lib.check_update(3, tee.latest())
  tee.log_scalar("actor/train/loss", float("nan"))  # the step's second update
  tee.log_scalar("actor/train/grad_norm", float("inf"))
  with pytest.raises(step_lib.NonFiniteError, match=r"^step 3: the update's loss nan, grad_norm inf; stopped before"):
    step_lib.check_update(3, tee.latest())
  assert math.isnan(tee.drain()["actor/train/loss"])  # kept: it used to vanish from the records


def test_the_console_says_when_a_step_trains_on_nothing():
  from maxtext_rl_plugin.run import step as step_lib  # pylint: disable=import-outside-toplevel

  signal_ = step_lib.LearningSignal(log_period=1)
  uniform = {"reward/zero_variance_group_fraction": 1.0}
  notes = [signal_.note(s, uniform, 2) for s in range(1, 23)]
  assert [i + 1 for i, n in enumerate(notes) if n] == [1, 11, 21]  # first, then every 10 * log_period steps
  assert notes[0].startswith("note: step 1 trains on nothing: every group's completions got equal rewards")
  assert signal_.note(23, {"reward/zero_variance_group_fraction": 0.5}, 2) is None
  short = {
      "reward/zero_variance_group_fraction": 1.0,
      "dynamic_sampling/short_groups": 2.0,
      "dynamic_sampling/refill_rounds": 3.0,
      "dynamic_sampling/refills_stopped": 0.0,
  }
  assert signal_.note(24, short, 2) == (
      "note: step 24: dynamic sampling found 0 informative group(s) of 2 after 3 refill round(s) (rl.max_refill_rounds "
      "is spent); 2 slot(s) are masked out and the step trains on nothing (a zero update)"
  )


@pytest.mark.slow
def test_rewards_that_overflow_the_update_stop_the_run_before_anything_is_saved(tmp_path):
  # Rewards of +-3e38 (each a float32, their spread not) made the advantages 0 or NaN, the loss NaN, and the run saved
  # its step-1 checkpoint that way and exited 0 with `loss` and `grad_norm` missing from its records.
  rewards_file = REPO / "tests" / "data" / "dynamic_sampling_rewards.py"
  p = _train(
      tmp_path,
      "num_batches=2",
      "reward_functions=spread_beyond_float32",
      f"reward_functions_path={rewards_file}",
      "eval_before_training=false",
      check=False,
  )
  errs = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
  assert len(errs) == 1 and errs[0].startswith(
      "error: step 1: the rewards of group 0 ([-3e+38, 3e+38]) spread beyond"
  ), errs
  assert not (tmp_path / "r" / "checkpoints" / "1").exists() and not (tmp_path / "r" / "summary.json").exists()
  assert not (tmp_path / "r" / "batches.jsonl").exists()  # the step never trained
