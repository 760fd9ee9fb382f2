"""Config loading: MaxText's pyconfig + the plugin schema, overrides, shorthands and one-line errors."""

import os
import tempfile
import types as pytypes

from maxtext.configs import pyconfig
from maxtext.configs import types
from maxtext.utils import model_creation_utils
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR
import pytest
import yaml

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import keys as config_keys
from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin.run import evaluation
from maxtext_rl_plugin.config import key_status
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin import registry
from maxtext_rl_plugin import tunix_compat
from maxtext_rl_plugin.config import rules
from maxtext_rl_plugin.config.schema import PluginKeys
from maxtext_rl_plugin.config.schema import PluginRL
from maxtext_rl_plugin.errors import ConfigError

import _in_process as in_process

TINY = "configs/cpu_tiny.yml"


@pytest.fixture(name="tiny", scope="module")
def tiny_fixture():
  """The tiny CPU config, parsed once for the module."""
  return config_lib.load_config([TINY])


def test_rl_yml_inherits_maxtext_post_train_rl_and_adds_plugin_keys():
  c = config_lib.load_config(["configs/rl.yml", "model_name=qwen3-0.6b", "tokenizer_path=tokenizers/qwen3-tokenizer"])
  # From MaxText's post_train/rl.yml (base_config), unchanged:
  assert c.use_pathways is True and c.decoder_layer_input == "offload"
  assert c.reward_exact_answer == 1.0 and c.stop_strings is None
  # The plugin's keys and its rl: block additions:
  assert c.rl.kl_estimator == "k3" and c.rl.verify_weight_sync == "first"
  assert c.rollout_engine == "auto"


def test_tiny_config_shrinks_the_named_model(tiny):
  # override_model_config=true: the plugin yml wins over configs/models/qwen3-0.6b.yml.
  assert (tiny.emb_dim, tiny.num_decoder_layers, tiny.num_query_heads, tiny.head_dim) == (64, 2, 4, 16)
  assert os.path.isdir(tiny.tokenizer_path), "relative tokenizer path resolved inside the maxtext wheel"
  assert tiny.checkpoint_dir.endswith(os.path.join("runs", "cpu_tiny", "checkpoints", ""))


@pytest.mark.parametrize(
    "override, attr, expected",
    [
        ("rl.kl_estimator=k1", ("rl", "kl_estimator"), "k1"),
        ("rl.num_generations=4", ("rl", "num_generations"), 4),
        ("rl.epsilon_high=0.28", ("rl", "epsilon_high"), 0.28),
        ("loss_algo=gspo-token", ("rl", "loss_algo"), "gspo-token"),  # seed-tutorial shorthand
        ("rl.loss_algo=gspo-token", ("rl", "loss_algo"), "gspo-token"),
        ("num_generations=3", ("rl", "num_generations"), 3),
        ("reward.reward_exact_answer=2.5", ("reward_exact_answer",), 2.5),
        ("run_name=abc", ("run_name",), "abc"),
        ("base_output_directory=/tmp/x", ("base_output_directory",), "/tmp/x"),
        ("hf_access_token=hf_secret", ("hf_access_token",), "hf_secret"),
    ],
)
def test_overrides_and_shorthands(override, attr, expected):
  c = config_lib.load_config([TINY, override])
  v = c
  for a in attr:
    v = getattr(v, a)
  assert v == expected


def test_nested_and_flat_views_agree_after_override():
  c = config_lib.load_config([TINY, "rl.num_generations=4", "loss_algo=gspo-token"])
  assert c.num_generations == c.rl.num_generations == 4
  assert c.loss_algo == c.rl.loss_algo == "gspo-token"


