"""validation.validate: no non-finite or meaningless value reaches training, and print_config refuses what training
refuses (one line naming the key, before any model is built).

References: the values are chosen so that each has no meaning (NaN, a negative temperature, a nucleus of mass 0);
the rule tests walk the real schema (every float and int leaf of a parsed cpu_tiny config), so a key MaxText or the
plugin adds later is covered without a new line here.
"""

import json
import math
import os
import random
import subprocess
import sys

import pytest

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.config import keys as config_keys
from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin.config import dependent_keys
from maxtext_rl_plugin.config import validation
from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.data import synthetic
from maxtext_rl_plugin.errors import ConfigError

import _in_process as in_process

TINY = "configs/cpu_tiny.yml"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(name="tiny_pc", scope="module")
def tiny_pc_fixture():
  return config_lib.load_pydantic([TINY])


_MEANINGLESS = (
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
        (["decode_sampling_temperature=-1"], "'decode_sampling_temperature'=-1.0: must be >= 0.01"),
        # Issue 61: values that cannot work (NaN loss after 36 s, or a group of identical greedy responses).
        (["decode_sampling_temperature=1e-8"], "'decode_sampling_temperature'=1e-08: must be >= 0.01"),
        (["decode_sampling_temperature=0"], "'decode_sampling_temperature'=0: the rollout would be greedy, so the"),
        (["decode_sampling_top_k=1"], "'decode_sampling_top_k'=1: the rollout would be greedy"),
        (["rope_max_timescale=0"], "'rope_max_timescale'=0: must be > 0"),
        (["rope_min_timescale=0"], "'rope_min_timescale'=0: must be > 0"),
        (["generation_configs.greedy.eval_temperature=-0.5"], "'generation_configs.greedy.eval_temperature'=-0.5"),
        (["decode_sampling_nucleus_p=0"], "'decode_sampling_nucleus_p'=0"),
        (["decode_sampling_top_k=-3"], "'decode_sampling_top_k'=-3: must be >= 0 (0 = off)"),
        (["generation_configs.greedy.eval_top_p=0"], "'generation_configs.greedy.eval_top_p'=0"),
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
        # max_seq_token_per_tpu (algorithms/packing.py): a row holds a whole sequence (multi-turn episodes and MoE
        # batches pack: tests/algorithms/test_packing.py).
        (["max_seq_token_per_tpu=100"], "'max_seq_token_per_tpu'=100: must be"),  # MaxText's words in the typed pass
        # A run_name that would put outputs outside one run directory.
        (["run_name=a/b"], "'run_name'='a/b': must be one directory name"),
        (["run_name=.."], "'run_name'='..': must be one directory name"),
    ],
)
# Rows the first pass (config_precheck.precheck, before JAX is imported) leaves to the typed config, and why.
_NEEDS_THE_SCHEMA = {
    "rl.rollout_is_cap=inf": "no shipped yml default types the key (a schema-only field)",
    "lora.enable_lora=true": "the rank is compared with emb_dim, which MaxText derives from the model",
}


@pytest.mark.parametrize(*_MEANINGLESS)
def test_meaningless_values_are_refused_in_one_line(overrides, needle):
  with pytest.raises(ConfigError) as e:
    config_lib.load_config([TINY, *overrides])
  assert f"invalid value for {needle}" in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(*_MEANINGLESS)
def test_the_first_pass_refuses_them_from_the_config_as_written(overrides, needle):
  # The same validation checks on the yml and the command line as written, typed by the shipped defaults: the same
  # line as the typed config's, or nothing (the row is then decided by the test above).
  if overrides[0] in _NEEDS_THE_SCHEMA:
    assert isinstance(config_precheck.precheck([TINY, *overrides]), validation.RawConfig)
    return
  with pytest.raises(ConfigError) as e:
    config_precheck.precheck([TINY, *overrides])
  assert f"invalid value for {needle}" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_first_pass_refuses_nothing_the_typed_config_accepts():
  # Values that look odd as written but that the schema types into valid ones: pyconfig's `none`, numbers written as
  # strings or with an exponent, an empty override, the conventions, a flat twin of an `rl.` key.
  argv = [
      TINY,
      "learning_rate=1e-4",
      "adam_b1=0",
      "decode_sampling_temperature=0.01",
      "decode_sampling_top_k=0",
      "decode_sampling_nucleus_p=1",
      "checkpoint_period=10.0",
      "grpo_epsilon=0.3",
      "rl.epsilon_high=0.4",
      "load_parameters_path=",
      "print_config=true",
  ]
  view = config_precheck.precheck(argv)
  pc = config_lib.load_pydantic(argv)
  assert (view.rl.grpo_epsilon, view.rl.epsilon_high) == (pc.rl.grpo_epsilon, pc.rl.epsilon_high) == (0.3, 0.4)
  assert view.learning_rate == pc.learning_rate == 1e-4 and view.checkpoint_period == pc.checkpoint_period == 10


