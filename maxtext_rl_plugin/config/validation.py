"""`validate`: every device-free check of a parsed config, once, for `print_config=true`, the launchers and training.

Three layers, all before any model is built (and before JAX has a backend), each refusal one line naming the key:

* a scan of every value of the schema (top-level keys, each nested block, lists and dicts inside them): a float
  must be finite (NaN passes every `x < 0` check, so ranges alone never catch it) unless the key is in
  `INFINITY_MEANS`, which says what infinity means there; an integer must fit int64 (what JAX and NumPy index with);
* `RANGES`: the keys whose meaningful values are narrower than their type (a negative temperature, a nucleus of mass 0,
  a beta outside [0, 1)): MaxText's restated here, the plugin's from their fields' bounds (config/rules.py), so the
  first pass checks them too; only documented conventions pass (top_k 0 = off, top_p 1 = off, an evaluation
  temperature 0 = greedy; a rollout's greedy decode is refused by `early_checks.check_greedy_rollout`);
* `_CROSS_CHECKS`: rules between keys (the completion budget, micro-batch divisibility, the run directory).

Checks that need the device set (the trainer/sampler split, a per-host sampler for rollouts ahead) stay in the trainer
(`run/build.check_runtime`). Rows that do not divide over the trainer are valid (Tunix replicates them:
`distributed.rows_sharding`); the run says what they cost in one `note:` line.

The same checks run twice: first by `validate_raw` on a `RawConfig` (the yml chain and the command line as written,
typed by the shipped defaults) before the schema's imports (JAX, MaxText: seconds on a loaded machine), so a config
mistake is refused in a second; then by `validate` on the typed config. A check that reads a value only the schema
knows (a derived key, a value pydantic would coerce) is skipped in the first pass and decided by the second.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Iterator

from maxtext_rl_plugin.config import dependent_keys
from maxtext_rl_plugin.config import early_checks
from maxtext_rl_plugin.config import key_status
from maxtext_rl_plugin.config import rules
from maxtext_rl_plugin.config.unresolved import Unresolved
from maxtext_rl_plugin.config.unresolved import value_or
from maxtext_rl_plugin import lora
from maxtext_rl_plugin.errors import ConfigError

INT64_MAX = 2**63 - 1

# Keys where an infinite float is meaningful, with what it means (every other float key must be finite).
INFINITY_MEANS: dict[str, str] = {}


def _bad(key: str, value: Any, why: str) -> ConfigError:
  return ConfigError(f"invalid value for '{key}'={value!r}: {why}")


def _typed(value: Any, default: Any) -> Any:
  """`value` as the schema would type it, judged by the type of the shipped default; `Unresolved` when unsure."""
  if isinstance(value, str) and "${" in value:
    raise Unresolved(value)  # an OmegaConf interpolation: pyconfig resolves it (or says why it cannot)
  if isinstance(value, str) and value.strip().lower() == "none":
    return None  # MaxText reads the string "none" as None
  if isinstance(default, bool):
    if isinstance(value, bool):
      return value
  elif isinstance(default, int):
    if isinstance(value, bool):
      raise Unresolved(default)
    if isinstance(value, int):
      return value
    number = _number(value)
    if number is not None and math.isfinite(number) and number == int(number):
      return int(number)
  elif isinstance(default, float):
    number = _number(value)
    if number is not None:
      return number
  elif isinstance(default, str):
    if isinstance(value, str):
      return value
  elif default is None or isinstance(default, (list, dict)):
    if value is None or (isinstance(value, (int, float, list, dict)) and not isinstance(value, bool)):
      return value
  raise Unresolved(value)


def _number(value: Any) -> float | None:
  """An int, float or numeric string as pydantic's lax float reads it (`"inf"`, `"1e-4"`), else None."""
  if isinstance(value, bool):
    return None
  if isinstance(value, (int, float)):
    return float(value)
  if isinstance(value, str):
    try:
      return float(value)
    except ValueError:
      return None
  return None


