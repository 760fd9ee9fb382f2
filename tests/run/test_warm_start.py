"""The SFT warm start (run/warm_start.py): a stop during it keeps its steps, and a rerun continues them to the weights
of an uninterrupted warm start.

Three short warm starts of cpu_tiny (3 steps, 80-token rows) share one compilation (the tests' compilation cache).
"""

import os
import signal

from flax import nnx
import jax
import numpy as np
import pytest

from maxtext_rl_plugin import checkpointing
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin import signals
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.data import load as data_load
from maxtext_rl_plugin.run import warm_start

from _tiny import SMALL_VOCAB

STEPS, STOP_AT = 3, 1


@pytest.fixture(name="tiny", scope="module")
def tiny_fixture(tmp_path_factory):
  """cpu_tiny on the small tokenizer, short rows: config, model, its initial weights, mesh, tokenizer, train split."""
  root = tmp_path_factory.mktemp("sft")
  argv = [
      "configs/cpu_tiny.yml",
      f"base_output_directory={root}",
      "run_name=r",
      *SMALL_VOCAB,
      f"sft_warmup_steps={STEPS}",
      "sft_batch_size=2",
      "sft_learning_rate=0.01",
      "max_prefill_predict_length=64",  # short rows: this is about the stop, not the data
      "max_target_length=80",
  ]
  rs = models.setup_devices(config_lib.parse(argv))
  config = rs.trainer_config
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config))
  train_split, _ = data_load.load_splits(data_load.DataSettings.from_config(config), tokenizer)
  model, mesh = models.build_model(config, rs.trainer_devices, pad_id=tokenizer.pad_token_id)
  initial = jax.tree_util.tree_map(lambda x: x, nnx.state(model, nnx.Param))  # a copy: nnx.state holds live Variables
  return config, model, initial, mesh, tokenizer, train_split


def _warm_start(tiny, run_dir):
  """A warm start from the model's initial weights into `run_dir`: its params (host copies) and meta."""
  config, model, initial, mesh, tokenizer, train_split = tiny
  nnx.update(model, initial)
  meta = warm_start.warm_start(
      warm_start.SftSettings.from_config(config), model, mesh, tokenizer, train_split, str(run_dir)
  )
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))], meta


def _stopped_then_continued(tiny, run, monkeypatch, capsys):
  """SIGTERM delivered inside step STOP_AT (before its update) under the trainer's handlers; then the rerun."""
  real = warm_start._tokenize_batch  # pylint: disable=protected-access
  calls = []

  def signal_during_step(*args, **kwargs):
    calls.append(1)
    if len(calls) == STOP_AT:
      os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)

  with monkeypatch.context() as m:
    m.setattr(warm_start, "_tokenize_batch", signal_during_step)
    with pytest.raises(signals.Stopped) as stopped, signals.GracefulStop():
      _warm_start(tiny, run)
  ckpt = run / "checkpoints" / "sft"
  assert stopped.value.exit_code == 143
  assert str(stopped.value) == (
      f"stopped by SIGTERM during the SFT warm start after step {STOP_AT}/{STEPS}; its steps are saved in {ckpt}: "
      f"rerunning the same command continues the warm start from step {STOP_AT}"
  )
  assert sorted(os.listdir(ckpt)) == [str(STOP_AT)]
  assert "SIGTERM received: finishing the current step" in capsys.readouterr().out
  continued = _warm_start(tiny, run)
  out = capsys.readouterr().out
  assert f"SFT warm start: continuing from step {STOP_AT}/{STEPS}" in out
  assert f"SFT warm start step {STOP_AT}/" not in out and f"SFT warm start step {STEPS}/{STEPS}" in out
  assert sorted(os.listdir(ckpt)) == [str(STEPS)]  # the finished warm start replaces the partial one
  return continued


def test_sigterm_during_the_warm_start_saves_its_steps_and_a_rerun_continues_them(tiny, tmp_path, monkeypatch, capsys):
  """Issue 61: a SIGTERM during the warm start said "nothing was written" and its steps were lost. Now the step in
  flight finishes, the steps so far are saved (params and optimizer state), one line says where, exit 143, and the
  rerun trains only the remaining steps. The reference: the same warm start uninterrupted. Batch k is a pure function
  of (seed, k) and the optimizer state carries the schedule's position, so the continued run ends on its weights."""
  reference, ref_meta = _warm_start(tiny, tmp_path / "uninterrupted")
  continued, meta = _stopped_then_continued(tiny, tmp_path / "stopped", monkeypatch, capsys)
  assert len(continued) == len(reference)
  for a, b in zip(continued, reference):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert meta["final_loss"] == pytest.approx(ref_meta["final_loss"], rel=1e-6)


class _Trained(Exception):
  """Raised where training would begin: the decision before it is what is tested."""


def test_a_saved_warm_start_of_another_plan_starts_over(tiny, tmp_path, monkeypatch, capsys):
  """A partial warm start written with another sft_learning_rate is not continued (it would mix two schedules)."""
  config, _, initial, _, _, train_split = tiny
  ckpt = tmp_path / "r" / "checkpoints" / "sft"
  manager = checkpointing.open_manager(str(ckpt), ("params", "opt_state", "meta"), storage=checkpointing.Storage())
  plan = {key: getattr(config, key) for key in warm_start._PLAN_KEYS}  # pylint: disable=protected-access
  checkpointing.save_items(
      manager, 1, {"params": initial}, {**plan, "sft_learning_rate": 0.5, "steps": 1}, storage=checkpointing.Storage()
  )
  manager.close()
  monkeypatch.setattr(train_split, "batches", lambda *a, **k: (_ for _ in ()).throw(_Trained()))
  with pytest.raises(_Trained):
    _warm_start(tiny, tmp_path / "r")
  out = capsys.readouterr().out
  assert f"SFT warm start: step 1 in {ckpt} was written with sft_learning_rate=0.5; starting over" in out


def test_the_schedule_of_one_warm_start_step_is_defined():
  """sft_warmup_steps=1 was optax's ValueError (cosine with 0 decay steps); longer warm starts keep their schedule."""
  assert float(warm_start.lr_schedule(1, 1e-3)(0)) == pytest.approx(1e-3)
  ten = warm_start.lr_schedule(10, 1e-3)
  assert float(ten(0)) == 0.0 and float(ten(1)) == pytest.approx(1e-3) and float(ten(10)) == pytest.approx(1e-4)