def test_load_parameters_path_and_model_name_shorthands():
  c = config_lib.load_config([TINY, "model_name=llama3.1-8b", "load_parameters_path=/ckpt/0/items"])
  assert c.model_name == "llama3.1-8b" and c.load_parameters_path == "/ckpt/0/items"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["configs/rl.yml", "not_a_key=1"], "unknown config key 'not_a_key'"),
        ([TINY, "rl.not_a_key=1"], "unknown config key 'rl.not_a_key'"),
        ([TINY, "rl.num_generations=1"], "'rl.num_generations'=1"),
        ([TINY, "loss_algo=foo"], "'foo'"),
        ([TINY, "rl.kl_estimator=k2"], "kl_estimator"),
        ([TINY, "batch_size=abc"], "'batch_size'='abc'"),
        ([TINY, "model_name=qwen9-7b"], "'model_name'='qwen9-7b'"),
        ([TINY, "noequals"], "'noequals' is not of the form key=value"),
        (["does/not/exist.yml"], "config file 'does/not/exist.yml' not found"),
        ([], "usage"),
        ([TINY, "learing_rate=1"], "did you mean 'learning_rate'"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(argv, needle):
  with pytest.raises(ConfigError) as e:
    config_lib.load_config(argv)
  msg = str(e.value)
  assert needle in msg
  assert "\n" not in msg and len(msg) < 400


def test_unknown_key_inside_yml_names_the_file(tmp_path):
  bad = tmp_path / "bad.yml"
  bad.write_text("base_config: rl.yml\nrl:\n  num_generatoins: 4\n")
  with pytest.raises(ConfigError, match=r"rl.num_generatoins.*bad.yml"):
    config_lib.load_config([str(bad)])


def test_invalid_yaml_is_reported(tmp_path):
  bad = tmp_path / "broken.yml"
  bad.write_text("rl: [unclosed\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    config_lib.load_config([str(bad)])


def test_shipped_config_resolves_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert config_files.resolve_yml("configs/rl.yml").endswith(os.path.join("configs", "rl.yml"))
  assert config_files.resolve_yml("cpu_tiny").endswith("cpu_tiny.yml")


def test_dump_yaml_round_trips_and_redacts_token():
  c = config_lib.load_config([TINY, "hf_access_token=hf_secret", "rl.kl_estimator=k1"])
  data = yaml.safe_load(config_lib.dump_yaml(c))
  assert data["hf_access_token"] == "<redacted>"
  assert data["rl"]["kl_estimator"] == "k1" and data["emb_dim"] == 64


def _run_cli(*args):
  return in_process.train_rl(args)


def test_cli_unknown_key_exits_nonzero_with_one_line():
  p = _run_cli("configs/rl.yml", "not_a_key=1")
  assert p.returncode == 2
  err_lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert err_lines == ["error: unknown config key 'not_a_key' (command line)"]
  assert "Traceback" not in p.stderr


def test_cli_print_config_prints_resolved_yaml_and_exits_zero():
  p = _run_cli(TINY, "print_config=true", "loss_algo=gspo-token")
  assert p.returncode == 0, p.stderr[-2000:]
  data = yaml.safe_load(p.stdout)
  assert data["rl"]["loss_algo"] == "gspo-token" and data["base_emb_dim"] == 64


def test_console_script_lists_registered_components():
  d = registry.describe()
  assert "embedded" in d["rollout_engines"] and "vllm" in d["rollout_engines"]
  assert {"rl", "cpu_tiny"} <= set(d["configs"])
  assert os.path.isfile(registry.load("configs", "rl"))


# --- every key has a status; refused keys are errors when set -------------------------------------------------------


def _maxtext_rl_yml_keys() -> set[str]:
  """Keys of MaxText's own configs/post_train/rl.yml file (not its base), read with plain PyYAML."""
  with open(os.path.join(MAXTEXT_CONFIGS_DIR, "post_train", "rl.yml"), encoding="utf-8") as f:
    raw = yaml.safe_load(f)
  keys = set()
  for k, v in raw.items():
    if k == "base_config":
      continue
    keys |= {f"{k}.{inner}" for inner in v} if k == "rl" else {k}
  return keys


def test_every_maxtext_and_plugin_key_has_a_status():
  keys = set(types.RLConfig.model_fields) - set(key_status.BLOCKS)
  keys |= {f"rl.{k}" for k in PluginRL.model_fields.keys()}  # MaxText's rl block and the plugin's additions
  for block in key_status.BLOCKS[1:]:
    keys |= set(types.RLConfig.model_fields[block].annotation.model_fields)
  keys |= set(PluginKeys.model_fields) | _maxtext_rl_yml_keys()
  assert len(keys) > 900
  missing = sorted(k for k in keys if key_status.status(k) is None)
  assert not missing, f"keys without a status in config/key_status.py: {missing[:20]}"
  for k in keys:
    s = key_status.status(k)
    assert s.startswith("honoured (") or (s.startswith("refused: ") and len(s) > 20), (k, s)
  assert set(key_status.all_keys()) >= {key_status.canonical(k) for k in keys}
  # A plugin key's status is its field's rule (config/rules.py; tests/config/test_rules.py: every field has one).
  assert all(key_status.status(k) == s for k, s in rules.statuses().items())


def test_every_mixin_class_of_rlconfig_has_a_class_status():
  # A MaxText upgrade adding a mixin class (a family of keys) must fail here, not default silently.

  classes = {k.__name__ for k in types.RLConfig.__mro__ if "model_fields" in dir(k) and k.__module__ == types.__name__}
  assert not classes - set(key_status.CLASS_STATUS)


@pytest.mark.parametrize(
    "key",
    # the easy-to-miss list, each decided by reading the plugin's code
    [
        "eval_mode",
        "num_eval_passes",
        "eval_dataset_name",
        "num_test_batches",
        "free_kv_cache_during_weight_sync",
        "vllm_block_size",
        "rl.num_iterations",
        "rl.mini_batch_size",
        "train_micro_batch_size",
        "rollout_micro_batch_size",
        "eval_interval",
        "log_period",
        "eval_sampling_strategy",
        "generation_configs",
        "async_checkpointing",
        "profiler",
        "profiler_steps",
        "skip_first_n_steps_for_profiler",
        "rl.use_rollout_logps",
        "rl.force_on_policy_ratio",
        "rl.log_sampler_trainer_agreement",
        "rl.epsilon_high",
        "rl.off_policy_steps",
        "checkpoint_period",
        "max_num_checkpoints_to_keep",
        "enable_checkpointing",
        "num_batches",
        "num_epoch",
        "train_fraction",
        "eval_batch_size",
        "loss_algo",
        "hbm_utilization_vllm",
        "base_emb_dim",
        "ici_fsdp_parallelism",
        "rl.use_agentic_rollout",
        "rl.agentic_max_turns",
        "synthetic_task",
    ],
)
def test_honoured_keys(key):
  assert key_status.status(key).startswith("honoured ("), key_status.status(key)


@pytest.mark.parametrize(
    "override, key, why",
    [
        ("rl.max_concurrency=8", "rl.max_concurrency", "agentic rollout"),
        ("rl.system_prompt=hi", "rl.system_prompt", "agentic rollout"),
        ("reward_num_workers=4", "reward_num_workers", "reward worker pool"),
        ("reward_worker_timeout_seconds=10", "reward_worker_timeout_seconds", "reward worker pool"),
        ("tensorboard_dir=/tmp/elsewhere", "tensorboard_dir", "derived by MaxText"),
        ("checkpoint_dir=/tmp/elsewhere", "checkpoint_dir", "derived by MaxText"),
        ("gc_collect_after_weight_sync=false", "gc_collect_after_weight_sync", "gc.collect"),
        ("use_pathways_reshard=false", "use_pathways_reshard", "Pathways"),
        ("weight_sync_debug=true", "weight_sync_debug", "verify_weight_sync"),
        ("log_weight_sync_time=true", "log_weight_sync_time", "sync"),
        ("rollout_backend=vllm", "rollout_backend", "maps weights itself"),
        ("enable_goodput_recording=true", "enable_goodput_recording", "goodput"),
        ("enable_emergency_checkpoint=true", "enable_emergency_checkpoint", "emergency"),
        ("mtp_num_layers=1", "mtp_num_layers", "multi-token prediction"),
        ("steps=7", "steps", "num_batches"),
    ],
)
def test_refused_key_set_on_the_command_line_is_one_line(override, key, why):
  with pytest.raises(ConfigError) as e:
    config_lib.load_config([TINY, override])
  msg = str(e.value)
  assert msg.startswith(f"config key '{key}' is not supported by maxtext_rl_plugin: "), msg
  assert why in msg and "\n" not in msg


def test_refused_key_at_maxtext_default_is_accepted():
  # Setting a refused key to MaxText's own RL value (post_train/rl.yml or the schema) changes nothing: accepted.
  c = config_lib.load_config(
      [
          TINY,
          "rl.off_policy_steps=0",
          "reward_num_workers=0",
          "max_seq_token_per_tpu=0",
          "rl.max_concurrency=256",
          "gc_collect_after_weight_sync=true",
          "eval_sampling_strategy=greedy",
          "generation_configs.greedy.eval_top_k=1",
      ]
  )
  assert c.rl.off_policy_steps == 0 and c.reward_num_workers == 0


def test_generation_configs_reach_the_eval_sampling(tmp_path):
  """generation_configs is honoured (run/evaluation.py): a user's per-strategy value reaches the eval sampling."""
  f = tmp_path / "gen.yml"
  f.write_text(
      "base_config: cpu_tiny.yml\neval_sampling_strategy: standard\ngeneration_configs:\n  standard:\n"
      "    eval_top_p: 0.5\n"
  )
  cfg = config_lib.load_config([str(f)])
  assert evaluation.sampling_for(cfg) == {"temperature": 0.7, "top_k": 50, "top_p": 0.5}


def test_refused_key_in_a_user_yml_names_the_key(tmp_path):
  f = tmp_path / "mine.yml"
  f.write_text("base_config: cpu_tiny.yml\nrl:\n  max_concurrency: 8\n")
  with pytest.raises(ConfigError, match=r"^config key 'rl.max_concurrency' is not supported"):
    config_lib.load_config([str(f)])


def test_maxtext_rl_yml_values_are_never_refused():
  # MaxText's post_train/rl.yml sets refused keys (e.g. checkpoint_storage_use_ocdbt: false, vllm_load_format):
  # a config that only inherits them loads.
  c = config_lib.load_config(["configs/rl.yml", "model_name=qwen3-0.6b", "tokenizer_path=tokenizers/qwen3-tokenizer"])
  assert c.checkpoint_storage_use_ocdbt is False and c.vllm_load_format == "dummy"


@pytest.mark.parametrize("yml", ["configs/rl.yml", "configs/cpu_tiny.yml", "configs/cpu_demo.yml"])
def test_shipped_configs_set_no_refused_key(yml):
  argv = [yml] + (
      ["model_name=qwen3-0.6b", "tokenizer_path=tokenizers/qwen3-tokenizer"] if yml.endswith("/rl.yml") else []
  )
  assert config_lib.load_pydantic(argv).rl.num_generations >= 2


# --- validate once, the same for print_config and training -------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["batch_size=0"], "'batch_size'=0: must be >= 1"),
        (["max_target_length=128"], "'max_target_length'=128: must exceed max_prefill_predict_length=128"),
        (["rl.grpo_epsilon=-0.1"], "'rl.grpo_epsilon'=-0.1: must be >= 0"),
        (["rl.epsilon_high=-0.2"], "'rl.epsilon_high'=-0.2: must be >= 0"),
        (["rl.grpo_beta=-1"], "'rl.grpo_beta'=-1.0: must be >= 0"),
        (["checkpoint_period=0"], "'checkpoint_period'=0: must be >= 1"),
        (["batch_size=4", "rl.mini_batch_size=3"], "'rl.mini_batch_size'=3: must be >= 1 and divide batch_size=4"),
        (
            ["batch_size=4", "rl.mini_batch_size=2", "train_micro_batch_size=4"],
            "'train_micro_batch_size'=4: must be -1 or a divisor of the mini batch (2 prompts)",
        ),
        (
            ["batch_size=4", "rollout_micro_batch_size=3"],
            "'rollout_micro_batch_size'=3: must be -1 or a divisor of batch_size=4",
        ),
        (
            ["rl.force_on_policy_ratio=true", "rl.num_iterations=2"],
            "'rl.force_on_policy_ratio'=True: valid only with rl.num_iterations=1",
        ),
    ],
)
def test_validate_refuses_with_one_line_naming_the_key(overrides, needle):
  with pytest.raises(ConfigError) as e:
    config_lib.load_config([TINY, *overrides])
  assert f"invalid value for {needle}" in str(e.value)


