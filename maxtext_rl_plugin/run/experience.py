r"""One RL step's experience: rollouts -> rewards -> group advantages -> reference and old-policy log-probs.

This replaces Tunix 0.1.7's private `GrpoLearner._generate_and_compute_advantage` with the same steps on
`RLCluster`'s public API, plus what that method cannot do:

* rollout micro-batching through `RLCluster.generate(micro_batch_size=...)` (MaxText's `rollout_micro_batch_size`);
* old-policy log-probs computed once per batch, before its first update, by the *trainer's* forward at the batch's
  starting weights (Tunix takes them from the rollout engine, `get_old_per_token_logps`, which is unreliable in 0.1.7
  for every engine), or, with `rl.use_rollout_logps=true` (MaxText's meaning of that key), the log-probs the rollout
  engine returned with the samples (recomputed on the sampler's weights for an engine that returns none);
* rollout importance weights (`rl.rollout_is`, divergence.rollout_is_weights) from the behaviour log-probs the
  engine returned at sampling time and the trainer's old log-probs;
* sampler-vs-trainer agreement metrics (`rl.log_sampler_trainer_agreement`), behaviour vs trainer:
      d_t = lp_behaviour - lp_trainer on completion tokens,
      mismatch/logp_abs_diff_mean = mean |d_t|,
      mismatch/kl_k3 = mean( exp(d_t) - d_t - 1 )   (k3 estimate of KL(trainer || sampler) on trainer samples).

The work is split in two halves so that rollouts can run ahead of the trainer (`run/async_rollout.py`): `sample` is the
sampler's half (generate, rewards, advantages, behaviour log-probs; depends only on the weights that sampled the batch)
and `score` the trainer's (reference and old-policy log-probs at the trainer's current weights, importance weights,
agreement metrics). `make_experience` runs both back to back, the synchronous step.

Log-probs everywhere are at the rollout temperature (logits / T), the distribution the tokens were sampled from and
the one Tunix's loss and reference use.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin.algorithms import divergence
from maxtext_rl_plugin.algorithms import reward_aggregation
from maxtext_rl_plugin.algorithms import shaping
from maxtext_rl_plugin.algorithms.settings import AlgorithmSettings
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.run import async_rollout
from maxtext_rl_plugin.run import logps as logps_lib
from maxtext_rl_plugin.run import parity
from maxtext_rl_plugin.agentic import episode as episode_lib
from maxtext_rl_plugin.run.updates import UpdatePlan
from maxtext_rl_plugin.rewards.loader import RewardFunctionError


@dataclasses.dataclass
class Experience:
  """A rollout batch ready for the policy update."""

  example: Any  # tunix TrainExample, rows = prompts x G
  texts: list[str]
  rewards: np.ndarray  # [rows] summed over reward functions
  metrics: dict[str, float]


def _micro(size: int, num_generations: int) -> int | None:
  """MaxText's -1 (= no micro-batching) -> None; prompts -> rows."""
  return None if size is None or int(size) <= 0 else int(size) * num_generations


def pad_rows(rows: Sequence[Any], length: int, fill: Any, dtype: Any) -> np.ndarray:
  """[len(rows), length] array of the variable-length `rows`, right-padded with `fill` (a longer row is cut: it cannot
  happen with the rollout's max_tokens_to_generate == length, but a cut is safer than a shape error)."""
  out = np.full((len(rows), length), fill, dtype=dtype)
  for i, r in enumerate(rows):
    r = np.asarray(r, dtype=dtype)[:length]
    out[i, : r.shape[0]] = r
  return out


