"""The one module that touches Tunix 0.1.7's and MaxText 0.2.5's private names, each with the reason.

The plugin drives Tunix's actor trainer step by step (instead of `GrpoLearner.train()`) to get exact resume,
greedy evaluation and per-phase timing. What has no public API in Tunix 0.1.7 or MaxText 0.2.5:

* the trainer's step counters, which a resumed run must set to the restored optimizer-update count (Tunix's own
  resume reads them from its own checkpoint manager, which the plugin does not use);
* flushing the trainer's buffered metrics: Tunix writes an update's loss/KL/clip fraction one update late (to
  overlap I/O), so without a flush a step's metrics would be logged with the next step;
* the learner's reward aggregation is private too, but the plugin computes rewards itself (`run/experience.py`);
* MaxText 0.2.5's pyconfig (`pyconfig_reads`): `_initialize_pydantic` is the only entry point that raises instead of
  logging many lines and calling sys.exit(2); it reads the yml chain through the module-level `_load_config`, which
  the plugin swaps for the chain `config/files.py` already read and merged (plugin-config bases, no temporary copies);
* MaxText 0.2.5's LoRA target resolution (`lora_utils._get_lora_module_path`: lora.lora_module_path, else
  lora_module_path.yml's entry for the model), used as is so the plugin adapts the same modules MaxText would;
* MaxText 0.2.5's math_verify spawn pool (`math_verify_pool._shutdown_pool`) for the rewards benchmark, which runs
  MaxText's reward stack side by side with the plugin's: left to interpreter exit, its finalizer can block on
  orphaned locks, and MaxText has no public way to stop it;
* the actor trainer's step body (`use_train_step`): Tunix jits whatever its public `create_train_step_fn` returns,
  calling it as `step(model, optimizer, inputs) -> (loss, aux, grad_norm)` with the optimizer donated; the plugin's
  step (accumulation.py) accumulates micro-batches inside one update instead of Tunix's `optax.MultiSteps`, with the
  loss (GrpoLearner's, which returns aux) and input functions the learner set;
* multi-process runs (`multiprocess_workarounds`): `RLCluster` snapshots the actor's whole state to pinned host memory
  with one `jax.device_put` (`tunix.rl.utils.put_params_on_memory_kind`, at construction and on every sync), which
  in a multi-controller program rejects the model's typed PRNG-key leaves on a global mesh. The plugin swaps in
  `distributed.put_on_memory_kind` (same result, keys moved as key data). The snapshot only feeds
  `get_actor_per_token_logps`, which the plugin never calls.

`tests/test_tunix_compat.py` checks each name against the pinned Tunix, so an upgrade fails there, not in a run.
"""

# Tunix's RL utils and MaxText's pyconfig and RL trainer package are imported inside the functions that need them:
# they are heavy (the whole Tunix/MaxText training stack), and the step-counter helpers need none of them.
# pylint: disable=import-outside-toplevel
# This module is where the plugin touches private names (the docstring gives each one's reason), and nowhere else.
# pylint: disable=protected-access

from __future__ import annotations

import contextlib
import copy
import importlib
import types
from typing import Any, Callable, Iterator

from maxtext_rl_plugin import distributed

# MaxText 0.2.5's math_verify_pool annotates with multiprocessing.pool.Pool but imports only multiprocessing: the
# submodule must be loaded before math_verify_pool is (a bare `import multiprocessing.pool` would be an unused name).
importlib.import_module("multiprocessing.pool")

PINNED_TUNIX = "0.1.7"


def set_trainer_steps(actor_trainer: Any, updates: int, micro_steps_per_update: int) -> None:
  """Make a restored trainer count `updates` optimizer updates (`_train_steps`) and the matching micro-steps
  (`_iter_steps`, which also drives Tunix's profiler window and gradient-accumulation phase)."""
  actor_trainer._train_steps = int(updates)
  actor_trainer._iter_steps = int(updates) * int(micro_steps_per_update)


def trainer_steps(actor_trainer: Any) -> tuple[int, int]:
  """(optimizer updates, micro-steps) the trainer has taken (public read-only properties in 0.1.7)."""
  return int(actor_trainer.train_steps), int(actor_trainer.iter_steps)


