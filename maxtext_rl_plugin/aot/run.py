"""`compile_topology=<MaxText name>`: compile the RL step's programs for that TPU instead of training.

MaxText's `train_compile` answers "does pre-training fit on v5p-128?" from a workstation; this answers it for the RL
run: the target's devices (aot/topology.py) split into trainer and sampler exactly as `run/models.setup_devices` splits a
real slice, every program of one RL step built abstractly from the run's own functions (aot/programs.py), each
compiled (aot/compile.py), and one table with a fit verdict and a roofline step time (aot/report.py). No TPU, no
checkpoint, no tokenizer, no data: `load_parameters_path` and `tokenizer_path` are not opened, weights are abstract.

A program that does not fit ends the command with one line (`error: program ... needs X GiB of Y GiB ...`) and exit 2,
after the table; one that fails to compile (the run's own program would fail the same way) with an `error:` line and
exit 1; the JSON report is written either way (`<base_output_directory>/<run_name>.aot-<topology>.json`,
a bucket too, through maxtext_rl_plugin/storage.py).
"""

from __future__ import annotations

import os
import sys
import time

from absl import logging
from flax import nnx
import jax

from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin import run_dir
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.run import updates
from maxtext_rl_plugin.aot import compile as compile_lib
from maxtext_rl_plugin.aot import programs
from maxtext_rl_plugin.aot import report
from maxtext_rl_plugin.aot import topology
from maxtext_rl_plugin.aot import tpu_inference_compat as compat
from maxtext_rl_plugin.aot import vllm_programs
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.rollout import engines
from maxtext_rl_plugin.run import build
from maxtext_rl_plugin.run import engine as run_engine

# Compile only the programs of these phases (comma-separated: rollout, logps, update, sync); unset: every program.
ONLY_PHASES_ENV = "MAXTEXT_RL_AOT_PHASES"


class DoesNotFitError(ConfigError):
  """A program of the run needs more HBM than the target's device has (the one-line verdict)."""


def _say(message: str) -> None:
  print(f"[aot] {message}", flush=True)


def _axes(mesh) -> dict:
  """The mesh's axes that shard anything (MaxText's meshes name a dozen axes of size 1)."""
  return {k: v for k, v in mesh.shape.items() if v > 1}


def report_path(config) -> str:
  """Beside the run directory (`<base_output_directory>/<run_name>.aot-<topology>.json`, a bucket too, through
  `storage`). Its directory is probed before anything compiles: an unwritable path or a bucket without credentials is
  one line then, not after every program."""
  topo = config.compile_topology
  base = str(config.base_output_directory)
  run_dir.probe_dir(base, "base_output_directory")
  return os.path.join(base, f"{config.run_name}.aot-{topo}.json")


def only_phases() -> set[str]:
  """The phases `MAXTEXT_RL_AOT_PHASES` asks for (empty: every program); one line for a name that is not a phase."""
  raw = os.environ.get(ONLY_PHASES_ENV, "")
  asked = [p.strip() for p in raw.split(",") if p.strip()]
  bad = [p for p in asked if p not in report.PHASES]
  if bad:
    raise ConfigError(
        f"invalid value for {ONLY_PHASES_ENV}={raw!r}: '{bad[0]}' is not a phase; expected a comma-separated list of "
        f"{', '.join(report.PHASES)}"
    )
  return set(asked)


def num_slices(config) -> int:
  """compile_topology_num_slices: MaxText's train_compile asserts it is > 0; its default -1 (unset) compiles one
  slice. One slice is what this compile covers: the multislice split (num_trainer_slices / num_samplers_slices over
  DCN) is refused in one line rather than half-built."""
  n = int(config.compile_topology_num_slices)
  if n == 0 or n < -1:
    raise ConfigError(
        f"invalid value for 'compile_topology_num_slices'={n}: must be > 0 (MaxText's train_compile asserts it; "
        "-1, the default, compiles one slice)"
    )
  if n > 1 or int(config.num_trainer_slices) != -1 or int(config.num_samplers_slices) != -1:
    raise ConfigError(
        f"compile_topology_num_slices={n}, num_trainer_slices={config.num_trainer_slices}, num_samplers_slices="
        f"{config.num_samplers_slices}: the RL compile covers one slice (trainer and sampler on it); the multislice "
        "split over DCN is not compiled yet: compile one slice (compile_topology_num_slices=1, both slice keys -1)"
    )
  return 1


