"""Building an RL run: device split, runtime checks, rollout engine, optimizer and LR schedule, the RLCluster.

`build_run` turns a loaded config into an `RLRun`: MaxText models on Tunix's `RLCluster` (actor, reference, rollout
engine, trainer -> sampler weight sync) and a `GrpoLearner` that wires the plugin's policy loss into the actor trainer.
Everything here happens once, before the first step; the loop (run/loop.py) and the step (step.py) only read it.
"""

from __future__ import annotations

import dataclasses
import os

from absl import logging
from flax import nnx
import jax
from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
import optax
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import metrics_logger

from maxtext_rl_plugin.algorithms import tunix_wiring
from maxtext_rl_plugin.algorithms.settings import AlgorithmSettings
from maxtext_rl_plugin.run import accumulation
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import engine as run_engine
from maxtext_rl_plugin.run import evaluation as evaluation_lib
from maxtext_rl_plugin.run import logps
from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin import metrics as metrics_lib
from maxtext_rl_plugin.data import tokenizer as tokenizer_lib
from maxtext_rl_plugin.run import meta as run_meta
from maxtext_rl_plugin.run import rewards as run_rewards
from maxtext_rl_plugin.run import models as run_models
from maxtext_rl_plugin.run import warm_start
from maxtext_rl_plugin import tunix_compat
from maxtext_rl_plugin.run import updates
from maxtext_rl_plugin.data import load
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.resharding import sync
from maxtext_rl_plugin.rollout import engines
from maxtext_rl_plugin.run.state import PhaseTimer, RewardRecorder, RLRun


def per_host_split(rs: run_models.RunSetup) -> run_models.RunSetup:
  """A disaggregated single-slice split in a multi-process program, redone per process: MaxText splits the global
  device list (the first processes' devices train, the last ones' sample), which leaves a sampler no process can drive
  alone; here every process gives its first local devices to the trainer (one global trainer mesh) and its last ones
  to its own per-host sampler mesh (distributed.split_local_devices). Unchanged on one process, colocated or
  multislice."""
  cfg = rs.trainer_config
  if not distributed.is_multiprocess() or not rs.disaggregated or cfg.num_trainer_slices != -1:
    return rs
  trainer, sampler = distributed.split_local_devices(
      jax.devices(), float(cfg.trainer_devices_fraction), float(cfg.sampler_devices_fraction)
  )
  return dataclasses.replace(rs, trainer_devices=trainer, sampler_devices=sampler)


def check_runtime(config, rs: run_models.RunSetup) -> None:
  """Checks that need the device set, before any model is built (device-free ones: `config.validate`)."""
  distributed.check_device_split(rs.trainer_devices, rs.sampler_devices)
  k = int(config.rl.off_policy_steps)
  if k < 0:
    raise ConfigError(f"invalid value for 'rl.off_policy_steps'={k}: expected >= 0 (0 = synchronous rollouts)")
  if (
      k > 0
      and config.rl.rollout_is == "off"
      and not (config.rl.use_rollout_logps and not config.rl.force_on_policy_ratio)
  ):
    raise ConfigError(
        f"invalid value for 'rl.off_policy_steps'={k}: batches up to {k} step(s) stale need a correction; set "
        "rl.rollout_is=truncate (or mask: importance weights pi_old/pi_behaviour) or rl.use_rollout_logps=true (the PPO "
        "ratio against the behaviour policy, without rl.force_on_policy_ratio)"
    )
  if config.rl.rollout_is != "off" and config.rl.use_rollout_logps:
    raise ConfigError(
        f"invalid value for 'rl.rollout_is'='{config.rl.rollout_is}': needs rl.use_rollout_logps=false "
        "(the importance weight is pi_old / pi_behaviour, with pi_old the trainer's own forward)"
    )