class RawConfig:
  """Attribute view of a merged yml chain plus overrides (plain containers), each value typed like its shipped default
  (`defaults`); a key that is absent, listed in `unresolved` (set by a model file), or not of its default's type
  raises `Unresolved` (config/unresolved.py: not an AttributeError; `value_or(view, key)` reads it as unset)."""

  def __init__(
      self, values: dict[str, Any], defaults: dict[str, Any], unresolved: frozenset[str] = frozenset(), source: Any = None
  ):
    self._values = values
    self._defaults = defaults
    self._unresolved = unresolved
    self._source = source

  def source(self) -> Any:
    """What this view was built from (`config/precheck.Written`: the yml chain and the overrides, read once), which the
    typed pass (`config/load.typed`) reads instead of the files and the command line again; None for a nested block."""
    return self._source

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_"):
      raise AttributeError(name)  # not a key: Python's own protocol lookups (copy, pickle) find nothing here
    if name in self._unresolved or name not in self._values:
      raise Unresolved(name)
    value, default = self._values[name], self._defaults.get(name)
    if name == "run_name" and value is None:
      return ""  # pyconfig's rule for `run_name=` (OmegaConf reads an empty value as None)
    if name in key_status.NESTED_BLOCKS and isinstance(value, dict) and isinstance(default, dict):
      return RawConfig(value, default)  # a nested block (`rl:`, `lora:`)
    return _typed(value, default)

  def __contains__(self, name: str) -> bool:
    """Whether the config as written sets `name` (typed or not)."""
    return name in self._values

  def field_names(self) -> list[str]:
    """The keys whose typed value is known."""
    return [k for k in self._values if k not in self._unresolved and _known(self, k)]


def _known(view: RawConfig, key: str) -> bool:
  try:
    getattr(view, key)
  except Unresolved:
    return False
  return True


def _fields(block: Any) -> list[str] | None:
  """The keys of a pydantic block or a `RawConfig`, None for any other value."""
  if isinstance(block, RawConfig):
    return block.field_names()
  fields = getattr(type(block), "model_fields", None)
  return list(fields) if fields is not None else None


def _leaves(key: str, value: Any) -> Iterator[tuple[str, Any]]:
  """(dotted key, leaf value) of a value that may be a pydantic block, a dict or a list."""
  inner_keys = _fields(value)
  if inner_keys is not None:
    for inner in inner_keys:
      yield from _leaves(f"{key}.{inner}", getattr(value, inner))
  elif isinstance(value, dict):
    for k, v in value.items():
      yield from _leaves(f"{key}.{k}", v)
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      yield from _leaves(f"{key}[{i}]", v)
  else:
    yield key, value


def check_numbers(pc) -> None:
  """Every float finite (unless `INFINITY_MEANS` says otherwise), every integer within int64."""
  # The `rl:` and `lora:` blocks first: their keys are named dotted (`rl.grpo_beta`, not its flat twin).
  names = sorted(_fields(pc), key=lambda n: n not in ("rl", "lora"))
  for name in names:
    for key, value in _leaves(name, getattr(pc, name)):
      if isinstance(value, bool):
        continue
      if isinstance(value, float) and not math.isfinite(value):
        if math.isinf(value) and key in INFINITY_MEANS:
          continue
        raise _bad(key, value, "must be a finite number")
      if isinstance(value, int) and abs(value) > INT64_MAX:
        raise _bad(key, value, f"must fit a 64-bit integer (|value| <= {INT64_MAX})")


def _get(pc, key: str) -> Any:
  value = pc
  for part in key.split("."):
    value = value.get(part) if isinstance(value, dict) else value_or(value, part)
  return value


_Check = Callable[[Any], bool]
# The smallest sampling temperature of a rollout (RANGES' decode_sampling_temperature row says why).
MIN_SAMPLING_TEMPERATURE = 1e-2


def _ge(lo: float) -> _Check:
  return lambda v: v >= lo


def _gt(lo: float) -> _Check:
  return lambda v: v > lo


def _unit_open(v) -> bool:
  return 0.0 <= v < 1.0


def _unit(v) -> bool:
  return 0.0 <= v <= 1.0


def _prob_mass(v) -> bool:
  return 0.0 < v <= 1.0