def test_the_first_pass_knows_every_key_name_of_the_schema():
  # config_keys.light_keys (shipped defaults + key_status's two difference lists) must name exactly the schema's keys: an
  # unknown key is refused before JAX loads, and no known key is refused.
  light, schema = config_keys.light_keys(), config_keys.schema_keys()
  assert light.top == schema.top and light.flat() == schema.flat()
  assert set(light.blocks) == set(schema.blocks)
  for block, inner in light.blocks.items():
    assert inner is None or inner == schema.blocks[block], block


def test_documented_conventions_still_pass():
  # Greedy evaluation (eval_temperature 0) stays valid; a greedy rollout does not (a group of identical responses).
  c = config_lib.load_config(
      [TINY, "generation_configs.greedy.eval_temperature=0", "decode_sampling_top_k=0", "decode_sampling_nucleus_p=1"]
      + ["adam_b1=0"]
  )
  assert (c.decode_sampling_top_k, c.decode_sampling_nucleus_p) == (0, 1.0)


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


def test_the_typed_pass_validates_an_moe_config_without_the_model_code():
  """The second pass (launchers' dry runs, print_config, refusals that need the schema) imports MaxText's schema but
  no model code: `moe.py` pulled in MaxText's MoE layers and through them transformers (a launcher's dry run: 8.4 s,
  4.1 s without). The MoE checks run there all the same (config/early_checks.check_dropless)."""
  code = (
      "import json, sys\n"
      "from maxtext_rl_plugin.config import load\n"
      "from maxtext_rl_plugin.errors import ConfigError\n"
      "load.load_config(['configs/cpu_tiny_moe.yml'])\n"
      "try:\n"
      "  load.load_config(['configs/cpu_tiny_moe.yml', 'capacity_factor=1.25'])\n"
      "except ConfigError as e:\n"
      "  print(str(e))\n"
      "print(json.dumps([m for m in ('maxtext_rl_plugin.moe', 'maxtext.layers.moe', 'maxtext.layers', 'transformers')"
      " if m in sys.modules]))\n"
  )
  p = subprocess.run(
      [sys.executable, "-c", code],
      cwd=REPO,
      capture_output=True,
      text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
      timeout=300,
      check=False,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  refusal, imported = p.stdout.strip().splitlines()[-2:]
  assert refusal.startswith("invalid value for 'capacity_factor'=1.25: token dropping") and "dropless" in refusal
  assert json.loads(imported) == []


def _cli(*args):
  return in_process.train_rl([TINY, *args])


_REFUSE_ALL = """
import importlib, json, sys
for module, argv in json.loads(sys.argv[1]):
  try:
    code = importlib.import_module(f"maxtext_rl_plugin.{module}").main(argv)
  except SystemExit as e:
    code = e.code
  print(json.dumps([code, [m for m in ("jax", "maxtext.configs.types", "tunix") if m in sys.modules]]), flush=True)
import transformers  # what train_rl's quiet settings keep from printing its import-time warnings before a run's lines
"""


def test_config_and_path_mistakes_are_refused_before_jax_is_imported(tmp_path):
  # One process runs train_rl.main (and export_lora.main) on each argv in turn: each must end in exactly one `error:`
  # line, exit 2, with neither JAX nor MaxText's schema nor Tunix imported (they cost ~10 s on a loaded machine);
  # print_config=true refuses what training refuses. Nothing else reaches stderr (transformers' import warnings included).
  tiny = os.path.join(REPO, TINY)
  bad_yml = tmp_path / "bad.yml"
  bad_yml.write_text("base_config: rl.yml\nrl: 5\n")
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  exits, broken, good = tmp_path / "exits.py", tmp_path / "broken.py", tmp_path / "good.py"
  exits.write_text("import sys\nsys.exit(0)\n")
  broken.write_text("def f(:\n")
  good.write_text("def f(prompts, completions, **kwargs):\n  return [0.0] * len(completions)\n")
  cases = [
      ([tiny, "print_config=true", "run_name="], "error: invalid value for 'run_name'='': must be set for a run"),
      ([tiny, "print_config=true", "synthetic_min_steps=3"], "error: invalid value for 'synthetic_max_steps'=2"),
      ([tiny, "print_config=true", "rl.grpo_epsilon=1.5"], "error: invalid value for 'rl.grpo_epsilon'=1.5"),
      # A plugin key's bound is its field's (ge=2): the first pass checks it too (config/rules.ranges).
      ([tiny, "rl.num_generations=1"], "error: invalid value for 'rl.num_generations'=1: must be >= 2"),
      ([tiny, "run_name="], "error: invalid value for 'run_name'='': must be set for a run"),
      ([tiny, "run_name=a/b"], "error: invalid value for 'run_name'='a/b'"),
      ([tiny, "base_output_directory=/proc/x"], "error: invalid value for 'base_output_directory'"),
      ([tiny, f"base_output_directory={a_file}"], "error: invalid value for 'base_output_directory'"),
      ([tiny, "train_data_path=/nonexistent/x.jsonl"], "error: train_data_path='/nonexistent/x.jsonl': file not found"),
      ([tiny, f"eval_data_path={tmp_path}"], f"error: eval_data_path='{tmp_path}': is a directory"),
      ([tiny, "tokenizer_path=/nonexistent/tok"], "error: invalid value for 'tokenizer_path'='/nonexistent/tok'"),
      ([tiny, "load_parameters_path=/nonexistent/c"], "error: invalid value for 'load_parameters_path'='/nonexistent/c'"),
      ([tiny, "learning_rat=1e-4"], "error: unknown config key 'learning_rat' (command line); did you mean"),
      ([tiny, "rl.grpo_betta=0"], "error: unknown config key 'rl.grpo_betta' (command line); did you mean"),
      ([tiny, "learning_rate=inf"], "error: invalid value for 'learning_rate'=inf: must be a finite number"),
      ([tiny, "rl.grpo_beta=nan"], "error: invalid value for 'rl.grpo_beta'=nan"),
      ([tiny, "decode_sampling_nucleus_p=0"], "error: invalid value for 'decode_sampling_nucleus_p'=0.0"),
      ([tiny, "model_name=qwen9-1b"], "error: invalid value for 'model_name'='qwen9-1b'"),
      ([str(bad_yml)], f"error: config file '{bad_yml}': 'rl' must be a block of keys"),
      ([tmp_path], f"error: config file '{tmp_path}' is a directory; give a yml file"),
      ([tiny, "data_template_path=/nonexistent/t.json"], "error: invalid value for 'data_template_path'="),
      ([str(tmp_path / "missing.yml")], "error: config file"),
      # Reward functions: a missing or unimportable file, an unknown name (training and print_config alike).
      ([tiny, "reward_functions=f", "reward_functions_path=/nonexistent/r.py"], "error: reward_functions_path="),
      (
          [tiny, "print_config=true", "reward_functions=f", "reward_functions_path=/nonexistent/r.py"],
          "error: reward_functions_path='/nonexistent/r.py': file not found",
      ),
      ([tiny, "print_config=true", "reward_functions=nosuch"], "error: reward_functions: 'nosuch' is not defined"),
      ([tiny, "reward_functions=f", f"reward_functions_path={exits}"], "error: reward_functions_path="),
      ([tiny, "reward_functions=nosuch", f"reward_functions_path={broken}"], "error: reward_functions_path="),
      ([tiny, "reward_functions=g", f"reward_functions_path={good}"], "error: reward_functions: 'g' is not defined in"),
      # A products task with fewer distinct questions than its eval set; dependent keys with their switch off.
      ([tiny, "synthetic_task=products", "synthetic_max_value=12"], "error: invalid value for 'synthetic_max_value'=12"),
      ([tiny, "rl.agentic_max_turns=8"], "error: config key 'rl.agentic_max_turns'=8 has no effect with"),
      ([tiny, "rl.dynamic_sampling=true", "rl.max_refill_rounds=1000000"], "error: invalid value for 'rl.max_refill_"),
  ]
  cases = [("train_rl", argv, line) for argv, line in cases] + [
      ("export_lora", ["--output", str(tmp_path / "o"), tiny, "run_name=a/b"], "error: invalid value for 'run_name'"),
      ("export_lora", ["--output", str(tmp_path / "o"), tiny, "learning_rat=1"], "error: unknown config key"),
  ]
  # PYTHONDONTWRITEBYTECODE: importing the user's reward files makes Python (not the plugin) cache their bytecode in a
  # __pycache__ beside them; the listing below checks that the refused runs wrote nothing of their own.
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONDONTWRITEBYTECODE="1")
  p = subprocess.run(
      [sys.executable, "-c", _REFUSE_ALL, json.dumps([(m, [str(a) for a in argv]) for m, argv, _ in cases])],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
      check=False,
  )
  results = [json.loads(l) for l in p.stdout.splitlines()]
  errors = p.stderr.splitlines()
  assert len(results) == len(errors) == len(cases), p.stderr[-3000:]
  for (_, argv, line), (code, heavy), err in zip(cases, results, errors):
    assert code == 2 and err.startswith(line), (argv, code, err)
    assert not heavy, (argv, heavy)
  assert sorted(os.listdir(tmp_path)) == ["a_file", "bad.yml", "broken.py", "exits.py", "good.py"]


