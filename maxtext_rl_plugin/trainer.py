"""The RL run: MaxText models on Tunix's RLCluster + GrpoLearner, driven step by step by the plugin.

Tunix owns the algorithm pieces (rollout -> rewards -> group advantages -> reference log-probs ->
policy update through its actor trainer, trainer -> sampler weight sync). The plugin drives the outer
loop itself instead of calling `GrpoLearner.train()`, because a production run needs what that loop
does not give: a data position that resumes with no repeated or skipped batch, Orbax checkpoints of
params + optimizer + data position + RNG in MaxText's layout, greedy eval before and after RL,
per-phase timings, and one metrics stream (TensorBoard, `metrics_file`, console).

Per step:  batch(step) -> learner._generate_and_compute_advantage  (rollout, rewards, ref logps)
           -> rl_cluster.update_actor (one optimizer step, the plugin's policy loss)
           -> rl_cluster.sync_weights (disaggregated only; the rollout engine reshards)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Callable, Sequence

from absl import logging
import numpy as np

from maxtext_rl_plugin import models
from maxtext_rl_plugin.errors import CheckpointError, ConfigError

# Keys whose change makes a checkpoint's data position meaningless: resuming must refuse them.
_RESUME_INVARIANTS = ("batch_size", "num_generations", "data_shuffle_seed", "dataset", "loss_algo", "rollout_seed")


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
  """Wraps reward functions so each step's per-function rewards and correctness can be logged."""

  def __init__(self, timer: PhaseTimer):
    self.timer = timer
    self.values: dict[str, list[float]] = {}

  def wrap(self, fn: Callable) -> Callable:
    name = getattr(fn, "__name__", type(fn).__name__)

    def recorded(prompts, completions, **kwargs):
      t = time.perf_counter()
      out = fn(prompts, completions, **kwargs)
      self.timer.add("reward", time.perf_counter() - t)
      self.values.setdefault(name, []).extend(float(x) for x in out)
      return out

    recorded.__name__ = name
    return recorded

  def reset(self) -> dict[str, list[float]]:
    out, self.values = self.values, {}
    return out


def _data_key(config) -> str:
  return config.train_data_path or config.dataset_name


def _check_runtime(config, rs: models.RunSetup) -> None:
  """Checks that need the device set, before any model is built (device-free ones: `config.validate`)."""
  n_trainer = len(rs.trainer_devices)
  rows = config.batch_size * config.rl.num_generations
  if rows % n_trainer:
    raise ConfigError(
        f"invalid value for 'batch_size'={config.batch_size}: batch_size * rl.num_generations = {rows} rows must be "
        f"divisible by the {n_trainer} trainer devices"
    )
  if config.rl.num_iterations != 1:
    # The step loop makes one policy update per rollout batch; several would need old-policy log-probs
    # and a schedule of num_batches * num_iterations updates. Refuse rather than silently run one.
    raise ConfigError(f"invalid value for 'rl.num_iterations'={config.rl.num_iterations}: the plugin's step loop "
                      "supports 1 (one on-policy update per rollout batch)")


def _resolve_engine_name(config) -> str:
  if config.rollout_engine != "auto":
    return config.rollout_engine
  import importlib.util  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  on_tpu = jax.default_backend() in ("tpu",) or "proxy" in os.environ.get("JAX_PLATFORMS", "")
  name = "vllm" if on_tpu and importlib.util.find_spec("vllm") is not None else "embedded"
  logging.info("rollout_engine=auto resolved to '%s' (backend %s)", name, jax.default_backend())
  return name


def rollout_engine_factory(name: str, sampler_config) -> Any:
  """A Tunix-constructible rollout engine (`functools.partial` of a `BaseRollout` subclass)."""
  if name == "embedded":
    from maxtext_rl_plugin.rollout import embedded  # pylint: disable=import-outside-toplevel

    return functools.partial(embedded.EmbeddedRollout, config=sampler_config)
  if name == "vllm":
    from maxtext_rl_plugin.rollout import vllm  # pylint: disable=import-outside-toplevel

    vllm.import_vllm()  # fail before any model is built when the [tpu] extra is missing
    return functools.partial(vllm.VllmRollout, config=sampler_config)
  from maxtext_rl_plugin import registry  # pylint: disable=import-outside-toplevel

  try:
    cls = registry.load("rollout_engines", name)
  except KeyError as e:
    raise ConfigError(f"invalid value for 'rollout_engine'='{name}': {e.args[0]}") from None
  return functools.partial(cls, config=sampler_config)


