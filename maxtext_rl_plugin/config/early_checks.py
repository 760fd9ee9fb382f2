"""Refusals the config as written decides, light enough for the first pass (no JAX, no schema, no model build).

Each was a traceback or a refusal after the model build (issues 51, 61): a value outside an enumerated key's choices
(config/choices.py), a model dimension below 1 or heads MaxText cannot group or shard, a parallelism size of 0, an MoE
routing more experts per token than it has, trainer and sampler devices that overlap, a checkpoint I/O budget of 0
GB (found at the first save), an engine name nothing registered, router replay where no layer can carry the forced
experts (no MoE, pipeline stages, an engine that does not report routing). `validation._light_checks` runs them in both
passes (on the `RawConfig` of `config_precheck` and on the typed config), so each is one `error:` line within a second
or two.

An engine's own refusals (a model the embedded engine cannot decode, a head_dim vLLM's native route refuses, a model
whose routing vLLM cannot report) are the engine's: its `EngineSpec` (rollout/engines.py), found by name through the
`maxtext_rl_plugin.rollout_engines` entry points (`engine_spec`), carries them in a module light enough for this pass.
config/ imports no engine module.

The schema's enumerated choices (config/schema.py imports JAX and MaxText) are restated in config/choices.py;
tests/test_bad_input.py compares them with the schema's. `mesh_refusal` needs the device count, so it runs where that is
known (train_rl after the typed pass, run/models.setup_devices), not in `CHECKS`.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from maxtext_rl_plugin.config import choices as config_choices
from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin import registry

# Every enumerated key of the schema and remat_policy (config/choices.py), with its choices.
CHOICES = config_choices.CHOICES
# `rollout_engine`'s one value that names no registered engine: the run picks one (run/build.py).
AUTO_ENGINE = "auto"
# What a rollout_engines entry point names (rollout/engines.py).
ENGINE_SPEC = "maxtext_rl_plugin.rollout.engines.EngineSpec"
# Checkpoint I/O budgets (checkpointing.Storage): a positive number, or null for Orbax's default. The OCDBT data file
# size may also be 0 (TensorStore: no limit), not negative.
_POSITIVE_OR_NULL = ("checkpoint_storage_concurrent_gb", "checkpoint_storage_device_host_concurrent_gb")


def _bad(key: str, value: Any, why: str) -> ConfigError:
  return ConfigError(f"invalid value for '{key}'={value!r}: {why}")


def _get(pc, key: str) -> Any:
  """A dotted key's value (AttributeError when the first pass cannot type it: the check waits for the second)."""
  value = pc
  for part in key.split("."):
    value = getattr(value, part)
  return value


def _experts(pc) -> int:
  """num_experts; 1 (MaxText's base.yml default) where the config as written leaves it to that default."""
  return int(value_or(pc, "num_experts", 1))


def check_choices(pc) -> None:
  """An enumerated key holds one of its choices (config/choices.py; pydantic refuses it too, after the schema's imports,
  and MaxText's decoder refuses an unknown remat_policy with an AssertionError at the first forward)."""
  for key, choices in CHOICES.items():
    try:
      value = _get(pc, key)
    except (Unresolved, AttributeError):  # AttributeError: a block the first pass does not type (`vllm:`)
      continue
    if value is not None and getattr(value, "value", value) not in choices:
      shown = ", ".join(repr(c) if c == "" else str(c) for c in choices)
      close = [c for c in choices if str(c).lower() == str(value).lower()]
      hint = f" (did you mean '{close[0]}'? choices are case-sensitive)" if close else ""
      raise _bad(key, value, f"expected one of {shown}{hint}")


def check_moe(pc) -> None:
  """An MoE layer routes each token to num_experts_per_tok of its num_experts experts."""
  experts, per_tok = _experts(pc), int(value_or(pc, "num_experts_per_tok", 1))
  if experts > 1 and not 1 <= per_tok <= experts:
    raise _bad("num_experts_per_tok", per_tok, f"must be between 1 and num_experts={experts}")


# MaxText's model dimensions (configs/types.py bounds none of them): below 1 each is a ZeroDivisionError or a shape error
# in the model build, 10-20 s later.
MODEL_DIMS = (
    "base_emb_dim",
    "base_mlp_dim",
    "base_num_decoder_layers",
    "base_num_query_heads",
    "base_num_kv_heads",
    "head_dim",
    "vocab_size",
)
# The mesh axes MaxText shards attention heads over (types.py's logical rules: "heads", "q_heads", "kv_heads").
HEAD_AXES = ("tensor", "tensor_sequence", "autoregressive")


