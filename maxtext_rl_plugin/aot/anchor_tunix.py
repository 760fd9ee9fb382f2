"""Tunix's own GRPO loss step compiled beside the plugin's `actor_update`, for the same run on the same TPU topology.

`python -m maxtext_rl_plugin.aot.anchor_tunix <config.yml> compile_topology=v5p-128 [key=value ...]`

Why: the plugin's update replaces Tunix's loss (`tunix_wiring.tunix_policy_loss_fn`: configurable KL estimator,
aggregation, entropy metric, MoE terms) but keeps Tunix's trainer step. Whether that costs HBM or FLOPs is answered
by compiling Tunix 0.1.7's unmodified GRPO loss (`algo_core.grpo_loss_fn`, looked up by the name `GRPOConfig`
gives it, as `GRPOLearner.__init__` does, and wrapped in the learner's own lambda) inside the same train step
(`accumulation.train_step`, which with one micro-batch per update is `PeftTrainer._train_step`'s body), over the same
abstract actor + optimizer state (`programs.abstract_train_state`) and example (`programs._example`) on the same
trainer devices and mesh
(`run/models.setup_devices` on the topology's devices). Only the loss function differs between the two rows.

Tunix's loss gets Tunix's own `GRPOConfig` with the run's G, mu, beta, epsilon, loss_algo and aggregation; the KL
estimator maps `rl.kl_estimator` k3 -> `low_var_kl`, k1 -> `kl` (Tunix's names for the same formulas).
The report (`<base_output_directory>/<run_name>.anchor-tunix-<topology>.json`) has one row per program, the rows
`compile_rl` writes, and the Tunix / plugin ratios. `--programs=tunix` compiles Tunix's step only.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Sequence

from absl import logging

from maxtext_rl_plugin import errors
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.run import updates
from maxtext_rl_plugin.errors import ConfigError

# JAX reads JAX_PLATFORMS when it is imported: JAX, Flax, MaxText and Tunix are imported inside the functions, after
# main() has set it (as train_rl does), so libtpu on the path only compiles.
# pylint: disable=import-outside-toplevel

TUNIX_ROW = "tunix_grpo_update"
PLUGIN_ROW = "actor_update"
_KL_MODES = {"k3": "low_var_kl", "k1": "kl"}
# The losses Tunix 0.1.7's `grpo_loss_fn` computes (`GRPOConfig.loss_algo`).
_TUNIX_LOSSES = ("grpo", "gspo-token")
RATIO_FIELDS = ("argument_gib", "output_gib", "temp_gib", "peak_gib", "host_temp_gib", "gflops", "gbytes")


def tunix_algo_config(config):
  """Tunix's `GRPOConfig` for the run's `rl.*` keys, temperature set as `GRPOLearner.__init__` sets it."""
  from tunix.rl.grpo import grpo_learner

  rl = config.rl
  if rl.loss_algo not in _TUNIX_LOSSES:  # a registered loss of another package (docs/extending.md): no Tunix twin
    raise ConfigError(
        f"rl.loss_algo={rl.loss_algo!r}: the anchor compiles Tunix's own loss, which has only "
        f"{' and '.join(_TUNIX_LOSSES)}; compile_rl compiles any registered loss"
    )
  if rl.kl_estimator not in _KL_MODES:
    raise ConfigError(f"rl.kl_estimator={rl.kl_estimator!r}: Tunix's GRPO loss has only k3 and k1")
  algo = grpo_learner.GRPOConfig(
      num_generations=int(rl.num_generations),
      num_iterations=int(rl.num_iterations),
      beta=float(rl.grpo_beta),
      epsilon=float(rl.grpo_epsilon),
      loss_algo=rl.loss_algo,
      loss_agg_mode=rl.loss_agg_mode,
      kl_loss_mode=_KL_MODES[rl.kl_estimator],
  )
  algo.epsilon_high = float(rl.grpo_epsilon if rl.epsilon_high is None else rl.epsilon_high)
  algo.temperature = float(config.decode_sampling_temperature)
  return algo


def tunix_loss_fn(algo, pad_id: int, eos_id: int):
  """The loss `GRPOLearner.__init__` hands the actor trainer: the registry's `algo.policy_loss_fn` ("grpo")."""
  from tunix.rl import function_registry

  policy_loss_fn = function_registry.get_policy_loss_fn(algo.policy_loss_fn)
  return lambda model, train_example, algo_config: policy_loss_fn(
      model, train_example, algo_config=algo, pad_id=pad_id, eos_id=eos_id
  )


