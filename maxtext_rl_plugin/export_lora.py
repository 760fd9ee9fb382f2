"""Merge a LoRA RL run's adapters into its base and write a MaxText params checkpoint (what a user serves).

    python -m maxtext_rl_plugin.export_lora --output DIR [--step N] <config.yml> [key=value ...]
    maxtext-rl export-lora --output DIR [--step N] <config.yml> [key=value ...]

Give the same yml and overrides as the training run: they name the run directory
(`<base_output_directory>/<run_name>/checkpoints`), the base weights (`load_parameters_path`, plus the run's SFT
warm start when `sft_warmup_steps` > 0) and the adapters' shape (`lora.*`). The adapters of checkpoint `--step`
(default: the newest) are merged as `W + lora_alpha/lora_rank * A @ B` and the merged weights are written with
MaxText's `checkpointing.save_params_to_path` to `DIR/0` (in the format of `checkpoint_storage_use_ocdbt` /
`checkpoint_storage_use_zarr3`, as MaxText writes it); load them with `load_parameters_path=DIR/0/items` and
`lora.enable_lora=false` (no adapter keys needed).
"""

# JAX, Flax, Orbax and MaxText's model code are imported where a model is built: `--help`, a config mistake or an
# unwritable --output is answered in a second, before ~15 s of imports.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import os
import sys

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin import errors
from maxtext_rl_plugin import lora
from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.run import identity as run_identity
from maxtext_rl_plugin.errors import CheckpointError
from maxtext_rl_plugin.errors import ConfigError


def _parse(argv):
  """The flags wherever they are (before the yml, after it, between overrides: `... run_name=x --step 3` read --step as
  an override before) and the training run's `<config.yml> [key=value ...]` in their order."""
  p = argparse.ArgumentParser(prog="python -m maxtext_rl_plugin.export_lora", description=__doc__.splitlines()[0])
  p.add_argument("--output", required=True, help="directory to write (the checkpoint lands in OUTPUT/0)")
  p.add_argument("--step", type=int, default=None, help="RL checkpoint step (default: the newest)")
  p.add_argument("config", nargs="*", help="<config.yml> [key=value ...] of the training run")
  args, rest = p.parse_known_args(argv)
  config = [*args.config, *rest]
  if not config:
    p.error("the training run's <config.yml> [key=value ...] is required")
  if config[0].startswith("-"):
    p.error(f"unrecognized argument: {config[0]}")
  args.config = config  # argparse keeps the first run of positionals; the later ones follow in `rest`, in order
  return args


def _check_step(view, step: int | None) -> None:
  """The checkpoint `--step` names exists, read from the config as written before the schema's imports: the same
  refusal as `restore_adapters`, in a second instead of twenty."""
  try:
    run_dir = os.path.join(view.base_output_directory, view.run_name)
    ckpt_dir = value_or(view, "checkpoint_dir", None) or os.path.join(run_dir, "checkpoints")
  except Unresolved:
    return  # a key the schema types: restore_adapters decides
  if step is None:
    return  # the newest: a run without checkpoints is refused with the reason that comes first (e.g. no LoRA)
  steps = run_identity.checkpoint_steps(storage.absolute(ckpt_dir))
  if not steps:
    raise CheckpointError(f"no checkpoints in {storage.absolute(ckpt_dir)}: run training with this config first")
  if step not in steps:
    raise CheckpointError(f"no checkpoint step {step} in {storage.absolute(ckpt_dir)} (steps: {sorted(steps)})")


def restore_adapters(model, ckpt_dir: str, step: int | None) -> int:
  """Load the adapters (the `params` item) of RL checkpoint `step` (newest when None) into `model`; returns the step."""
  from flax import nnx
  import orbax.checkpoint as ocp

  from maxtext_rl_plugin import checkpointing

  if not storage.isdir(ckpt_dir):
    raise CheckpointError(f"no checkpoints in {ckpt_dir}: run training with this config first")
  # Restores read any format (Orbax detects it per checkpoint); `storage` only matters for writing.
  manager = checkpointing.open_manager(
      ckpt_dir, ("params", "opt_state", "meta"), storage=checkpointing.Storage(), create=False
  )
  try:
    steps = list(manager.all_steps())
    if step is None:
      if not steps:
        raise CheckpointError(f"no checkpoints in {ckpt_dir}: run training with this config first")
      step = max(steps)
    elif step not in steps:
      raise CheckpointError(f"no checkpoint step {step} in {ckpt_dir} (steps: {sorted(steps)})")
    target = nnx.state(model, nnx.LoRAParam)
    try:
      restored = manager.restore(step, args=ocp.args.Composite(params=checkpointing.restore_args(target, None)))
    except (ValueError, KeyError, FileNotFoundError) as e:
      raise CheckpointError(
          f"checkpoint {ckpt_dir}/{step} does not hold this run's adapters (check the lora.* keys "
          f"match the training run): {type(e).__name__}: {str(e).splitlines()[0][:200]}"
      ) from None
  finally:
    manager.close()
  nnx.update(model, restored.params)
  return step


