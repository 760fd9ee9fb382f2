"""End-to-end GRPO/GSPO on the tiny MaxText model: outputs, resume, crash safety and bad input.

Each run is a real `train_rl configs/cpu_tiny.yml ...`: MaxText model, Tunix RLCluster + GrpoLearner with the
plugin's loss, the embedded rollout engine, real rewards, Orbax checkpoints, TensorBoard event files and the
metrics_file. Runs go through `train_rl.main` in this process (tests/_in_process.py says why and what it restores);
the SIGKILL during a checkpoint write and the Pathways split start a process of their own.
"""

import hashlib
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time

import jax
from jax.sharding import PartitionSpec as P
import maxtext
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tensorboardX.proto import event_pb2
from tunix.sft import sharding_utils as tunix_sharding

from maxtext_rl_plugin import distributed

import _in_process as in_process
from _tiny import SMALL_VOCAB

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = "configs/cpu_tiny.yml"
FAST = ["num_test_batches=1", "eval_batch_size=4", "checkpoint_period=1", "log_period=1"]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("XLA_FLAGS", None)
  return env


def train_command(out: pathlib.Path, run_name: str, *overrides: str) -> list[str]:
  """The fast tiny-config train_rl command line of run `run_name` under `out`."""
  return [
      sys.executable,
      "-m",
      "maxtext_rl_plugin.train_rl",
      TINY,
      f"base_output_directory={out}",
      f"run_name={run_name}",
      *FAST,
      *overrides,
  ]


