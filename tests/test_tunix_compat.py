"""Contract of `maxtext_rl_plugin/tunix_compat.py` with the pinned Tunix: every private name it touches exists and
means what the plugin assumes. A Tunix upgrade that renames or repurposes one fails here, not in a user's run."""

import importlib.metadata
import inspect
import multiprocessing.pool  # pylint: disable=unused-import  # MaxText's math_verify_pool needs it loaded first
import re

from maxtext.configs import pyconfig
from maxtext.trainers.post_train.rl import math_verify_pool
from maxtext.utils import lora_utils
from tunix.rl import rl_cluster
from tunix.rl import utils as rl_utils
from tunix.rl.grpo import grpo_learner
from tunix.sft import peft_trainer

from maxtext_rl_plugin import tunix_compat


def test_pinned_tunix_version():
  assert importlib.metadata.version("google-tunix") == tunix_compat.PINNED_TUNIX


def test_trainer_step_counters_and_metric_flush_exist():
  init_src = inspect.getsource(peft_trainer.PeftTrainer.__init__)
  assert "self._train_steps = 0" in init_src and "self._iter_steps = 0" in init_src
  train_src = inspect.getsource(peft_trainer.PeftTrainer.train)
  # One optimizer update every gradient_accumulation_steps micro-steps, counted in _train_steps.
  assert "gradient_accumulation_steps" in train_src and "self._train_steps += 1" in train_src
  # An externally managed trainer (the RL learner sets this) does not skip already-seen examples on its own.
  assert "is_managed_externally" in train_src
  assert callable(peft_trainer.PeftTrainer._write_train_metrics)  # pylint: disable=protected-access
  assert "_prev_buffered_train_metrics" in inspect.getsource(peft_trainer.PeftTrainer._write_train_metrics)  # pylint: disable=protected-access
  assert isinstance(peft_trainer.PeftTrainer.train_steps, property)
  assert isinstance(peft_trainer.PeftTrainer.iter_steps, property)


def test_public_seams_the_step_loop_uses():
  """The public API the plugin's step loop relies on instead of the learner's private step."""
  cfg_fields = set(rl_cluster.RLTrainingConfig.__dataclass_fields__)
  assert {
      "mini_batch_size",
      "train_micro_batch_size",
      "rollout_micro_batch_size",
      "compute_logps_micro_batch_size",
  } <= cfg_fields
  for name in ("generate", "get_ref_per_token_logps", "get_old_per_token_logps", "update_actor", "sync_weights"):
    assert callable(getattr(rl_cluster.RLCluster, name)), name
  assert "micro_batch_size" in inspect.signature(rl_cluster.RLCluster.generate).parameters
  fields = set(grpo_learner.TrainExample.__dataclass_fields__)
  assert {
      "prompt_ids",
      "prompt_mask",
      "completion_ids",
      "completion_mask",
      "ref_per_token_logps",
      "advantages",
      "old_per_token_logps",
  } <= fields


def test_pinned_host_snapshot_goes_through_the_module_attribute_the_workaround_replaces():
  """tunix_compat.multiprocess_workarounds swaps `tunix.rl.utils.put_params_on_memory_kind`: RLCluster must look it up
  through that module at call time (construction and sync_weights), and it must be one jax.device_put of the tree."""
  assert "rl_utils.put_params_on_memory_kind(" in inspect.getsource(rl_cluster.RLCluster._init_cluster)  # pylint: disable=protected-access
  assert "rl_utils.put_params_on_memory_kind(" in inspect.getsource(rl_cluster.RLCluster.sync_weights)
  assert "jax.device_put(" in inspect.getsource(rl_utils.put_params_on_memory_kind)
  assert list(inspect.signature(rl_utils.put_params_on_memory_kind).parameters) == ["params", "memory_kind"]