def _typed(view, key: str) -> bool:
  """Whether the first pass knows `key`'s typed value (one it leaves to pyconfig raises `Unresolved`)."""
  try:
    getattr(view, key)
  except Unresolved:
    return False
  return True


def test_the_first_pass_leaves_environment_overrides_to_pyconfig(tmp_path, monkeypatch):
  # MaxText's `M_<KEY>` variables override the yml with pyconfig's own rules: the first pass must not refuse a value
  # the environment replaces (an empty run_name in the yml, set by M_RUN_NAME).
  yml = tmp_path / "env.yml"
  yml.write_text('base_config: cpu_tiny.yml\nrun_name: ""\n')
  monkeypatch.setenv("M_RUN_NAME", "from_env")
  view = config_precheck.precheck([str(yml)])
  assert "run_name" in view and not _typed(view, "run_name")
  assert config_lib.load_config([str(yml)]).run_name == "from_env"


@pytest.mark.parametrize(
    "text, line",
    [
        ("base_config: cpu_tiny.yml\nrun_name: a\nrun_name: b\n", "found duplicate key run_name (line 3, column 1)"),
        ("base_config: cpu_tiny.yml\nrl:\n\tgrpo_beta: 0.1\n", "found character that cannot start any token (line 3"),
    ],
)
def test_a_yml_that_does_not_parse_names_the_problem_and_its_line(tmp_path, text, line):
  yml = tmp_path / "x.yml"
  yml.write_text(text)
  with pytest.raises(ConfigError) as e:
    config_precheck.precheck([str(yml)])
  assert str(e.value).startswith(f"config file '{yml}' is not valid YAML: {line}"), str(e.value)