def sum_rewards(
    reward_fns: Sequence[Callable],
    prompts: list,
    completions: list[str],
    weights: Sequence[float] | None = None,
    **kwargs,
) -> np.ndarray:
  """Per-completion total reward: the sum over reward functions (as Tunix's learner sums them), each times its weight
  (`rl.reward_weights`, algorithms/reward_aggregation.py; None or 1 = the plain sum, bit for bit).

  A function returning the wrong number of values, or a non-finite value, is an error here rather than a silent
  NaN advantage later.
  """
  total = np.zeros(len(completions), dtype=np.float64)
  names = []
  for i, fn in enumerate(reward_fns):
    name = getattr(fn, "__name__", repr(fn))
    names.append(name)
    try:
      vals = np.asarray(fn(prompts, completions, **kwargs), dtype=np.float64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:  # a ragged or non-numeric result of a function not wrapped
      raise RewardFunctionError(f"reward function {name} returned values that are not one number each: {e}") from None
    if vals.shape[0] != len(completions):
      raise RewardFunctionError(
          f"reward function {name} returned {vals.shape[0]} values for {len(completions)} completions"
      )
    if not np.all(np.isfinite(vals)):
      raise RewardFunctionError(f"reward function {name} returned a non-finite reward")
    w = 1.0 if weights is None else float(weights[i])
    total += vals if w == 1.0 else w * vals
  with np.errstate(over="ignore"):
    out = total.astype(np.float32)
  if not np.all(np.isfinite(out)):
    i = int(np.flatnonzero(~np.isfinite(out))[0])
    raise RewardFunctionError(
        f"the rewards of completion {i} ({' + '.join(names)}) sum to {total[i]:g}, beyond the float32 range the "
        "advantages and the loss are computed in; keep rewards within +-3.4e38 (a few units is what GRPO expects)"
    )
  return out


def behaviour_logps(out: Any, length: int) -> np.ndarray | None:
  """[rows, length] log-probs the sampler assigned to the tokens it sampled (the behaviour policy mu), zero-padded;
  None when the engine returned none."""
  if out.logprobs is None or any(lp is None for lp in out.logprobs):
    return None
  return pad_rows(out.logprobs, length, 0.0, np.float32)


def agreement_metrics(sampler: jax.Array, trainer: jax.Array, mask: jax.Array) -> dict[str, float]:
  """Sampler-vs-trainer log-prob agreement on completion tokens (formulas in the module docstring)."""
  m = np.asarray(mask, dtype=np.float64)
  sampler = np.where(m > 0, np.asarray(sampler, np.float64), 0.0)
  trainer = np.where(m > 0, np.asarray(trainer, np.float64), 0.0)
  d = sampler - trainer
  n = max(m.sum(), 1.0)
  k3 = divergence.kl_estimate(trainer, sampler, "k3", xp=np)  # KL(trainer || sampler): the loss's estimator and clamp
  return {
      "mismatch/logp_abs_diff_mean": float(np.abs(d).sum() / n),
      "mismatch/logp_abs_diff_max": float(np.abs(d).max()) if d.size else 0.0,
      "mismatch/kl_k3": float((k3 * m).sum() / n),
  }


@dataclasses.dataclass
class Sampled:
  """The sampler's half of a step: what the rollout engine produced and the rewards of it.

  Built by `sample` (in the rollout producer's thread when rollouts run ahead, `run/async_rollout.py`); everything here
  depends only on the weights that sampled the batch, never on the trainer's current weights.
  """

  prompts: list[str]
  texts: list[str]
  prompt_ids: jax.Array  # [rows, P] left-padded
  completion_ids: np.ndarray  # [rows, T] right-padded with pad_id
  rewards: np.ndarray  # [rows] summed over reward functions
  advantages: np.ndarray  # [rows]
  behaviour: jax.Array | None  # [rows, T] the sampler's log-probs of its tokens, when a consumer needs them
  reward_values: dict[str, list[float]]  # per reward function, for the step's metrics
  pad_id: int
  eos_id: int
  # [rows] bool, rows that contribute loss (False: a truncated completion under rl.mask_truncated_completions, or a
  # slot rl.dynamic_sampling could not fill); None = all.
  loss_rows: np.ndarray | None = None
  truncated: np.ndarray | None = None  # [rows] bool, completions cut by the length limit (shaping.truncated_rows)
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the sampler side's step metrics
  next_position: int | None = None  # rl.dynamic_sampling: the data stream position after this batch
  # [rows, T] bool, rl.use_agentic_rollout: the policy's own tokens (False on the environment's tool results, which
  # are in the context but carry no loss: agentic/episode.py); None = every completion token is the policy's.
  token_mask: np.ndarray | None = None
  # [rows, P + T, layers, k] on MoE models whose engine reports routing (moe.py): the experts the sampler routed each
  # prompt and completion token to; replayed in the trainer's forwards under rl.router_replay.
  routing: np.ndarray | None = None
  prompt_host: np.ndarray | None = None  # [rows, P] `prompt_ids` on the host (no gather from the trainer mesh)


def rollout_routing(run: Any) -> np.ndarray | None:
  """The routing of the rollout calls this thread made since the last take (the engine's `take_routing`,
  rollout/contract.py), gathered across processes like the rows themselves (`generate`); None when the engine reports
  none."""
  routing = run.rl_cluster.rollout.take_routing()
  if routing is not None and samples_per_host(run):
    routing = async_rollout.cross_process(distributed.gather_rows, routing)
  return routing


def _gather_output(out: base_rollout.RolloutOutput, pad_id: int) -> base_rollout.RolloutOutput:
  """Every process's `out` (its own prompts' rows, the same row count on each) as one output of the whole batch in
  process order, on every process: the plugin's convention that every process holds the same host batch."""
  lengths = distributed.gather_rows(np.asarray([len(t) for t in out.tokens], np.int64))
  width = int(distributed.gather_rows(np.asarray([max((len(t) for t in out.tokens), default=0)], np.int64)).max())
  tokens = distributed.gather_rows(pad_rows(out.tokens, max(width, 1), pad_id, np.int32))
  logprobs = None
  if out.logprobs is not None and all(lp is not None for lp in out.logprobs):
    logprobs = distributed.gather_rows(pad_rows(out.logprobs, max(width, 1), 0.0, np.float32))
  return base_rollout.RolloutOutput(
      text=distributed.gather_texts(list(out.text)),
      logits=None,
      tokens=[tokens[i, :k] for i, k in enumerate(lengths)],
      left_padded_prompt_tokens=distributed.gather_rows(np.asarray(out.left_padded_prompt_tokens, np.int32)),
      logprobs=None if logprobs is None else [logprobs[i, :k] for i, k in enumerate(lengths)],
  )


def samples_per_host(run: Any) -> bool:
  """Whether each JAX process samples only its own share of a batch: a multi-process run whose sampler is per host
  (a disaggregated split, distributed.split_local_devices, or an engine that is one per host itself: vLLM)."""
  rollout = run.rl_cluster.rollout
  return distributed.is_multiprocess() and (run.setup.disaggregated or rollout.per_host)


def generate(run: Any, prompts: list[str], num_generations: int, micro_batch_size: int | None):
  """The rollout of `prompts` (each repeated `num_generations` times, consecutively).

  Disaggregated runs sample with per-row keys where the engine has them (`prompt_offset`, capabilities.row_keys,
  rollout/contract.py: a row's tokens depend on its prompt's global index, not on the batch it is sampled in). With
  more than one JAX process the sampler mesh is
  per host (distributed.split_local_devices, or vLLM's one engine per host): each process samples its own prompt
  groups (`process_slice`), and the rows are then gathered so every process holds the whole batch, as 1 process
  sampling all of them would.
  """
  cluster = run.rl_cluster
  rollout = cluster.rollout
  per_host = samples_per_host(run)
  if not run.setup.disaggregated and not per_host:
    return cluster.generate(prompts=prompts, mode=rl_cluster_lib.Mode.TRAIN, micro_batch_size=micro_batch_size)
  g = num_generations
  own = distributed.process_slice(len(prompts) // g) if per_host else slice(0, len(prompts) // g)
  keyed = rollout.capabilities.row_keys
  if keyed:
    rollout.prompt_offset = own.start
  try:
    out = cluster.generate(
        prompts=prompts[own.start * g : own.stop * g], mode=rl_cluster_lib.Mode.TRAIN, micro_batch_size=micro_batch_size
    )
  finally:
    if keyed:
      rollout.prompt_offset = None
  # The gather is a cross-process collective: the trainer's thread issues it (run/async_rollout.py, hand-overs).
  return async_rollout.cross_process(_gather_output, out, int(rollout.pad_id())) if per_host else out


def agentic_rollout(run: Any, prompts: list[str], num_generations: int):
  """Episodes of `prompts` (agentic/episode.py). With a per-host sampler each process runs its own prompt groups'
  episodes, tools included, and every process then holds all of them: rows, loss masks and counters gathered in
  process order (the gather handed to the trainer's thread when rollouts run ahead)."""
  if not samples_per_host(run):
    return episode_lib.generate(run, prompts, rl_cluster_lib.Mode.TRAIN)
  own = distributed.process_slice(len(prompts) // num_generations)
  out, eps = episode_lib.generate(run, prompts, rl_cluster_lib.Mode.TRAIN, groups=own)
  return async_rollout.cross_process(_gather_episodes, out, eps, int(run.rl_cluster.rollout.pad_id()))


def _gather_episodes(out: base_rollout.RolloutOutput, eps: list, pad_id: int):
  """This process's episodes -> every process's (the rollout rows, each loss mask, the counters metrics read)."""
  full = _gather_output(out, pad_id)
  width = max(1, max((len(t) for t in full.tokens), default=0))
  mask = distributed.gather_rows(pad_rows([e.loss_mask for e in eps], width, 0, np.int8))
  numbers = distributed.gather_rows(np.asarray([episode_lib.counters(e) for e in eps], np.int64).reshape(len(eps), 4))
  return full, [episode_lib.from_counters(t, m[: len(t)], c) for t, m, c in zip(full.tokens, mask, numbers)]


def sample(run: Any, inputs: dict[str, list], plan: UpdatePlan, timer: Any) -> Sampled:
  """Rollouts, rewards and group advantages of one batch (`inputs` rows are prompts repeated G times)."""
  cfg = run.config
  cluster = run.rl_cluster
  g = plan.num_generations
  train_rollout = cluster.cluster_config.rollout_config[rl_cluster_lib.Mode.TRAIN]
  pad_id, eos_id = int(cluster.rollout.pad_id()), int(cluster.rollout.eos_id())

  episodes = None
  with timer.phase("rollout"):
    if cfg.rl.use_agentic_rollout:  # multi-turn episodes with tools (agentic/episode.py)
      out, episodes = agentic_rollout(run, list(inputs["prompts"]), g)
    else:
      rollout_routing(run)  # drop routing another caller of this thread left (evaluation)
      out = generate(run, list(inputs["prompts"]), g, _micro(cfg.rollout_micro_batch_size, g))
    routing = None if episodes is not None else rollout_routing(run)

  completion_ids = pad_rows(out.tokens, train_rollout.max_tokens_to_generate, pad_id, np.int32)
  put = logps_lib.put_rows(cluster)
  prompt_host = np.asarray(out.left_padded_prompt_tokens, np.int32)
  prompt_ids = put(prompt_host)

  with timer.phase("reward"):
    run.rewards.reset()  # the recorder holds this batch's values only
    weights = reward_aggregation.weights_of(cfg.rl, [getattr(f, "__name__", repr(f)) for f in run.reward_fns])
    rewards = sum_rewards(
        run.reward_fns,
        list(inputs["prompts"]),
        list(out.text),
        weights,
        **{k: v for k, v in inputs.items() if k != "prompts"},
    )
    reward_values = run.rewards.reset()
    max_len = completion_ids.shape[1]
    truncated = shaping.truncated_rows(completion_ids, pad_id, train_rollout.eos_tokens or [eos_id])
    metrics = {"completion/truncated_fraction": float(truncated.mean())}
    token_mask = None
    if episodes is not None:
      token_mask = pad_rows([e.loss_mask for e in episodes], max_len, 0, np.int32).astype(bool)
      metrics.update(episode_lib.metrics(episodes))
    if routing is not None:  # the rollout's expert load (moe.py)
      mask = moe.routed_mask(np.asarray(out.left_padded_prompt_tokens) != pad_id, completion_ids != pad_id)
      metrics.update(moe.step_metrics(routing, None, mask, int(cfg.num_experts)))
    if int(cfg.rl.overlong_buffer_len) > 0:  # DAPO's soft overlong penalty, in tokens (algorithms/shaping.py)
      penalty = shaping.overlong_penalty(
          out.tokens, max_len, int(cfg.rl.overlong_buffer_len), float(cfg.rl.overlong_penalty_factor)
      )
      rewards = (rewards + penalty).astype(np.float32)
      reward_values["overlong_penalty"] = [float(x) for x in penalty]
    # rl.reward_aggregation: the weighted total (sum) or each reward standardised in its group first (gdpo)
    signal = reward_aggregation.signal_of(cfg.rl, rewards, reward_values, g)
    advantages = AlgorithmSettings.from_config(cfg).advantage(signal, g)

  behaviour = None
  if needs_behaviour_logps(cfg, plan):
    with timer.phase("logps"):
      behaviour = behaviour_logps(out, completion_ids.shape[1])
      if behaviour is None:  # an engine that returns no log-probs: recompute them on the sampler's weights
        behaviour = cluster.get_old_per_token_logps(
            prompt_tokens=prompt_ids,
            completion_tokens=put(completion_ids),
            micro_batch_size=_micro(cfg.train_micro_batch_size, g),
        )
  elif cfg.rl.parity_check != "off":  # the parity gate's sampler side (parity.py), free when the engine returns them
    behaviour = behaviour_logps(out, completion_ids.shape[1])
  return Sampled(
      list(inputs["prompts"]),
      list(out.text),
      prompt_ids,
      completion_ids,
      rewards,
      advantages,
      behaviour,
      reward_values,
      pad_id,
      eos_id,
      loss_rows=~truncated if cfg.rl.mask_truncated_completions else None,
      truncated=truncated,
      metrics=metrics,
      token_mask=token_mask,
      routing=routing,
      prompt_host=prompt_host,
  )


def needs_behaviour_logps(cfg: Any, plan: UpdatePlan) -> bool:
  """Whether a consumer of the batch needs the sampler's log-probs: the old policy of `rl.use_rollout_logps`, the
  rollout importance weights, or the agreement metrics."""
  use_sampler = plan.needs_old_logps and cfg.rl.use_rollout_logps
  return bool(use_sampler or cfg.rl.rollout_is != "off" or cfg.rl.log_sampler_trainer_agreement)


def score(run: Any, sampled: Sampled, plan: UpdatePlan, timer: Any, parity_step: int | None = None) -> Experience:
  """The trainer's half: reference and old-policy log-probs at the trainer's current weights, importance weights and
  agreement metrics; the `TrainExample` the update consumes. With `parity_step` (a step the parity gate checks, its
  batch sampled at the trainer's current weights) the gate's figures join the metrics, and a figure past its
  tolerance stops the run here, before the update (parity.py)."""
  cfg = run.config
  cluster = run.rl_cluster
  temperature = cluster.cluster_config.rollout_config[rl_cluster_lib.Mode.TRAIN].temperature
  pad_id, eos_id = sampled.pad_id, sampled.eos_id
  logps_micro = _micro(cfg.train_micro_batch_size, plan.num_generations)
  prompt_ids = sampled.prompt_ids
  completion_mask = (
      sampled.completion_ids != pad_id
  )  # the stop token is kept and trained (algorithms/__init__.py, EOS policy)
  if sampled.token_mask is not None:  # environment tokens: context, never loss (nor KL, IS weights, agreement)
    completion_mask = completion_mask & np.asarray(sampled.token_mask, bool)
  if sampled.loss_rows is not None:  # masked rows contribute no loss (they leave the aggregation's counts too)
    completion_mask = completion_mask & np.asarray(sampled.loss_rows, bool)[:, None]
  put = logps_lib.put_rows(cluster)
  completion = put(sampled.completion_ids)
  metrics: dict[str, float] = dict(sampled.metrics)
  with timer.phase("logps"):  # the trainer's forwards of this batch
    ref = None
    if float(cfg.rl.grpo_beta) != 0.0 and run.trainer_logps.row_tokens > 0:  # max_seq_token_per_tpu
      ref = run.trainer_logps.reference(prompt_ids, completion, pad_id, temperature, logps_micro)
    elif float(cfg.rl.grpo_beta) != 0.0:
      ref = cluster.get_ref_per_token_logps(
          prompt_tokens=prompt_ids,
          completion_tokens=completion,
          pad_id=pad_id,
          eos_id=eos_id,
          micro_batch_size=logps_micro,
      )
    rollout_is = cfg.rl.rollout_is != "off"
    agreement = bool(cfg.rl.log_sampler_trainer_agreement)
    use_sampler = plan.needs_old_logps and cfg.rl.use_rollout_logps
    behaviour = sampled.behaviour
    # rl.router_replay: the trainer's old-policy and policy forwards route every token as the sampler did (moe.py);
    # never a silent free-routing update.
    if cfg.rl.router_replay and sampled.routing is None and moe.MoeSettings.from_config(cfg).is_moe:
      raise RuntimeError(
          "rl.router_replay=true: the rollout engine returned no routing for this batch "
          f"({type(cluster.rollout).__name__} captured none)"
      )
    forced = put(sampled.routing) if cfg.rl.router_replay and sampled.routing is not None else None
    if parity_step is not None and behaviour is None:  # an engine that returned no log-probs: its weights' forward
      behaviour = cluster.get_old_per_token_logps(
          prompt_tokens=prompt_ids, completion_tokens=completion, micro_batch_size=logps_micro
      )
    trainer_lp = None
    if (plan.needs_old_logps and not use_sampler) or rollout_is or agreement or parity_step is not None:
      trainer_lp = run.trainer_logps(prompt_ids, completion, pad_id, eos_id, temperature, logps_micro, forced=forced)
      trainer_route = getattr(run.trainer_logps, "last_routing", None)
      if trainer_route is not None and sampled.routing is not None:  # expert load; the mismatch unless replayed
        mask = moe.routed_mask(distributed.to_host(prompt_ids) != pad_id, sampled.completion_ids != pad_id)
        metrics.update(
            moe.step_metrics(None if forced is not None else sampled.routing, trainer_route, mask, int(cfg.num_experts))
        )
    if parity_step is not None:
      figs = parity.figures(
          distributed.to_host(behaviour),
          distributed.to_host(trainer_lp),
          completion_mask,
          routing_mismatch=metrics.get("moe/routing_mismatch_fraction"),
      )
      metrics.update(figs)
      engine = getattr(run, "engine_name", "embedded")
      parity.check(parity_step, figs, parity.tolerance(cfg, engine), parity.pairing(cfg, engine))
    old = None
    if plan.needs_old_logps:
      old = behaviour if use_sampler else trainer_lp
    is_weights = None
    if rollout_is:
      w, is_metrics = divergence.rollout_is_weights(
          distributed.to_host(trainer_lp),
          distributed.to_host(behaviour),
          completion_mask,
          cfg.rl.rollout_is,
          float(cfg.rl.rollout_is_cap),
      )
      is_weights = put(np.asarray(w, np.float32))
      metrics.update({f"rollout_is/{k}": v for k, v in is_metrics.items()})
    if agreement:
      metrics.update(agreement_metrics(distributed.to_host(behaviour), distributed.to_host(trainer_lp), completion_mask))

  example_cls = grpo_learner.TrainExample if forced is None else moe.RoutedTrainExample
  extra = {} if forced is None else {"routed_experts": forced}
  example = example_cls(
      prompt_ids=prompt_ids,
      prompt_mask=prompt_ids != pad_id,
      completion_ids=completion,
      completion_mask=put(completion_mask),
      ref_per_token_logps=ref,
      advantages=put(np.asarray(sampled.advantages, np.float32)),
      old_per_token_logps=None if old is None else put(old),
      sampler_is_weights=is_weights,
      **extra,
  )
  return Experience(example=example, texts=sampled.texts, rewards=sampled.rewards, metrics=metrics)


def make_experience(run: Any, inputs: dict[str, list], plan: UpdatePlan, timer: Any) -> Experience:
  """Rollouts and everything the update needs for one RL step, sampled and scored at the same weights."""
  return score(run, sample(run, inputs, plan, timer), plan, timer)