def train(out: pathlib.Path, run_name: str, *overrides: str, check=True):
  """Run train_rl to completion (with a metrics_file) in this process; a failure raises with the output's tail."""
  cmd = train_command(out, run_name, f"metrics_file={out / run_name / 'metrics.jsonl'}", *overrides)
  p = in_process.train_rl(cmd[3:])
  if check and p.returncode != 0:
    raise AssertionError(f"train_rl failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
  return p


def _arrays(tree) -> dict:
  """Leaf path -> NumPy array of an Orbax-restored tree."""
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def read_jsonl(path):
  return [json.loads(l) for l in pathlib.Path(path).read_text(encoding="utf-8").splitlines() if l.strip()]


def read_tb_scalars(logdir) -> dict[str, dict[int, float]]:
  """Parse TensorBoard event files (TFRecord framing + Event protos) without TensorFlow."""
  out: dict[str, dict[int, float]] = {}
  for f in pathlib.Path(logdir).glob("events.out.tfevents.*"):
    data = f.read_bytes()
    i = 0
    while i + 12 <= len(data):
      (n,) = struct.unpack("<Q", data[i : i + 8])
      ev = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
      i += 12 + n + 4
      for v in ev.summary.value:
        out.setdefault(v.tag, {})[ev.step] = v.simple_value
  return out


def params_digest(step_dir: pathlib.Path) -> str:
  h = hashlib.sha256()
  for f in sorted(step_dir.rglob("*")):
    if f.is_file():
      h.update(f.relative_to(step_dir).as_posix().encode())
      h.update(f.read_bytes())
  return h.hexdigest()


@pytest.fixture(name="out", scope="module")
def out_fixture(tmp_path_factory):
  return tmp_path_factory.mktemp("runs")


@pytest.fixture(name="grpo_run", scope="module")
def grpo_run_fixture(out):
  """A fresh 3-step GRPO run; the reference for the output and resume tests. On the demo's tokenizer (tests/_tiny.py):
  Qwen3's and its chat template run end to end in tests/test_install.py's installed run."""
  p = train(out, "grpo", *SMALL_VOCAB, "num_batches=3")
  return p, out / "grpo"


def test_grpo_run_writes_checkpoints_tensorboard_metrics_and_progress(grpo_run):
  p, run = grpo_run
  assert [int(d.name) for d in sorted((run / "checkpoints").iterdir()) if d.name.isdigit()] == [1, 2, 3]
  for item in ("params", "opt_state", "meta"):
    assert (run / "checkpoints" / "3" / item).is_dir()
  meta = json.loads((run / "checkpoints" / "3" / "meta" / "metadata").read_text())
  assert meta["step"] == 3 and meta["next_batch_index"] == 3
  recs = read_jsonl(run / "metrics.jsonl")
  steps = [r["step"] for r in recs if "reward/mean" in r]
  assert steps == [1, 2, 3]
  # The parity gate (run/parity.py; rl.parity_check=first by default) passed this honest run: step 1's record carries
  # its figures (float32 both sides: the cached decode and the full forward agree to ~1e-6 nats), steps 2-3 none.
  gated = [r for r in recs if "reward/mean" in r]
  assert 0.0 <= gated[0]["parity/logp_abs_diff_mean"] < 1e-4 and gated[0]["parity/logp_abs_diff_max"] < 1e-3
  assert gated[0]["parity/tokens"] > 0 and not any("parity/logp_abs_diff_mean" in r for r in gated[1:])
  evals = [r for r in recs if "eval/accuracy" in r]
  assert [r["step"] for r in evals] == [0, 3]
  assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
  first = next(r for r in recs if r["step"] == 1 and "reward/mean" in r)
  for key in (
      "accuracy",
      "kl",
      "clip_fraction",
      "entropy",
      "completion/length_mean",
      "perf/tokens_per_s",
      "time/rollout_s",
      "time/reward_s",
      "time/logps_s",
      "time/train_s",
      "time/weight_sync_s",
      "reward/check_answer/mean",
      "reward/match_format_exactly/std",
  ):
    assert key in first, key
  tb = read_tb_scalars(run / "tensorboard")
  assert set(tb["reward/mean"]) == {1, 2, 3}
  assert tb["reward/mean"][2] == pytest.approx(next(r["reward/mean"] for r in recs if r["step"] == 2), rel=1e-6)
  assert 0 in tb["eval/accuracy"]
  progress = [l for l in p.stdout.splitlines() if l.startswith("step ")]
  assert len(progress) == 3 and "step 3/3" in progress[-1] and "tok/s" in progress[0] and "ETA" in progress[0]
  assert "TensorBoard logs:" in p.stdout


# GSPO-token end to end (loss_algo=gspo-token, 2 steps, its sequence-ratio metrics, a finite loss) is one run of
# tests/run/test_trainer_updates.py::test_off_policy_updates_make_ratios_and_gspo_clipping_live, which asserts those and
# more (clipping live, exact resume); the progress line's "step N/N" is asserted by the GRPO run above.


def test_resume_continues_with_no_repeated_or_skipped_batch(out, grpo_run):
  _, ref = grpo_run
  train(out, "resumed", *SMALL_VOCAB, "num_batches=2")
  p = train(out, "resumed", *SMALL_VOCAB, "num_batches=3")
  assert "resuming" in p.stdout and "from checkpoint step 2" in p.stdout
  # num_batches 2 -> 3 stretches the learning-rate schedule (sized by the run's updates): said, with the key to keep it.
  assert "note: the learning-rate schedule now spans 3 optimizer updates, not the 2" in p.stdout
  assert "learning_rate_schedule_steps=2 keeps the old one" in p.stdout
  run = out / "resumed"
  assert read_jsonl(run / "batches.jsonl") == read_jsonl(ref / "batches.jsonl")
  recs = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
  assert [r["step"] for r in recs] == [1, 2, 3]
  # The gate checks each launch's first step: step 1, and step 3, the resumed launch's first (restored weights).
  assert [r["step"] for r in recs if "parity/logp_abs_diff_mean" in r] == [1, 3]
  assert recs[-1]["parity/logp_abs_diff_mean"] < 1e-4
  ref_recs = {r["step"]: r for r in read_jsonl(ref / "metrics.jsonl") if "reward/mean" in r}
  # Same data, same per-step sampling seed, restored params + optimizer: step 3 matches the uninterrupted run.
  assert recs[-1]["reward/mean"] == pytest.approx(ref_recs[3]["reward/mean"], abs=1e-6)
  assert recs[-1]["loss"] == pytest.approx(ref_recs[3]["loss"], rel=1e-4, abs=1e-6)
  # Step 3's loss is computed before its update; the update itself needs the restored AdamW moments too: the weights
  # after step 3 match the uninterrupted run's (a resume that left the optimizer fresh passed every check above).
  for item in ("params", "opt_state"):
    got = _arrays(ocp.StandardCheckpointer().restore(run / "checkpoints" / "3" / item))
    want = _arrays(ocp.StandardCheckpointer().restore(ref / "checkpoints" / "3" / item))
    assert got.keys() == want.keys() and got
    for k, v in want.items():
      np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-7, err_msg=f"{item}{k}")


