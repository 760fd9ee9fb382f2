"""validation.validate: no non-finite or meaningless value reaches training, and print_config refuses what training
refuses (one line naming the key, before any model is built).

References: the values are chosen so that each has no meaning (NaN, a negative temperature, a nucleus of mass 0);
the rule tests walk the real schema (every float and int leaf of a parsed cpu_tiny config), so a key MaxText or the
plugin adds later is covered without a new line here.
"""

import math
import os
import subprocess
import sys

import pytest

from maxtext_rl_plugin import config as config_lib
from maxtext_rl_plugin import validation
from maxtext_rl_plugin.errors import ConfigError

TINY = "configs/cpu_tiny.yml"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(name="tiny_pc", scope="module")
def tiny_pc_fixture():
  return config_lib.load_pydantic([TINY])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        # Non-finite: NaN passes every `x < 0` check, so only a finiteness check stops it.
        (["learning_rate=inf"], "'learning_rate'=inf: must be a finite number"),
        (["rl.grpo_beta=nan"], "'rl.grpo_beta'=nan: must be a finite number"),
        (["rl.grpo_beta=inf"], "'rl.grpo_beta'=inf: must be a finite number"),
        (["reward_exact_answer=nan"], "'reward_exact_answer'=nan: must be a finite number"),
        (["rl.rollout_is_cap=inf"], "'rl.rollout_is_cap'=inf: must be a finite number"),
        (["sft_learning_rate=inf"], "'sft_learning_rate'=inf: must be a finite number"),
        # Values that used to be silently reinterpreted.
        (["decode_sampling_temperature=-1"], "'decode_sampling_temperature'=-1.0: must be >= 0 (0 = greedy)"),
        (["decode_sampling_nucleus_p=0"], "'decode_sampling_nucleus_p'=0"),
        (["decode_sampling_top_k=-3"], "'decode_sampling_top_k'=-3: must be >= 0 (0 = off)"),
        (["generation_configs.greedy.eval_top_p=0"], "'generation_configs.greedy.eval_top_p'=0"),
        (["generation_configs.greedy.eval_temperature=-0.5"], "'generation_configs.greedy.eval_temperature'=-0.5"),
        (["adam_b1=1.0"], "'adam_b1'=1.0: must be in [0, 1)"),
        (["adam_b2=-0.1"], "'adam_b2'=-0.1: must be in [0, 1)"),
        (
            ["lora.enable_lora=true", "lora.lora_rank=128", "lora.lora_alpha=8"],
            "'lora.lora_rank'=128: must be <= emb_dim",
        ),
        (["num_eval_passes=0"], "'num_eval_passes'=0: must be >= 1"),
        (["max_prefill_predict_length=0"], "'max_prefill_predict_length'=0: must be >= 1"),
        (["rl.grpo_epsilon=2"], "'rl.grpo_epsilon'=2.0: must be >= 0 and <= 1"),
        # Values that used to crash later (ZeroDivisionError, OverflowError) or only at model build.
        (["rollout_prefill_buckets=[0,32]"], "'rollout_prefill_buckets'=[0, 32]"),
        (["rollout_batch_buckets=[0]"], "'rollout_batch_buckets'=[0]"),
        (["num_batches=99999999999999999999"], "'num_batches'=99999999999999999999: must fit a 64-bit integer"),
        (["synthetic_min_steps=3"], "'synthetic_max_steps'=2: must be >= synthetic_min_steps=3"),
        (["log_period=0"], "'log_period'=0: must be >= 1"),
        (["stop_token_ids=[-1]"], "'stop_token_ids'=[-1]: must be token ids >= 0"),
        (["rl.off_policy_steps=-1"], "'rl.off_policy_steps'=-1: must be >= 0"),
        (["rl.reshard_chunk_size=0"], "'rl.reshard_chunk_size'=0: must be >= 1"),
        # rl.use_agentic_rollout's limits fit the completion budget (cpu_tiny: 160 - 128 = 32 tokens).
        (["rl.use_agentic_rollout=true", "rl.agentic_max_tokens=33"], "'rl.agentic_max_tokens'=33: must be <= the"),
        (
            ["rl.use_agentic_rollout=true", "rl.agentic_max_tokens=16", "rl.agentic_turn_tokens=17"],
            "'rl.agentic_turn_tokens'=17: must be <= the episode's 16 tokens",
        ),
        (["rl.use_agentic_rollout=true", "rl.agentic_tools=[]"], "'rl.agentic_tools'=[]: must name at least one tool"),
        # A run_name that would put outputs outside one run directory.
        (["run_name=a/b"], "'run_name'='a/b': must be one directory name"),
        (["run_name=.."], "'run_name'='..': must be one directory name"),
    ],
)
def test_meaningless_values_are_refused_in_one_line(overrides, needle):
  with pytest.raises(ConfigError) as e:
    config_lib.load_config([TINY, *overrides])
  assert f"invalid value for {needle}" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_documented_conventions_still_pass():
  c = config_lib.load_config(
      [TINY, "decode_sampling_temperature=0", "decode_sampling_top_k=0", "decode_sampling_nucleus_p=1", "adam_b1=0"]
  )
  assert (c.decode_sampling_temperature, c.decode_sampling_top_k, c.decode_sampling_nucleus_p) == (0.0, 0, 1.0)