def rollout_configs(config, tokenizer) -> dict:
  """Tunix RolloutConfigs for TRAIN (decode_sampling_* keys) and EVAL (`eval_sampling_strategy`; greedy is exact)."""
  eos = [int(tokenizer.eos_token_id), *[int(t) for t in config.stop_token_ids]]
  common = {
      "max_tokens_to_generate": config.max_target_length - config.max_prefill_predict_length,
      "max_prompt_length": config.max_prefill_predict_length,
      "kv_cache_size": config.max_target_length + config.kv_cache_buffer,
      "eos_tokens": eos,
      "rollout_vllm_model_version": config.tokenizer_path,
      "rollout_vllm_hbm_utilization": config.hbm_utilization_vllm,
  }
  top_k = config.decode_sampling_top_k if config.decode_sampling_top_k and config.decode_sampling_top_k > 0 else None
  train_config = base_rollout.RolloutConfig(
      temperature=config.decode_sampling_temperature,
      top_p=config.decode_sampling_nucleus_p,
      top_k=top_k,
      **common,
  )
  try:
    eval_sampling = evaluation_lib.sampling_for(config)
  except KeyError:
    raise ConfigError(
        f"invalid value for 'eval_sampling_strategy'='{config.eval_sampling_strategy}': not a key of generation_configs "
        f"({', '.join(sorted(config.generation_configs or {})) or 'empty'})"
    ) from None
  evaluation = base_rollout.RolloutConfig(**eval_sampling, **common)
  return {rl_cluster_lib.Mode.TRAIN: train_config, rl_cluster_lib.Mode.EVAL: evaluation}


def lr_schedule(config):
  """MaxText's RL schedule (warmup + cosine decay to 0, `utils_rl.get_optimizer`) over `schedule_updates` updates
  (run/meta.py)."""
  sched_steps = run_meta.schedule_updates(config)
  return optax.schedules.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=int(config.warmup_steps_fraction * sched_steps),
      decay_steps=sched_steps,
      end_value=0.0,
  )


def build_optimizer(config):
  """MaxText's RL optimizer (global-norm clipping + AdamW on `lr_schedule`), with `adam_eps` / `adam_eps_root`.

  The chain is MaxText 0.2.5's `utils_rl.get_optimizer` (tests/run/test_trainer_updates.py checks the two agree when the
  schedule lengths agree); it is rebuilt here because that function drops `adam_eps`/`adam_eps_root` and sizes the
  schedule by `train_steps`, which undercounts updates when a batch is split into mini-batches.
  """

  def make(learning_rate):
    clip = (
        [optax.clip_by_global_norm(config.gradient_clipping_threshold)] if config.gradient_clipping_threshold > 0 else []
    )
    return optax.chain(
        *clip,
        optax.adamw(
            learning_rate,
            b1=config.adam_b1,
            b2=config.adam_b2,
            eps=float(config.adam_eps),
            eps_root=float(config.adam_eps_root),
            weight_decay=config.adam_weight_decay,
        ),
    )

  return optax.inject_hyperparams(make)(learning_rate=lr_schedule(config))


