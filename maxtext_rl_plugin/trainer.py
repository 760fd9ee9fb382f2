"""The RL run: MaxText models on Tunix's RLCluster + GrpoLearner, driven step by step by the plugin.

Tunix owns the model plumbing (actor trainer with the plugin's policy loss, reference, rollout engine, trainer ->
sampler weight sync). The plugin drives the outer loop itself instead of calling `GrpoLearner.train()`, because a
production run needs what that loop does not give: a data position that resumes with no repeated or skipped batch,
Orbax checkpoints of params + optimizer + data position + RNG in MaxText's layout, greedy/pass@k eval on MaxText's
`eval_interval`, per-phase timings, and one metrics stream (TensorBoard, `metrics_file`, console).

Per RL step (one rollout batch of `batch_size` prompts x G):
    batch(step) -> experience.sample             (rollout, rewards, advantages; async_rollout.RolloutProducer samples
                                                  it inline, or up to rl.off_policy_steps steps ahead in its thread)
                -> experience.score              (ref and old-policy log-probs, importance weights, at the trainer)
                -> rl_cluster.update_actor       (mu * batch_size / mini_batch_size optimizer updates, each over
                                                  mini/micro micro-batches: updates.py)
                -> producer.publish              (the new weights reach the sampler: rl_cluster.sync_weights when
                                                  disaggregated; the rollout engine reshards)
                -> eval every eval_interval, checkpoint every checkpoint_period
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import importlib.util
import os
import signal as signal_lib
import time
from typing import Any, Callable, Sequence

from absl import logging
from flax import nnx
import jax
from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
import numpy as np
import optax
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import metrics_logger

from maxtext_rl_plugin import algorithms
from maxtext_rl_plugin import async_rollout
from maxtext_rl_plugin import config as config_lib
from maxtext_rl_plugin import data
from maxtext_rl_plugin import experience
from maxtext_rl_plugin import resharding
from maxtext_rl_plugin import rewards as rewards_lib
from maxtext_rl_plugin import sft
from maxtext_rl_plugin import summary as summary_lib
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import evaluation as evaluation_lib
from maxtext_rl_plugin import lora as lora_lib
from maxtext_rl_plugin import metrics as metrics_lib
from maxtext_rl_plugin import models
from maxtext_rl_plugin import pathways
from maxtext_rl_plugin import run_dir as run_dir_lib
from maxtext_rl_plugin import signals
from maxtext_rl_plugin import tunix_compat
from maxtext_rl_plugin import updates
from maxtext_rl_plugin.checkpointing import RunCheckpointer
from maxtext_rl_plugin.errors import CheckpointError, ConfigError
from maxtext_rl_plugin.rollout import embedded
from maxtext_rl_plugin.rollout import vllm as vllm_rollout

# Keys whose change makes a checkpoint's data position meaningless: resuming must refuse them.
_RESUME_INVARIANTS = (
    "batch_size",
    "num_generations",
    "data_shuffle_seed",
    "dataset",
    "loss_algo",
    "rollout_seed",
    "updates_per_step",
)


class PhaseTimer:
  """Accumulates wall seconds per named phase within a step."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  def add(self, phase: str, seconds: float) -> None:
    self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

  def wrap(self, phase: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def timed(*args, **kwargs):
      t = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.add(phase, time.perf_counter() - t)

    return timed

  def reset(self) -> dict[str, float]:
    out, self.seconds = self.seconds, {}
    return out


class RewardRecorder:
  """Wraps reward functions so each step's per-function rewards can be logged (time is the caller's phase)."""

  def __init__(self):
    self.values: dict[str, list[float]] = {}

  def wrap(self, fn: Callable) -> Callable:
    name = getattr(fn, "__name__", type(fn).__name__)

    def recorded(prompts, completions, **kwargs):
      out = fn(prompts, completions, **kwargs)
      self.values.setdefault(name, []).extend(float(x) for x in out)
      return out

    recorded.__name__ = name
    return recorded

  def reset(self) -> dict[str, list[float]]:
    out, self.values = self.values, {}
    return out


def _data_key(config) -> str:
  return config.train_data_path or config.dataset_name


def per_host_split(rs: models.RunSetup) -> models.RunSetup:
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


def _check_runtime(config, rs: models.RunSetup) -> None:
  """Checks that need the device set, before any model is built (device-free ones: `config.validate`)."""
  distributed.check_device_split(rs.trainer_devices, rs.sampler_devices)
  distributed.check_synchronous(int(config.rl.off_policy_steps))
  n_trainer = len(rs.trainer_devices)
  plan = updates.UpdatePlan.from_config(config)
  for key, prompts in (("batch_size", plan.batch_size), ("train_micro_batch_size", plan.micro_batch_size)):
    rows = prompts * plan.num_generations
    if rows % n_trainer:
      raise ConfigError(
          f"invalid value for '{key}'={prompts}: {key} * rl.num_generations = {rows} rows must be divisible by the "
          f"{n_trainer} trainer devices (each micro-batch is sharded over them)"
      )
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


def num_rl_steps(config) -> int:
  """RL steps (rollout batches) of the run. MaxText's `train_steps` counts num_batches * num_iterations *
  train_fraction * num_epoch, i.e. updates with one update per iteration; the plugin's step is one rollout batch."""
  return int(config.train_steps) // max(1, int(config.rl.num_iterations))


def total_updates(config) -> int:
  """Optimizer updates of the whole run: the learning-rate schedule's length (unless set explicitly)."""
  return num_rl_steps(config) * updates.UpdatePlan.from_config(config).updates_per_step


def _resolve_engine_name(config) -> str:
  """`rollout_engine` resolved ('auto': vLLM on TPU when installed and one controller drives the sampler)."""
  multi = vllm_rollout.multi_controller_reason(jax.process_count(), pathways.requested())
  if config.rollout_engine == "vllm" and multi:
    raise ConfigError(multi)
  if config.rollout_engine != "auto":
    return config.rollout_engine

  on_tpu = jax.default_backend() in ("tpu",) or pathways.requested()
  name = "vllm" if on_tpu and importlib.util.find_spec("vllm") is not None else "embedded"
  head_dim_reason = config_lib.vllm_head_dim_reason(config.model_name, config.head_dim)
  if name == "vllm" and head_dim_reason:
    name = "embedded"
    logging.info("rollout_engine=auto resolved to 'embedded': %s", head_dim_reason)
  elif name == "vllm" and multi:
    name = "embedded"
    logging.info(
        "rollout_engine=auto resolved to 'embedded': vLLM is installed but %d JAX processes run without "
        "Pathways (tpu-inference needs the rollout devices local to one controller)",
        jax.process_count(),
    )
  else:
    logging.info("rollout_engine=auto resolved to '%s' (backend %s)", name, jax.default_backend())
  return name


def rollout_engine_factory(name: str, sampler_config) -> Any:
  """A Tunix-constructible rollout engine (`functools.partial` of a `BaseRollout` subclass)."""
  if name == "embedded":
    return functools.partial(embedded.EmbeddedRollout, config=sampler_config)
  if name == "vllm":
    vllm_rollout.import_vllm()  # fail before any model is built when the [tpu] extra is missing
    return functools.partial(vllm_rollout.VllmRollout, config=sampler_config)
  # `rollout_engine` is a Literal in config_types.py: the config never reaches here with another name.
  raise ValueError(f"unknown rollout engine {name!r}")


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
  """MaxText's RL schedule (warmup + cosine decay to 0, `utils_rl.get_optimizer`), counted in optimizer updates.

  Its length is the run's optimizer-update count (`total_updates`: mu * batch_size / mini_batch_size per RL step;
  MaxText's `train_steps` when each batch gets one update per iteration), unless `learning_rate_schedule_steps` is set
  deliberately (MaxText's rule: a positive value different from `steps`, which the validator fills in when unset).
  """
  sched_steps = config.learning_rate_schedule_steps
  explicit = sched_steps and sched_steps > 0 and sched_steps not in (config.steps, config.train_steps)
  sched_steps = int(sched_steps) if explicit else total_updates(config)
  return optax.schedules.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=int(config.warmup_steps_fraction * sched_steps),
      decay_steps=sched_steps,
      end_value=0.0,
  )


