"""Issue 51, classes 3-5: bad input refused in one line, before any model is built; records kept whole.

Each refusal is asserted in the first pass (`config_precheck.precheck` and `train_rl._precheck`: the config as
written, before JAX, the schema and any model) and, where the typed config used to end in a traceback, in the second
pass too (`config.load_config`). `train_rl.main` is run with the schema's loader replaced by one that fails the test,
so "refused before the model build" is checked, not timed. References: the values each key's meaning rules out
(MaxText's own rules: top-k <= experts, an I/O budget > 0), and what a real run writes (run/meta.checkpoint_meta).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
import typing

from maxtext.configs import types as max_types
from maxtext.layers import nnx_decoders
from maxtext.utils import accelerator_to_spec_map
from maxtext.utils import max_utils
import jax
import numpy as np
import pytest
import transformers

from maxtext_rl_plugin import compile_rl
from maxtext_rl_plugin import export_lora
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin.config import schema as config_types
from maxtext_rl_plugin.config import early_checks
from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import keys as config_keys
from maxtext_rl_plugin import errors
from maxtext_rl_plugin.config import key_status
from maxtext_rl_plugin import metrics as metrics_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.run import meta as run_meta
from maxtext_rl_plugin import train_rl
from maxtext_rl_plugin.algorithms import tunix_wiring
from maxtext_rl_plugin.bench import moe as bench_moe
from maxtext_rl_plugin.data import rows as data_rows
from maxtext_rl_plugin.run import resume

TINY = "configs/cpu_tiny.yml"
MOE = "configs/cpu_tiny_moe.yml"

# (config, overrides, what the one line says). Every row was a traceback or a refusal after the model build.
_REFUSED = [
    (TINY, ["run_name=[abc"], "invalid value for 'run_name'='[abc' (command line): not valid YAML"),
    (TINY, ["stop_strings={a"], "invalid value for 'stop_strings'='{a' (command line): not valid YAML"),
    (TINY, ['vllm_hf_overrides={"architectures":["MaxTextForCausalLM"]'], "'vllm_hf_overrides'="),
    (MOE, ["num_experts_per_tok=8"], "invalid value for 'num_experts_per_tok'=8: must be between 1 and num_experts=4"),
    (TINY, ["trainer_devices_fraction=0.75"], "invalid value for 'trainer_devices_fraction'=0.75: with sampler_"),
    (TINY, ["checkpoint_storage_concurrent_gb=0"], "invalid value for 'checkpoint_storage_concurrent_gb'=0: must be > 0"),
    (TINY, ["checkpoint_storage_concurrent_gb=-4"], "'checkpoint_storage_concurrent_gb'=-4: must be > 0"),
    (TINY, ["model_name=deepseek3-tiny"], "rollout_engine=embedded cannot sample deepseek3-tiny (decoder_block=deepseek"),
    (TINY, ["rollout_engine=bogus"], "invalid value for 'rollout_engine'='bogus': expected one of auto, embedded, vllm"),
    (TINY, ["rl.kl_estimator=k2"], "invalid value for 'rl.kl_estimator'='k2': expected one of k1, k3"),
    (TINY, ["rl.router_replay=true"], "rl.router_replay=true needs a mixture-of-experts model; qwen3-0.6b has"),
    (
        TINY,
        ["model_name=qwen3-30b-a3b", "rl.router_replay=true", "ici_pipeline_parallelism=2"],
        "rl.router_replay=true with pipeline parallelism",
    ),
    (TINY, ["rollout_engine=vllm"], "invalid value for 'head_dim'=16: rollout_engine=vllm with qwen3-0.6b needs"),
    # Issue 61: MaxText's own tracebacks (ZeroDivisionError, AssertionError) 10-21 s later, or the schema pass's 10 s.
    (TINY, ["head_dim=0"], "invalid value for 'head_dim'=0: must be >= 1"),
    (TINY, ["head_dim=-4"], "invalid value for 'head_dim'=-4: must be >= 1"),
    (TINY, ["base_num_kv_heads=0"], "invalid value for 'base_num_kv_heads'=0: must be >= 1"),
    (TINY, ["base_num_query_heads=3", "base_num_kv_heads=2"], "'base_num_query_heads'=3: must be a multiple of base_n"),
    (TINY, ["ici_tensor_parallelism=4"], "invalid value for 'base_num_kv_heads'=2: must be divisible by 4"),
    (TINY, ["remat_policy=Full"], "invalid value for 'remat_policy'='Full': expected one of full, minimal"),
    (TINY, ["remat_policy=bogus"], "invalid value for 'remat_policy'='bogus': expected one of full, minimal"),
    (TINY, ["loss_algo=no_such_name"], "invalid value for 'rl.loss_algo'='no_such_name': expected one of grpo, gspo"),
    (TINY, ["decoder_block=foo"], "invalid value for 'decoder_block'='foo': expected one of default,"),
    (TINY, ["ici_fsdp_parallelism=0"], "invalid value for 'ici_fsdp_parallelism'=0: must be >= 1, or -1"),
    (TINY, ["dcn_data_parallelism=-2"], "invalid value for 'dcn_data_parallelism'=-2: must be >= 1, or -1"),
]
# Rows whose typed config (the second pass) used to end in a traceback: checked there too.
_SECOND_PASS = {
    "run_name=[abc",
    "num_experts_per_tok=8",
    "trainer_devices_fraction=0.75",
    "model_name=deepseek3-tiny",
    "head_dim=0",
    "base_num_query_heads=3",
    "remat_policy=Full",
}


def _ids(rows):
  return [" ".join(r[1]) for r in rows]


@pytest.mark.parametrize("config, overrides, needle", _REFUSED, ids=_ids(_REFUSED))
def test_the_first_pass_refuses_in_one_line(config, overrides, needle):
  with pytest.raises(errors.ConfigError) as e:
    config_precheck.precheck([config, *overrides])
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
  if overrides[0] in _SECOND_PASS:
    with pytest.raises(errors.ConfigError) as e2:
      config_lib.load_config([config, *overrides])
    assert needle in str(e2.value), str(e2.value)


@pytest.mark.parametrize(
    "config, overrides",
    [
        (TINY, ["trainer_devices_fraction=1.0", "sampler_devices_fraction=1.0"]),  # colocated: every device is both
        (TINY, ["trainer_devices_fraction=0.25", "sampler_devices_fraction=0.75"]),
        (TINY, ["checkpoint_storage_concurrent_gb=null"]),  # Orbax's default
        (TINY, ["rollout_engine=vllm", "head_dim=64"]),
        (TINY, ["rollout_engine=vllm", 'vllm_hf_overrides={"architectures":["MaxTextForCausalLM"]}']),
        (TINY, ["stop_strings=['</answer>']", "run_name='[abc]'"]),
        (MOE, ["rl.router_replay=true"]),  # Mixtral: MaxText forces its routing
        (MOE, ["num_experts_per_tok=4"]),
        (TINY, ["remat_policy=minimal_with_context"]),  # a name MaxText's decoder knows beyond its RematPolicy enum
        (TINY, ["ici_tensor_parallelism=2"]),  # cpu_tiny's 2 key/value heads split over 2 devices
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_the_first_pass_refuses_nothing_these_mean(config, overrides):
  config_precheck.precheck([config, *overrides])


def test_early_checks_restate_maxtext_and_the_schema():
  # The choices the first pass keeps light (no JAX, config/choices.py) are every enumerated field of the schema:
  # MaxText's and the plugin's Literal[...] and Enum fields (model_name: check_model_name; lists: per item).
  literal = {}
  blocks = [("", config_types.PluginRLConfig)] + [
      (f"{b}.", m) for b, m in config_keys.nested_fields(config_types.PluginRLConfig).items()
  ]
  for prefix, cls in blocks:
    for name, field in cls.model_fields.items():
      if name == "model_name" or typing.get_origin(field.annotation) is list:
        continue
      for a in (field.annotation, *typing.get_args(field.annotation)):  # Literal[...], Optional[...], an Enum
        if typing.get_origin(a) is typing.Literal:
          literal[prefix + name] = typing.get_args(a)
        elif isinstance(a, type) and issubclass(a, enum.Enum):
          literal[prefix + name] = tuple(m.value for m in a)
  assert {k: v for k, v in early_checks.CHOICES.items() if k != "remat_policy"} == literal
  # remat_policy is a plain string in the schema: MaxText's RematPolicy and the names its decoder's get_remat_policy
  # compares with (an AssertionError at the first forward otherwise), read from its source.
  source = inspect.getsource(nnx_decoders.NNXDecoder.get_remat_policy)
  decoder = set(re.findall(r'remat_policy == "(\w+)"', source)) | set(
      re.findall(r'"(\w+)"', source.split("{")[1].split("}")[0])
  )
  assert set(early_checks.CHOICES["remat_policy"]) == {p.value for p in max_types.RematPolicy} | decoder | {"none"}


def _refused_before_the_schema(monkeypatch, capsys, argv) -> str:
  """train_rl.main's one `error:` line for `argv`; the schema's loader fails the test if it is reached."""

  def must_not_load(_argv):
    raise AssertionError("the config reached the schema (and the model build after it)")

  monkeypatch.setattr(config_lib, "load_config", must_not_load)
  with pytest.raises(SystemExit) as e:
    train_rl.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
  return err


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["model_name=qwen3-30b-a3b", "rl.router_replay=true", "rl.use_agentic_rollout=true"],
            "rl.router_replay=true with rl.use_agentic_rollout=true",
        ),
        (["rollout_engine=bogus"], "'rollout_engine'='bogus'"),
        (["rollout_engine=vllm"], "'head_dim'=16"),
        (["num_experts_per_tok=9"], "'num_experts_per_tok'=9"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_refused_before_the_schema_and_the_model(monkeypatch, capsys, tmp_path, overrides, needle):
  config = MOE if overrides[0].startswith("num_experts") else TINY
  err = _refused_before_the_schema(monkeypatch, capsys, [config, f"base_output_directory={tmp_path}", *overrides])
  assert needle in err


@pytest.fixture(name="checkpointed_run", scope="module")
def checkpointed_run_fixture(tmp_path_factory):
  """A cpu_tiny run directory whose step 2 holds the metadata a real run writes (run/meta.checkpoint_meta of its typed
  config)."""
  base = tmp_path_factory.mktemp("resume")
  argv = [TINY, f"base_output_directory={base}", "run_name=r", "num_batches=4"]
  config = config_lib.load_config(argv)
  meta_dir = base / "r" / "checkpoints" / "2" / "meta"
  meta_dir.mkdir(parents=True)
  (meta_dir / "metadata").write_text(json.dumps(run_meta.checkpoint_meta(config, 2)))
  return argv, config


@pytest.mark.parametrize(
    "override, needle",
    [
        ("loss_algo=gspo-token", "written with rl.loss_algo='grpo' but this run has rl.loss_algo='gspo-token'"),
        ("rl.num_iterations=2", "written with rl.num_iterations * batch_size / rl.mini_batch_size=1 but this run has"),
        ("batch_size=4", "written with batch_size=2 but this run has batch_size=4"),
        # Issue 61: accepted silently (other token ids on the same weights; step 2's params saved in bfloat16).
        ("tokenizer_path=tokenizers/arith-bpe-512", "written with tokenizer_path='files "),
        ("weight_dtype=bfloat16", "written with weight_dtype='float32' but this run has weight_dtype='bfloat16'"),
    ],
)
def test_a_resume_that_changes_the_update_is_refused_before_the_schema(
    monkeypatch, capsys, checkpointed_run, override, needle
):
  argv, _ = checkpointed_run
  err = _refused_before_the_schema(monkeypatch, capsys, [*argv, override])
  assert needle in err and "cannot resume" in err


def test_the_same_resume_is_refused_by_the_second_pass_too(checkpointed_run):
  argv, _ = checkpointed_run
  config = config_lib.load_config([*argv, "loss_algo=gspo-token"])
  with pytest.raises(errors.CheckpointError, match="rl.loss_algo='grpo'"):
    run_meta.preflight(config)
  run_meta.preflight(config_lib.load_config([*argv, "learning_rate=1e-5"]))  # an update key: a note, not a refusal


def test_a_resume_is_refused_at_the_restore_by_the_same_rule(checkpointed_run, tmp_path):
  # The restore compares the checkpoint it restores (not only the newest on disk) with run/meta.resume_invariants;
  # the same tokenizer found at another path is the same tokenizer.
  argv, config = checkpointed_run
  meta = run_meta.checkpoint_meta(config, 2)
  bf16 = config_lib.load_config([*argv, "weight_dtype=bfloat16"])
  with pytest.raises(errors.CheckpointError, match="weight_dtype='float32' but this run has weight_dtype='bfloat16'"):
    resume._check_resume_compatible(bf16, meta, "ckpt/2")  # pylint: disable=protected-access
  copy = tmp_path / "tok"
  shutil.copytree(config.tokenizer_path, copy)
  moved = config_lib.load_config([*argv, f"tokenizer_path={copy}"])
  resume._check_resume_compatible(moved, meta, "ckpt/2")  # pylint: disable=protected-access
  (copy / "tokenizer_config.json").write_text("{}")
  with pytest.raises(errors.CheckpointError, match="written with tokenizer_path="):
    run_meta.preflight(config_lib.load_config([*argv, f"tokenizer_path={copy}"]))


@pytest.mark.parametrize(
    "config, overrides",
    [
        (TINY, ["vocab_size=528"]),  # Qwen3's 151,669 ids on 528 embedding rows (the issue's probe)
        ("configs/cpu_demo.yml", ["tokenizer_path=tokenizers/qwen3-tokenizer"]),
    ],
)
def test_a_tokenizer_larger_than_the_vocabulary_is_refused(monkeypatch, capsys, tmp_path, config, overrides):
  # Issue 61: it trained, with ids past the embedding. The first pass reads the size from tokenizer.json; the loaded
  # tokenizer (a hub id's first look) is checked the same way, before the model build. Reference: transformers' len.
  err = _refused_before_the_schema(monkeypatch, capsys, [config, f"base_output_directory={tmp_path}", *overrides])
  assert "invalid value for 'vocab_size'=528: the tokenizer at 'tokenizers/qwen3-tokenizer' has 151669 token" in err
  tok = transformers.AutoTokenizer.from_pretrained(config_files.resolved_tokenizer_path("tokenizers/qwen3-tokenizer"))
  assert len(tok) == config_files.tokenizer_size("tokenizers/qwen3-tokenizer") == 151669
  loaded = types.SimpleNamespace(tokenizer_path="org/hub-id", vocab_size=528, use_chat_template=False, hf_access_token="")
  monkeypatch.setattr(tokenizer_lib, "_tokenizer", lambda *_: tok)
  with pytest.raises(errors.ConfigError, match="'vocab_size'=528: the tokenizer at 'org/hub-id' has 151669"):
    tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(loaded))


def test_a_resume_says_every_update_key_it_changes(checkpointed_run):
  # rl.router_replay and load_balance_loss_weight got no note (rl.dynamic_sampling did).
  argv, config = checkpointed_run
  meta = {"step": 2, "update_keys": run_meta.update_values(config)}
  changed = config_lib.load_config(
      [*argv, "rl.router_replay=true", "load_balance_loss_weight=0.05", "model_name=mixtral-8x7b", "num_experts=4"]
      + ["num_experts_per_tok=2", "capacity_factor=-1", "base_moe_mlp_dim=32", "sparse_matmul=false", "megablox=false"]
  )
  notes = "\n".join(run_meta.update_changes(changed, meta))
  assert "note: resuming with rl.router_replay=True, not the False of the checkpoint's steps (1-2)" in notes
  assert "note: resuming with load_balance_loss_weight=0.05, not the" in notes


def test_every_update_key_is_noted_refused_or_exempt():
  # The keys of the update's concerns (the rl: block, the loss, optimizer, rewards, rollout): each is noted on resume
  # (UPDATE_KEYS), refused on resume (resume_invariants' keys) or exempt with a reason. A new key in none fails here.
  concerns = (
      "honoured (algorithms",
      "honoured (rewards",
      "honoured (trainer: optimizer",
      "honoured (rollout engine",
      "honoured (async_rollout",
      "honoured (dynamic_sampling",
      "honoured (experience",
      "honoured (agentic",
      "honoured (moe",
  )
  refused_on_resume = {
      "batch_size",
      "rl.num_generations",
      "data_shuffle_seed",
      "train_data_path",
      "dataset_name",
      "rl.loss_algo",
      "rollout_seed",
      "rl.num_iterations",
      "rl.mini_batch_size",
  }
  domain = set()
  for key in key_status.all_keys():
    status = key_status.status(key) or ""
    if (key.startswith("rl.") or status.startswith(concerns)) and status.startswith("honoured"):
      domain.add(key_status.canonical(key))
  missing = domain - set(run_meta.UPDATE_KEYS) - refused_on_resume - set(run_meta.RESUME_EXEMPT)
  assert not missing, f"neither noted on resume, refused nor exempt (run/meta.RESUME_EXEMPT): {sorted(missing)}"
  assert {"rl.router_replay", "load_balance_loss_weight"} <= set(run_meta.UPDATE_KEYS)


def test_metrics_file_in_another_runs_directory_is_refused(tmp_path):
  # Run X writing into run Y's directory: Y's fresh start took the file for its own and pruned X's records.
  base = tmp_path / "runs"
  argv = [TINY, f"base_output_directory={base}", "run_name=x", f"metrics_file={base / 'y' / 'metrics.jsonl'}"]
  with pytest.raises(errors.UserError, match=r"lies in .*/runs/y, another run's directory"):
    train_rl._precheck(config_precheck.precheck(argv))  # pylint: disable=protected-access
  elsewhere = tmp_path / "old" / "z"  # a run directory under another base: known by the files a run writes
  elsewhere.mkdir(parents=True)
  (elsewhere / "batches.jsonl").write_text("")
  argv[-1] = f"metrics_file={elsewhere / 'sub' / 'm.jsonl'}"
  with pytest.raises(errors.UserError, match="another run's directory"):
    train_rl._precheck(config_precheck.precheck(argv))  # pylint: disable=protected-access
  for ok in (base / "x" / "m.jsonl", base / "all.jsonl", tmp_path / "mine" / "m.jsonl"):
    argv[-1] = f"metrics_file={ok}"
    train_rl._precheck(config_precheck.precheck(argv))  # pylint: disable=protected-access


def test_an_empty_min_or_max_is_left_out_of_the_records_and_said_once(tmp_path, capsys):
  # Dynamic sampling with no informative group: the loss saw no token, ratio_min = min() = +inf, ratio_max = -inf.
  path = tmp_path / "m.jsonl"
  logger = metrics_lib.RunLogger(str(tmp_path / "tb"), str(path), total_steps=3)
  try:
    for step in (1, 2):
      logger.log_step(step, {"train/ratio_min": math.inf, "train/ratio_max": -math.inf, "train/ratio_mean": 1.0})
    logger.log_step(3, {"train/ratio_min": 0.8, "train/ratio_max": 1.3, "train/loss": math.nan})
  finally:
    logger.close()

  def no_constants(name):
    raise AssertionError(f"{name} in the metrics stream")

  lines = path.read_text(encoding="utf-8").splitlines()
  recs = [json.loads(line, parse_constant=no_constants if "NaN" not in line else None) for line in lines]
  assert [sorted(r) for r in recs[:2]] == [["step", "train/ratio_mean"]] * 2
  assert recs[2]["train/ratio_min"] == 0.8 and recs[2]["train/ratio_max"] == 1.3
  assert math.isnan(recs[2]["train/loss"])  # a NaN loss stays: run/step.check_update must see it
  out = capsys.readouterr().out
  assert out.count("note: train/ratio_min left out") == 1 and out.count("note: train/ratio_max left out") == 1
  # A logging window reduces the extremes as extremes: one empty step does not turn the window's min into +inf.
  reducers = tunix_wiring.rl_metrics_to_log(tunix_wiring.PluginGrpoConfig(num_generations=2))
  assert reducers["ratio_min"]([math.inf, 0.9]) == 0.9 and reducers["ratio_max"]([-math.inf, 1.2]) == 1.2
  assert reducers["ratio_mean"] is np.mean
  # The step's own warning (run/step.py) names only real faults: an empty extreme is not one, a NaN loss is.
  assert metrics_lib.is_empty_extreme("train/ratio_min", math.inf)
  assert metrics_lib.is_empty_extreme("train/ratio_max", -math.inf)
  assert not metrics_lib.is_empty_extreme("train/ratio_min", -math.inf)
  assert not metrics_lib.is_empty_extreme("loss", math.nan)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--router-scales", "abc"], "'--router-scales'='abc'"),
        (["--router-scales", "1,-0.1"], "'--router-scales'='1,-0.1'"),
        (["--prompts", "0"], "'--prompts'=0: must be >= 1"),
        (["--temperature", "-1"], "'--temperature'=-1.0: must be > 0"),
        (["--temperature", "nan"], "'--temperature'=nan"),
    ],
)
def test_bench_moe_flags_are_one_line_before_any_model(monkeypatch, argv, needle):
  monkeypatch.setattr(bench_moe.models, "setup_devices", lambda *a, **k: pytest.fail("reached the model setup"))
  with pytest.raises(errors.ConfigError) as e:
    bench_moe.main(argv)
  assert needle in str(e.value)


def test_ray_launch_fields_are_dataclass_fields():
  # test_launch_ray.py checks every numeric flag against NUMERIC_FLAGS when ray is installed; this one always runs.
  from maxtext_rl_plugin.launch import ray as ray_lib  # pylint: disable=import-outside-toplevel

  numeric = {f.name for f in dataclasses.fields(ray_lib.RayLaunch) if f.type in ("int", "float", "int | None")}
  assert numeric == set(ray_lib.NUMERIC_FLAGS)
  with pytest.raises(errors.UserError, match="--cpus-per-worker must be > 0"):
    ray_lib.RayLaunch(num_workers=2, overrides=[], cpus_per_worker=-2).validate(check_overrides=False)


# Class 6: what a user cannot act on stays off the output, and MAXTEXT_RL_VERBOSE=1 shows it.


def _xpk_dry_run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", errors.VERBOSE_ENV)}
  env.update(JAX_PLATFORMS="cpu", **env_extra)
  cmd = [sys.executable, "-m", "maxtext_rl_plugin.launch", "xpk", "--workload", "w", "--cluster", "c"]
  cmd += ["--tpu-type", "v5p-8", "--project", "p", "--docker-image", "i", "--dry-run", "--", "run_name=x"]
  cmd += ["base_output_directory=gs://bucket/runs"]  # launch xpk refuses outputs that die with the pod
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_the_launcher_prints_no_transformers_import_chatter():
  # `launch ... --dry-run` validates the overrides: its PyTorch and DeepseekV32Config warnings came before the
  # launcher's own lines, from transformers, which the validation imported through moe.py and MaxText's MoE layers.
  # The validation no longer imports model code (tests/config/test_validation.py), so not even the verbose run
  # (MAXTEXT_RL_VERBOSE, which un-silences third-party logs) has them.
  quiet, loud = _xpk_dry_run({}), _xpk_dry_run({errors.VERBOSE_ENV: "1"})
  assert quiet.returncode == loud.returncode == 0, quiet.stderr[-2000:]
  for p in (quiet, loud):
    assert "[transformers]" not in p.stderr and "PyTorch was not found" not in p.stderr
    assert "xpk workload create-pathways" in p.stdout
    assert "warning: HF_TOKEN is not set" in p.stderr  # what the user can act on stays


_ORBAX_SAVES = """
import os, sys, tempfile
import numpy as np
from maxtext_rl_plugin import checkpointing, errors
directory = tempfile.mkdtemp()
for name in ("verbose", "quiet"):
  if name == "quiet":
    del os.environ[errors.VERBOSE_ENV]
    print("=== quiet", file=sys.stderr, flush=True)
  errors.quiet_third_party_logs()
  storage = checkpointing.Storage()  # the run's default format
  manager = checkpointing.open_manager(os.path.join(directory, name), ("params", "meta"), storage=storage)
  checkpointing.save_items(manager, 1, {"params": {"w": np.ones(4, np.float32)}}, {"step": 1}, storage=storage)
  manager.close()