# key -> (accepts the value, what is expected). None values (a key left unset) are not checked. MaxText's keys here; the
# plugin's bounds are their fields' (`ge`/`gt`/`le`/`lt`, config/rules.ranges), added below.
RANGES: dict[str, tuple[_Check, str]] = {
    "batch_size": (_ge(1), "must be >= 1"),
    "num_batches": (_ge(1), "must be >= 1"),
    "checkpoint_period": (
        _ge(1),
        "must be >= 1 (checkpoints are saved every N steps; enable_checkpointing=false turns them off)",
    ),
    "learning_rate": (_ge(0.0), "must be >= 0"),
    "adam_b1": (_unit_open, "must be in [0, 1) (Adam's first-moment decay)"),
    "adam_b2": (_unit_open, "must be in [0, 1) (Adam's second-moment decay)"),
    "adam_eps": (_gt(0.0), "must be > 0 (it keeps Adam's denominator away from 0)"),
    "adam_weight_decay": (_ge(0.0), "must be >= 0"),
    "gradient_clipping_threshold": (_ge(0.0), "must be >= 0 (0 = no clipping)"),
    "warmup_steps_fraction": (_unit, "must be in [0, 1]"),
    "decode_sampling_temperature": (
        lambda v: v == 0 or v >= MIN_SAMPLING_TEMPERATURE,
        f"must be >= {MIN_SAMPLING_TEMPERATURE:g}: the log-probs are the logits divided by it, so below that a change "
        "of less than one logit already overflows float32's exp in the importance ratio (NaN loss); 1.0 samples the "
        "model as it is",
    ),
    "decode_sampling_top_k": (_ge(0), "must be >= 0 (0 = off)"),
    "decode_sampling_nucleus_p": (_prob_mass, "must be in (0, 1] (1 = off; 0 would keep no token)"),
    "max_prefill_predict_length": (_ge(1), "must be >= 1 (the prompt budget in tokens)"),
    "num_eval_passes": (_ge(1), "must be >= 1 (generations per eval prompt)"),
    "num_test_batches": (_ge(0), "must be >= 0 (0 = no eval)"),
    "rl.grpo_epsilon": (_unit, "must be >= 0 and <= 1 (the clip range [1 - eps, 1 + eps])"),
    "rl.epsilon_high": (_ge(0.0), "must be >= 0 (or null for rl.grpo_epsilon)"),
    "rl.grpo_beta": (_ge(0.0), "must be >= 0 (0 disables the KL term and the reference model)"),
    "rl.num_iterations": (_ge(1), "must be >= 1"),
    "rl.off_policy_steps": (_ge(0), "must be >= 0 (0 = synchronous rollouts)"),
    "rl.reshard_chunk_size": (_ge(1), "must be >= 1 (or null: one chunk)"),
    "rope_max_timescale": (_gt(0), "must be > 0 (RoPE's longest wavelength; 0 divides by zero: NaN loss)"),
    "rope_min_timescale": (_gt(0), "must be > 0 (RoPE's shortest wavelength; 0 divides by zero: NaN loss)"),
    "log_period": (_ge(1), "must be >= 1 (steps between progress lines and TensorBoard flushes)"),
}

RANGES.update(rules.ranges())
# Numeric plugin keys every value of whose type means something: no bound, and their field's rule says why
# (`KeyRule.any_value`; tests/config/test_rules.py fails for a numeric plugin key with neither).
UNBOUNDED: dict[str, str] = rules.unbounded()
# Each sampling strategy of generation_configs (run/evaluation.py): the same conventions as the rollout's keys.
_GENERATION_RANGES: dict[str, tuple[_Check, str]] = {
    "eval_temperature": (_ge(0.0), "must be >= 0 (0 = greedy)"),  # evaluation trains nothing: any temperature works
    "eval_top_k": RANGES["decode_sampling_top_k"],
    "eval_top_p": RANGES["decode_sampling_nucleus_p"],
}


def check_ranges(pc) -> None:
  """Every key of `RANGES` (and each generation_configs strategy) holds a value with a meaning."""
  for key, (ok, why) in RANGES.items():
    value = _get(pc, key)
    if value is not None and not ok(value):
      raise _bad(key, value, why)
  for strategy, params in (value_or(pc, "generation_configs") or {}).items():
    for inner, (ok, why) in _GENERATION_RANGES.items():
      value = params.get(inner) if isinstance(params, dict) else None
      if value is not None and not ok(value):
        raise _bad(f"generation_configs.{strategy}.{inner}", value, why)


def check_run_dir(pc) -> None:
  """Every output of a run lives under one run directory, `<base_output_directory>/<run_name>`: a path-like run_name
  (or checkpoint/TensorBoard directories outside it) would put a run's outputs where another run finds them."""
  name = pc.run_name
  if not name:
    return  # a config that does not train (the score CLI, a launcher's dry run); `check_run` refuses it for a run
  if not name.strip() or name != name.strip():
    raise _bad("run_name", name, "must be a directory name without leading or trailing spaces")
  if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
    raise _bad("run_name", name, "must be one directory name (no '/', not '.' or '..')")
  run_dir = os.path.join(pc.base_output_directory, name)
  for key in ("checkpoint_dir", "tensorboard_dir"):
    path = value_or(pc, key)
    if path and not os.path.normpath(path).startswith(os.path.normpath(run_dir) + os.sep):
      raise _bad(key, path, f"must lie inside the run directory {run_dir}")