def test_micro_batches_that_divide_are_accepted():
  c = config_lib.load_config(
      [TINY, "batch_size=8", "rl.mini_batch_size=4", "train_micro_batch_size=2", "rollout_micro_batch_size=4"]
  )
  assert (c.rl.mini_batch_size, c.train_micro_batch_size, c.rollout_micro_batch_size) == (4, 2, 4)


def test_cli_print_config_refuses_what_training_refuses():
  # print_config=true goes through the same load + validate as training.
  for args, line in (
      (["rl.grpo_epsilon=-1"], "error: invalid value for 'rl.grpo_epsilon'=-1.0: must be >= 0"),
      (["reward_num_workers=4"], "error: config key 'reward_num_workers' is not supported by maxtext_rl_plugin: "),
  ):
    p = _run_cli(TINY, "print_config=true", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errs = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert len(errs) == 1 and errs[0].startswith(line), errs


# --- config-file edges: one line naming the file ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, needle",
    [
        ("- a\n- b\n", "must be a mapping of key: value, not a list"),
        ("", "is empty"),
        ("5\n", "must be a mapping of key: value"),
        ("base_config: rl.yml\nrl: 5\n", "'rl' must be a block of keys"),
        ("base_config: rl.yml\nrl: [unclosed\n", "is not valid YAML"),
        ("batch_size: 2\n", "does not extend MaxText's configuration"),
        ("base_config: nowhere.yml\n", "config file 'nowhere.yml' (base_config of"),
    ],
)
def test_config_file_edges_are_one_line_naming_the_file(tmp_path, text, needle):
  f = tmp_path / "edge.yml"
  f.write_text(text)
  with pytest.raises(ConfigError) as e:
    config_lib.load_config([str(f)])
  msg = str(e.value)
  assert needle in msg and "edge.yml" in msg and "\n" not in msg, msg