def flush_train_metrics(actor_trainer: Any) -> None:
  """Write the last update's buffered metrics now (Tunix defers them by one update)."""
  actor_trainer._write_train_metrics()


def use_train_step(actor_trainer: Any, step: Callable[..., Any], steps: int) -> None:
  """Make `actor_trainer` jit `step(model, optimizer, inputs, *, loss_fn, gen_model_input_fn, lora, steps)` (the
  accumulating update, accumulation.train_step) with the loss and input functions its learner set, instead of
  `PeftTrainer._train_step`; call after the learner is built (it sets them) and before the first update."""
  from tunix.sft import utils as sft_utils

  trainer = actor_trainer
  if trainer.config.gradient_accumulation_steps is not None:
    raise ValueError("the actor trainer accumulates itself (train_micro_batch_size set): its MultiSteps would too")
  lora = sft_utils.is_lora_enabled(trainer.model)

  def create_train_step_fn():
    def train_step(model, optimizer, inputs):
      return step(
          model,
          optimizer,
          inputs,
          loss_fn=trainer.loss_fn,
          gen_model_input_fn=trainer.gen_model_input_fn,
          lora=lora,
          steps=steps,
      )

    return train_step

  trainer.create_train_step_fn = create_train_step_fn
  trainer.clear_jit_cache()


def multiprocess_workarounds() -> None:
  """Before building `RLCluster` in a multi-process program: its memory-kind snapshot goes through
  `distributed.put_on_memory_kind` (see the module docstring). A no-op on one process."""
  if not distributed.is_multiprocess():
    return
  from tunix.rl import utils as rl_utils

  rl_utils.put_params_on_memory_kind = distributed.put_on_memory_kind


def shutdown_maxtext_math_verify_pool() -> None:
  """Stop MaxText's math_verify worker pool now (see the module docstring); a no-op when it never started."""
  from maxtext.trainers.post_train.rl import math_verify_pool

  math_verify_pool._shutdown_pool()


@contextlib.contextmanager
def pyconfig_reads(merged: Any) -> Iterator[Callable[..., Any]]:
  """Yield MaxText's `pyconfig._initialize_pydantic` reading `merged` (an OmegaConf mapping) as its yml chain."""
  from maxtext.configs import pyconfig

  original = pyconfig._load_config
  pyconfig._load_config = lambda _path: copy.deepcopy(merged)
  try:
    yield pyconfig._initialize_pydantic
  finally:
    pyconfig._load_config = original


def maxtext_lora_module_path(model_name: str, module_path: str = "") -> str:
  """The regex of the modules MaxText applies LoRA to (see the module docstring): `module_path` when given, else
  lora_module_path.yml's entry for `model_name`. MaxText's resolver reads exactly these two values off its config
  (`lora.lora_module_path`, `model_name`): a stand-in holding them is all it gets."""
  from maxtext.utils import lora_utils

  stand_in = types.SimpleNamespace(model_name=model_name, lora=types.SimpleNamespace(lora_module_path=module_path))
  return lora_utils._get_lora_module_path(stand_in)


def actor_train_step(
    model: Any, optimizer: Any, inputs: Any, loss_fn: Callable, gen_model_input_fn: Callable, lora: bool
):
  """Tunix's actor-trainer step body (`PeftTrainer._train_step`: value_and_grad of the loss, global grad norm,
  `optimizer.update`), run on a stand-in trainer holding the learner's loss and input functions. The AOT compile
  (aot/programs.py) lowers this for a TPU topology: the very code the run's `actor_trainer` jits, not a copy."""
  from tunix.sft import peft_trainer

  stand_in = _TrainerStandIn(loss_fn=loss_fn, gen_model_input_fn=gen_model_input_fn, _lora_enabled=lora, _has_aux=True)
  return peft_trainer.PeftTrainer._train_step(stand_in, model, optimizer, inputs)


class _TrainerStandIn:
  """The four attributes `PeftTrainer._train_step` reads from its trainer."""

  def __init__(self, **attrs: Any):
    self.__dict__.update(attrs)