"""


def test_orbax_ocdbt_merge_notice_is_quiet_unless_verbose():
  # A real Orbax save on one process logs "Skipping merge of OCDBT checkpoints" (the CPU demo: at every save). One
  # process: a save with MAXTEXT_RL_VERBOSE=1 (the reference: the line is there), then one without.
  env = dict(os.environ, JAX_PLATFORMS="cpu", **{errors.VERBOSE_ENV: "1"})
  p = subprocess.run(
      [sys.executable, "-c", _ORBAX_SAVES], env=env, capture_output=True, text=True, timeout=600, check=False
  )
  assert p.returncode == 0, p.stderr[-2000:]
  verbose, quiet = p.stderr.split("=== quiet")
  assert "Skipping merge of OCDBT checkpoints" in verbose and "Skipping merge" not in quiet


def test_compile_rl_accepts_a_yml_that_sets_compile_topology(tmp_path, monkeypatch, capsys):
  # train_rl accepted it; compile_rl answered "compile_topology=... is required".
  yml = tmp_path / "aot.yml"
  yml.write_text("base_config: cpu_tiny.yml\ncompile_topology: v5p-8\n")
  passed = []
  monkeypatch.setattr(compile_rl.train_rl, "main", lambda argv: passed.append(argv) or 0)
  assert compile_rl.main([str(yml), "run_name=c"]) == 0 and passed == [[str(yml), "run_name=c"]]
  assert compile_rl.main([TINY, "compile_topology=v5p-8"]) == 0
  assert compile_rl.main([TINY]) == 2 and compile_rl.main([str(yml), "compile_topology="]) == 2
  assert capsys.readouterr().err.count("error: compile_topology=<MaxText topology name") == 2


def test_the_demos_remaining_unactionable_lines_are_quiet_unless_verbose(monkeypatch):
  # The CPU demo's output (re-read end to end this round) still carried Tunix's "Skipping non-TPU device: cpu. You might
  # be missing jax[tpu] dependency." and four WARNING lines about synthetic prompts redrawn to fit the prompt budget,
  # the synthetic task's design: nothing a user can act on.
  import logging  # pylint: disable=import-outside-toplevel

  from maxtext_rl_plugin.data import synthetic  # pylint: disable=import-outside-toplevel

  tunix_line = "Skipping non-TPU device: cpu. You might be missing jax[tpu] dependency."
  record = logging.LogRecord("absl", logging.WARNING, __file__, 1, tunix_line, (), None)
  assert not errors._DropUnactionable().filter(record)  # pylint: disable=protected-access
  other = logging.LogRecord("absl", logging.WARNING, __file__, 1, "a checkpoint does not restore", (), None)
  assert errors._DropUnactionable().filter(other)  # pylint: disable=protected-access
  monkeypatch.delenv(errors.VERBOSE_ENV, raising=False)
  assert synthetic._redraw_log() is synthetic.logging.info  # pylint: disable=protected-access
  monkeypatch.setenv(errors.VERBOSE_ENV, "1")
  assert synthetic._redraw_log() is synthetic.logging.warning  # pylint: disable=protected-access


def _mesh_config(ici: dict[str, int], dcn: dict[str, int], slices: int = 1):
  axes = ["data", "stage", "fsdp", "tensor", "expert"]
  return types.SimpleNamespace(
      mesh_axes=axes,
      ici_parallelism=[ici.get(a, 1) for a in axes],
      dcn_parallelism=[dcn.get(a, 1) for a in axes],
      num_slices=slices,
  )


def _maxtext_accepts(config, devices: int) -> bool:
  """MaxText's own mesh rule (max_utils.fill_unspecified_mesh_axes), the reference: an AssertionError means no mesh."""
  try:
    max_utils.fill_unspecified_mesh_axes(list(config.ici_parallelism), devices // config.num_slices, "ICI")
    max_utils.fill_unspecified_mesh_axes(list(config.dcn_parallelism), config.num_slices, "DCN")
  except AssertionError:
    return False
  return True


@pytest.mark.parametrize("devices, slices", [(1, 1), (4, 1), (8, 2), (6, 1)])
def test_the_mesh_check_agrees_with_maxtexts_mesh_rule(devices, slices):
  # Issue 61: ici_fsdp_parallelism=3 or ici_tensor_parallelism=2 on one device were MaxText's AssertionError after
  # 10-21 s. Every combination of sizes on three axes, against MaxText's own function.
  sizes = (-1, 1, 2, 3, 4)
  for fsdp, tensor, data in itertools.product(sizes, sizes, sizes):
    for dcn in ({"data": -1}, {"data": 2}, {"data": -1, "fsdp": 2}, {"fsdp": -1, "data": -1}):
      config = _mesh_config({"fsdp": fsdp, "tensor": tensor, "data": data}, dcn, slices)
      why = early_checks.mesh_refusal(config, devices)
      assert (why is None) == _maxtext_accepts(config, devices), (fsdp, tensor, data, dcn, why)
      assert why is None or (why.startswith("invalid value for '") and "\n" not in why)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("ici_fsdp_parallelism=3", "'ici_fsdp_parallelism'=3: the ici sizes multiply to 3"),
        (
            "ici_tensor_parallelism=2",
            "'ici_tensor_parallelism'=2: the ici sizes (ici_tensor_parallelism=2) do not divide",
        ),
        ("ici_tensor_parallelism=-1", "'ici_tensor_parallelism'=-1: ici_fsdp_parallelism is -1 too"),
    ],
)
def test_a_mesh_this_host_cannot_make_is_one_line_before_the_model(monkeypatch, capsys, tmp_path, override, needle):
  # print_config=true refuses it (it accepted it), and the run's device split refuses it before any model is built.
  argv = [TINY, f"base_output_directory={tmp_path}", "run_name=m", override]
  with pytest.raises(SystemExit) as e:
    train_rl.main([*argv, "print_config=true"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and needle in err and err.count("\n") == 1, err
  with pytest.raises(errors.ConfigError, match=re.escape(needle)):
    models.setup_devices(config_lib.parse(argv), devices=jax.devices()[:1])


@pytest.mark.parametrize(
    "argv, needle",
    [
        # Issue 61 class 6: the flat key exists; say so.
        (
            [TINY, "rl.train_micro_batch_size=2"],
            "unknown config key 'rl.train_micro_batch_size' (command line): 'train_micro_batch_size' is a top-level "
            "key, not one of the rl: block; did you mean 'train_micro_batch_size'?",
        ),
        # A dependent key the user set is still theirs to drop.
        (
            ["configs/cpu_demo.yml", "sft_warmup_steps=0", "sft_learning_rate=0.1"],
            "config key 'sft_learning_rate'=0.1 has no effect with sft_warmup_steps=0",
        ),
    ],
)
def test_messages_name_what_the_user_can_change(argv, needle):
  with pytest.raises(errors.ConfigError) as e:
    config_precheck.precheck(argv)
  assert needle in str(e.value), str(e.value)


def test_a_key_only_a_shipped_yml_sets_is_not_the_users_to_drop(tmp_path):
  # Issue 61: `sft_warmup_steps=0` on the demo config said "drop sft_learning_rate", which only cpu_demo.yml sets.
  argv = ["configs/cpu_demo.yml", "sft_warmup_steps=0"]
  config_precheck.precheck(argv)
  assert config_lib.load_pydantic(argv).sft_warmup_steps == 0
  # The user's own yml that sets it (over the shipped demo) is refused, in both passes.
  own = tmp_path / "mine.yml"
  own.write_text(f"base_config: {os.path.abspath('configs/cpu_demo.yml')}\nsft_warmup_steps: 0\nsft_batch_size: 8\n")
  for load in (config_precheck.precheck, config_lib.load_pydantic):
    with pytest.raises(errors.ConfigError, match="config key 'sft_batch_size'=8 has no effect with sft_warmup_steps=0"):
      load([str(own)])


def test_a_number_given_to_a_string_key_is_its_text():
  # Issue 61: run_name=7 was pydantic's "Input should be a valid string"; MaxText's own run names are any text.
  assert config_precheck.precheck([TINY, "run_name=7"]).run_name == "7"
  assert config_lib.load_pydantic([TINY, "run_name=7", "dataset_name=1e3"]).run_name == "7"


def test_export_lora_reads_its_flags_anywhere_and_refuses_a_missing_step_before_the_schema(monkeypatch, capsys, tmp_path):
  # Issue 61: `export_lora <yml> ... --step 99` read --step as a key=value; a missing step took 20 s (two schema
  # passes and the imports) to be refused.
  def must_not_load(_written):
    raise AssertionError("reached the schema")

  monkeypatch.setattr(config_lib, "typed", must_not_load)
  (tmp_path / "r" / "checkpoints" / "2").mkdir(parents=True)
  argv = [TINY, f"base_output_directory={tmp_path}", "run_name=r", "--step", "99", "--output", str(tmp_path / "o")]
  with pytest.raises(SystemExit) as e:
    export_lora.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1, err
  assert f"error: no checkpoint step 99 in {tmp_path}/r/checkpoints (steps: [2])" in err
  assert not (tmp_path / "o").exists()


def test_a_data_file_without_a_usable_row_is_refused_before_the_schema(monkeypatch, capsys, tmp_path):
  # Issue 61: refused by the data loader after the schema's imports and the device split (8 s). Now the first pass
  # reads a JSONL file up to its first usable row, and one without any whole, for the loader's own line.
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"q": 1}\nnot json\n{"question": "x", "answer": "no number"}\n')
  argv = [TINY, f"base_output_directory={tmp_path}", f"train_data_path={bad}"]
  err = _refused_before_the_schema(monkeypatch, capsys, argv)
  assert f"train_data_path='{bad}': no usable rows of 3 (1 invalid JSON, 1 with no question string, 1 with no " in err
  good = tmp_path / "good.jsonl"
  good.write_text('not json\n\n{"question": "2+2?", "answer": "#### 4"}\n')
  data_rows.check_file_rows(str(good), "train_data_path")
  assert [r[1] for r in data_rows.load_file_rows(str(good), "train_data_path")] == ["4"]  # the loader agrees


@pytest.mark.parametrize(
    "topology, needle",
    [
        ("v99-8", "'compile_topology'='v99-8': no published figures for TPU generation 'v99'"),
        ("v5p-7", "'compile_topology'='v5p-7': MaxText 0.2.5 does not know this topology; close: v5p-768, v5p-8"),
    ],
)
def test_an_unknown_topology_is_refused_before_the_schema(monkeypatch, capsys, topology, needle):
  # Issue 61: 12 s (the schema pass) before the line. The reference: MaxText's own table of topology names.
  def must_not_load(_written):
    raise AssertionError("reached the schema")

  monkeypatch.setattr(config_lib, "typed", must_not_load)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  with pytest.raises(SystemExit) as e:
    train_rl.main([TINY, f"compile_topology={topology}"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and needle in err and err.count("\n") == 1, err
  assert topology not in accelerator_to_spec_map.UserFacingNameToSystemCharacteristics