def check_run(config) -> None:
  """What a run (training, print_config of a run, export_lora) needs beyond `validate`: a run_name. Without one,
  MaxText's RLConfig puts checkpoints and TensorBoard logs in `<cwd>/maxtext_output/`, shared by every unnamed run,
  while the summary lands in the base directory: a second, unrelated run would resume from the first one's state."""
  if not config.run_name or not config.base_output_directory:
    key = "run_name" if not config.run_name else "base_output_directory"
    raise _bad(
        key, getattr(config, key), "must be set for a run (its outputs live in <base_output_directory>/<run_name>)"
    )


def _check_batches(pc) -> None:
  """Mini-batches divide the rollout batch and micro-batches divide a mini-batch (Tunix accumulates over them)."""
  rl = pc.rl
  mini = pc.batch_size if rl.mini_batch_size is None else rl.mini_batch_size
  if mini < 1 or pc.batch_size % mini:
    raise _bad("rl.mini_batch_size", rl.mini_batch_size, f"must be >= 1 and divide batch_size={pc.batch_size}")
  if pc.train_micro_batch_size != -1 and (pc.train_micro_batch_size < 1 or mini % pc.train_micro_batch_size):
    raise _bad(
        "train_micro_batch_size", pc.train_micro_batch_size, f"must be -1 or a divisor of the mini batch ({mini} prompts)"
    )
  if pc.rollout_micro_batch_size != -1 and (
      pc.rollout_micro_batch_size < 1 or pc.batch_size % pc.rollout_micro_batch_size
  ):
    raise _bad(
        "rollout_micro_batch_size", pc.rollout_micro_batch_size, f"must be -1 or a divisor of batch_size={pc.batch_size}"
    )


def _check_lengths(pc) -> None:
  """The completion budget max_target_length - max_prefill_predict_length is positive."""
  if pc.max_target_length <= pc.max_prefill_predict_length:
    raise _bad(
        "max_target_length",
        pc.max_target_length,
        f"must exceed max_prefill_predict_length={pc.max_prefill_predict_length} (the difference is the "
        "completion budget)",
    )


def _check_algorithm(pc) -> None:
  """rl.force_on_policy_ratio sets the ratio to 1, which is only true on the first of rl.num_iterations updates."""
  rl = pc.rl
  if rl.force_on_policy_ratio and rl.num_iterations > 1:
    raise _bad("rl.force_on_policy_ratio", True, f"valid only with rl.num_iterations=1 (got {rl.num_iterations})")


def _check_synthetic(pc) -> None:
  """The synthetic task's range of operations is not empty, and `products` has more distinct questions than its eval
  set takes (the training stream redraws every eval question: with too few it finds none, after the model build)."""
  if pc.synthetic_max_steps < pc.synthetic_min_steps:
    raise _bad("synthetic_max_steps", pc.synthetic_max_steps, f"must be >= synthetic_min_steps={pc.synthetic_min_steps}")
  eval_synthetic = not pc.eval_data_path and (pc.eval_dataset_name or pc.dataset_name) == "synthetic"
  if pc.synthetic_task == "products" and not pc.train_data_path and pc.dataset_name == "synthetic" and eval_synthetic:
    distinct = products_questions(pc.synthetic_max_value)
    if distinct <= pc.synthetic_num_eval:
      raise _bad(
          "synthetic_max_value",
          pc.synthetic_max_value,
          f"synthetic_task=products draws both operands from [{min(10, pc.synthetic_max_value)}, synthetic_max_value]: "
          f"{distinct} distinct questions, not more than the synthetic_num_eval={pc.synthetic_num_eval} the eval set "
          "takes (training never sees an eval question); raise synthetic_max_value or lower synthetic_num_eval",
      )


def products_questions(max_value: int) -> int:
  """Distinct "What is a * b?" questions of synthetic_task=products (data/synthetic.product_problem's range)."""
  lo = min(10, int(max_value))
  return max(0, int(max_value) - lo + 1) ** 2


def _check_lora_rank(pc) -> None:
  """A LoRA rank above the width of the layers it adapts (every adapted projection has emb_dim on one side) adds
  parameters that can only ever span the same space: refused rather than trained."""
  if pc.lora.enable_lora and pc.lora.lora_rank > pc.emb_dim:
    raise _bad("lora.lora_rank", pc.lora.lora_rank, f"must be <= emb_dim={pc.emb_dim} (the width of the adapted layers)")


def _check_lora(pc) -> None:
  """lora.validate's checks of the `lora:` block, on the settings the run builds from it (lora.LoraSettings)."""
  lora.validate(lora.LoraSettings.from_config(pc))