def test_maxtext_math_verify_pool_shutdown_exists_and_is_idempotent():
  src = inspect.getsource(math_verify_pool._shutdown_pool)  # pylint: disable=protected-access
  assert "_POOL = None" in src and "SIGKILL" in src
  tunix_compat.shutdown_maxtext_math_verify_pool()  # never started here: a no-op, twice
  tunix_compat.shutdown_maxtext_math_verify_pool()
  assert math_verify_pool._POOL is None  # pylint: disable=protected-access


def test_pyconfig_private_contract():
  # tunix_compat.pyconfig_reads swaps pyconfig._load_config under pyconfig._initialize_pydantic (MaxText 0.2.5).
  src = inspect.getsource(pyconfig._initialize_pydantic)  # pylint: disable=protected-access
  assert "_load_config(config_path)" in src and "config_class(**pydantic_kwargs)" in src
  assert callable(pyconfig._load_config)  # pylint: disable=protected-access
  real = pyconfig._load_config  # pylint: disable=protected-access
  with tunix_compat.pyconfig_reads({"run_name": "probe"}) as initialize:
    assert initialize is pyconfig._initialize_pydantic  # pylint: disable=protected-access
    assert pyconfig._load_config("ignored.yml") == {"run_name": "probe"}  # pylint: disable=protected-access
  assert pyconfig._load_config is real  # pylint: disable=protected-access


def test_maxtext_lora_module_path_resolution_exists():
  src = inspect.getsource(lora_utils._get_lora_module_path)  # pylint: disable=protected-access
  assert "lora_module_path" in src and "_load_lora_module_configs" in src
  assert tunix_compat.maxtext_lora_module_path("x", "decoder/.*/mlp") == "decoder/.*/mlp"
  # The stand-in holds only the two values the resolver reads: a third read would be an AttributeError here.
  assert tunix_compat.maxtext_lora_module_path("qwen3-0.6b").startswith("decoder/")


def test_actor_train_step_body_reads_only_what_the_stand_in_holds():
  # aot/programs.py lowers PeftTrainer._train_step on a stand-in trainer with exactly these attributes.
  src = inspect.getsource(peft_trainer.PeftTrainer._train_step)  # pylint: disable=protected-access
  used = set(re.findall(r"self\.(\w+)", src))
  assert used == {"gen_model_input_fn", "loss_fn", "_lora_enabled", "_has_aux"}
  assert list(inspect.signature(peft_trainer.PeftTrainer._train_step).parameters) == [  # pylint: disable=protected-access
      "self",
      "model",
      "optimizer",
      "inputs",
  ]


def test_train_step_seam_the_accumulating_update_uses():
  """`use_train_step`: the trainer jits what `create_train_step_fn` returns with the optimizer donated and unpacks
  (loss, aux, grad_norm); MultiSteps wraps the optimizer only when gradient_accumulation_steps is set, which
  RLTrainingConfig derives only from train_micro_batch_size (build_run leaves it unset)."""
  jit_src = inspect.getsource(peft_trainer.PeftTrainer.jit_train_and_eval_step)
  assert "self.create_train_step_fn()" in jit_src and 'donate_argnames=("optimizer",)' in jit_src
  assert "train_loss, aux, grad_norm = train_step(train_example)" in inspect.getsource(peft_trainer.PeftTrainer.train)
  init_src = inspect.getsource(peft_trainer.PeftTrainer.__init__)
  assert "if training_config.gradient_accumulation_steps is not None:" in init_src and "MultiSteps" in init_src
  post_src = inspect.getsource(rl_cluster.RLTrainingConfig.__post_init__)
  assert "if self.train_micro_batch_size is not None:" in post_src
  assert "self.gradient_accumulation_steps = (" in post_src
  # Its step body: value_and_grad of the learner's loss over the trainable params, global norm, optimizer update.
  body = inspect.getsource(getattr(peft_trainer.PeftTrainer, "_train_step"))
  assert "nnx.value_and_grad(" in body and "optax.global_norm(grads)" in body and "optimizer.update(model, grads)" in body
