"""Config loading: MaxText's pyconfig + the plugin schema, overrides, shorthands and one-line errors."""

import os
import subprocess
import sys

import pytest
import yaml

from maxtext_rl_plugin import config as config_lib
from maxtext_rl_plugin.errors import ConfigError

TINY = "configs/cpu_tiny.yml"


@pytest.fixture(scope="module")
def tiny():
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
  assert config_lib.resolve_yml("configs/rl.yml").endswith(os.path.join("configs", "rl.yml"))
  assert config_lib.resolve_yml("cpu_tiny").endswith("cpu_tiny.yml")


def test_dump_yaml_round_trips_and_redacts_token():
  c = config_lib.load_config([TINY, "hf_access_token=hf_secret", "rl.kl_estimator=k1"])
  data = yaml.safe_load(config_lib.dump_yaml(c))
  assert data["hf_access_token"] == "<redacted>"
  assert data["rl"]["kl_estimator"] == "k1" and data["emb_dim"] == 64


def _run_cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "maxtext_rl_plugin.train_rl", *args], capture_output=True, text=True,
                        env=env, timeout=300, check=False)


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
  from maxtext_rl_plugin import registry

  d = registry.describe()
  assert "embedded" in d["rollout_engines"] and "vllm" in d["rollout_engines"]
  assert {"rl", "cpu_tiny"} <= set(d["configs"])
  assert os.path.isfile(registry.load("configs", "rl"))