def check_model_shape(pc) -> None:
  """The model's dimensions are positive and its heads group as MaxText's attention asserts: every key/value head
  serves the same number of query heads (attentions._validate_kv_heads), and the key/value heads split evenly over
  the mesh axes that shard heads (attentions._validate_kv_head_sharding)."""
  for key in MODEL_DIMS:
    value = value_or(pc, key, None)
    if value is not None and int(value) < 1:
      raise _bad(key, value, "must be >= 1 (a model dimension)")
  query, kv = value_or(pc, "base_num_query_heads", None), value_or(pc, "base_num_kv_heads", None)
  if query is not None and kv is not None and int(query) % int(kv):
    raise _bad(
        "base_num_query_heads",
        query,
        f"must be a multiple of base_num_kv_heads={kv}: grouped-query attention gives every key/value head the same "
        "number of query heads (MaxText: 'Invalid num_kv_heads for GQA')",
    )
  if kv is None or int(value_or(pc, "global_parameter_scale", 1)) != 1:
    return  # a scaled model's head counts are derived by the schema
  shards, named = 1, []
  for axis in HEAD_AXES:
    for kind in ("ici", "dcn"):
      key = f"{kind}_{axis}_parallelism"
      value = value_or(pc, key, 1)
      if value is not None and int(value) > 1:
        shards *= int(value)
        named.append(f"{key}={value}")
  if int(kv) % shards:
    raise _bad(
        "base_num_kv_heads",
        kv,
        f"must be divisible by {shards} ({' x '.join(named)}): the mesh axes that shard attention heads cannot split "
        "one head (MaxText refuses it at the model build)",
    )


def _parallelism_keys(pc) -> list[str]:
  """The ici_*/dcn_* parallelism keys the config holds (MaxText's base.yml names them; the first pass reads the
  shipped defaults, the typed config its fields)."""
  names = pc.field_names() if hasattr(pc, "field_names") else list(type(pc).model_fields)
  return [k for k in names if k.startswith(("ici_", "dcn_")) and k.endswith("_parallelism")]


def check_parallelism_values(pc) -> None:
  """Each ici_*/dcn_* parallelism is a positive size, or -1 (the axis that takes the devices the others leave): 0 or
  a negative size is an AssertionError in MaxText's mesh creation (fill_unspecified_mesh_axes)."""
  for key in _parallelism_keys(pc):
    value = value_or(pc, key, None)
    if isinstance(value, int) and not isinstance(value, bool) and value != -1 and value < 1:
      raise _bad(key, value, "must be >= 1, or -1 (the one axis that takes the devices the others leave)")


# A mesh axis's key where its name is not the axis's (MaxText's ici_map/dcn_map).
_AXIS_KEY = {"stage": "pipeline", "model": "tensor"}