def build_optimizer(config):
  """MaxText's RL optimizer (global-norm clipping + AdamW on `lr_schedule`), with `adam_eps` / `adam_eps_root`.

  The chain is MaxText 0.2.5's `utils_rl.get_optimizer` (tests/test_trainer_updates.py checks the two agree when the
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


@dataclasses.dataclass
class RLRun:
  """Everything a step needs; built once by `build_run`."""

  config: Any
  setup: models.RunSetup
  tokenizer: Any
  train_split: Any
  eval_split: Any
  rl_cluster: Any
  learner: Any
  timer: PhaseTimer
  rewards: RewardRecorder
  reward_fns: list
  trainer_logps: Any
  plan: updates.UpdatePlan
  tee: Any
  run_dir: str
  engine_name: str
  weight_sync: Any = None
  metrics_file: str | None = None
  lock: Any = None


def build_run(config, argv: Sequence[str]) -> RLRun:
  """Models, meshes, data, rewards, Tunix cluster and learner for `config`."""
  rs = per_host_split(models.setup_devices(argv))
  config = rs.trainer_config
  _check_runtime(config, rs)
  plan = updates.UpdatePlan.from_config(config)
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  tokenizer = models.load_tokenizer(config)
  train_split, eval_split = data.load_splits(config, tokenizer)
  engine_name = _resolve_engine_name(config)
  rollout_factory = rollout_engine_factory(engine_name, rs.sampler_config)
  rollout_cfgs = rollout_configs(config, tokenizer)

  actor, actor_mesh = models.build_model(config, rs.trainer_devices, pad_id=tokenizer.pad_token_id)
  if config.sft_warmup_steps > 0:
    sft.warm_start(config, actor, actor_mesh, tokenizer, train_split, run_dir)
  actor, frozen_base = lora_lib.apply(config, actor, actor_mesh, tokenizer.pad_token_id)  # (actor, None) without LoRA
  reference = None
  if config.rl.grpo_beta != 0.0:
    # The KL anchor is the starting policy (after the warm start), on the trainer mesh; with LoRA, the frozen base
    # itself (it shares the actor's base arrays: no second copy).
    with actor_mesh:
      reference = frozen_base or TunixMaxTextAdapter(base_model=nnx.clone(actor.base), pad_id=tokenizer.pad_token_id)
  rollout_mesh = models.build_sampler_mesh(rs.sampler_config, rs.sampler_devices)
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
          eval_every_n_steps=10**9,  # eval is the plugin's (evaluation.py, on eval_interval)
          max_steps=total_updates(config),
          # Public micro-batch fields (prompts): Tunix derives gradient_accumulation_steps = mini / micro from them.
          mini_batch_size=plan.mini_batch_size,
          train_micro_batch_size=plan.micro_batch_size,
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

  weight_sync = resharding.attach_to_rl_cluster(rl_cluster, rs.sampler_config)
  timer = PhaseTimer()
  recorder = RewardRecorder()
  reward_fns = [recorder.wrap(fn) for fn in rewards_lib.reward_fns_from_config(config)]
  algorithms.register_with_tunix()
  algo_config = algorithms.tunix_algo_config(config)
  # The learner wires the plugin's policy loss into the actor trainer; its own step (`train()`) is not used.
  learner = grpo_learner.GrpoLearner(rl_cluster=rl_cluster, algo_config=algo_config, reward_fns=reward_fns)
  rl_cluster.actor_trainer.with_rl_metrics_to_log(algorithms.rl_metrics_to_log(algo_config))
  trainer_logps = experience.TrainerLogps(rl_cluster, actor_mesh, config.logical_axis_rules)
  if (
      config.rl.off_policy_steps > 0
      and not learner.should_sync_weights
      and not hasattr(rl_cluster.rollout, "snapshot_weights")
  ):
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


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------


def _meta(config, step: int, extra: dict | None = None) -> dict:
  plan = updates.UpdatePlan.from_config(config)
  return {
      "step": step,
      "next_batch_index": step,  # batches are indexed by step: batch k is trained at step k + 1
      "optimizer_updates": step * plan.updates_per_step,
      "batch_size": config.batch_size,
      "num_generations": config.rl.num_generations,
      "updates_per_step": plan.updates_per_step,
      "data_shuffle_seed": config.data_shuffle_seed,
      "dataset": _data_key(config),
      "loss_algo": config.rl.loss_algo,
      "model_name": config.model_name,
      "rollout_seed": int(config.rollout_seed),
      **(extra or {}),
  }


def _check_resume_compatible(config, meta: dict, path: str) -> None:
  now = _meta(config, 0)
  for key in _RESUME_INVARIANTS:
    if key in meta and meta[key] != now[key]:
      shown = "rl.num_iterations * batch_size / rl.mini_batch_size" if key == "updates_per_step" else key
      raise CheckpointError(
          f"cannot resume from {path}: it was written with {shown}={meta[key]!r} but this run has "
          f"{shown}={now[key]!r}; use a new run_name to start over"
      )


def _actor_state(rl_run: RLRun):
  trainer = rl_run.rl_cluster.actor_trainer
  return nnx.state(trainer.model, lora_lib.trainable(trainer.model)), nnx.state(trainer.optimizer)


def _restore_newest(rl_run: RLRun, ckpt) -> tuple[int, dict]:
  """Restore the newest checkpoint that restores; (0, {}) when there is none.

  A checkpoint that fails to restore while an older one restores is corrupt (a truncated array file, broken
  metadata): it is renamed `<step>.corrupt-<time>` (kept for inspection, never deleted; Orbax no longer lists it) and
  the run resumes from the older one. When none restores, nothing is renamed and the newest failure is the error
  (e.g. a checkpoint of a different model).
  """
  steps = sorted(ckpt.all_steps(), reverse=True)
  failures: list[tuple[int, str]] = []
  trainer = rl_run.rl_cluster.actor_trainer
  for step in steps:
    params, opt_state = _actor_state(rl_run)
    try:
      params, opt_state, meta = ckpt.restore(step, params, opt_state)
    except Exception as e:  # pylint: disable=broad-exception-caught  # any restore failure: try the next older one
      failures.append((step, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
      logging.warning("checkpoint %s/%d does not restore: %s", ckpt.directory, step, failures[-1][1])
      continue
    _check_resume_compatible(rl_run.config, meta, f"{ckpt.directory}/{step}")
    for bad, why in failures:
      kept = ckpt.set_aside(bad)
      if metrics_lib.is_writer():
        print(f"skipped checkpoint step {bad} (does not restore: {why}); kept as {kept}", flush=True)
    nnx.update(trainer.model, params)
    nnx.update(trainer.optimizer, opt_state)
    tunix_compat.set_trainer_steps(trainer, step * rl_run.plan.updates_per_step, rl_run.plan.accumulation_steps)
    rl_run.rl_cluster.global_steps = step
    if rl_run.learner.should_sync_weights:
      rl_run.rl_cluster.sync_weights()
      rl_run.rl_cluster.global_steps = step
    return step, meta
  if failures:
    step, why = failures[0]
    raise CheckpointError(
        f"no checkpoint in {ckpt.directory} restores (newest, step {step}: {why}); " "use a new run_name to start over"
    )
  return 0, {}


def _step_inputs(rl_run: RLRun, step: int) -> tuple[dict, list]:
  """Batch `step - 1` as Tunix inputs: each prompt, answer and question repeated num_generations times."""
  config = rl_run.config
  # Batch k (0-based) is a pure function of (seed, k): resuming at step s replays nothing and skips nothing.
  batch = rl_run.train_split.batch(step - 1, config.batch_size)
  g = config.rl.num_generations
  inputs = {
      "prompts": [e.prompt for e in batch for _ in range(g)],
      "answer": [e.answer for e in batch for _ in range(g)],
      "question": [e.question for e in batch for _ in range(g)],
  }
  return inputs, batch


def _seed_rollout(rl_run: RLRun, step: int) -> None:
  """Sampling randomness is a function of (rollout_seed, step), so a resumed run samples what an
  uninterrupted one would have (the RNG part of the resume state)."""
  rc = rl_run.rl_cluster.cluster_config.rollout_config[rl_cluster_lib.Mode.TRAIN]
  rc.seed = (int(rl_run.config.rollout_seed) * 1_000_003 + step) % (2**31 - 1)


def _sample_batch(rl_run: RLRun, index: int, phases: dict[str, float]) -> tuple[list, dict, Any]:
  """Batch `index` (trained at step index + 1) sampled by the sampler's current weights: the rollout producer's
  `sample_fn` (async_rollout.py; in its thread when rollouts run ahead)."""
  step = index + 1
  _seed_rollout(rl_run, step)
  inputs, batch = _step_inputs(rl_run, step)
  timer = PhaseTimer()
  sampled = experience.sample(rl_run, inputs, rl_run.plan, timer)
  phases.update(timer.reset())
  return batch, inputs, sampled


def _install_weights(rl_run: RLRun, snapshot: bool) -> None:
  """The trainer's current weights become the sampler's (after a step's updates): a weight sync when the engine has
  its own copy, else (shared arrays) a snapshot when rollouts run ahead."""
  if rl_run.learner.should_sync_weights:
    rl_run.rl_cluster.sync_weights()
  else:
    rl_run.rl_cluster.global_steps += 1
    if snapshot:
      rl_run.rl_cluster.rollout.snapshot_weights()


def _audit_batch(run_dir: str, step: int, batch) -> None:
  """Append which examples step `step` trained on to `<run>/batches.jsonl` (resume audit trail)."""
  path = os.path.join(run_dir, "batches.jsonl")
  try:
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"step": step, "ids": [e.id for e in batch]}) + "\n")
  except OSError as e:
    raise run_dir_lib.OutputError(run_dir_lib.describe_os_error(e, path)) from None


# Tunix trainer scalars (mean over the step's optimizer updates) -> the plugin's metric names.
_TUNIX_RENAMES = {
    "loss": "loss",
    "kl": "kl",
    "pg_clipfrac": "clip_fraction",
    "grad_norm": "grad_norm",
    "entropy": "entropy",
    "ratio_mean": "ratio_mean",
}


def _step_metrics(
    rl_run: RLRun, exp, item, answers: list, phases: dict[str, float], step: int, step_seconds: float, wait_sync_s: float
) -> dict[str, float]:
  """One step's record: rewards per function, accuracy, completion lengths, Tunix's loss metrics, phase timings."""
  values = item.value[2].reward_values
  m: dict[str, float] = {}
  for name, vals in values.items():
    arr = np.asarray(vals, dtype=np.float64)
    m[f"reward/{name}/mean"] = float(arr.mean())
    m[f"reward/{name}/std"] = float(arr.std())
  m["reward/mean"] = float(exp.rewards.mean())
  m["reward/std"] = float(exp.rewards.std())
  # The check_answer reward's own grading (rewards memoise the last batch): no second pass.
  graded = rewards_lib.score_batch(exp.texts, answers, rl_run.config)
  m["accuracy"] = float(np.mean([r.correct for r in graded]))
  m["strict_accuracy"] = float(np.mean([r.correct and r.format_ok for r in graded]))
  mask = distributed.to_host(exp.example.completion_mask)
  lengths = mask.sum(axis=-1)
  m["completion/length_mean"] = float(lengths.mean())
  m["completion/length_max"] = float(lengths.max())
  m["completion/stopped_fraction"] = float(np.mean(lengths < mask.shape[-1]))
  tunix = rl_run.tee.drain()
  for k, v in tunix.items():
    if not k.startswith("actor/train/"):
      continue
    name = k.split("/")[-1]
    m[_TUNIX_RENAMES.get(name, "train/" + name)] = v
  m.update(exp.metrics)
  updates_done, _ = tunix_compat.trainer_steps(rl_run.rl_cluster.actor_trainer)
  m["opt/updates"] = float(updates_done)
  for phase in ("rollout", "reward", "logps", "train", "weight_sync"):
    m[f"time/{phase}_s"] = phases.get(phase, 0.0)
  m["perf/step_s"] = step_seconds
  # async_rollout.py: weight versions between the batch's sampler and the trainer (<= rl.off_policy_steps), and the
  # seconds each side waited for the other.
  m["async/policy_lag"] = float(step - 1 - item.version)
  m["async/wait_rollout_s"] = item.wait_s
  m["async/wait_sync_s"] = wait_sync_s
  m["async/producer_idle_s"] = item.idle_s
  rollout_s = phases.get("rollout", 0.0)
  if rollout_s > 0:
    m["perf/tokens_per_s"] = float(lengths.sum()) / rollout_s
  return m


class StepProfiler:
  """MaxText's `profiler=xplane`: a JAX trace of RL steps skip+1 .. skip+profiler_steps (rollout, update and sync
  together, not only Tunix's train micro-steps), written under `tensorboard_dir` for TensorBoard's profile tab."""

  def __init__(self, config):
    self.enabled = str(config.profiler) in ("xplane", "ProfilerType.XPLANE")
    self.first = int(config.skip_first_n_steps_for_profiler) + 1
    self.last = self.first + max(1, int(config.profiler_steps)) - 1
    self.log_dir = config.tensorboard_dir
    self.active = False

  def before_step(self, step: int) -> None:
    if self.enabled and step == self.first and not self.active:
      jax.profiler.start_trace(self.log_dir)
      self.active = True
      logging.info("profiling RL steps %d..%d into %s", self.first, self.last, self.log_dir)

  def after_step(self, step: int, force: bool = False) -> None:
    if self.active and (step >= self.last or force):
      jax.profiler.stop_trace()
      self.active = False


def _read_history(path: str | None) -> list[dict[str, Any]] | None:
  """Every record of the run's metrics file (steps before a resume included), or None without a file."""
  if not path or not os.path.isfile(path):
    return None
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rec = json.loads(line)
      except ValueError:
        continue
      if isinstance(rec, dict):
        out.append(rec)
  return out


def _save(ckpt, rl_run: RLRun, step: int, summary: dict) -> None:
  params, opt_state = _actor_state(rl_run)
  ckpt.save(step, params, opt_state, _meta(rl_run.config, step, {"eval_before": summary["eval_before"]}))


def train(rl_run: RLRun, stop: signals.GracefulStop | None = None) -> dict[str, Any]:
  """Run (or resume) the RL loop; returns a summary dict (eval before/after, history)."""
  config = rl_run.config
  plan = rl_run.plan
  stop = stop or signals.GracefulStop()
  total = num_rl_steps(config)
  ckpt = RunCheckpointer(
      config.checkpoint_dir or os.path.join(rl_run.run_dir, "checkpoints"),
      period=config.checkpoint_period,
      max_to_keep=config.max_num_checkpoints_to_keep,
      enabled=config.enable_checkpointing,
      async_save=bool(config.async_checkpointing),
  )
  start, meta = _restore_newest(rl_run, ckpt)  # every process joins the restore
  start = distributed.agree(start, "the checkpoint step to resume from")
  if metrics_lib.is_writer():
    if not start:
      run_dir_lib.check_fresh_metrics_file(rl_run.metrics_file, rl_run.run_dir)
    # Records of steps after the restored checkpoint were trained and then lost with the process: drop them (and a
    # torn last line) so every step appears once. A fresh start drops a failed attempt's records likewise.
    for path in (rl_run.metrics_file, os.path.join(rl_run.run_dir, "batches.jsonl")):
      run_dir_lib.prune_jsonl(path, start if start else -1)
  out_logger = metrics_lib.RunLogger(
      config.tensorboard_dir, rl_run.metrics_file, total, start, log_period=max(1, int(config.log_period))
  )
  summary: dict[str, Any] = {
      "run_dir": rl_run.run_dir,
      "start_step": start,
      "total_steps": total,
      "eval_before": meta.get("eval_before"),
      "eval_after": None,
      "eval_history": [],
      "eval_sampling": f"{config.eval_sampling_strategy}, {config.num_eval_passes} pass(es)",
  }
  if start:
    out_logger.note(f"resuming {rl_run.run_dir} from checkpoint step {start} (next batch index {start})")
  else:
    out_logger.note(
        f"starting {rl_run.run_dir}: {total} RL steps of {config.rl.loss_algo}, batch {config.batch_size} x "
        f"{config.rl.num_generations} generations, rollout engine '{rl_run.engine_name}'"
    )
  out_logger.note(
      f"updates: {plan.updates_per_step} optimizer update(s) per RL step (rl.num_iterations={plan.num_iterations}, "
      f"mini-batch {plan.mini_batch_size} prompts), {plan.accumulation_steps} micro-batch(es) of "
      f"{plan.micro_batch_size} prompts each; old-policy log-probs: "
      + (
          "not needed (on-policy)"
          if not plan.needs_old_logps
          else ("sampler (rl.use_rollout_logps)" if config.rl.use_rollout_logps else "trainer forward")
      )
  )
  rs = rl_run.setup
  sync = rl_run.weight_sync
  out_logger.note(
      f"devices: trainer {len(rs.trainer_devices)}, sampler {len(rs.sampler_devices)} ("
      + (
          f"disaggregated; weight sync via {sync.path}, chunk_size={sync.chunk_size}, verify={sync.verify_policy})"
          if sync is not None
          else "colocated: the sampler shares the trainer's weights)"
      )
  )
  if start == 0 and config.eval_before_training and config.num_test_batches > 0:
    summary["eval_before"] = evaluation_lib.evaluate(rl_run, 0)
    rl_run.timer.reset()
    out_logger.log_eval(0, summary["eval_before"], "eval before RL")

  profiler = StepProfiler(config)
  trainer = rl_run.rl_cluster.actor_trainer
  # Rollouts run up to rl.off_policy_steps batches ahead of the updates (0: sampled inline, the synchronous step).
  producer = async_rollout.RolloutProducer(
      functools.partial(_sample_batch, rl_run), off_policy_steps=int(config.rl.off_policy_steps), start=start, end=total
  )
  snapshot = producer.asynchronous and not rl_run.learner.should_sync_weights
  if snapshot:  # colocated: the producer samples a pinned version while the trainer updates the shared arrays
    rl_run.rl_cluster.rollout.snapshot_weights()
  if producer.asynchronous:
    out_logger.note(
        f"rollouts run up to rl.off_policy_steps={producer.k} step(s) ahead of the trainer "
        f"(staleness corrected by {_staleness_correction(config)})"
    )
  stop.in_loop = True
  producer.start_producing()
  try:
    for step in range(start + 1, total + 1):
      t_step = time.perf_counter()
      rl_run.timer.reset()
      profiler.before_step(step)
      item = producer.take(step - 1)
      batch, inputs, sampled = item.value
      exp = experience.score(rl_run, sampled, plan, rl_run.timer)
      t = time.perf_counter()
      rl_run.rl_cluster.update_actor(updates.micro_batches(exp.example, plan), None, skip_jit=False)
      # Tunix defers writing an update's metrics by one update (to overlap I/O); flush so this step's are this step's.
      tunix_compat.flush_train_metrics(trainer)
      rl_run.timer.add("train", time.perf_counter() - t)
      t = time.perf_counter()
      wait_sync = producer.publish(step, functools.partial(_install_weights, rl_run, snapshot))
      rl_run.timer.add("weight_sync", time.perf_counter() - t - wait_sync)
      profiler.after_step(step)
      if out_logger.writer:  # after the update: the audit never names a step that did not train
        _audit_batch(rl_run.run_dir, step, batch)
      phases = rl_run.timer.reset()
      for phase, seconds in item.phases.items():  # the batch's sampling (async: overlapped with an earlier step)
        phases[phase] = phases.get(phase, 0.0) + seconds
      metrics = _step_metrics(rl_run, exp, item, inputs["answer"], phases, step, time.perf_counter() - t_step, wait_sync)
      if not all(math.isfinite(v) for v in metrics.values()):
        logging.warning(
            "non-finite metrics at step %d: %s", step, {k: v for k, v in metrics.items() if not math.isfinite(v)}
        )
      out_logger.log_step(step, metrics)
      if evaluation_lib.should_evaluate(config, step, total):
        with producer.engine():
          ev = evaluation_lib.evaluate(rl_run, step)
        rl_run.timer.reset()
        summary["eval_history"].append({"step": step, **ev})
        out_logger.log_eval(step, ev, "eval")
      saved = ckpt.should_save(step, total)
      if saved:
        _save(ckpt, rl_run, step, summary)
      if stop.requested is not None and step < total:
        producer.close()  # batches sampled ahead are dropped: a resume samples them again (async_rollout.py)
        if not saved and ckpt.enabled:
          _save(ckpt, rl_run, step, summary)
        where = f"checkpoint step {step} in {ckpt.directory}" if ckpt.enabled else "nowhere (enable_checkpointing=false)"
        profiler.after_step(step, force=True)
        out_logger.close()
        ckpt.close()

        raise signals.Stopped(
            f"stopped by {signal_lib.Signals(stop.requested).name} after step {step}/{total}; "
            f"resume from {where} by rerunning the same command",
            stop.requested,
        )
  finally:
    producer.close()
  if snapshot:
    rl_run.rl_cluster.rollout.release_snapshot()
  stop.in_loop = False
  profiler.after_step(total, force=True)

  if config.eval_after_training and config.num_test_batches > 0 and total > start:
    summary["eval_after"] = evaluation_lib.evaluate(rl_run, total)
    out_logger.log_eval(total, summary["eval_after"], "eval after RL")
  if rl_run.weight_sync is not None:
    summary["weight_syncs"] = {
        "count": rl_run.weight_sync.num_syncs,
        "verified": rl_run.weight_sync.num_verified,
        "last_seconds": rl_run.weight_sync.last_seconds,
        "last_bytes": rl_run.weight_sync.last_bytes,
    }
    out_logger.note(
        f"weight syncs: {rl_run.weight_sync.num_syncs}, verified bit-exact: {rl_run.weight_sync.num_verified}"
    )
  out_logger.close()
  summary["history"] = _read_history(rl_run.metrics_file) or out_logger.history
  summary["tensorboard_dir"] = out_logger.tensorboard_dir
  summary["metrics_file"] = rl_run.metrics_file
  ckpt.close()
  rl_run.rl_cluster.close()
  return summary


def _staleness_correction(config) -> str:
  if config.rl.rollout_is != "off":
    return f"rl.rollout_is={config.rl.rollout_is}, cap {config.rl.rollout_is_cap}"
  return "the PPO ratio against the behaviour policy (rl.use_rollout_logps)"


def _finished_summary(config, run_dir: str) -> dict[str, Any] | None:
  """The summary of a run that already trained every step (its summary.json and final checkpoint exist), else None."""
  path = os.path.join(run_dir, "summary.json")
  final = os.path.join(config.checkpoint_dir or os.path.join(run_dir, "checkpoints"), str(num_rl_steps(config)))
  if not (os.path.isfile(path) and os.path.isdir(final)):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  return summary if summary.get("total_steps") == num_rl_steps(config) else None


def run(config, argv: Sequence[str]) -> dict[str, Any]:
  """Entry point from `train_rl.main`: check outputs, lock the run directory, build, train (or resume), summarise."""
  out_dir = os.path.join(config.base_output_directory, config.run_name)
  metrics_file = run_dir_lib.resolve_metrics_file(config.metrics_file, out_dir)
  writer = metrics_lib.is_writer()  # process 0 alone checks, locks and writes the run's files
  if writer:
    run_dir_lib.check_writable(out_dir, metrics_file)
  finished = _finished_summary(config, out_dir)
  if finished is not None:  # a rerun of a finished run reports it and changes nothing
    if writer:
      print(
          f"{out_dir} already finished all {finished['total_steps']} RL steps; nothing to do "
          "(raise num_batches to train further, or use a new run_name)",
          flush=True,
      )
      print("\n" + summary_lib.table(finished), flush=True)
    return finished
  lock = run_dir_lib.RunLock(out_dir)
  if writer:
    lock.acquire()
    lock.start_heartbeat()  # a daemon thread: a step longer than the lock's stale_after_s never looks dead
  try:
    with signals.GracefulStop() as stop:
      rl_run = build_run(config, argv)
      rl_run.metrics_file = metrics_file
      rl_run.lock = lock
      summary = train(rl_run, stop)
    if writer:
      summary_lib.report(rl_run.config, summary)
      tmp = os.path.join(rl_run.run_dir, f".summary.json.{os.getpid()}")
      with open(tmp, "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in summary.items() if k != "history"}, f, indent=2, default=str)
      os.replace(tmp, os.path.join(rl_run.run_dir, "summary.json"))
  finally:
    lock.release()
  return summary