def test_block_given_a_scalar_on_the_command_line_is_refused():
  with pytest.raises(ConfigError, match="'rl' is a block of keys"):
    config_lib.load_config([TINY, "rl=5"])


def test_cli_list_yml_is_one_line(tmp_path):
  f = tmp_path / "list.yml"
  f.write_text("- 1\n- 2\n")
  p = _run_cli(str(f))
  assert p.returncode == 2 and "Traceback" not in p.stderr
  assert [l for l in p.stderr.splitlines() if l.startswith("error:")] == [
      f"error: config file '{f}' must be a mapping of key: value, not a list"
  ]


def test_user_yml_with_a_token_is_never_copied_to_disk(tmp_path, monkeypatch):
  # base_config naming the plugin's shipped rl.yml used to be materialised as /tmp/<name>-XXXX.yml, token included.
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  monkeypatch.setenv("TMPDIR", str(tmp))

  monkeypatch.setattr(tempfile, "tempdir", None)
  f = tmp_path / "secret.yml"
  f.write_text("base_config: cpu_tiny.yml\nhf_access_token: hf_SECRET_123\n")
  c = config_lib.load_config([str(f), "run_name=tok"])
  assert c.hf_access_token == "hf_SECRET_123"
  assert not list(tmp.iterdir())
  assert not [p for p in tmp_path.iterdir() if p.name not in ("secret.yml", "tmp")]