def _check_agentic(pc) -> None:
  """rl.use_agentic_rollout's token limits fit the completion budget (the width of the trainer's completion rows)."""
  rl = pc.rl
  if not rl.use_agentic_rollout:
    return
  budget = pc.max_target_length - pc.max_prefill_predict_length
  if rl.agentic_max_tokens > budget:
    raise _bad(
        "rl.agentic_max_tokens",
        rl.agentic_max_tokens,
        f"must be <= the completion budget max_target_length - max_prefill_predict_length = {budget} (0 = all of it)",
    )
  total = rl.agentic_max_tokens or budget
  if rl.agentic_turn_tokens > total:
    raise _bad("rl.agentic_turn_tokens", rl.agentic_turn_tokens, f"must be <= the episode's {total} tokens (0 = all)")
  if not rl.agentic_tools:
    raise _bad("rl.agentic_tools", rl.agentic_tools, "must name at least one tool (e.g. ['calculator'])")


def _check_packing(pc) -> None:
  """max_seq_token_per_tpu (algorithms/packing.py): MaxText's own check makes a row hold max_target_length tokens.
  Multi-turn episodes pack as any completion (their environment tokens are context outside the loss mask); MoE
  batches pack with their routing."""
  rows = int(pc.max_seq_token_per_tpu or 0)
  if rows <= 0:
    return
  if rows < int(pc.max_target_length):
    raise _bad(
        "max_seq_token_per_tpu",
        rows,
        f"must be >= max_target_length={pc.max_target_length} (a packed row holds a whole sequence: the prompt "
        "budget and the completion budget; MaxText's own check)",
    )


_CROSS_CHECKS = (
    check_run_dir,
    _check_lengths,
    _check_batches,
    _check_algorithm,
    _check_synthetic,
    _check_lora_rank,
    _check_agentic,
    _check_packing,
)


def _light_checks(user_keys: frozenset[str] | None = None) -> tuple[Callable[[Any], None], ...]:
  """The checks that import nothing heavy, in order: both passes run them. `user_keys`: the keys the user set
  (`config/precheck.Written.user_keys`; None: unknown), which alone a dependent key's refusal may name."""
  dependent = functools.partial(dependent_keys.check, user_keys=user_keys)
  return (check_numbers, check_ranges, *_CROSS_CHECKS, _check_lora, dependent, *early_checks.CHECKS)


# Features one JAX process runs and several cannot (the trainer refuses them at start-up when jax.process_count() > 1),
# with why; a launcher that starts several processes (`launch ray --num-workers N`) refuses them before anything
# starts. Empty: multi-turn episodes, dynamic sampling and rollouts ahead of the trainer run across processes (issue
# 62; docs/architecture.md). What remains device-dependent is the trainer's (rollouts ahead need a per-host sampler:
# distributed.check_asynchronous).
SINGLE_PROCESS: dict[str, str] = {}


def check_processes(pc, processes: int) -> None:
  """Refuse (one line) a feature of `SINGLE_PROCESS` set for a program of `processes` JAX processes."""
  if processes <= 1:
    return
  for key, why in SINGLE_PROCESS.items():
    value = _get(pc, key)  # set: true, or a positive number of steps
    if value:
      raise _bad(key, value, f"not supported with more than one JAX process yet ({processes} asked): {why}")


def validate(pc, source: Any = None) -> None:
  """Device-free checks of a parsed config, the same for print_config, launchers and training (one line each);
  `source`: the `config/precheck.Written` it was read from, when known (which keys the user set)."""
  # algorithms/ and an engine's typed checks import Tunix and JAX: only this second pass, after the schema's imports,
  # needs them (validate_raw runs before those imports). The MoE checks (capacity_factor, rl.router_replay) are
  # early_checks': importing moe.py (MaxText's MoE layers, and through them transformers) cost a launcher 4.3 s.
  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.algorithms.settings import AlgorithmSettings

  for check in _light_checks(source.user_keys() if source is not None else None):
    check(pc)
  AlgorithmSettings.from_config(pc)  # the registered loss and estimator, its scaling and aggregation, overlong buffer
  early_checks.check_engine_typed(pc)  # the engine's checks that import its heavier modules (vLLM: the route's own)


def validate_raw(view: RawConfig) -> None:
  """`validate`'s checks on the config as written, before the schema's imports; a check that reads a value only the
  schema can type (an `Unresolved` key, a comparison with an untyped value) is left to `validate`."""
  source = view.source()
  for check in _light_checks(source.user_keys() if source is not None else None):
    try:
      check(view)
    except (Unresolved, AttributeError, TypeError, ValueError):  # AttributeError: an untyped value's missing method
      continue