def test_the_first_pass_leaves_interpolations_to_pyconfig(tmp_path):
  # `${oc.env:NOPE}` is not a run name: the first pass must neither refuse it as one nor create a directory named
  # after it; pyconfig resolves it or says why it cannot.
  yml = tmp_path / "interp.yml"
  base = os.path.join(REPO, TINY)
  yml.write_text(f"base_config: {base}\nbase_output_directory: {tmp_path}/out\nrun_name: ${{oc.env:NOPE}}\n")
  view = config_precheck.precheck([str(yml)])
  assert "run_name" in view and not _typed(view, "run_name")
  with pytest.raises(ConfigError, match="Environment variable 'NOPE' not found"):
    config_lib.load_config([str(yml)])
  assert not (tmp_path / "out").exists()


# Each dependent-key family (dependent_keys.FAMILIES): a key set while its switch is off, refused by both passes.
_DEPENDENT = [
    (["rl.agentic_max_turns=8"], "'rl.agentic_max_turns'=8 has no effect with rl.use_agentic_rollout=false"),
    (["rl.agentic_tools=[]"], "'rl.agentic_tools'=[] has no effect with rl.use_agentic_rollout=false"),
    (["rl.agentic_tool_timeout_s=5"], "'rl.agentic_tool_timeout_s'=5"),
    (["rl.max_refill_rounds=5"], "'rl.max_refill_rounds'=5 has no effect with rl.dynamic_sampling=false"),
    (["rl.overlong_penalty_factor=2"], "'rl.overlong_penalty_factor'=2"),
    (["rl.verify_weight_sync_every=3"], "'rl.verify_weight_sync_every'=3 has no effect with rl.verify_weight_sync="),
    (["sft_batch_size=4"], "'sft_batch_size'=4 has no effect with sft_warmup_steps=0"),
    (["sft_learning_rate=0.1"], "'sft_learning_rate'=0.1 has no effect with sft_warmup_steps=0"),
    (["synthetic_tool_rate=0.5"], "'synthetic_tool_rate'=0.5 has no effect with synthetic_task='word_problems'"),
]