def _lora_from_run(argv: list[str], config, ckpt_dir: str, step: int | None) -> list[str]:
  """`argv` with the run's own `lora.*` keys (stored in its checkpoint metadata): a config that leaves LoRA off gets
  them added; one that sets a different rank, alpha or module path is refused (the merge would use the wrong scale or
  the wrong modules). A checkpoint written before the metadata held them is taken as the config says."""
  steps = run_identity.checkpoint_steps(ckpt_dir)
  chosen = step if step is not None else (steps[0] if steps else None)
  meta = run_identity.read_meta(ckpt_dir, chosen) if chosen is not None else None
  trained = meta.get("lora") if meta else None
  if not isinstance(trained, dict):
    return argv
  given = run_identity.lora_keys(config)
  if not given["enable_lora"]:
    return [*argv, *(f"lora.{k}={v}" for k, v in trained.items() if given.get(k) != v)]
  for key, value in trained.items():
    if given.get(key) != value:
      raise ConfigError(
          f"invalid value for 'lora.{key}'={given.get(key)!r}: the run in {ckpt_dir} trained its adapters with "
          f"lora.{key}={value!r}; drop the override (export_lora reads it from the run) or give the run's value"
      )
  return argv


def export(argv, output: str, step: int | None = None) -> str:
  """Build the run's base, apply and restore its adapters, merge, save; returns the `load_parameters_path`."""
  view = config_precheck.precheck(argv)  # key names and values as written, before the schema's imports
  _check_step(view, step)
  out = os.path.join(storage.absolute(output), "0")
  if storage.exists(out):
    raise ConfigError(f"invalid value for '--output'='{output}': {out} already exists")
  run_dir_lib.check_not_in_other_run(out, "--output", None)  # never a step inside a run's checkpoints
  config = config_lib.typed(view.source()).hyperparameters()
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  argv = _lora_from_run(list(argv), config, storage.absolute(run_identity.checkpoint_dir(config, run_dir)), step)
  parsed = config_lib.parse(argv)  # with the run's own lora.* keys
  config = parsed.hyperparameters()
  settings = lora.LoraSettings.from_config(config)
  if not settings.enable:
    raise ConfigError(
        "export_lora needs the training run's lora.enable_lora=true (a full fine-tuning run's "
        "checkpoints already hold every weight)"
    )
  run_dir_lib.probe_dir(storage.absolute(output), "--output")  # writable (created), once the run is one to export
  from flax import nnx
  from maxtext.common import checkpointing as mt_checkpointing

  from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
  from maxtext_rl_plugin.run import models as run_models
  from maxtext_rl_plugin.run import warm_start

  rs = run_models.setup_devices(parsed)
  config = rs.trainer_config
  tokenizer = tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config))
  actor, mesh = run_models.build_model(config, rs.trainer_devices, pad_id=tokenizer.pad_token_id)
  if config.sft_warmup_steps > 0:
    sft_dir = os.path.join(storage.absolute(run_dir), "checkpoints", "sft", str(config.sft_warmup_steps))
    if not storage.isdir(sft_dir):
      raise CheckpointError(f"the run's base is its SFT warm start, but {sft_dir} does not exist")
    # restores (the finished warm start is there)
    warm_start.warm_start(warm_start.SftSettings.from_config(config), actor, mesh, tokenizer, None, run_dir)
  lora_actor, _ = run_models.apply_lora(config, actor, mesh, tokenizer.pad_token_id)
  ckpt_dir = storage.absolute(config.checkpoint_dir or os.path.join(run_dir, "checkpoints"))
  step = restore_adapters(lora_actor, ckpt_dir, step)
  merged = lora.merged_params(lora_actor, settings.scale, int(config.param_scan_axis))
  try:
    # In the format of MaxText's OrbaxStorage keys, as MaxText's own param-only checkpoints (its RL default: plain
    # zarr2 arrays, which Pathways' persistence handler writes).
    mt_checkpointing.save_params_to_path(
        out,
        {"params": nnx.to_pure_dict(merged)},
        use_ocdbt=config.checkpoint_storage_use_ocdbt,
        use_zarr3=config.checkpoint_storage_use_zarr3,
    )
  except OSError as e:
    raise CheckpointError(f"the merged weights were not written: {storage.describe_error(e, out)}") from None
  path = os.path.join(out, "items")
  print(
      f"exported {run_dir} step {step} (LoRA rank {config.lora.lora_rank}, alpha {config.lora.lora_alpha} merged) "
      f"to {out}; serve or fine-tune it with load_parameters_path={path}",
      flush=True,
  )
  return path


def main(argv=None) -> int:
  errors.quiet_third_party_logs()
  args = _parse(list(sys.argv[1:] if argv is None else argv))
  with errors.exit_on_user_error():
    export(args.config, args.output, args.step)
  return 0


if __name__ == "__main__":
  sys.exit(main())
