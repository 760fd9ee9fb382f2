"""Rollouts ahead of the trainer (maxtext_rl_plugin/run/async_rollout.py + the step loop).

References: the schedule against a hand-counted table; the producer against a simulated sampler whose weight version
is whatever the last `install` put there, under randomised thread timing (the version a batch was sampled with must be
the schedule's, whatever the speeds); end to end on the real tiny MaxText model, the stale batch's behaviour log-probs
against the trainer's (they differ only when the batch really was sampled by older weights).
"""

import json
import random
import shutil
import threading
import time

import pytest
from test_trainer_updates import _train

from maxtext_rl_plugin.run import async_rollout
from maxtext_rl_plugin import signals
from maxtext_rl_plugin.bench import async_rollout as bench

import _in_process as in_process


@pytest.mark.parametrize(
    "k,start,expected",
    [
        (0, 0, [0, 1, 2, 3, 4, 5, 6, 7]),  # synchronous: batch b is sampled by the weights after b steps
        (1, 0, [0, 0, 1, 2, 3, 4, 5, 6]),  # one step ahead: batch b by version b - 1
        (2, 0, [0, 0, 0, 1, 2, 3, 4, 5]),
        (2, 3, [None, None, None, 3, 3, 3, 4, 5]),  # resumed at step 3: batches 3-5 (in flight) resampled by version 3
    ],
)
def test_behaviour_version_table(k, start, expected):
  got = [async_rollout.behaviour_version(b, k, start) for b in range(start, 8)]
  assert got == expected[start:]
  assert all(0 <= b - v <= k for b, v in zip(range(start, 8), got))


class _Sampler:
  """A rollout engine reduced to what the schedule is about: the weight version it holds, and one user at a time."""

  def __init__(self, start, rng):
    self.version = start
    self.in_use = 0
    self.samples = {}  # batch -> version it was sampled with
    self.rng = rng
    self.lock = threading.Lock()

  def _enter(self):
    with self.lock:
      self.in_use += 1
      assert self.in_use == 1, "the engine was used by two threads at once"

  def _leave(self):
    with self.lock:
      self.in_use -= 1

  def sample(self, b, phases):
    """Record the weight version batch `b` was sampled with; fails if the weights change meanwhile."""
    self._enter()
    try:
      v = self.version
      time.sleep(self.rng.uniform(0, 0.004))
      assert self.version == v, "weights changed while a batch was being sampled"
      self.samples[b] = v
      phases["rollout"] = 0.001
      return ("batch", b)
    finally:
      self._leave()

  def install(self, v):
    self._enter()
    try:
      time.sleep(self.rng.uniform(0, 0.002))
      self.version = v
    finally:
      self._leave()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("start", [0, 2])
def test_producer_samples_every_batch_once_with_the_scheduled_weights(k, start, seed):
  rng = random.Random(seed * 100 + k)
  end = 9
  sampler = _Sampler(start, rng)
  prod = async_rollout.RolloutProducer(sampler.sample, off_policy_steps=k, start=start, end=end)
  prod.start_producing()
  lags = []
  try:
    for step in range(start + 1, end + 1):
      item = prod.take(step - 1)
      assert item.value == ("batch", step - 1) and item.index == step - 1
      lags.append(step - 1 - item.version)
      time.sleep(rng.uniform(0, 0.004))  # "training"
      prod.publish(step, lambda s=step: sampler.install(s))
  finally:
    prod.close()
  expected = {b: max(start, b - k) for b in range(start, end)}
  assert sampler.samples == expected
  assert lags == [min(b - start, k) for b in range(start, end)]
  assert sampler.version == end


def test_synchronous_producer_runs_no_thread():
  sampler = _Sampler(0, random.Random(0))
  prod = async_rollout.RolloutProducer(sampler.sample, off_policy_steps=0, start=0, end=3)
  prod.start_producing()
  assert not prod.asynchronous and not prod.producing
  assert threading.current_thread() is threading.main_thread()
  assert prod.take(0).version == 0
  prod.publish(1, lambda: sampler.install(1))
  with pytest.raises(RuntimeError, match="needs weight version 2"):
    prod.take(2)  # batch 2 before version 2: the synchronous loop never does this


