"""train_rm (maxtext_rl_plugin/train_rm.py) and the reward model as a reward (maxtext_rl_plugin/reward_model.py).

A tiny reward model (cpu_tiny's shape on the CPU demo's 528-token tokenizer) trains on synthetic preference pairs whose
chosen answer is the sum and whose rejected one is a wrong sum with a question mark; its held-out pair accuracy must
rise above chance (it starts at 0 here: the random head happens to prefer the rejected ending). The restored
checkpoint then scores as a reward exactly as the trained model did, and a checkpoint of another size, vocabulary or
tokenizer is refused in one line. The 2-step train_rl with the reward model as a reward is extended (the default tier
checks the reward function in process, on the same restore path train_rl takes)."""

import json
import pathlib
import random

import jax
import numpy as np
import pytest

import _in_process as in_process
from _tiny import SMALL_VOCAB
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin import train_rm
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.data import prompts as prompts_lib
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.run import rewards as run_rewards
from maxtext_rl_plugin import reward_model

REPO = pathlib.Path(__file__).resolve().parents[1]
_MODEL = ["configs/cpu_tiny.yml", *SMALL_VOCAB, "max_prefill_predict_length=48", "max_target_length=64"]


def _pairs(n: int, seed: int) -> list[dict]:
  rng = random.Random(seed)
  rows = []
  for _ in range(n):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    wrong = a + b + rng.randint(1, 3)
    rows.append({"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}.", "rejected": f"{a} + {b} = {wrong}?"})
  return rows


@pytest.fixture(name="rm_run", scope="module")
def _rm_run(tmp_path_factory):
  """A reward model trained on 40 synthetic pairs (10 held out), 8 steps: (output directory, train_rm's summary)."""
  out = tmp_path_factory.mktemp("rm")
  pairs = out / "pairs.jsonl"
  pairs.write_text("".join(json.dumps(r) + "\n" for r in _pairs(50, 0)))
  argv = [
      *_MODEL,
      f"train_data_path={pairs}",
      f"base_output_directory={out}",
      "run_name=rm",
      "batch_size=8",
      "num_batches=8",
      "learning_rate=3e-3",
      "eval_interval=0",
      "metrics_file=metrics.jsonl",
  ]
  summary = train_rm.train(argv)
  return out, summary


def test_a_tiny_reward_model_learns_held_out_pairs(rm_run):
  out, summary = rm_run
  assert summary["train_pairs"] == 40 and summary["heldout_pairs"] == 10  # every 5th row held out
  assert summary["heldout_accuracy"] >= 0.9 > summary["heldout_accuracy_before"]
  recs = [json.loads(l) for l in (out / "rm" / "metrics.jsonl").read_text().splitlines()]
  assert recs[0]["step"] == 0 and "eval/pair_accuracy" in recs[0]
  assert recs[-1]["step"] == 8 and recs[-1]["eval/pair_accuracy"] == summary["heldout_accuracy"]
  assert recs[-1]["rm/loss"] < recs[1]["rm/loss"]  # the Bradley-Terry loss fell
  assert list((out / "rm" / "tensorboard").rglob("events.out.tfevents.*")) or list((out / "rm").rglob("events.*"))
  assert (out / "rm" / "checkpoints" / "8").is_dir()


def test_the_restored_reward_model_scores_as_it_trained(rm_run):
  """The reward functions train_rl builds (run/rewards.reward_fns: the loader's, then the reward model), in process: on
  the held-out pairs its scores prefer the chosen answer as often as the trained model did, with the same mean margin."""
  out, summary = rm_run
  config = config_lib.load_config([*_MODEL, f"rl.reward_model_path={out / 'rm'}", "reward_functions=check_answer"])
  fns = run_rewards.reward_fns(config, jax.devices())
  assert [f.__name__ for f in fns] == ["check_answer", "reward_model"]
  held = [r for i, r in enumerate(_pairs(50, 0)) if i % 5 == 4]
  tok = tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config))
  settings = prompts_lib.PromptSettings.from_config(config)
  prompts = [prompts_lib.build_prompt(r["prompt"], tok, settings) for r in held]
  chosen = np.asarray(fns[1](prompts, [r["chosen"] for r in held]))
  rejected = np.asarray(fns[1](prompts, [r["rejected"] for r in held]))
  assert np.mean(chosen > rejected) == summary["heldout_accuracy"]
  last = json.loads((out / "rm" / "metrics.jsonl").read_text().splitlines()[-1])
  assert np.mean(chosen - rejected) == pytest.approx(last["eval/margin"], rel=1e-4, abs=1e-4)


def test_a_mismatched_reward_model_is_refused_in_one_line(rm_run):
  out, _ = rm_run
  config = config_lib.load_config([*_MODEL, f"rl.reward_model_path={out / 'rm'}", "base_emb_dim=32"])
  with pytest.raises(ConfigError) as e:
    run_rewards.reward_model_reward(config, jax.devices())
  msg = str(e.value)
  assert "'rl.reward_model_path'" in msg and "head reads hidden states of size 64, the run's model 32" in msg
  assert "\n" not in msg
  base = config_lib.load_config(_MODEL)
  saved = reward_model.meta_of(
      reward_model.ModelIdentity.of(base),
      tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(base)),
  )
  for key, value in (("tokenizer", "files 0123456789abcdef"), ("vocab_size", 151936), ("kind", "other")):
    with pytest.raises(ConfigError, match="rl.reward_model_path"):
      reward_model.check_meta(
          "p",
          {**saved, key: value},
          reward_model.meta_of(
              reward_model.ModelIdentity.of(config),
              tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config)),
          ),
      )
  with pytest.raises(ConfigError, match="no reward model checkpoint|no such directory"):
    reward_model.read_meta(str(out / "nothing"))


@pytest.mark.extended  # the default tier: test_the_restored_reward_model_scores_as_it_trained (the same reward function)
def test_train_rl_with_the_reward_model_as_a_reward(rm_run, tmp_path):
  out, _ = rm_run
  argv = [
      *_MODEL,
      "decode_sampling_temperature=30",
      "reward_functions=narrow_reward",
      f"reward_functions_path={REPO / 'tests' / 'data' / 'multi_rewards.py'}",
      f"rl.reward_model_path={out / 'rm'}",
      "rl.reward_model_weight=0.5",
      "rl.reward_model_batch_size=3",
      "rl.reward_aggregation=gdpo",
      "metrics_file=metrics.jsonl",
      "eval_before_training=false",
      "eval_after_training=false",
      "num_test_batches=0",
      "num_batches=2",
      "batch_size=2",
      "rl.num_generations=4",
      f"base_output_directory={tmp_path}",
      "run_name=rl",
  ]
  p = in_process.train_rl(argv)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  recs = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines() if l.strip()]
  steps = [r for r in recs if "reward/mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    assert np.isfinite(r["reward/reward_model/mean"]) and "reward/reward_model/zero_spread_fraction" in r
    assert r["reward/mean"] == pytest.approx(
        r["reward/narrow_reward/mean"] + 0.5 * r["reward/reward_model/mean"], rel=1e-4
    )
