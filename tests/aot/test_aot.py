"""The AOT path compiles the run's own programs (`compile_topology`, maxtext_rl_plugin/aot/).

* Same program: the actor update the AOT path lowers, compiled here for the CPU devices and executed on the run's own
  weights and optimizer state, gives exactly (bit for bit) the loss, gradient norm, new weights and new optimizer
  state of the run's actor trainer (Tunix's jitted step with the plugin's loss) on the same micro-batch.
* For a TPU (subprocesses with libtpu on their path only; `scripts/venv.sh` installs it into `.venv-aot-libtpu`):
  a tiny config compiled for v5p-8 writes the report with every program of the step; one that cannot fit a v5e-4
  ends with the one-line verdict and exit 2; a tiny MoE on MaxText's sparse path, whose rollout cannot trace the
  routing recording, ends with an error line and exit 1; Tunix's own GRPO step compiles beside the plugin's update;
  a vllm rollout where tpu-inference does not import is a `not compiled:` line, not a traceback.
* MoE programs are the run's: routing recorded by the engine and the old-policy forward, replayed under
  rl.router_replay (lowered for the CPU devices).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import types

from flax import nnx
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from maxtext.common import train_state_nnx
from tunix.rl import algo_core
from tunix.rl import common as tunix_common
from tunix.rl import function_registry
from tunix.rl.grpo import grpo_learner
from tunix.sft import sharding_utils

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin import errors
from maxtext_rl_plugin.aot import anchor_tunix
from maxtext_rl_plugin.aot import compile as compile_lib
from maxtext_rl_plugin.aot import programs
from maxtext_rl_plugin.aot import report
from maxtext_rl_plugin.aot import run as aot_run
from maxtext_rl_plugin.aot import topology
from maxtext_rl_plugin.aot import vllm_programs
from maxtext_rl_plugin.run import build

from _tiny import SMALL_VOCAB

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = "configs/cpu_tiny.yml"
MOE = "configs/cpu_tiny_moe.yml"
LIBTPU = REPO / ".venv-aot-libtpu"


@pytest.fixture(name="tiny_run", scope="module")
def tiny_run_fixture(tmp_path_factory):
  """A built (not trained) tiny run whose update accumulates two micro-batches (inside its one jitted step,
  accumulation.py), with a reference (beta != 0)."""
  out = tmp_path_factory.mktemp("aot_run")
  argv = [
      TINY,
      *SMALL_VOCAB,
      f"base_output_directory={out}",
      "run_name=aot",
      "batch_size=2",
      "rl.num_generations=2",
      "train_micro_batch_size=1",  # two micro-batches per update, accumulated inside the step
      "rl.grpo_beta=0.08",
      "learning_rate=0.01",
      "warmup_steps_fraction=0",
  ]
  parsed = config_lib.parse(argv)
  return build.build_run(parsed.hyperparameters(), parsed)


def _example(run, rows: int):
  """A micro-batch with random tokens, masks, advantages and log-probs, placed as Tunix's trainer places it."""
  cfg = run.config
  rng = np.random.default_rng(0)
  lp, lc = cfg.max_prefill_predict_length, cfg.max_target_length - cfg.max_prefill_predict_length
  vocab = cfg.vocab_size
  completion_mask = (np.arange(lc)[None, :] < rng.integers(4, lc, rows)[:, None]).astype(np.int32)
  ex = tunix_common.TrainExample(
      prompt_ids=rng.integers(2, vocab, (rows, lp)).astype(np.int32),
      prompt_mask=np.ones((rows, lp), np.int32),
      completion_ids=np.where(completion_mask, rng.integers(2, vocab, (rows, lc)), run.tokenizer.pad_token_id).astype(
          np.int32
      ),
      completion_mask=completion_mask,
      advantages=rng.normal(size=(rows,)).astype(np.float32),
      ref_per_token_logps=None,
      old_per_token_logps=None,
  )
  # Old and reference log-probs near the policy's own (the loss clamps log-ratios at +-20: far-off values would zero
  # the gradient), from the run's trainer-side forward.
  pad, eos = run.rl_cluster.rollout.pad_id(), run.rl_cluster.rollout.eos_id()
  lp = np.asarray(run.trainer_logps(jnp.asarray(ex.prompt_ids), jnp.asarray(ex.completion_ids), pad, eos, 1.0))
  ex = ex.replace(
      old_per_token_logps=(lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32),
      ref_per_token_logps=(lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32),
  )
  with run.rl_cluster.cluster_config.role_to_mesh[programs_role()]:
    return sharding_utils.shard_input(jax.tree.map(jnp.asarray, ex), programs.DATA_AXIS)