# --- parse once --------------------------------------------------------------------------------------------------


def test_config_is_parsed_once_per_argv(monkeypatch):
  # train_rl's path: the first pass reads argv, the typed pass reads what it read, and the result is handed down
  # (its HyperParameters view, the device split): MaxText parses once.
  argv = [TINY, "run_name=parse_once_probe"]
  calls = []
  real = pyconfig._initialize_pydantic  # pylint: disable=protected-access  # counts every MaxText parse, ours or not
  monkeypatch.setattr(pyconfig, "_initialize_pydantic", lambda *a, **k: calls.append(a) or real(*a, **k))
  parsed = config_lib.typed(config_precheck.precheck(argv).source())
  parsed.hyperparameters()
  rs = models.setup_devices(parsed)
  assert len(calls) == 1
  assert rs.trainer_config.run_name == "parse_once_probe" and not rs.disaggregated


def _maxtext_split(argv):
  """MaxText's own setup_configs_and_devices on the same parsed inputs (it re-parses argv itself)."""
  parsed = config_lib.parse(argv)
  with tunix_compat.pyconfig_reads(parsed.merged):
    return model_creation_utils.setup_configs_and_devices(
        ["", parsed.yml, *parsed.overrides], parsed.kwargs, config_class=config_keys.config_class()
    )