@pytest.mark.parametrize("overrides, needle", _DEPENDENT)
def test_a_dependent_key_with_its_switch_off_is_refused_by_both_passes(overrides, needle):
  for load in (config_precheck.precheck, config_lib.load_pydantic):
    with pytest.raises(ConfigError) as e:
      load([TINY, *overrides])
    assert needle in str(e.value) and "\n" not in str(e.value), (load, str(e.value))


def test_the_schema_only_dependent_key_is_refused_by_the_typed_pass():
  # rl.rollout_is_cap has no shipped yml default: the first pass cannot type it, the second refuses it.
  assert isinstance(config_precheck.precheck([TINY, "rl.rollout_is_cap=3"]), validation.RawConfig)
  with pytest.raises(ConfigError, match="'rl.rollout_is_cap'=3.0 has no effect with rl.rollout_is='off'"):
    config_lib.load_pydantic([TINY, "rl.rollout_is_cap=3"])


def test_dependent_keys_pass_with_their_switch_on_and_at_their_defaults(tiny_pc):
  config_lib.load_pydantic([TINY, "rl.dynamic_sampling=true", "rl.max_refill_rounds=5", "rl.overlong_buffer_len=4"])
  config_lib.load_pydantic(
      [TINY, "rl.rollout_is=truncate", "rl.rollout_is_cap=3", "sft_warmup_steps=2", "sft_batch_size=4"]
  )
  config_lib.load_pydantic([TINY, "rl.max_refill_rounds=3", "sft_batch_size=16", "rl.agentic_tools=[calculator]"])
  # Each family's defaults are the schema's, so a key left alone is never refused.
  for family in dependent_keys.FAMILIES:
    for key, default in family.keys.items():
      value = dependent_keys._get(tiny_pc, key)  # pylint: disable=protected-access
      assert dependent_keys._same(value, default), (key, value, default)  # pylint: disable=protected-access


@pytest.mark.parametrize(
    "overrides, ok",
    [
        (["synthetic_task=products", "synthetic_max_value=25"], False),  # 16 * 16 = 256 questions: not more than 256
        (["synthetic_task=products", "synthetic_max_value=26"], True),
        (["synthetic_task=products", "synthetic_max_value=9"], False),  # one operand range [9, 9]: 1 question
        (["synthetic_task=products", "synthetic_max_value=20", "synthetic_num_eval=100"], True),
        (["synthetic_task=products", "synthetic_max_value=12", "eval_data_path=tests/data/gsm8k/test.jsonl"], True),
    ],
)
def test_products_needs_more_distinct_questions_than_its_eval_set(overrides, ok):
  # Reference: the distinct questions the generator draws, counted by enumerating its seeds (not by the formula).

  pc = None
  try:
    pc = config_lib.load_pydantic([TINY, *overrides])
  except ConfigError as e:
    assert not ok and "raise synthetic_max_value or lower synthetic_num_eval" in str(e), str(e)
  mv = int(dict(o.split("=") for o in overrides)["synthetic_max_value"])
  cfg = synthetic.SyntheticSettings(max_value=mv, task="products")
  seen = {synthetic.product_problem(random.Random(i), cfg)[0] for i in range(20000)}
  assert validation.products_questions(mv) == len(seen)
  if pc is not None:
    assert ok