def programs_role():
  from tunix.rl import rl_cluster  # pylint: disable=import-outside-toplevel  # only for the role name

  return rl_cluster.Role.ACTOR


def _leaves(tree) -> dict:
  """Path -> host array (typed PRNG keys as their key data)."""

  def host(v):
    return np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)

  return {jax.tree_util.keystr(k): host(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_aot_update_is_the_runs_update_bit_for_bit(tiny_run):
  run = tiny_run
  cfg = run.config
  trainer = run.rl_cluster.actor_trainer
  mesh = run.rl_cluster.cluster_config.role_to_mesh[programs_role()]
  rows = run.plan.mini_batch_size * run.plan.num_generations  # the trainer takes one mini-batch per update
  example = _example(run, rows)
  pad, eos = run.rl_cluster.rollout.pad_id(), run.rl_cluster.rollout.eos_id()

  # The AOT path: the program it would compile for a TPU, lowered for these CPU devices, run on a copy of the state.
  prog, _ = programs.actor_update(cfg, mesh, False, pad, eos)
  state = nnx.state(train_state_nnx.TrainStateNNX(trainer.model, trainer.optimizer))
  before = _leaves(state)  # host copies now: the state's variables are the trainer's, updated in place by its step
  state_copy = jax.tree.map(lambda x, s: jax.device_put(jnp.copy(x), s), state, prog.in_shardings[0])
  compiled = compile_lib.lower(prog).compile()
  with mesh, nn_partitioning.axis_rules(cfg.logical_axis_rules):
    aot_state, aot_loss, aot_aux, aot_gnorm = compiled(state_copy, example)

  # The run's own update: the actor trainer's jitted step (Tunix's PeftTrainer with the learner's loss).
  step, _ = trainer.jit_train_and_eval_step()
  with mesh, nn_partitioning.axis_rules(cfg.logical_axis_rules):
    loss, aux, gnorm = step(example)
  run_state = nnx.state(train_state_nnx.TrainStateNNX(trainer.model, trainer.optimizer))

  assert np.asarray(aot_loss).tobytes() == np.asarray(loss).tobytes()
  assert np.asarray(aot_gnorm).tobytes() == np.asarray(gnorm).tobytes() and float(gnorm) > 0
  assert set(aux) == set(aot_aux) and all(np.array_equal(aux[k], aot_aux[k]) for k in aux)
  want, got = _leaves(run_state), _leaves(aot_state)
  assert set(want) == set(got)
  for k in want:
    assert np.array_equal(want[k], got[k]), k
  # The step updated the weights, and the optimizer state holds no gradient accumulator.
  assert any(not np.array_equal(before[k], want[k]) for k in want if k.startswith("['model']"))
  assert not any("acc_grads" in k or "mini_step" in k for k in want)


def test_moe_programs_are_the_runs_routing_recording_and_replaying_ones(tmp_path):
  # rl.router_replay on a tiny Mixtral (MaxText can force its routing): the engine records each token's experts, the
  # old-policy forward is logps.TrainerLogps' recording MoE forward with the sampler's routing replayed, and the
  # update's micro-batch is the run's RoutedTrainExample. Lowered (not compiled) for this host's CPU devices.
  argv = [MOE, f"base_output_directory={tmp_path}", "run_name=m", "rl.router_replay=true", "rl.num_iterations=2"]
  cfg = config_lib.load_config(argv)
  progs, _ = aot_run.build_programs(cfg, config_lib.parse(argv), jax.devices())
  by = {p.name: p for p, _, _ in progs}
  assert list(by) == ["actor_update", "old_logps", "reference_logps", "rollout_prefill_decode"]
  rows = cfg.batch_size * cfg.rl.num_generations
  routing = (rows, cfg.max_target_length, cfg.base_num_decoder_layers, cfg.num_experts_per_tok)
  upd = by["actor_update"]
  assert upd.args[1].routed_experts.shape == routing and upd.args[1].routed_experts.dtype == jnp.int32
  compile_lib.lower(upd)  # the loss's replay branch (moe.forward_logps with forced experts) traces
  _, route = compile_lib.lower(by["old_logps"]).out_info
  assert by["old_logps"].args[3].shape == routing and route.shape == routing
  *_, routes = compile_lib.lower(by["rollout_prefill_decode"]).out_info  # (prompt, completion) routing
  assert routes is not None and routes[1].shape[2:] == routing[2:]


def _compile(tmp_path, *extra, module="maxtext_rl_plugin.compile_rl", config=TINY) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{LIBTPU}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  env.pop("XLA_FLAGS", None)  # the target's devices come from the topology, not forced host devices
  cmd = [sys.executable, "-m", module, config, f"base_output_directory={tmp_path}", *extra]
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


needs_libtpu = pytest.mark.skipif(
    not (LIBTPU / "libtpu").is_dir(), reason="libtpu not installed in .venv-aot-libtpu (scripts/venv.sh installs it)"
)


@needs_libtpu
def test_tiny_config_compiles_for_v5p_8_with_every_program(tmp_path):
  # batch_size=1: MaxText's rl.yml default, 1 x 2 rows that do not split over 4 chips: replicated, as the run does.
  res = _compile(
      tmp_path,
      *SMALL_VOCAB,
      "run_name=t",
      "compile_topology=v5p-8",
      "compile_topology_num_slices=1",
      "rl.num_iterations=2",
      "batch_size=1",
  )
  assert res.returncode == 0, res.stderr[-3000:]
  assert "note: the train micro-batch of 2 rows does not split over the trainer's 4-way data axis" in res.stdout
  rep = json.loads((tmp_path / "t.aot-v5p-8.json").read_text())
  names = [p["name"] for p in rep["programs"]]
  # mu = 2: old-policy log-probs; beta = 0.08 (rl.yml): the reference forward; colocated: no weight sync.
  assert names == ["actor_update", "old_logps", "reference_logps", "rollout_prefill_decode"]
  assert rep["fits"] and rep["device"]["hbm_bytes"] == 95 * 1024**3
  for p in rep["programs"]:
    assert p["devices"] == 4 and p["fits"] and p["gflops"] > 0
    assert 0 < p["peak_gib"] <= p["needs_gib"] < p["hbm_gib"]
  upd = rep["programs"][0]
  assert upd["calls_per_step"] == 2  # mu x batch / micro-batch = 2 x 1 / 1 (micro = batch)
  assert set(rep["step_seconds"]) == {"rollout", "logps", "update", "sync", "total"}
  assert "fits: every program" in res.stdout and "actor_update" in res.stdout


@needs_libtpu
def test_what_cannot_fit_is_one_line_and_exit_2(tmp_path):
  # 256 rows of 4096 tokens on a 4-chip v5e (16 GiB): the [rows, T, vocab 151936] f32 logits alone are ~600 GB.
  res = _compile(
      tmp_path,
      "run_name=big",
      "compile_topology=v5e-4",
      "batch_size=128",
      "max_target_length=4096",
      "max_prefill_predict_length=128",
  )
  assert res.returncode == 2, res.stderr[-3000:]
  err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
  assert len(err) == 1 and "Traceback" not in res.stderr
  assert "program 'actor_update'" in err[0] and "v5e-4" in err[0] and "train_micro_batch_size" in err[0]
  rep = json.loads((tmp_path / "big.aot-v5e-4.json").read_text())
  assert not rep["fits"]


@pytest.mark.extended  # a second family: the tiny config on v5p-8 and the MoE programs check are the default tier's
@needs_libtpu
def test_moe_sparse_matmul_for_v5p_8_compiles_every_program_the_run_executes(tmp_path):
  # MaxText's sparse MoE path (sparse_matmul: ragged grouped matmuls in a shard_map), its TPU default: the engine's
  # routing recording traced inside that shard_map until moe.py recorded it outside (a Flax TraceContextError, and a
  # run that would have failed at its first rollout); the rollout now compiles with the rest.
  res = _compile(tmp_path, "run_name=m", "compile_topology=v5p-8", "sparse_matmul=true", "megablox=false", config=MOE)
  assert res.returncode == 0, res.stderr[-3000:]
  rep = json.loads((tmp_path / "m.aot-v5p-8.json").read_text())
  assert [p["name"] for p in rep["programs"]] == ["actor_update", "reference_logps", "rollout_prefill_decode"]
  assert rep["fits"] and rep["all_compiled"] and not rep["not_compiled"]


@pytest.mark.extended  # the vLLM rollout's compile is tests/tpu_contract/test_aot_vllm.py's (pass 3)
@needs_libtpu
def test_vllm_rollout_without_tpu_inference_is_a_not_compiled_line(tmp_path, monkeypatch):
  # The main .venv has no tpu_inference: the vllm rollout is listed as not compiled, not a traceback. Rollout phase
  # only (MAXTEXT_RL_AOT_PHASES), so nothing compiles; head_dim=64: the vllm route's own config check passes.
  if importlib.util.find_spec("tpu_inference") is not None:
    pytest.skip("tpu_inference imports here: the vllm rollout compiles (tests/tpu_contract/test_aot_vllm.py)")
  monkeypatch.setenv(aot_run.ONLY_PHASES_ENV, "rollout")
  res = _compile(tmp_path, "run_name=v", "compile_topology=v5p-8", "rollout_engine=vllm", "head_dim=64")
  assert res.returncode == 0, res.stderr[-3000:]
  assert "Traceback" not in res.stderr
  assert f"not compiled: {vllm_programs.NEEDS_STACK}" in res.stdout.splitlines()
  assert "nothing compiled for v5p-8" in res.stdout and "fits:" not in res.stdout
  rep = json.loads((tmp_path / "v.aot-v5p-8.json").read_text())
  assert rep["programs"] == [] and rep["missing"] == [vllm_programs.NEEDS_STACK] and rep["fits"] is None
  assert "actor_update: skipped (MAXTEXT_RL_AOT_PHASES=rollout)" in rep["not_compiled"]


@pytest.mark.extended  # a measurement beside Tunix's step; its loss is checked by the next test
@needs_libtpu
def test_tunix_anchor_compiles_tunixs_grpo_step_beside_the_plugins(tmp_path):
  res = _compile(
      tmp_path, "run_name=a", "compile_topology=v5p-8", "compile_topology_num_slices=1", module=anchor_tunix.__name__
  )
  assert res.returncode == 0, res.stderr[-3000:]
  rep = json.loads((tmp_path / "a.anchor-tunix-v5p-8.json").read_text())
  assert [p["name"] for p in rep["programs"]] == ["actor_update", "tunix_grpo_update"]
  fields = {f.name for f in dataclasses.fields(report.Row)}
  for p in rep["programs"]:  # the rows compile_rl writes
    assert set(p) == fields and p["devices"] == 4 and p["fits"] and p["gflops"] > 0 and p["peak_gib"] > 0
  assert set(rep["tunix_over_plugin"]) == set(anchor_tunix.RATIO_FIELDS)
  # Same state in, same state out: only the loss differs.
  upd, tun = rep["programs"]
  assert upd["argument_gib"] == tun["argument_gib"] and "tunix / plugin:" in res.stdout


def test_tunix_anchor_loss_is_tunixs_registered_grpo_loss():
  rl = types.SimpleNamespace(
      num_generations=4,
      num_iterations=1,
      grpo_beta=0.08,
      grpo_epsilon=0.2,
      epsilon_high=None,
      loss_algo="grpo",
      loss_agg_mode="sequence-mean-token-mean",
      kl_estimator="k3",
  )
  algo = anchor_tunix.tunix_algo_config(types.SimpleNamespace(rl=rl, decode_sampling_temperature=0.9))
  # Tunix's own config class and the loss GRPOLearner looks up by its name, not the plugin's registered one.
  # Exactly Tunix's class, not a subclass such as the plugin's PluginGrpoConfig.
  assert type(algo) is grpo_learner.GRPOConfig  # pylint: disable=unidiomatic-typecheck
  assert algo.policy_loss_fn == "grpo"
  assert function_registry.get_policy_loss_fn(algo.policy_loss_fn) is algo_core.grpo_loss_fn
  assert (algo.kl_loss_mode, algo.epsilon_high, algo.temperature, algo.beta) == ("low_var_kl", 0.2, 0.9, 0.08)


def test_fit_and_roofline_arithmetic_of_one_row():
  # A compiled program's numbers -> the row, re-derived by hand (v5p: 95 GiB, 459e12 FLOP/s, 2765e9 B/s).
  spec = topology.device_spec("v5p-128")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  prog = programs.Program("actor_update", "update", mesh, None, (), calls_per_step=3, knob="train_micro_batch_size")
  gib = topology.GIB
  c = compile_lib.Compiled(
      prog,
      1.0,
      argument_bytes=20 * gib,
      output_bytes=20 * gib,
      temp_bytes=11 * gib,
      alias_bytes=20 * gib,
      peak_bytes=31 * gib,
      flops=1e13,
      bytes_accessed=148e9,
  )
  r = report.row(c, spec, resident_extra=4 * gib, replaces_args=False)
  assert (r.peak_gib, r.needs_gib, r.hbm_gib, r.fits) == (31, 35, 95, True)
  assert r.ms_per_call == pytest.approx(1e3 * max(1e13 / 459e12, 148e9 / 2765e9))
  assert r.ms_per_step == pytest.approx(3 * r.ms_per_call)
  big = report.row(dataclasses.replace(c, peak_bytes=100 * gib), spec, 0, False)
  line = report.verdict([r, big], "v5p-128")
  assert (
      line == "program 'actor_update' needs 100.0 GiB of 95.0 GiB HBM per device on v5p-128; lower train_micro_batch_size"
  )
  oom = report.row(
      dataclasses.replace(c, oom="RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm"), spec, 0, False
  )
  assert not oom.fits and "ran out of HBM" in report.verdict([oom], "v5p-128")
  # A Pallas kernel's VMEM (what tiny MoE shapes under megablox's default tiles hit on v5p-8) is not HBM.
  vmem = report.row(dataclasses.replace(c, oom="RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:"), spec, 0, False)
  assert "overflow VMEM" in report.verdict([vmem], "v5p-8") and "HBM" not in report.verdict([vmem], "v5p-8")


def test_published_figures_per_jax_device():
  # An Ironwood chip is two JAX devices: each gets half its HBM, FLOP/s and bandwidth; v5p in megacore is one.
  ironwood, v5p = topology.device_spec("tpu7x-128"), topology.device_spec("v5p-8")
  assert ironwood.hbm_bytes == 96 * topology.GIB and ironwood.peak_flops == pytest.approx(2307e12 / 2)
  assert v5p.hbm_bytes == 95 * topology.GIB and v5p.hbm_bandwidth == 2765e9
  assert topology.device_spec("v5litepod-16").generation == "v5e"
  with pytest.raises(errors.ConfigError, match="compile_topology"):
    topology.device_spec("v3-8")


# Issue 51, class 2: a verdict says no more than was compiled. Device-free (no libtpu): the checks run before the
# target's devices are asked for, and the verdict's arithmetic is the report's.


def _aot_config(tmp_path, **over):
  keys = {
      "compile_topology": "v5p-8",
      "base_output_directory": str(tmp_path),
      "run_name": "r",
      "compile_topology_num_slices": 1,
      "num_trainer_slices": -1,
      "num_samplers_slices": -1,
  }
  return types.SimpleNamespace(**{**keys, **over})


@pytest.fixture(name="no_target")
def no_target_fixture(monkeypatch):
  """The target's devices: asking for them fails the test (the refusal must come first)."""
  monkeypatch.setattr(topology, "topology_devices", lambda *a: pytest.fail("reached the topology before refusing"))


@pytest.mark.parametrize("phases, bad", [("updates", "updates"), ("ROLLOUT", "ROLLOUT"), ("rollout,bogus", "bogus")])
def test_aot_phases_are_validated_in_one_line(tmp_path, monkeypatch, no_target, phases, bad):
  del no_target
  monkeypatch.setenv(aot_run.ONLY_PHASES_ENV, phases)
  with pytest.raises(errors.ConfigError) as e:
    aot_run.run(_aot_config(tmp_path), [])
  assert f"'{bad}' is not a phase; expected a comma-separated list of rollout, logps, update, sync" in str(e.value)
  monkeypatch.setenv(aot_run.ONLY_PHASES_ENV, " rollout,update ")
  assert aot_run.only_phases() == {"rollout", "update"}


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"compile_topology_num_slices": 0}, "'compile_topology_num_slices'=0: must be > 0"),
        ({"compile_topology_num_slices": -5}, "'compile_topology_num_slices'=-5: must be > 0"),
        ({"compile_topology_num_slices": 2}, "the RL compile covers one slice"),
        ({"num_trainer_slices": 1, "num_samplers_slices": 1}, "the RL compile covers one slice"),
    ],
)
def test_aot_slices_are_maxtexts_rule_or_one_line(tmp_path, no_target, over, needle):
  del no_target
  with pytest.raises(errors.ConfigError, match=needle.replace("(", r"\(")):
    aot_run.run(_aot_config(tmp_path, **over), [])
  assert aot_run.num_slices(_aot_config(tmp_path, compile_topology_num_slices=-1)) == 1  # MaxText's default: unset