def build_programs(config, parsed: config_lib.Parsed, devices: list) -> tuple[list, dict]:
  """(programs in compile order with their residency, facts for the JSON) for the run (`parsed`) on `devices`."""
  if int(config.max_seq_token_per_tpu or 0) > 0:
    raise ConfigError(
        f"max_seq_token_per_tpu={config.max_seq_token_per_tpu}: the compile lays out padded rows; the packed update "
        "(algorithms/packing.py) is not compiled ahead of time yet: compile with max_seq_token_per_tpu=0"
    )
  rs = models.setup_devices(parsed, devices=devices)
  cfg = rs.trainer_config
  build.check_runtime(cfg, rs)  # the run's own device-split checks, unchanged
  plan = updates.UpdatePlan.from_config(cfg)
  lora = lora_lib.LoraSettings.from_config(cfg).enable
  _say(
      f"{len(devices)} devices: trainer {len(rs.trainer_devices)}, sampler {len(rs.sampler_devices)} "
      f"({'disaggregated' if rs.disaggregated else 'colocated'}); model {cfg.model_name}, "
      f"{'LoRA' if lora else 'full fine-tuning'}, loss {cfg.rl.loss_algo}"
  )
  mesh = programs.trainer_mesh(cfg, rs.trainer_devices)
  _say(f"trainer mesh {_axes(mesh)}: building the abstract actor + optimizer state")
  rows_note = distributed.rows_note(plan.micro_batch_size * plan.num_generations, mesh, programs.DATA_AXIS)
  if rows_note:
    _say(rows_note)
  update, (graphdef, state, _) = programs.actor_update(cfg, mesh, lora)
  # The MaxText model's params (the adapter's `base`), as the weight sync moves them.
  params = nnx.state(nnx.merge(graphdef, state).model.base, nnx.Param)
  with jax.set_mesh(mesh):
    train_state_bytes = report.per_device_bytes(state)
  beta = float(cfg.rl.grpo_beta)
  ref_copy = 0
  if beta and not lora:  # build_run clones the actor's params as the reference (LoRA: the frozen base, shared)
    ref_copy = report.per_device_bytes(params)
  trainer_resident = train_state_bytes + ref_copy
  out = [(update, ref_copy, False)]
  logps_calls = plan.batch_size // plan.micro_batch_size
  if plan.needs_old_logps:
    out.append((programs.logps_program("old_logps", cfg, mesh, graphdef, state, logps_calls), trainer_resident, True))
  if beta:
    out.append(
        (programs.logps_program("reference_logps", cfg, mesh, graphdef, state, logps_calls), trainer_resident, True)
    )
  engine = cfg.rollout_engine
  facts = {
      "model": cfg.model_name,
      "lora": lora,
      "loss_algo": cfg.rl.loss_algo,
      "trainer_devices": len(rs.trainer_devices),
      "sampler_devices": len(rs.sampler_devices),
      "disaggregated": rs.disaggregated,
      "rollout_engine": engine,
      "train_state_gib_per_device": train_state_bytes / topology.GIB,
      "reference_copy_gib_per_device": ref_copy / topology.GIB,
      "not_compiled": [],  # lines that explain a program that does not exist (LoRA: no staging program)
      "missing": [],  # programs the run executes that were not compiled here: no verdict covers them
  }
  compiled = engine
  if engine == engines.AUTO:
    compiled, facts["engine_note"] = auto_engine_note(rs.sampler_config)
    _say(facts["engine_note"])
  builder = engines.spec(compiled).aot_programs
  if builder:  # the engine's own rollout programs (its spec names them: no engine is special here)
    rollout_progs, rollout_facts = engines.load(builder)(rs, config.compile_topology, trainer_resident)
    out += rollout_progs
    facts["missing"] += rollout_facts.pop("not_compiled", [])  # programs the run executes that did not compile
    facts.update(rollout_facts)
  else:
    facts["missing"].append(
        f"rollout: the {compiled} engine names no ahead-of-time programs (its EngineSpec.aot_programs), so its "
        "rollout is not compiled"
    )
  facts["missing"] += agentic_missing(cfg)
  if rs.disaggregated and lora:
    facts["not_compiled"].append(
        "weight sync: a LoRA run moves only the adapters (replicated, a few MB), which the embedded engine merges; "
        "no staging program"
    )
  elif rs.disaggregated:
    sync = programs.sync_program(params, mesh, rs.sampler_config, rs.sampler_devices)
    if sync is None:
      facts["not_compiled"].append(
          "weight sync: trainer and sampler device counts differ; the device_put path copies without a staging "
          "program (Pathways reshards in its own runtime)"
      )
    else:
      out.append((sync, trainer_resident, True))
  return out, facts