def rollout_configs(config, tokenizer) -> dict:
  """Tunix RolloutConfigs for TRAIN (sampling keys) and EVAL (exact greedy: top_k=1)."""
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=import-outside-toplevel
  from tunix.rl.rollout import base_rollout  # pylint: disable=import-outside-toplevel

  eos = [int(tokenizer.eos_token_id), *[int(t) for t in config.stop_token_ids]]
  common = dict(
      max_tokens_to_generate=config.max_target_length - config.max_prefill_predict_length,
      max_prompt_length=config.max_prefill_predict_length,
      kv_cache_size=config.max_target_length + config.kv_cache_buffer,
      eos_tokens=eos,
      rollout_vllm_model_version=config.tokenizer_path,
      rollout_vllm_hbm_utilization=config.hbm_utilization_vllm,
  )
  top_k = config.decode_sampling_top_k if config.decode_sampling_top_k and config.decode_sampling_top_k > 0 else None
  train = base_rollout.RolloutConfig(
      temperature=config.decode_sampling_temperature,
      top_p=config.decode_sampling_nucleus_p,
      top_k=top_k,
      **common,
  )
  evaluation = base_rollout.RolloutConfig(temperature=1.0, top_p=1.0, top_k=1, **common)
  return {rl_cluster_lib.Mode.TRAIN: train, rl_cluster_lib.Mode.EVAL: evaluation}


def build_optimizer(config):
  """MaxText's RL optimizer (AdamW + warmup-cosine schedule + global-norm clipping).

  MaxText 0.2.5's `utils_rl.get_optimizer` drops `adam_eps` / `adam_eps_root`. With the defaults the plugin
  returns MaxText's optimizer unchanged; otherwise it rebuilds the same chain with them, so a key the user
  sets is not silently ignored. (A large eps makes small-gradient updates SGD-like; on the CPU demo it did
  not help, see docs/cpu_demo.md.)
  """
  import multiprocessing.pool  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import  (utils_rl needs it)

  import optax  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.post_train.rl import utils_rl  # pylint: disable=import-outside-toplevel

  eps, eps_root = float(config.adam_eps), float(config.adam_eps_root)
  if eps == 1e-8 and eps_root == 0.0:
    return utils_rl.get_optimizer(config)
  # Same schedule as utils_rl.get_optimizer (including its learning_rate_schedule_steps rule).
  sched_steps = config.learning_rate_schedule_steps
  if not (sched_steps and sched_steps > 0 and sched_steps != config.steps):
    sched_steps = config.train_steps
  schedule = optax.schedules.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=int(config.warmup_steps_fraction * sched_steps),
      decay_steps=sched_steps, end_value=0.0)

  def make(learning_rate):
    clip = [optax.clip_by_global_norm(config.gradient_clipping_threshold)] if config.gradient_clipping_threshold > 0 else []
    return optax.chain(*clip, optax.adamw(learning_rate, b1=config.adam_b1, b2=config.adam_b2, eps=eps,
                                          eps_root=eps_root, weight_decay=config.adam_weight_decay))

  return optax.inject_hyperparams(make)(learning_rate=schedule)


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
  tee: Any
  run_dir: str
  engine_name: str
  weight_sync: Any = None


def _reward_functions(config, recorder: RewardRecorder) -> list[Callable]:
  from maxtext_rl_plugin import rewards  # pylint: disable=import-outside-toplevel

  return [recorder.wrap(fn) for fn in rewards.reward_fns_from_config(config)]