def test_an_unwritable_report_path_is_refused_before_compiling(tmp_path, no_target):
  del no_target
  (tmp_path / "file").write_text("")
  with pytest.raises(errors.UserError, match="base_output_directory") as e:
    aot_run.run(_aot_config(tmp_path / "file"), [])
  assert "\n" not in str(e.value)


def test_a_partial_compile_is_no_fit_and_exits_non_zero(tmp_path, monkeypatch, capsys):
  # The vllm rollout without tpu-inference printed `not compiled: ...` and then `fits: every program ...`, exit 0,
  # `fits: true` in the JSON. The trainer programs are skipped here (nothing to compile on this host); what counts is
  # that a program the run executes was not compiled.
  monkeypatch.setattr(topology, "topology_devices", lambda *a: [])
  facts = {"not_compiled": [], "missing": [vllm_programs.NEEDS_STACK], "train_state_gib_per_device": 1.0}
  facts["reference_copy_gib_per_device"] = 0.0
  monkeypatch.setattr(aot_run, "build_programs", lambda *a: ([], dict(facts, missing=list(facts["missing"]))))
  assert aot_run.run(_aot_config(tmp_path), []) == 1
  out, err = capsys.readouterr()
  assert "fits:" not in out and f"not compiled: {vllm_programs.NEEDS_STACK}" in out
  assert err.startswith("error: 1 program(s) of the RL step not compiled for v5p-8: vllm rollout needs tpu-inference")
  rep = json.loads((tmp_path / "r.aot-v5p-8.json").read_text())
  assert rep["fits"] is None and not rep["all_compiled"] and rep["missing"] == [vllm_programs.NEEDS_STACK]
  monkeypatch.setenv(aot_run.ONLY_PHASES_ENV, "rollout")  # a subset asked for: said, not an error
  assert aot_run.run(_aot_config(tmp_path), []) == 0