def test_sigkill_during_checkpoint_write_resumes_from_previous_complete_step(tmp_path):
  out = tmp_path  # its own directory: no shared module fixture, so pytest-xdist may run it beside the GRPO group
  run = out / "killed"
  cmd = train_command(out, "killed", *SMALL_VOCAB, "num_batches=3")
  ckpts = run / "checkpoints"
  complete_before_kill: dict[str, str] = {}
  killed = False
  deadline = time.time() + 600
  with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env()) as proc:
    while proc.poll() is None and time.time() < deadline:
      if ckpts.is_dir():
        names = os.listdir(ckpts)
        tmp = [n for n in names if "tmp" in n and n.split(".")[0] == "2"]
        if tmp:
          complete_before_kill = {n: params_digest(ckpts / n) for n in names if n.isdigit()}
          proc.send_signal(signal.SIGKILL)
          killed = True
          break
      time.sleep(0.002)
    if not killed:
      proc.kill()  # stalled past the deadline: do not leave it running (the assert below reports it)
    proc.wait(timeout=60)
  assert killed, "the run finished or stalled before step 2's checkpoint write could be interrupted"
  assert "1" in complete_before_kill and "2" not in complete_before_kill
  p = train(out, "killed", *SMALL_VOCAB, "num_batches=3")
  assert "from checkpoint step 1" in p.stdout
  # The checkpoint that was complete before the kill is untouched; the run finishes.
  assert params_digest(ckpts / "1") == complete_before_kill["1"]
  assert sorted(int(n) for n in os.listdir(ckpts) if n.isdigit()) == [1, 2, 3]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["load_parameters_path=/nonexistent/ckpt/0/items"], "'load_parameters_path'='/nonexistent/ckpt/0/items'"),
        (["model_name=qwen4-1b"], "'model_name'='qwen4-1b'"),
        (["tokenizer_path=/nonexistent/tokenizer"], "'tokenizer_path'='/nonexistent/tokenizer'"),
    ],
)
def test_bad_input_one_line_and_run_dir_untouched(out, grpo_run, overrides, needle):
  _, ref = grpo_run
  before = {n: params_digest(ref / "checkpoints" / n) for n in ("1", "2", "3")}
  # num_batches=4: a resume that would train (asking for fewer steps than the 3 done is refused before any key is read)
  p = train(out, "grpo", *SMALL_VOCAB, *overrides, "num_batches=4", check=False)
  assert p.returncode == 2, p.stderr[-3000:]
  errs = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert len(errs) == 1 and needle in errs[0], p.stderr[-3000:]
  assert "Traceback" not in p.stderr
  assert {n: params_digest(ref / "checkpoints" / n) for n in ("1", "2", "3")} == before


def test_resume_with_incompatible_batch_size_refuses(out, grpo_run):
  p = train(out, "grpo", *SMALL_VOCAB, "num_batches=4", "batch_size=4", check=False)
  assert p.returncode == 2
  assert "cannot resume" in p.stderr and "batch_size=2" in p.stderr