def test_a_stop_during_sampling_ahead_lets_the_trainers_step_finish():
  # The producer abandons batch 1 on a stop request (dynamic sampling's refill rounds raise StopSampling): the trainer's
  # step 1 still publishes its weights (its update is applied; it is then checkpointed), and batch 1 is never handed out.
  def sample(b, phases):
    del phases
    if b == 1:
      raise signals.StopSampling("a stop was requested during step 2's refill round 1")
    return b

  prod = async_rollout.RolloutProducer(sample, off_policy_steps=1, start=0, end=4)
  prod.start_producing()
  installed = []
  try:
    assert prod.take(0).value == 0
    prod.publish(1, lambda: installed.append(1))
    assert installed == [1]
    with pytest.raises(signals.StopSampling):
      prod.take(1)
  finally:
    prod.close()


def test_a_failed_rollout_reaches_the_trainer_and_stops_the_producer():
  calls = []

  def sample(b, phases):
    calls.append(b)
    if b == 1:
      raise ValueError("reward function r returned a non-finite reward")
    return b

  prod = async_rollout.RolloutProducer(sample, off_policy_steps=2, start=0, end=6)
  prod.start_producing()
  try:
    assert prod.take(0).value == 0
    with pytest.raises(ValueError, match="non-finite reward"):
      prod.take(1)
    with pytest.raises(ValueError, match="non-finite reward"):
      prod.publish(1, lambda: None)
  finally:
    prod.close()
  assert calls == [0, 1]


def test_close_stops_sampling_ahead():
  calls = []
  prod = async_rollout.RolloutProducer(lambda b, p: calls.append(b), off_policy_steps=3, start=0, end=100)
  prod.start_producing()
  prod.take(0)
  prod.close(timeout=10)
  n = len(calls)
  time.sleep(0.05)
  assert len(calls) == n <= 4  # batches 0..3 (version 0) at most; never past the staleness bound
  assert not prod.producing


# ----------------------------------------------------------------------------------------------------------------------
# End to end on the tiny MaxText model (colocated: the producer samples a pinned snapshot of the shared weights)
# ----------------------------------------------------------------------------------------------------------------------

_ASYNC = [
    "rl.use_rollout_logps=false",
    "rl.rollout_is=truncate",
    "rl.log_sampler_trainer_agreement=true",
    "learning_rate=3e-2",
    "num_test_batches=0",
    "eval_interval=0",
    "num_batches=3",
]