def agentic_missing(cfg) -> list[str]:
  """rl.use_agentic_rollout: the episodes' programs (each turn re-prefills the transcript, then decodes a turn, at
  shapes of their own) are not built here; the single-turn rollout compiled in their place does not stand for them."""
  if not cfg.rl.use_agentic_rollout:
    return []
  return [
      "agentic episodes (rl.use_agentic_rollout: a re-prefill of the transcript and a decode per turn, at shapes of "
      "their own): not built by this compile; the single-turn rollout program compiled does not stand for them"
  ]


def embedded_rollout(rs, topo: str, trainer_resident: int) -> tuple[list, dict]:
  """The embedded engine's `aot_programs` (rollout/embedded_spec.py): its whole prefill + decode program on the sampler
  mesh, resident beside the trainer's state when colocated."""
  del topo  # the sampler devices are the topology's already
  rollout = programs.rollout_program(rs.sampler_config, rs.sampler_devices)
  return [(rollout, 0 if rs.disaggregated else trainer_resident, not rs.disaggregated)], {}


def vllm_rollout(rs, topo: str, trainer_resident: int) -> tuple[list, dict]:
  """The vLLM engine's `aot_programs` (rollout/vllm_spec.py): tpu-inference's model step and vLLM's KV pool
  (aot/vllm_programs.py), in the TPU image's stack; without it, one `not_compiled` line."""
  compat.quiet_env(topo)
  if not compat.importable():
    return [], {"not_compiled": [vllm_programs.NEEDS_STACK]}
  return vllm_programs.build(rs, topology.device_spec(topo), trainer_resident, rs.sampler_devices)


def auto_engine_note(sampler_config) -> tuple[str, str]:
  """(the engine a `rollout_engine=auto` compile covers, the line that says so). It covers the engine `auto` takes on a
  TPU without the optional extras (run/engine.auto_choice: the embedded one for the built-ins), and says which engine
  the TPU run takes with them installed when that is another (the compile's stack may not have them)."""
  compiled, passed = run_engine.auto_choice(sampler_config, on="tpu", installed=False)
  taken, passed = run_engine.auto_choice(sampler_config, on="tpu", installed=True)
  if taken == compiled:
    why = f" ({passed[-1][1]})" if passed else ""
    return compiled, f"rollout_engine=auto: compiled the {compiled} engine, which the TPU run takes too{why}"
  needs = engines.spec(taken).auto.needs
  return compiled, (
      f"rollout_engine=auto: compiled the {compiled} engine; on a TPU with {needs or 'its stack'} installed the run "
      f"takes {taken}, whose rollout this compile does not cover (compile with rollout_engine={taken} in the TPU "
      "image's stack for it)"
  )