def test_agentic_and_auto_verdicts_say_what_they_cover():
  agentic = config_lib.load_config([TINY, "rl.use_agentic_rollout=true", "rl.agentic_tools=['calculator']"])
  assert "agentic episodes" in aot_run.agentic_missing(agentic)[0]
  assert not aot_run.agentic_missing(config_lib.load_config([TINY]))
  # cpu_tiny's head_dim 16: auto never takes vLLM for it; head_dim 128: on a TPU with vLLM it would.
  compiled, note = aot_run.auto_engine_note(config_lib.load_config([TINY, "head_dim=16"]))
  assert compiled == "embedded" and "compiled the embedded engine, which the TPU run takes too (" in note
  compiled, note = aot_run.auto_engine_note(config_lib.load_config([TINY, "head_dim=128"]))
  assert compiled == "embedded" and "with vllm installed the run takes vllm, whose rollout this compile does not" in note


def test_the_oom_line_is_in_gib_and_names_the_knob_that_can_move_it():
  # "1.16T exceeds 95.73G ... lower train_micro_batch_size", where the train state alone was 945 GiB per chip.
  spec = topology.device_spec("v5p-128")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  prog = programs.Program("actor_update", "update", mesh, None, (), calls_per_step=1, knob="train_micro_batch_size")
  oom = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 1.16T of 95.73G hbm. Exceeded by 1.07T."
  c = compile_lib.Compiled(prog, 1.0, oom=oom)
  r = report.row(c, spec, 0, False)
  assert report.oom_gib(oom) == pytest.approx((1.16 * 1024, 95.73))
  line = report.verdict([r], "v5p-128", resident_gib=945.0)
  assert "the compiler needs 1187.8 GiB of 95.7 GiB HBM per device" in line
  assert "the train state alone is 945.0 GiB per device" in line and "more chips" in line
  assert "train_micro_batch_size" not in line
  assert report.verdict([r], "v5p-128", resident_gib=20.0).endswith("; lower train_micro_batch_size")