def tunix_update(plugin_update, graphdef, config, lora: bool):
  """The plugin's update program with Tunix's loss in its place (same state, example, shardings, donation)."""
  from maxtext_rl_plugin.aot import programs

  algo = tunix_algo_config(config)
  loss_fn = tunix_loss_fn(algo, programs.PAD_ID, programs.EOS_ID)

  steps = updates.UpdatePlan.from_config(config).accumulation_steps
  step = programs.train_step_fn(graphdef, loss_fn, algo, lora, steps)
  return dataclasses.replace(plugin_update, name=TUNIX_ROW, fn=step, note="Tunix 0.1.7 algo_core.grpo_loss_fn")


def ratios(rows) -> dict:
  """Tunix's row over the plugin's, per field (None where the plugin's is 0)."""
  by = {r.name.removesuffix("_lora"): r for r in rows}
  if TUNIX_ROW not in by or PLUGIN_ROW not in by:
    return {}
  t, p = by[TUNIX_ROW], by[PLUGIN_ROW]
  return {f: (getattr(t, f) / getattr(p, f) if getattr(p, f) else None) for f in RATIO_FIELDS}


def run(config, parsed, which: set[str]) -> int:
  """Compile the requested rows on the run's trainer devices; print them and the ratios; write the JSON."""
  from maxtext_rl_plugin import lora as lora_lib
  from maxtext_rl_plugin.run import models
  from maxtext_rl_plugin.aot import compile as compile_lib
  from maxtext_rl_plugin.aot import programs
  from maxtext_rl_plugin.aot import report
  from maxtext_rl_plugin.aot import run as aot_run
  from maxtext_rl_plugin.aot import topology
  from maxtext_rl_plugin.run import build

  topo = config.compile_topology
  spec = topology.device_spec(topo)
  slices = aot_run.num_slices(config)  # MaxText's > 0 rule, one slice
  devices = topology.topology_devices(topo, slices)
  rs = models.setup_devices(parsed, devices=devices)
  cfg = rs.trainer_config
  build.check_runtime(cfg, rs)  # the run's own device-split checks
  lora = lora_lib.LoraSettings.from_config(cfg).enable
  mesh = programs.trainer_mesh(cfg, rs.trainer_devices)
  axes = {k: v for k, v in mesh.shape.items() if v > 1}
  print(f"[anchor] {cfg.model_name}: trainer {len(rs.trainer_devices)} devices of {topo}, mesh {axes}", flush=True)
  plugin, (graphdef, _, _) = programs.actor_update(cfg, mesh, lora)
  progs = ([plugin] if "plugin" in which else []) + (
      [tunix_update(plugin, graphdef, cfg, lora)] if "tunix" in which else []
  )
  rows = []
  for prog in progs:
    print(f"[anchor] compiling {prog.name} ...", flush=True)
    rows.append(report.row(compile_lib.compile_program(prog), spec, 0, False))
  print(report.table(rows, spec, topo), flush=True)
  rat = ratios(rows)
  if rat:
    print("tunix / plugin: " + ", ".join(f"{k} {v:.3f}" for k, v in rat.items() if v is not None), flush=True)
  base = str(config.base_output_directory)  # a bucket too (storage), as compile_rl's report
  storage.makedirs(base)
  path = os.path.join(base, f"{config.run_name}.anchor-tunix-{topo}.json")
  extra = {"model": cfg.model_name, "trainer_devices": len(rs.trainer_devices), "tunix_over_plugin": rat}
  storage.write_atomic(path, report.to_json(rows, spec, topo, slices, extra))
  print(f"[anchor] report: {path}", flush=True)
  logging.info("tunix anchor done")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; `argv` excludes the program name. `--programs=tunix|plugin|tunix,plugin` (default both)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  which = {"tunix", "plugin"}
  for a in [a for a in argv if a.startswith("--programs=")]:
    which = set(a.split("=", 1)[1].split(","))
    argv.remove(a)
  errors.quiet_third_party_logs()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles, nothing runs (as compile_rl)
  with errors.exit_on_user_error():
    if not which or not which <= {"tunix", "plugin"}:
      raise ConfigError(f"--programs={','.join(sorted(which))}: expected tunix, plugin or tunix,plugin")
    if not any(a.startswith("compile_topology=") and a != "compile_topology=" for a in argv):
      raise ConfigError("compile_topology=<MaxText topology name, e.g. v5p-128> is required")
    from maxtext_rl_plugin.config import load as config_lib

    parsed = config_lib.parse(argv)
    return run(parsed.hyperparameters(), parsed, which)


if __name__ == "__main__":
  sys.exit(main())