def mesh_refusal(config, devices: int, where: str = "") -> str | None:
  """Why MaxText's mesh for `devices` devices cannot be made from the config's ici_*/dcn_* parallelism, or None.

  MaxText's rule (max_utils.fill_unspecified_mesh_axes): the ici sizes multiply to the devices of one slice and the dcn
  sizes to the number of slices, one axis of each may be -1 and then takes what the others leave. `config` is the
  typed config: `ici_parallelism`/`dcn_parallelism` are MaxText's sizes in `mesh_axes` order."""
  slices = max(int(config.num_slices), 1)
  for kind, sizes, target, unit in (
      ("ici", config.ici_parallelism, devices // slices, "devices per slice"),
      ("dcn", config.dcn_parallelism, slices, "slices"),
  ):
    named = {f"{kind}_{_AXIS_KEY.get(a, a)}_parallelism": int(v) for a, v in zip(config.mesh_axes, sizes)}
    free = [k for k, v in named.items() if v == -1]
    fixed = {k: v for k, v in named.items() if v != -1}
    product = math.prod(fixed.values())
    shown = " x ".join(f"{k}={v}" for k, v in fixed.items() if v != 1) or "all 1"
    if len(free) > 1:
      return (
          f"invalid value for '{free[-1]}'=-1: {free[0]} is -1 too; at most one {kind} axis may be -1 (it takes the "
          f"{unit} the others leave)"
      )
    if free and (product < 1 or target % product):
      culprit = next((k for k, v in fixed.items() if v != 1), free[0])
      return (
          f"invalid value for '{culprit}'={named[culprit]}: the {kind} sizes ({shown}) do not divide the {target} "
          f"{unit}{where}, so {free[0]}=-1 cannot take the rest"
      )
    if not free and product != target:
      culprit = next((k for k, v in fixed.items() if v != 1), next(iter(fixed)))
      return (
          f"invalid value for '{culprit}'={named[culprit]}: the {kind} sizes multiply to {product} ({shown}), not "
          f"the {target} {unit}{where}; make them multiply to {target}, or set one axis to -1"
      )
  return None


def check_greedy_rollout(pc) -> None:
  """A rollout samples: with decode_sampling_temperature=0 (or top-k 1) every response of a group is the same greedy
  decode, every advantage is 0, and nothing is ever learned. Greedy decoding is for evaluation (generation_configs)."""
  groups = value_or(pc.rl, "num_generations", None)
  if groups is None or int(groups) < 2:
    return
  for key, greedy in (("decode_sampling_temperature", 0), ("decode_sampling_top_k", 1)):
    if value_or(pc, key, None) == greedy:
      raise _bad(
          key,
          greedy,
          f"the rollout would be greedy, so the rl.num_generations={groups} responses to a prompt are identical, every "
          "advantage is 0 and nothing is learned; sample (e.g. decode_sampling_temperature=1.0, "
          "decode_sampling_top_k=0) and keep greedy decoding for evaluation (generation_configs)",
      )


def check_dropless(pc) -> None:
  """An MoE model routes without token dropping (capacity_factor <= 0), so the sampler and the trainer route alike."""
  capacity = value_or(pc, "capacity_factor", -1.0)
  if _experts(pc) > 1 and float(capacity) > 0:
    raise _bad(
        "capacity_factor",
        capacity,
        "token dropping depends on how many tokens share a forward (one per decode step in the rollout, the whole "
        "sequence in the trainer), so the sampled and the trained policy would differ; use dropless routing "
        "(capacity_factor=-1)",
    )


def check_device_fractions(pc) -> None:
  """The trainer takes the first `trainer_devices_fraction` of the devices and the sampler the last
  `sampler_devices_fraction` (run/models.setup_devices, as MaxText's): fractions that add up to more than 1 give some
  devices to both, which is neither the colocated run (both 1.0: every device is both) nor a disaggregated one."""
  t, s = float(pc.trainer_devices_fraction), float(pc.sampler_devices_fraction)
  if t + s > 1.0 and not t == s == 1.0:
    raise _bad(
        "trainer_devices_fraction",
        t,
        f"with sampler_devices_fraction={s} the trainer's first {t:g} and the sampler's last {s:g} of the devices "
        "overlap; make them add up to at most 1 (disaggregated), or set both to 1.0 (colocated)",
    )


def check_checkpoint_storage(pc) -> None:
  """Orbax's I/O budgets are positive (0 or less fails at the first save, after the step it was to keep)."""
  for key in _POSITIVE_OR_NULL:
    value = value_or(pc, key, None)  # the config as written may leave one to MaxText's default (positive)
    if value is not None and value <= 0:
      raise _bad(key, value, "must be > 0 (or null: Orbax's default)")
  size = value_or(pc, "checkpoint_storage_target_data_file_size_bytes", None)
  if size is not None and size < 0:
    raise _bad("checkpoint_storage_target_data_file_size_bytes", size, "must be >= 0 (0: no limit)")


def engine_spec(pc) -> Any:
  """The `rollout/engines.EngineSpec` the config's `rollout_engine` names, found through the entry points (config/
  imports no engine module: each engine's checks live with the engine, in the light module its entry point names);
  None for 'auto', which names no engine until the run picks one (run/build.py)."""
  name = str(pc.rollout_engine)
  if name == AUTO_ENGINE:
    return None
  if name not in registry.entry_points("rollout_engines"):
    shown = ", ".join([AUTO_ENGINE, *sorted(registry.entry_points("rollout_engines"))])
    raise _bad(
        "rollout_engine",
        name,
        f"expected one of {shown} (the registered rollout engines: entry-point group "
        f"{registry.GROUPS['rollout_engines']})",
    )
  spec = registry.load("rollout_engines", name)
  if not _is_spec(spec):
    raise ConfigError(
        f"rollout_engine={name}: its entry point ({registry.entry_points('rollout_engines')[name].value}) names "
        f"{spec!r}, not an {ENGINE_SPEC} (metadata older than the plugin? reinstall it: pip install -e .)"
    )
  return spec


def _is_spec(entry: Any) -> bool:
  """Whether a rollout_engines entry is an EngineSpec (by its type's name: config/ imports no rollout module)."""
  return f"{type(entry).__module__}.{type(entry).__qualname__}" == ENGINE_SPEC


def check_engine_name(pc) -> None:
  """`rollout_engine` is 'auto' or a registered engine (one line listing them, as a bad choice's)."""
  engine_spec(pc)


# Keys that name an entry of a registry group (registry.GROUPS): their choices are the registered names.
REGISTERED_NAMES = {
    "rl.loss_algo": "policy_losses",
    "loss_algo": "policy_losses",
    "rl.advantage_estimator": "advantage_estimators",
}


def check_algorithm_names(pc) -> None:
  """The policy loss and the advantage estimator are registered names (entry points; none is loaded here): one line
  listing the registered ones, as a bad choice's."""
  for key, group in REGISTERED_NAMES.items():
    try:
      value = _get(pc, key)
    except (Unresolved, AttributeError):
      continue
    if value is not None and str(value) not in registry.names(group):
      raise registry.unknown(group, key, value)


def check_engine(pc) -> None:
  """The chosen engine's own refusals (its spec's `checks`: models it cannot sample, head_dim on vLLM's native
  route, ...), then a `rollout_quantization` its capabilities do not declare (`EngineSpec.precision_refusal`: what
  the engine declares decides, whoever registered it)."""
  spec = engine_spec(pc)
  if spec is None:
    return
  for check in spec.checks:
    check(pc)
  why = spec.precision_refusal(value_or(pc, "rollout_quantization", ""))
  if why:
    raise ConfigError(why)


def check_engine_typed(pc) -> None:
  """The chosen engine's refusals that import its heavier modules (its spec's `typed_checks`, 'module:function'
  paths; vLLM: the route's own), on the typed config: config/validation.validate's second pass only."""
  spec = engine_spec(pc)
  for path in spec.typed_checks if spec is not None else ():
    module, _, name = path.partition(":")
    getattr(importlib.import_module(module), name)(pc)


def _capture_engines() -> list[str]:
  """The registered engines that report MoE routing (their `capabilities.routing_capture`; an entry that is no spec is
  refused where it is chosen, `engine_spec`)."""
  specs = {n: registry.load("rollout_engines", n) for n in sorted(registry.entry_points("rollout_engines"))}
  return [n for n, spec in specs.items() if _is_spec(spec) and spec.capabilities.routing_capture]


def router_replay_refusal(pc) -> str | None:
  """Why `rl.router_replay=true` cannot run with this config (one line), or None (check_router_replay raises it)."""
  if not pc.rl.router_replay:
    return None
  if _experts(pc) <= 1:
    return f"rl.router_replay=true needs a mixture-of-experts model; {pc.model_name} has num_experts=1"
  # Every MoE family replays (moe.py forces the routing itself where MaxText's decoder does not); pipeline stages
  # slice the layers their own way and cannot carry each layer's forced experts.
  if int(pc.ici_pipeline_parallelism) > 1 or int(pc.dcn_pipeline_parallelism) > 1:
    return (
        "rl.router_replay=true with pipeline parallelism: the pipeline's stages run the layers with their own "
        "slicing, which cannot carry each layer's forced experts (MaxText refuses it too)"
    )
  spec = engine_spec(pc)
  if spec is None or not spec.capabilities.routing_capture:
    engines = " or ".join(_capture_engines())
    return (
        f"rl.router_replay=true needs rollout_engine={engines}: the {pc.rollout_engine} engine "
        + ("is chosen at launch" if spec is None else "does not report routing")
        + ", and replay needs an engine that reports the experts it routed each token to"
    )
  why = spec.routing_refusal(pc, "rl.router_replay=true") if spec.routing_refusal else None
  if why:
    return why
  if pc.rl.use_agentic_rollout:
    return (
        "rl.router_replay=true with rl.use_agentic_rollout=true: multi-turn episodes re-prefill their transcripts, "
        "and their routing is not recorded yet"
    )
  if int(value_or(pc, "mtp_num_layers", 0) or 0) > 0:
    return "rl.router_replay=true with mtp_num_layers > 0: MaxText cannot replay routing with MTP"
  return None


def check_router_replay(pc) -> None:
  why = router_replay_refusal(pc)
  if why:
    raise ConfigError(why)


def check_return_routed_experts(pc) -> None:
  """MaxText's `return_routed_experts` (record each MoE layer's routing from inference): an MoE model, and on vLLM a
  model whose recorded experts are the ones it used. The embedded engine records every MoE model's routing anyway."""
  if not bool(value_or(pc, "return_routed_experts", False)):
    return
  if _experts(pc) <= 1:
    raise _bad("return_routed_experts", True, f"{pc.model_name} has num_experts=1: a dense model routes nothing")
  spec = engine_spec(pc)
  why = spec.routing_refusal(pc, "return_routed_experts=true") if spec is not None and spec.routing_refusal else None
  if why:
    raise ConfigError(why)


def check_mesh(config, devices: int, where: str = "") -> None:
  """Refuse (one line) a config whose mesh cannot be made on `devices` devices (`mesh_refusal`): MaxText's
  AssertionError at mesh creation otherwise. Called where the devices are known: the run's device split
  (run/models.setup_devices) and train_rl's print_config/compile_topology (MaxText's num_target_devices)."""
  why = mesh_refusal(config, devices, where)
  if why:
    raise ConfigError(why)


CHECKS = (
    check_choices,
    check_engine_name,
    check_algorithm_names,
    check_greedy_rollout,
    check_model_shape,
    check_parallelism_values,
    check_moe,
    check_dropless,
    check_device_fractions,
    check_checkpoint_storage,
    check_engine,
    check_router_replay,
    check_return_routed_experts,
)
