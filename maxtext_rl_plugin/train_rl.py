"""`python -m maxtext_rl_plugin.train_rl <config.yml> [key=value ...]`: GRPO/GSPO on a MaxText model.

The argv contract is MaxText's `train_rl`: first the yml (a path, or the name of a shipped config such
as `configs/rl.yml`), then pyconfig `key=value` overrides. `print_config=true` prints the resolved
configuration and exits. Configuration and input mistakes end with one `error: ...` line, exit 2.
"""

# Imported in order inside _main: Pathways' backend factory must be registered before anything (config loading
# included) creates a JAX backend, and `--help` should not import JAX at all.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Sequence

from maxtext_rl_plugin import errors
from maxtext_rl_plugin.run import identity as run_identity
from maxtext_rl_plugin.run import meta as run_meta
from maxtext_rl_plugin import signals
from maxtext_rl_plugin.config import validation
from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.errors import exit_on_user_error
from maxtext_rl_plugin.rewards import loader as reward_loader


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; `argv` excludes the program name (defaults to sys.argv[1:])."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  errors.quiet_third_party_logs()
  try:
    return _main(argv)
  except KeyboardInterrupt:  # Ctrl-C before the trainer installed its handlers (config loading): one line, no trace
    print("error: interrupted before training started; nothing was written", file=sys.stderr, flush=True)
    return 130
  finally:
    _close_writers()


def _close_writers() -> None:
  """Close TensorBoard writers an error left open while threads can still start (metrics.close_all says why);
  metrics is looked up, not imported: a run that never reached it has none."""
  metrics = sys.modules.get("maxtext_rl_plugin.metrics")
  if metrics is not None:
    metrics.close_all()


@dataclasses.dataclass
class Prechecked:
  """What the first pass checked, by the values it read: the typed pass runs a check again only where a value differs
  (a key the first pass could not type), so each check runs once, in the first pass that can decide it."""

  run: tuple | None = None  # (run_name, base_output_directory) that validation.check_run passed
  paths: tuple | None = None  # run_identity.path_values that check_inputs and check_outputs passed


def _run_values(config) -> tuple:
  return (config.run_name, config.base_output_directory)


def _precheck(view) -> Prechecked:
  """The refusals `load_config` and `preflight` would make that the config as written already decides (a key the
  first pass cannot type is left to them): a run name, and for training the input files and the outputs."""
  done = Prechecked()
  try:
    validation.check_run(view)
    done.run = _run_values(view)
    print_config = view.print_config if "print_config" in view else False  # unset: the schema's default
  except Unresolved:
    return done
  try:
    reward_loader.check(reward_loader.RewardSelection.of(view))  # print_config=true too: it refuses what training refuses
  except Unresolved:
    pass
  if print_config is False and not _compiling(view):  # compile_topology opens no checkpoint, data or run dir
    run_identity.check_inputs(view)
    try:
      run_identity.check_outputs(view)
      done.paths = run_identity.path_values(view)
      # A resume that changes the loss or the update plan: the checkpoint's metadata says so before any model build.
      run_meta.check_resume_invariants(view, os.path.join(view.base_output_directory, view.run_name))
    except Unresolved:
      return done
  return done


def _check_mesh_here(config) -> None:
  """The ici_*/dcn_* sizes against this host's devices (the typed pass already made JAX's backend: MaxText's schema
  counts them), for print_config=true and before the trainer's imports; a Pathways or multislice run splits the devices
  first, so only its split (run/models.setup_devices, which checks each side) can tell."""
  if config.use_pathways or config.num_trainer_slices != -1:
    return
  import jax

  from maxtext_rl_plugin.config import early_checks

  early_checks.check_mesh(config, jax.device_count())


def _compiling(view) -> bool:
  """compile_topology set: compile the run's programs for that TPU (maxtext_rl_plugin.aot) instead of training."""
  try:
    return bool(view.compile_topology) if "compile_topology" in view else False
  except Unresolved:
    return False


def _main(argv: list[str]) -> int:
  """Pathways set-up, config, then training, with user errors as one line."""
  # A SIGTERM (or SIGINT) while the config loads and the trainer's modules import is one line and exit 143 (130), as
  # once the trainer runs (it installs its own handlers); without this, SIGTERM killed the process silently.
  with exit_on_user_error():
    with signals.GracefulStop():
      # Config and path mistakes first, in a second: the schema's imports (JAX, MaxText, Tunix) take ~10 s.
      from maxtext_rl_plugin.config import load as config_lib
      from maxtext_rl_plugin.config import precheck as config_precheck

      view = config_precheck.precheck(argv)  # the yml chain and the overrides, read once
      if _compiling(view):
        # Compiling for a TPU topology on this host (the command line's or the yml's compile_topology): JAX computes
        # on the CPU, libtpu only compiles (MaxText's train_compile runs the same way); without this a host with libtpu
        # installed would look for a TPU. JAX is not imported yet.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from maxtext_rl_plugin.aot import topology

        topology.check_name(str(view.compile_topology))  # a name MaxText knows, before the schema's imports
      done = _precheck(view)
      # Then, before anything creates a JAX backend (config loading may): on Pathways the proxy backend factory
      # must be registered now, as MaxText's train_rl.main does; later JAX refuses it.
      from maxtext_rl_plugin import pathways

      pathways.initialize()
      parsed = config_lib.typed(view.source())  # handed down from here: nothing below reads argv
      config = parsed.hyperparameters()
      if done.run is None or done.run != _run_values(config):
        validation.check_run(config)  # print_config=true refuses what training refuses
      if not config.compile_topology:  # compiling lays the mesh on the target's devices (aot/run.py)
        _check_mesh_here(config)  # what the run's device split (run/models.setup_devices) refuses, before the imports
      if config.print_config:
        sys.stdout.write(config_lib.dump_yaml(config))
        return 0
      if config.compile_topology:
        from maxtext_rl_plugin.aot import run as aot_run

        return aot_run.run(config, parsed)
      run_meta.preflight(config, done.paths)  # path and rerun refusals before the trainer's seconds of imports
      from maxtext_rl_plugin.run import loop as trainer

    trainer.run(config, parsed)
  return 0


if __name__ == "__main__":
  sys.exit(main())