@pytest.mark.extended  # async resume is also the LoRA resume test's (test_dynamic_sampling_e2e)
@pytest.mark.slow
def test_off_policy_steps_trains_stale_batches_deterministically_and_resumes(tmp_path):
  run, recs = _train(tmp_path, "async", "rl.off_policy_steps=1", *_ASYNC)
  assert [r["async/policy_lag"] for r in recs] == [0.0, 1.0, 1.0]
  # Step 1's batch was sampled by the weights it trains (behaviour == trainer to float32 rounding); steps 2 and 3 by
  # the weights one update older, so the sampler's log-probs of the sampled tokens differ from the trainer's and the
  # importance weights leave 1.
  assert recs[0]["mismatch/logp_abs_diff_mean"] < 1e-3
  for r in recs[1:]:
    assert r["mismatch/logp_abs_diff_mean"] > 10 * recs[0]["mismatch/logp_abs_diff_mean"] + 1e-4
    assert r["rollout_is/is_weight_mean"] != pytest.approx(1.0, abs=1e-4)
  ids = [json.loads(l) for l in (run / "batches.jsonl").read_text().splitlines()]
  assert [x["step"] for x in ids] == [1, 2, 3]
  # Deterministic whatever the threads' relative speed: a second run samples every batch with the same weights.
  _, again = _train(tmp_path, "async_again", "rl.off_policy_steps=1", *_ASYNC)
  for key in ("reward/mean", "loss", "mismatch/logp_abs_diff_mean", "rollout_is/is_weight_mean"):
    assert [r[key] for r in again] == [r[key] for r in recs], key

  # The same data order as the synchronous loop (batch k is a function of the seed and k only).
  sync_run, sync_recs = _train(tmp_path, "sync", "rl.off_policy_steps=0", *_ASYNC)
  assert [json.loads(l)["ids"] for l in (sync_run / "batches.jsonl").read_text().splitlines()] == [x["ids"] for x in ids]
  assert [r["async/policy_lag"] for r in sync_recs] == [0.0, 0.0, 0.0]
  assert all(r["mismatch/logp_abs_diff_mean"] < 1e-3 for r in sync_recs)
  # Step 1 is the same computation in both (batch 0, initial weights): thread timing changes nothing.
  assert recs[0]["reward/mean"] == sync_recs[0]["reward/mean"]
  assert recs[0]["loss"] == pytest.approx(sync_recs[0]["loss"], rel=1e-6, abs=1e-9)

  # Resume from step 2's checkpoint: batch 2 (in flight when the run stopped) is sampled again, by the restored
  # weights (lag 0), and no batch is repeated or skipped.
  shutil.rmtree(run / "checkpoints" / "3")
  _, resumed = _train(tmp_path, "async", "rl.off_policy_steps=1", *_ASYNC)
  # metrics_file keeps steps 1-2 of the first run (the record of step 3 went with its checkpoint) and the new step 3.
  assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[-1]["async/policy_lag"] == 0.0
  assert resumed[:2] == recs[:2]
  steps = [json.loads(l)["step"] for l in (run / "batches.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3]


def test_off_policy_steps_without_a_correction_is_refused(tmp_path):
  p = in_process.train_rl(
      ["configs/cpu_tiny.yml", f"base_output_directory={tmp_path}", "rl.off_policy_steps=1", "rl.use_rollout_logps=false"]
  )
  assert p.returncode == 2, p.stderr[-2000:]
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "error: invalid value for 'rl.off_policy_steps'=1: batches up to 1 step(s) stale need a " "correction"
  ), last


@pytest.mark.multidevice
def test_off_policy_steps_on_a_disaggregated_split_syncs_bit_exact_while_sampling_ahead(tmp_path):
  """Trainer 4 / sampler 4 forced CPU devices: the producer samples on the sampler's own copy while the trainer
  updates; every weight sync (serialised with sampling and with the mid-run eval) is verified bit for bit."""
  run, recs = _train(
      tmp_path,
      "dis",
      "rl.off_policy_steps=1",
      "use_pathways=true",
      "chips_per_vm=4",
      "rl.verify_weight_sync=every_n",
      "rl.verify_weight_sync_every=1",
      *_ASYNC[:-3],
      "num_batches=3",
      "num_test_batches=1",
      "eval_batch_size=4",
      "eval_interval=2",
  )
  assert [r["async/policy_lag"] for r in recs] == [0.0, 1.0, 1.0]
  assert all(r["mismatch/logp_abs_diff_mean"] > 10 * recs[0]["mismatch/logp_abs_diff_mean"] + 1e-4 for r in recs[1:])
  summary = json.loads((run / "summary.json").read_text())
  assert summary["weight_syncs"]["count"] == 3 and summary["weight_syncs"]["verified"] == 3
  assert [e["step"] for e in summary["eval_history"]] == [2]


def test_overlap_model_of_bench_async():
  # R = 2 + 1, T = 0.5 + 2.5, S = 0.5, O = 10 - 6.5 = 3.5: 10 s synchronous, max(3, 3) + 4 = 7 s overlapped.
  m = bench.overlap_model({"rollout": 2.0, "reward": 1.0, "logps": 0.5, "train": 2.5, "weight_sync": 0.5, "step": 10.0})
  assert (m["R"], m["T"], m["S"], m["O"]) == (3.0, 3.0, 0.5, 3.5)
  assert m["sync_step"] == 10.0 and m["async_step"] == 7.0
  assert m["predicted_speedup"] == pytest.approx(10 / 7)
  # Rollout-bound: the update hides entirely behind the rollout.
  m = bench.overlap_model({"rollout": 8.0, "reward": 0.0, "logps": 0.0, "train": 2.0, "weight_sync": 0.0, "step": 10.0})
  assert m["async_step"] == 8.0 and m["predicted_speedup"] == pytest.approx(1.25)
