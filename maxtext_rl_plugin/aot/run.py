"""`compile_topology=<MaxText name>`: compile the RL step's programs for that TPU instead of training.

MaxText's `train_compile` answers "does pre-training fit on v5p-128?" from a workstation; this answers it for the RL
run: the target's devices (aot/topology.py) split into trainer and sampler exactly as `models.setup_devices` splits a
real slice, every program of one RL step built abstractly from the run's own functions (aot/programs.py), each
compiled (aot/compile.py), and one table with a fit verdict and a roofline step time (aot/report.py). No TPU, no
checkpoint, no tokenizer, no data: `load_parameters_path` and `tokenizer_path` are not opened, weights are abstract.

A program that does not fit ends the command with one line (`error: program ... needs X GiB of Y GiB ...`) and exit 2,
after the table; one that fails to compile (the run's own program would fail the same way) with an `error:` line and
exit 1; the JSON report is written either way (`<base_output_directory>/<run_name>.aot-<topology>.json`,
or `./aot_reports/` when the output directory is remote).
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
from maxtext_rl_plugin import models
from maxtext_rl_plugin.run import updates
from maxtext_rl_plugin.aot import compile as compile_lib
from maxtext_rl_plugin.aot import programs
from maxtext_rl_plugin.aot import report
from maxtext_rl_plugin.aot import topology
from maxtext_rl_plugin.aot import tpu_inference_compat as compat
from maxtext_rl_plugin.aot import vllm_programs
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.run import build

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
  """Beside the run directory; local `./aot/` when the output directory is a bucket (no writes there from here)."""
  topo = config.compile_topology
  base = str(config.base_output_directory)
  if "://" in base:
    base = "aot_reports"
  os.makedirs(base, exist_ok=True)
  return os.path.join(base, f"{config.run_name}.aot-{topo}.json")


def build_programs(config, parsed: config_lib.Parsed, devices: list) -> tuple[list, dict]:
  """(programs in compile order with their residency, facts for the JSON) for the run (`parsed`) on `devices`."""
  rs = models.setup_devices(parsed, devices=devices)
  cfg = rs.trainer_config
  build.check_runtime(cfg, rs)  # the run's own device-split checks, unchanged
  plan = updates.UpdatePlan.from_config(cfg)
  lora = lora_lib.enabled(cfg)
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
      "not_compiled": [],
  }
  if engine == "vllm":  # tpu-inference's model step and vLLM's KV pool (aot/vllm_programs.py), in the TPU image's stack
    compat.quiet_env(config.compile_topology)
    if compat.importable():
      vllm_progs, vllm_facts = vllm_programs.build(
          rs, topology.device_spec(config.compile_topology), trainer_resident, rs.sampler_devices
      )
      out += vllm_progs
      facts["not_compiled"] += vllm_facts.pop("not_compiled")
      facts.update(vllm_facts)
    else:
      facts["not_compiled"].append(vllm_programs.NEEDS_STACK)
  else:
    if engine == "auto":
      _say("rollout_engine=auto: compiling the embedded engine (on a TPU with vLLM installed, auto picks vLLM)")
    rollout = programs.rollout_program(rs.sampler_config, rs.sampler_devices)
    out.append((rollout, 0 if rs.disaggregated else trainer_resident, not rs.disaggregated))
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


def run(config, parsed: config_lib.Parsed) -> int:
  """Compile, print the table, write the JSON; 2 and one line when a program does not fit."""
  topo = config.compile_topology
  num_slices = max(1, int(config.compile_topology_num_slices))
  spec = topology.device_spec(topo)
  t0 = time.perf_counter()
  devices = topology.topology_devices(topo, num_slices)
  progs, facts = build_programs(config, parsed, devices)
  only = {p for p in os.environ.get(ONLY_PHASES_ENV, "").split(",") if p}
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
  for line in facts["not_compiled"]:
    print(f"not compiled: {line}", flush=True)
  facts["compile_wall_seconds"] = time.perf_counter() - t0
  facts["all_compiled"] = not failed
  path = report_path(config)
  with open(path, "w", encoding="utf-8") as f:
    f.write(report.to_json(rows, spec, topo, num_slices, facts))
  _say(f"report: {path} ({facts['compile_wall_seconds']:.0f} s)")
  line = report.verdict(rows, topo)
  if line is not None:
    raise DoesNotFitError(line)
  if failed:  # the run would fail where it compiles these: never "every program fits"
    print(
        f"error: {', '.join(failed)} failed to compile for {topo} (the run's own program; 'not compiled:' above says "
        "why); the compiled programs fit",
        file=sys.stderr,
        flush=True,
    )
    return 1
  if not rows:  # e.g. only the rollout asked for and it needs tpu-inference: nothing was checked, so no "fits"
    print(f"nothing compiled for {topo}: every program asked for was skipped or is not compiled here (see above)")
    return 0
  what = f"the {','.join(sorted(only))} programs fit" if only else "every program of the RL step fits"
  print(f"fits: {what} {topo} ({spec.hbm_bytes / topology.GIB:.0f} GiB per device)")
  logging.info("aot compile done")
  sys.stdout.flush()
  return 0