def _accuracy_metric(config, recorder: RewardRecorder):
  """Tunix metric_fn: per-completion correctness against the gold answer (recorded as 'accuracy').

  The grading is the `check_answer` reward's own (rewards memoise the last batch), not a second pass.
  """
  from maxtext_rl_plugin import rewards as rewards_lib  # pylint: disable=import-outside-toplevel

  def accuracy(prompts, completions, rewards, advantages, answer=None, **kwargs):
    del prompts, rewards, advantages, kwargs
    correct = [float(r.correct) for r in rewards_lib.score_batch(completions, list(answer or []), config)]
    recorder.values.setdefault("accuracy", []).extend(correct)
    return {"accuracy": (float(np.mean(correct)) if correct else 0.0, np.mean)}

  return accuracy


def build_run(config, argv: Sequence[str]) -> RLRun:
  """Models, meshes, data, rewards, Tunix cluster and learner for `config`."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter  # pylint: disable=import-outside-toplevel
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=import-outside-toplevel
  from tunix.rl.grpo import grpo_learner  # pylint: disable=import-outside-toplevel
  from tunix.sft import metrics_logger  # pylint: disable=import-outside-toplevel

  from maxtext_rl_plugin import algorithms  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin import data  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.metrics import TunixTee  # pylint: disable=import-outside-toplevel

  rs = models.setup_devices(argv)
  config = rs.trainer_config
  _check_runtime(config, rs)
  models.check_load_parameters_path(config)
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  tokenizer = models.load_tokenizer(config)
  train_split, eval_split = data.load_splits(config, tokenizer)
  engine_name = _resolve_engine_name(config)
  rollout_factory = rollout_engine_factory(engine_name, rs.sampler_config)

  actor, actor_mesh = models.build_model(config, rs.trainer_devices, pad_id=tokenizer.pad_token_id)
  if config.sft_warmup_steps > 0:
    from maxtext_rl_plugin import sft  # pylint: disable=import-outside-toplevel

    sft.warm_start(config, actor, actor_mesh, tokenizer, train_split, run_dir)
  reference = None
  if config.rl.grpo_beta != 0.0:
    # The KL anchor is the starting policy (after the warm start), on the trainer mesh.
    with actor_mesh:
      reference = TunixMaxTextAdapter(base_model=nnx.clone(actor.base), pad_id=tokenizer.pad_token_id)
  rollout_mesh = models.build_sampler_mesh(rs.sampler_config, rs.sampler_devices)
  logging.info("trainer devices %d, sampler devices %d (%s)", len(rs.trainer_devices), len(rs.sampler_devices),
               "disaggregated" if rs.disaggregated else "colocated")

  tee = TunixTee()
  tb_dir = os.path.join(run_dir, "tensorboard")
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
          eval_every_n_steps=10**9,  # eval is the plugin's (greedy, on the eval split)
          max_steps=config.train_steps,
          mini_batch_size=config.batch_size,
          metrics_logging_options=metrics_logger.MetricsLoggerOptions(
              log_dir=tb_dir, flush_every_n_steps=1, backend_kwargs={"custom_backend": [lambda: tee]}
          ),
          checkpoint_root_directory=None,  # checkpoints are the plugin's (params + opt + data position + RNG)
      ),
      rollout_config=rollout_configs(config, tokenizer),
  )
  rl_cluster = rl_cluster_lib.RLCluster(
      actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=cluster_config
  )
  # Disaggregated runs: trainer -> sampler weights go through the plugin's resharding (chunked, guarded).
  from maxtext_rl_plugin import resharding  # pylint: disable=import-outside-toplevel

  weight_sync = resharding.attach_to_rl_cluster(rl_cluster, rs.sampler_config)
  timer = PhaseTimer()
  recorder = RewardRecorder(timer)
  algorithms.register_with_tunix()
  algo_config = algorithms.tunix_algo_config(config)
  learner = grpo_learner.GrpoLearner(
      rl_cluster=rl_cluster,
      algo_config=algo_config,
      reward_fns=_reward_functions(config, recorder),
      metric_fns=[_accuracy_metric(config, recorder)],
  )
  rl_cluster.actor_trainer.with_rl_metrics_to_log(algorithms.rl_metrics_to_log(algo_config))
  # GrpoLearner.train() sets these from the batch size; we drive steps ourselves.
  learner._rollout_micro_batch_size = config.batch_size  # pylint: disable=protected-access
  learner._compute_logps_micro_batch_size = config.batch_size  # pylint: disable=protected-access
  rollout = rl_cluster.rollout
  rollout.generate = timer.wrap("rollout", rollout.generate)
  rl_cluster.get_ref_per_token_logps = timer.wrap("logps", rl_cluster.get_ref_per_token_logps)
  rl_cluster.get_old_per_token_logps = timer.wrap("logps", rl_cluster.get_old_per_token_logps)
  return RLRun(config, rs, tokenizer, train_split, eval_split, rl_cluster, learner, timer, recorder, tee, run_dir,
               engine_name, weight_sync)


# ----------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------


def evaluate(run: RLRun, step: int) -> dict[str, float]:
  """Greedy generation on the eval split; accuracy, format and partial accuracy, mean reward."""
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=import-outside-toplevel

  from maxtext_rl_plugin import rewards  # pylint: disable=import-outside-toplevel

  config = run.config
  bs = config.eval_batch_size if config.eval_batch_size > 0 else config.batch_size
  n = min(len(run.eval_split), bs * max(1, config.num_test_batches))
  examples = [run.eval_split[i] for i in range(n)]
  t = time.perf_counter()
  results = []
  for s in range(0, n, bs):
    chunk = examples[s : s + bs]
    out = run.rl_cluster.generate(prompts=[e.prompt for e in chunk], mode=rl_cluster_lib.Mode.EVAL)
    results.extend(rewards.score_batch(out.text, [e.answer for e in chunk], config))
  run.timer.reset()  # eval time is not a training phase
  metrics = {
      "accuracy": float(np.mean([r.correct for r in results])),
      "format_accuracy": float(np.mean([bool(getattr(r, "format_ok", False)) for r in results])),
      "partial_accuracy": float(np.mean([bool(getattr(r, "partial", r.correct)) for r in results])),
      "reward_mean": float(np.mean([r.reward for r in results])),
      "num_examples": float(n),
      "seconds": time.perf_counter() - t,
  }
  logging.info("eval at step %d on %d examples: %s", step, n, metrics)
  return metrics


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------


def _meta(config, step: int, extra: dict | None = None) -> dict:
  return {
      "step": step,
      "next_batch_index": step,  # batches are indexed by step: batch k is trained at step k + 1
      "batch_size": config.batch_size,
      "num_generations": config.rl.num_generations,
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
      raise CheckpointError(
          f"cannot resume from {path}: it was written with {key}={meta[key]!r} but this run has {key}={now[key]!r}; "
          "use a new run_name to start over"
      )


def _actor_state(run: RLRun):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  trainer = run.rl_cluster.actor_trainer
  return nnx.state(trainer.model, nnx.Param), nnx.state(trainer.optimizer)


def _restore(run: RLRun, ckpt, step: int) -> dict:
  from flax import nnx  # pylint: disable=import-outside-toplevel

  trainer = run.rl_cluster.actor_trainer
  params, opt_state = _actor_state(run)
  params, opt_state, meta = ckpt.restore(step, params, opt_state)
  _check_resume_compatible(run.config, meta, f"{ckpt.directory}/{step}")
  nnx.update(trainer.model, params)
  nnx.update(trainer.optimizer, opt_state)
  trainer._train_steps = step  # pylint: disable=protected-access
  trainer._iter_steps = step  # pylint: disable=protected-access
  run.rl_cluster.global_steps = step
  if run.learner.should_sync_weights:
    run.rl_cluster.sync_weights()
    run.rl_cluster.global_steps = step
  return meta


def _step_inputs(run: RLRun, step: int) -> tuple[dict, list]:
  config = run.config
  # Batch k (0-based) is a pure function of (seed, k): resuming at step s replays nothing and skips nothing.
  batch = run.train_split.batch(step - 1, config.batch_size)
  g = config.rl.num_generations
  inputs = {
      "prompts": [e.prompt for e in batch for _ in range(g)],
      "answer": [e.answer for e in batch for _ in range(g)],
      "question": [e.question for e in batch for _ in range(g)],
  }
  return inputs, batch


def _seed_rollout(run: RLRun, step: int) -> None:
  """Sampling randomness is a function of (rollout_seed, step), so a resumed run samples what an
  uninterrupted one would have (the RNG part of the resume state)."""
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=import-outside-toplevel

  rc = run.rl_cluster.cluster_config.rollout_config[rl_cluster_lib.Mode.TRAIN]
  rc.seed = (int(run.config.rollout_seed) * 1_000_003 + step) % (2**31 - 1)


def _audit_batch(run_dir: str, step: int, batch) -> None:
  """Append which examples step `step` trained on to `<run>/batches.jsonl` (resume audit trail)."""
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "batches.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps({"step": step, "ids": [e.id for e in batch]}) + "\n")


def _step_metrics(run: RLRun, example, phases: dict[str, float], step_seconds: float) -> dict[str, float]:
  values = run.rewards.reset()
  m: dict[str, float] = {}
  total = None
  for name, vals in values.items():
    arr = np.asarray(vals, dtype=np.float64)
    if name == "accuracy":
      m["accuracy"] = float(arr.mean())
      continue
    m[f"reward/{name}/mean"] = float(arr.mean())
    m[f"reward/{name}/std"] = float(arr.std())
    total = arr if total is None else total + arr
  if total is not None:
    m["reward/mean"] = float(total.mean())
    m["reward/std"] = float(total.std())
  mask = np.asarray(example.completion_mask)
  lengths = mask.sum(axis=-1)
  m["completion/length_mean"] = float(lengths.mean())
  m["completion/length_max"] = float(lengths.max())
  m["completion/stopped_fraction"] = float(np.mean(lengths < mask.shape[-1]))
  tunix = run.tee.drain()
  for src, dst in (("actor/train/loss", "loss"), ("actor/train/kl", "kl"), ("actor/train/pg_clipfrac", "clip_fraction"),
                   ("actor/train/grad_norm", "grad_norm"), ("actor/train/entropy", "entropy"),
                   ("actor/train/ratio_mean", "ratio_mean")):
    if src in tunix:
      m[dst] = tunix[src]
  for k, v in tunix.items():
    if k.startswith("actor/train/") and k.split("/")[-1] not in ("loss", "kl", "pg_clipfrac", "grad_norm"):
      m.setdefault("train/" + k.split("/")[-1], v)
  for phase in ("rollout", "reward", "logps", "train", "weight_sync"):
    m[f"time/{phase}_s"] = phases.get(phase, 0.0)
  m["perf/step_s"] = step_seconds
  rollout_s = phases.get("rollout", 0.0)
  if rollout_s > 0:
    m["perf/tokens_per_s"] = float(lengths.sum()) / rollout_s
  return m


def train(run: RLRun) -> dict[str, Any]:
  """Run (or resume) the RL loop; returns a summary dict (eval before/after, history)."""
  from maxtext_rl_plugin.checkpointing import RunCheckpointer  # pylint: disable=import-outside-toplevel
  from maxtext_rl_plugin.metrics import RunLogger  # pylint: disable=import-outside-toplevel

  config = run.config
  total = config.train_steps
  ckpt = RunCheckpointer(
      os.path.join(run.run_dir, "checkpoints"),
      period=config.checkpoint_period,
      max_to_keep=config.max_num_checkpoints_to_keep,
      enabled=config.enable_checkpointing,
  )
  start = 0
  meta = {}
  latest = ckpt.latest_step()
  if latest is not None:
    meta = _restore(run, ckpt, latest)
    start = latest
  out_logger = RunLogger(os.path.join(run.run_dir, "tensorboard"), config.metrics_file or None, total, start)
  summary: dict[str, Any] = {"run_dir": run.run_dir, "start_step": start, "total_steps": total,
                             "eval_before": meta.get("eval_before"), "eval_after": None}
  if start:
    out_logger.note(f"resuming {run.run_dir} from checkpoint step {start} (next batch index {start})")
  else:
    out_logger.note(f"starting {run.run_dir}: {total} RL steps of {config.rl.loss_algo}, batch {config.batch_size} x "
                    f"{config.rl.num_generations} generations, rollout engine '{run.engine_name}'")
  rs = run.setup
  sync = run.weight_sync
  out_logger.note(
      f"devices: trainer {len(rs.trainer_devices)}, sampler {len(rs.sampler_devices)} ("
      + (f"disaggregated; weight sync via {sync.path}, chunk_size={sync.chunk_size}, verify={sync.verify_policy})"
         if sync is not None else "colocated: the sampler shares the trainer's weights)"))
  if start == 0 and config.eval_before_training and config.num_test_batches > 0:
    summary["eval_before"] = evaluate(run, 0)
    out_logger.log_eval(0, summary["eval_before"], "eval before RL")

  for step in range(start + 1, total + 1):
    t_step = time.perf_counter()
    run.timer.reset()
    _seed_rollout(run, step)
    inputs, batch = _step_inputs(run, step)
    _audit_batch(run.run_dir, step, batch)
    t = time.perf_counter()
    example = run.learner._generate_and_compute_advantage(inputs)  # pylint: disable=protected-access
    gen_s = time.perf_counter() - t
    t = time.perf_counter()
    run.rl_cluster.update_actor([example], None, skip_jit=False)
    # Tunix defers writing a step's trainer metrics by one step (to overlap I/O); flush now so this
    # step's loss/KL/clip fraction are logged with this step.
    run.rl_cluster.actor_trainer._write_train_metrics()  # pylint: disable=protected-access
    run.timer.add("train", time.perf_counter() - t)
    t = time.perf_counter()
    if run.learner.should_sync_weights:
      run.rl_cluster.sync_weights()
    else:
      run.rl_cluster.global_steps += 1
    run.timer.add("weight_sync", time.perf_counter() - t)
    phases = run.timer.reset()
    phases["logps"] = phases.get("logps", 0.0) + max(
        0.0, gen_s - phases.get("rollout", 0.0) - phases.get("reward", 0.0) - phases.get("logps", 0.0))
    metrics = _step_metrics(run, example, phases, time.perf_counter() - t_step)
    if not all(math.isfinite(v) for v in metrics.values()):
      logging.warning("non-finite metrics at step %d: %s", step, {k: v for k, v in metrics.items()
                                                                   if not math.isfinite(v)})
    out_logger.log_step(step, metrics)
    if ckpt.should_save(step, total):
      params, opt_state = _actor_state(run)
      ckpt.save(step, params, opt_state, _meta(config, step, {"eval_before": summary["eval_before"]}))

  if config.eval_after_training and config.num_test_batches > 0 and total > start:
    summary["eval_after"] = evaluate(run, total)
    out_logger.log_eval(total, summary["eval_after"], "eval after RL")
  if run.weight_sync is not None:
    summary["weight_syncs"] = {"count": run.weight_sync.num_syncs, "verified": run.weight_sync.num_verified,
                               "last_seconds": run.weight_sync.last_seconds, "last_bytes": run.weight_sync.last_bytes}
    out_logger.note(f"weight syncs: {run.weight_sync.num_syncs}, verified bit-exact: {run.weight_sync.num_verified}")
  summary["history"] = out_logger.history
  summary["tensorboard_dir"] = out_logger.tensorboard_dir
  out_logger.close()
  ckpt.close()
  run.rl_cluster.close()
  return summary


def run(config, argv: Sequence[str]) -> dict[str, Any]:
  """Entry point from `train_rl.main`: build, train (or resume), summarise."""
  rl_run = build_run(config, argv)
  summary = train(rl_run)
  from maxtext_rl_plugin import summary as summary_lib  # pylint: disable=import-outside-toplevel

  summary_lib.report(rl_run.config, summary)
  with open(os.path.join(rl_run.run_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump({k: v for k, v in summary.items() if k != "history"}, f, indent=2, default=str)
  return summary