def build_run(config, parsed: config_lib.Parsed) -> RLRun:
  """Models, meshes, data, rewards, Tunix cluster and learner for `config` (`parsed`: the same config as parsed, which
  MaxText's multislice trainer/sampler configs are derived from)."""
  rs = per_host_split(run_models.setup_devices(parsed))
  config = rs.trainer_config
  check_runtime(config, rs)
  plan = updates.UpdatePlan.from_config(config)
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  tokenizer = tokenizer_lib.load_run_tokenizer(tokenizer_lib.TokenizerSettings.from_config(config))
  train_split, eval_split = load.load_splits(load.DataSettings.from_config(config), tokenizer)
  engine_name = run_engine.resolve_name(config)
  engine = engines.spec(engine_name).capabilities
  # Rollouts ahead of the trainer across processes need a per-host sampler (experience.samples_per_host).
  distributed.check_asynchronous(
      int(config.rl.off_policy_steps), rs.disaggregated or run_engine.engine_per_process(engine)
  )
  engines.spec(engine_name).load_engine().ensure_available()  # a missing optional dependency: before any model build
  rollout_cfgs = rollout_configs(config, tokenizer)

  actor, actor_mesh = run_models.build_model(config, rs.trainer_devices, pad_id=tokenizer.pad_token_id)
  if config.sft_warmup_steps > 0:
    warm_start.warm_start(warm_start.SftSettings.from_config(config), actor, actor_mesh, tokenizer, train_split, run_dir)
  actor, frozen_base = run_models.apply_lora(config, actor, actor_mesh, tokenizer.pad_token_id)  # (actor, None) w/o LoRA
  reference = None
  if config.rl.grpo_beta != 0.0:
    # The KL anchor is the starting policy (after the warm start), on the trainer mesh; with LoRA, the frozen base
    # itself (it shares the actor's base arrays: no second copy).
    with actor_mesh:
      reference = frozen_base or TunixMaxTextAdapter(base_model=nnx.clone(actor.base), pad_id=tokenizer.pad_token_id)
  rollout_mesh = run_models.build_sampler_mesh(rs.sampler_config, rs.sampler_devices)
  rollout_factory = run_engine.rollout_engine_factory(engine_name, rs.sampler_config, rollout_mesh)
  logging.info(
      "trainer devices %d, sampler devices %d (%s)",
      len(rs.trainer_devices),
      len(rs.sampler_devices),
      "disaggregated" if rs.disaggregated else "colocated",
  )

  tee = metrics_lib.TunixTee()
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={
          rl_cluster_lib.Role.ACTOR: actor_mesh,
          rl_cluster_lib.Role.REFERENCE: actor_mesh,
          rl_cluster_lib.Role.ROLLOUT: rollout_mesh,
      },
      role_to_logical_axis_rule={
          rl_cluster_lib.Role.ACTOR: config.logical_axis_rules,
          rl_cluster_lib.Role.REFERENCE: config.logical_axis_rules,
          rl_cluster_lib.Role.ROLLOUT: rs.sampler_config.logical_axis_rules,
      },
      rollout_engine=rollout_factory,
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=build_optimizer(config),
          eval_every_n_steps=10**9,  # eval is the plugin's (run/evaluation.py, on eval_interval)
          max_steps=run_meta.total_updates(config),
          # Public micro-batch fields (prompts). train_micro_batch_size stays unset: Tunix would derive
          # gradient_accumulation_steps from it and wrap the optimizer in optax.MultiSteps (a persistent accumulator);
          # the plugin's train step accumulates the mini-batch's micro-batches itself (accumulation.py).
          mini_batch_size=plan.mini_batch_size,
          train_micro_batch_size=None,
          rollout_micro_batch_size=None if config.rollout_micro_batch_size <= 0 else config.rollout_micro_batch_size,
          compute_logps_micro_batch_size=plan.micro_batch_size,
          metrics_logging_options=metrics_logger.MetricsLoggerOptions(
              log_dir=config.tensorboard_dir,
              flush_every_n_steps=max(1, int(config.log_period)),
              backend_kwargs={"custom_backend": [lambda: tee]},
          ),
          checkpoint_root_directory=None,  # checkpoints are the plugin's (params + opt + data position + RNG)
      ),
      rollout_config=rollout_cfgs,
  )
  tunix_compat.multiprocess_workarounds()
  rl_cluster = rl_cluster_lib.RLCluster(
      actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=cluster_config
  )
  lora_lib.keep_base_shared(rl_cluster, frozen_base)
  # Disaggregated runs: trainer -> sampler weights go through the plugin's resharding (chunked, guarded).

  weight_sync = sync.attach_to_rl_cluster(
      rl_cluster, sync.SyncSettings.from_config(rs.sampler_config), engine.weight_sync
  )
  timer = PhaseTimer()
  recorder = RewardRecorder()
  # rl.reward_model_path: the reward model last, one more reward, on the trainer's devices (run/rewards.py)
  fns = run_rewards.reward_fns(config, rs.trainer_devices)
  reward_fns = [recorder.wrap(fn) for fn in fns]
  tunix_wiring.register_with_tunix()
  algo_config = tunix_wiring.tunix_algo_config(AlgorithmSettings.from_config(config))
  # The learner wires the plugin's policy loss into the actor trainer; its own step (`train()`) is not used.
  learner = grpo_learner.GrpoLearner(rl_cluster=rl_cluster, algo_config=algo_config, reward_fns=reward_fns)
  rl_cluster.actor_trainer.with_rl_metrics_to_log(tunix_wiring.rl_metrics_to_log(algo_config))
  tunix_compat.use_train_step(rl_cluster.actor_trainer, accumulation.train_step, plan.accumulation_steps)
  trainer_logps = logps.TrainerLogps(
      rl_cluster, actor_mesh, config.logical_axis_rules, row_tokens=int(config.max_seq_token_per_tpu or 0)
  )
  if config.rl.off_policy_steps > 0 and not learner.should_sync_weights and not engine.snapshots:
    raise ConfigError(
        f"invalid value for 'rl.off_policy_steps'={config.rl.off_policy_steps}: rollout engine "
        f"'{engine_name}' samples with the trainer's own weights here (colocated) and cannot pin a weight "
        "version while the trainer updates them; use rl.off_policy_steps=0 or a disaggregated split"
    )
  return RLRun(
      config,
      rs,
      tokenizer,
      train_split,
      eval_split,
      rl_cluster,
      learner,
      timer,
      recorder,
      reward_fns,
      trainer_logps,
      plan,
      tee,
      run_dir,
      engine_name,
      weight_sync,
  )