def run(config, parsed: config_lib.Parsed) -> int:
  """Compile, print the table, write the JSON; 2 and one line when a program does not fit, 1 when a program the run
  executes did not compile (unless MAXTEXT_RL_AOT_PHASES asked for a subset)."""
  topo = config.compile_topology
  only = only_phases()
  slices = num_slices(config)
  spec = topology.device_spec(topo)
  path = report_path(config)
  t0 = time.perf_counter()
  devices = topology.topology_devices(topo, slices)
  progs, facts = build_programs(config, parsed, devices)
  if only:  # e.g. a test that compiles the rollout alone: the others are listed as skipped, never as fitting
    facts["not_compiled"] += [
        f"{p.name}: skipped ({ONLY_PHASES_ENV}={','.join(sorted(only))})" for p, _, _ in progs if p.phase not in only
    ]
    progs = [x for x in progs if x[0].phase in only]
  rows, failed = [], []
  for i, (prog, resident, replaces) in enumerate(progs, 1):
    _say(f"compiling {i}/{len(progs)} {prog.name} on {prog.mesh.size} devices {_axes(prog.mesh)} ...")
    try:
      compiled = compile_lib.compile_program(prog)
    except Exception as e:  # pylint: disable=broad-exception-caught  # one program's failure must not hide the others
      first = " ".join(str(e).split())[:200]
      facts["not_compiled"].append(f"{prog.name}: failed to compile ({type(e).__name__}: {first})")
      _say(f"  {prog.name}: failed to compile ({type(e).__name__})")
      failed.append(prog.name)
      continue
    r = report.row(compiled, spec, resident, replaces)
    rows.append(r)
    _say(
        f"  {prog.name}: {'OUT OF MEMORY' if r.oom else f'needs {r.needs_gib:.2f} GiB of {r.hbm_gib:.0f}'} "
        f"({compiled.seconds:.0f} s)"
    )
  print(report.table(rows, spec, topo), flush=True)
  missing = [] if only else facts["missing"]  # a subset asked for: what it leaves out is said, not an error
  for line in facts["not_compiled"] + facts["missing"]:
    print(f"not compiled: {line}", flush=True)
  facts["compile_wall_seconds"] = time.perf_counter() - t0
  facts["all_compiled"] = not failed and not facts["missing"]
  # True only when every program of the step compiled and fits; None when the compiled ones fit but not all compiled
  # (a subset asked for, a failure, a program this environment cannot build): no verdict covers those.
  compiled_fit = all(r.fits for r in rows)
  facts["fits"] = (None if (only or not facts["all_compiled"]) else True) if compiled_fit else False
  resident_gib = facts["train_state_gib_per_device"] + facts["reference_copy_gib_per_device"]
  try:
    storage.write_atomic(path, report.to_json(rows, spec, topo, slices, facts))
  except OSError as e:  # storage.StorageError in a bucket
    raise run_dir.OutputError(f"the AOT report was not written: {storage.describe_error(e, path)}") from None
  _say(f"report: {path} ({facts['compile_wall_seconds']:.0f} s)")
  line = report.verdict(rows, topo, resident_gib)
  if line is not None:
    raise DoesNotFitError(line)
  if failed or missing:  # the verdict covers only what compiled: never "every program fits"
    names = failed + [m.split(":")[0] for m in missing]
    print(
        f"error: {len(names)} program(s) of the RL step not compiled for {topo}: {'; '.join(names)} ('not compiled:' "
        "above says why); the compiled programs fit, the others are not checked",
        file=sys.stderr,
        flush=True,
    )
    return 1
  if not rows:  # e.g. only the rollout asked for and it needs tpu-inference: nothing was checked, so no "fits"
    print(f"nothing compiled for {topo}: every program asked for was skipped or is not compiled here (see above)")
    return 0
  what = f"the {','.join(sorted(only))} programs fit" if only else "every program of the RL step fits"
  engine = f"; {facts['engine_note']}" if "engine_note" in facts else ""
  print(f"fits: {what} {topo} ({spec.hbm_bytes / topology.GIB:.0f} GiB per device){engine}")
  logging.info("aot compile done")
  sys.stdout.flush()
  return 0