def _float_leaves(pc):
  for name in type(pc).model_fields:
    for key, value in validation._leaves(name, getattr(pc, name)):  # pylint: disable=protected-access
      if isinstance(value, float) and not isinstance(value, bool):
        yield key


def _set_leaf(pc, key, value):
  """Set one leaf of a parsed config in place (a top-level key, `block.key` or `dict_key.a.b`)."""
  *path, last = key.split(".")
  obj = pc
  for part in path:
    obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
  if isinstance(obj, dict):
    obj[last] = value
  else:
    object.__setattr__(obj, last, value)


def test_every_float_key_refuses_nan_and_infinity(tiny_pc):
  keys = [k for k in _float_leaves(tiny_pc) if "[" not in k]
  assert len(keys) > 50, keys  # MaxText's and the plugin's float keys, found by walking the schema
  for key in keys:
    for bad in (math.nan, math.inf, -math.inf):
      pc = tiny_pc.model_copy(deep=True)
      _set_leaf(pc, key, bad)
      if math.isinf(bad) and key in validation.INFINITY_MEANS:
        validation.check_numbers(pc)
        continue
      with pytest.raises(ConfigError, match="must be a finite number"):
        validation.check_numbers(pc)


def test_integers_beyond_int64_are_refused(tiny_pc):
  pc = tiny_pc.model_copy(deep=True)
  _set_leaf(pc, "eval_interval", 2**63)
  with pytest.raises(ConfigError, match="'eval_interval'=9223372036854775808: must fit a 64-bit integer"):
    validation.check_numbers(pc)


def test_every_range_key_exists_in_the_schema(tiny_pc):
  # A typo in the table would check nothing: each key must name a real field.
  for key in validation.RANGES:
    head, _, inner = key.partition(".")
    cls = type(getattr(tiny_pc, head)) if inner else type(tiny_pc)
    assert (inner or head) in cls.model_fields, key


def test_a_run_needs_a_run_name():
  c = config_lib.load_config([TINY, "run_name="])  # a config that does not train (the score CLI) may omit it
  with pytest.raises(ConfigError, match="'run_name'='': must be set for a run"):
    validation.check_run(c)


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run(
      [sys.executable, "-m", "maxtext_rl_plugin.train_rl", TINY, *args],
      cwd=REPO,
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
      check=False,
  )


@pytest.mark.parametrize(
    "args, line",
    [
        (["run_name="], "error: invalid value for 'run_name'='': must be set for a run"),
        (["synthetic_min_steps=3"], "error: invalid value for 'synthetic_max_steps'=2"),
        (["rl.grpo_epsilon=1.5"], "error: invalid value for 'rl.grpo_epsilon'=1.5"),
    ],
)
def test_print_config_refuses_what_training_refuses(args, line):
  p = _cli("print_config=true", *args)
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
  errs = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert len(errs) == 1 and errs[0].startswith(line), p.stderr[-2000:]