def _assert_same_split(argv):
  t_pc, s_pc, t_dev, s_dev = _maxtext_split(argv)
  rs = models.setup_devices(config_lib.parse(argv))
  assert rs.trainer_devices == list(t_dev) and rs.sampler_devices == list(s_dev)
  assert rs.trainer_config.get_keys() == config_lib.to_hyperparameters(t_pc).get_keys()
  assert rs.sampler_config.get_keys() == config_lib.to_hyperparameters(s_pc).get_keys()
  return rs


def test_device_split_matches_maxtext_single_device():
  assert not _assert_same_split([TINY]).disaggregated


@pytest.mark.multidevice
def test_device_split_matches_maxtext_pathways_fractions():
  # 8 devices, chips_per_vm=4 -> 2 VMs: MaxText splits trainer/sampler devices by the fractions under Pathways.
  rs = _assert_same_split(
      [TINY, "use_pathways=true", "chips_per_vm=4", "trainer_devices_fraction=0.5", "sampler_devices_fraction=0.5"]
  )
  assert rs.disaggregated and len(rs.trainer_devices) == len(rs.sampler_devices) == 4


def test_slice_counts_must_agree():
  with pytest.raises(ConfigError, match="num_samplers_slices` must be both -1 or both positive"):
    models.setup_devices(config_lib.parse([TINY, "num_trainer_slices=2"]))


def test_refused_key_set_through_maxtext_environment_override(monkeypatch):
  monkeypatch.setenv("M_REWARD_NUM_WORKERS", "3")
  with pytest.raises(ConfigError, match="^config key 'reward_num_workers' is not supported"):
    config_lib.load_config([TINY, "run_name=env_probe"])


def test_multislice_split_and_configs_match_maxtext(monkeypatch):
  # MaxText groups jax.devices() by slice_index; fakes with two slices of 4 stand in for a 2-slice TPU job.

  fakes = [pytypes.SimpleNamespace(id=i, slice_index=i // 4) for i in range(8)]
  monkeypatch.setattr(model_creation_utils.jax, "devices", lambda: fakes)
  argv = [TINY, "num_trainer_slices=1", "num_samplers_slices=1", "ici_tensor_parallelism=2"]
  t_pc, s_pc, t_dev, s_dev = _maxtext_split(argv)
  rs = models.setup_devices(config_lib.parse(argv), devices=fakes)
  assert [d.id for d in rs.trainer_devices] == [d.id for d in t_dev] == [0, 1, 2, 3]
  assert [d.id for d in rs.sampler_devices] == [d.id for d in s_dev] == [4, 5, 6, 7]
  assert rs.trainer_config.get_keys() == config_lib.to_hyperparameters(t_pc).get_keys()
  assert rs.sampler_config.get_keys() == config_lib.to_hyperparameters(s_pc).get_keys()
  assert (rs.trainer_config.ici_fsdp_parallelism, rs.trainer_config.ici_tensor_parallelism) == (2, 2)
  assert (rs.sampler_config.ici_fsdp_parallelism, rs.sampler_config.ici_tensor_parallelism) == (4, -1)