def test_tokenizer_without_chat_template_is_one_line_error(tmp_path):
  out = tmp_path / "runs"
  tok_src = pathlib.Path(maxtext.__file__).parent / "assets" / "tokenizers" / "qwen3-tokenizer"
  tok = tmp_path / "no-template"
  tok.mkdir()
  (tok / "tokenizer.json").write_bytes((tok_src / "tokenizer.json").read_bytes())
  cfg = json.loads((tok_src / "tokenizer_config.json").read_text())
  cfg.pop("chat_template", None)
  (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
  p = train(out, "notemplate", f"tokenizer_path={tok}", check=False)
  assert p.returncode == 2
  errs = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert len(errs) == 1 and "no chat template" in errs[0] and "use_chat_template=false" in errs[0]
  assert not (out / "notemplate" / "checkpoints").exists()


@pytest.mark.parametrize("shape", [(2, 5), (4, 5), (8,), (6, 3), (16, 2, 2), (3,), (1, 7), (0, 4)])
def test_rows_sharding_is_tunix_shard_input_rule(shape):
  """The run's one placement rule for batches equals Tunix's `get_sharding` (what its shard_input gives the trainer's
  inputs): rows over fsdp when they divide over it, replicated otherwise (MaxText's 1 x 2 rows on 4 trainer chips)."""
  mesh = jax.sharding.AbstractMesh((4, 2), ("fsdp", "tensor"))
  ours = distributed.rows_sharding(mesh, ("fsdp",), shape)
  theirs = tunix_sharding.get_sharding(np.zeros(shape, np.float32), mesh, P("fsdp"))

  def spec(s):
    return tuple(s.spec) + (None,) * (len(shape) - len(s.spec))

  assert spec(ours) == spec(theirs), (shape, ours.spec, theirs.spec)
  assert (distributed.rows_note(shape[0], mesh, ("fsdp",)) is None) == (shape[0] % 4 == 0)


def test_rows_note_says_what_a_replicated_micro_batch_costs():
  mesh = jax.sharding.AbstractMesh((32,), ("fsdp",))
  assert distributed.rows_note(64, mesh, ("fsdp",)) is None
  assert "2 rows does not split over the trainer's 32-way data axis" in distributed.rows_note(2, mesh, ("fsdp",))
  assert "costs what 32 rows would" in distributed.rows_note(2, mesh, ("fsdp",))
  assert "costs what 64 rows would" in distributed.rows_note(40, mesh, ("fsdp",))


@pytest.mark.multidevice
def test_disaggregated_run_syncs_and_verifies_weights_every_step(tmp_path):
  """8 forced CPU devices, use_pathways=true + chips_per_vm=4: MaxText splits trainer 4 / sampler 4; every
  trainer->sampler sync goes through the plugin's resharding and is checked bit for bit."""
  argv = [
      TINY,
      *SMALL_VOCAB,
      f"base_output_directory={tmp_path}",
      "run_name=dis",
      *FAST,
      "num_batches=2",
      "batch_size=1",  # MaxText's post_train/rl.yml default: 1 x 2 rows on 4 trainer devices, replicated as Tunix does
      "use_pathways=true",
      "chips_per_vm=4",
      "rl.verify_weight_sync=every_n",
      "rl.verify_weight_sync_every=1",
      f"metrics_file={tmp_path / 'm.jsonl'}",
  ]
  # In this process (pass 2 forces the 8 devices at its start; in_process refuses any other XLA_FLAGS).
  p = in_process.train_rl(argv, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert p.returncode == 0, p.stderr[-4000:]
  assert "devices: trainer 4, sampler 4 (disaggregated" in p.stdout
  assert "weight syncs: 2, verified bit-exact: 2" in p.stdout
  assert "note: the train micro-batch of 2 rows does not split over the trainer's 4-way data axis" in p.stdout
  recs = [r for r in read_jsonl(tmp_path / "m.jsonl") if "reward/mean" in r]
  assert [r["step"] for r in recs] == [1, 2] and all(r["time/weight_sync_s"] > 0 for r in recs)
