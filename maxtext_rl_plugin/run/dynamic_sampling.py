r"""DAPO's dynamic sampling (`rl.dynamic_sampling`): no update spent on prompt groups that teach nothing.

A group whose G completions all get the same reward has zero advantage under every estimator
(algorithms/advantages.py), so it costs a rollout and gives no policy gradient; late in training most groups are
all-correct or all-wrong. DAPO (Yu et al. 2025, Algorithm 1) drops them and samples more prompts until the batch is
full. Per RL step (B = batch_size):

    round 0:      the next B prompts of the data stream, sampled as a plain step would (same seed)
    round r >= 1: while fewer than B informative groups are kept and r <= rl.max_refill_rounds, the next B prompts
                  (a full batch: the rollout keeps its compiled shape), seeded by (rollout_seed, step, r)
    keep          the first B informative groups in data order (max_g R > min_g R); later informative groups of the
                  last round are surplus (sampled, not trained)
    bound hit     the step trains on the informative groups it has: the missing slots are filled with dropped groups
                  whose completion mask is zeroed (no loss, not counted by the loss aggregation), so the batch keeps
                  its shape for micro-batching and the device mesh; reported as `dynamic_sampling/short_groups`.
                  (Skipping the step instead would break the step <-> optimizer-update <-> learning-rate bookkeeping.)
                  Under gradient accumulation a micro-batch of masked rows only adds a zero gradient to the mean,
                  i.e. a smaller update, as any masked row does.
    advantages    recomputed on the assembled batch (batch_std scaling spans the batch as trained)

The filter is the total reward the advantage is computed from (the overlong penalty included: a group of equally
correct completions of different lengths has a nonzero advantage and is kept), i.e. verl's
`filter_groups.metric=seq_final_reward`; with `rl.reward_aggregation=gdpo`, a group is kept when some reward of nonzero
weight varies (algorithms/reward_aggregation.kept_groups says why).

Data position: the training prompts are one stream (data.DatasetSplit.position_index) read by a cursor that counts
every prompt a round consumed, trained or not. Without dynamic sampling batch k is positions [kB, (k+1)B) (data.py);
with it each batch starts where the previous one stopped, so the position is state: every sampled batch carries the
position after it (`Sampled.next_position`), the checkpoint of step s stores that of batch s - 1
(`next_prompt_position`), and a resume continues from it: no prompt repeated or skipped. Batches are produced in
order by one thread (async_rollout.RolloutProducer), so the cursor needs no lock. `<run>/batches.jsonl` lists the
prompts each step trained (masked fillers excluded); the `data/next_position` metric is the cursor after the step.
With `rl.off_policy_steps > 0` the refills run in the producer thread, ahead of the trainer; batches sampled ahead
and lost at a stop are re-consumed from the checkpoint's position on resume, as in run/async_rollout.py.

Engines and processes: the refill rounds are ordinary `experience.sample` calls, so any rollout engine works (the
embedded one tested; vLLM by the same contract). Across JAX processes every process holds the whole sampled batch
(experience.generate gathers the hosts' rows) and the cursor counts global prompts, so the data position is the
global batch's on every process. The selection is decided once: each round's kept-group flags are process 0's,
broadcast to all (`distributed.from_writer_rows`; a broadcast, not an all-gather, since nothing is compared), so a
reward that differs between hosts (a timeout, a remote judge) cannot make processes keep different groups or run a
different number of rounds (which would leave one process's rollout collectives unmatched: a hang). With rollouts
ahead (`rl.off_policy_steps` > 0) the broadcast, like the gather, is handed to the trainer's thread
(async_rollout.cross_process). A stop signal is not checked between rounds across processes (it reaches each process
at its own moment; the step finishes and the loop stops after it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib

from maxtext_rl_plugin.algorithms import reward_aggregation
from maxtext_rl_plugin.algorithms import shaping
from maxtext_rl_plugin.algorithms.settings import AlgorithmSettings
from maxtext_rl_plugin import distributed
from maxtext_rl_plugin.run import async_rollout
from maxtext_rl_plugin.run import experience
from maxtext_rl_plugin.run import logps
from maxtext_rl_plugin.run.state import PhaseTimer
from maxtext_rl_plugin import moe
from maxtext_rl_plugin import rewards as rewards_lib
from maxtext_rl_plugin import signals
from maxtext_rl_plugin.errors import CheckpointError


def informative_groups(rewards: Any, num_generations: int) -> np.ndarray:
  """[groups] bool: groups whose rewards are not all equal (a nonzero advantage for some completion)."""
  groups = np.asarray(rewards, np.float64).reshape(-1, num_generations)
  return groups.max(axis=1) > groups.min(axis=1)


def start_position(config: Any, start: int, meta: dict) -> int:
  """The data stream position of batch `start` (the first one a (re)started run trains)."""
  plain = int(start) * int(config.batch_size)
  saved = meta.get("next_prompt_position")
  if saved is None:
    return plain
  if not config.rl.dynamic_sampling and int(saved) != plain:
    raise CheckpointError(
        f"cannot resume with rl.dynamic_sampling=false: the checkpoint of step {start} was written with dynamic "
        f"sampling at data position {saved} (not {plain}); resume with rl.dynamic_sampling=true or use a new run_name"
    )
  return int(saved)


def next_position(sampled: experience.Sampled, step: int, batch_size: int) -> int:
  """The data position after the batch of step `step` (the checkpoint's `next_prompt_position`)."""
  return int(step) * int(batch_size) if sampled.next_position is None else int(sampled.next_position)


def inputs_of(examples: Sequence[Any], num_generations: int) -> dict[str, list]:
  """Tunix inputs of `examples`: each prompt, answer and question repeated G times (every step's layout)."""
  g = num_generations
  return {
      "prompts": [e.prompt for e in examples for _ in range(g)],
      "answer": [e.answer for e in examples for _ in range(g)],
      "question": [e.question for e in examples for _ in range(g)],
  }


def refill_seed(rollout_seed: int, step: int, round_: int) -> int:
  """Sampling seed of refill round `round_` >= 1 of step `step`: a function of (rollout_seed, step, round), so a
  resumed run samples what an uninterrupted one would have."""
  return int(np.random.SeedSequence([int(rollout_seed), int(step), int(round_)]).generate_state(1)[0]) % (2**31 - 1)


@dataclasses.dataclass
class _Round:
  examples: list
  inputs: dict[str, list]
  sampled: experience.Sampled
  informative: np.ndarray  # [groups] bool


def pick_groups(informative: Sequence[np.ndarray], batch_size: int):
  """The batch's groups from rounds' `informative` flags: `(picks, dropped, short)` with picks the `(round, group,
  trained)` in data order (the first `batch_size` informative groups, topped up with untrained dropped groups when
  there are fewer), dropped every zero-variance `(round, group)`, short the number of untrained slots."""
  picks = [(r, int(k), True) for r, inf in enumerate(informative) for k in np.flatnonzero(inf)][:batch_size]
  short = batch_size - len(picks)
  dropped = [(r, int(k)) for r, inf in enumerate(informative) for k in np.flatnonzero(~np.asarray(inf, bool))]
  picks += [(r, k, False) for r, k in dropped[:short]]
  return sorted(picks), dropped, short


def _rows(groups: Sequence[int], g: int) -> np.ndarray:
  return np.asarray([i for k in groups for i in range(k * g, (k + 1) * g)], np.int64)


def _left_pad(rows: np.ndarray, width: int, pad_id: int) -> np.ndarray:
  out = np.full((rows.shape[0], width), pad_id, rows.dtype)
  out[:, width - rows.shape[1] :] = rows
  return out


def assemble(rounds: Sequence[_Round], picks: Sequence[tuple[int, int, bool]], g: int, put: Callable, cfg: Any):
  """One batch of the picked groups `(round, group, trained)` in order: host rows selected and concatenated, the
  untrained ones masked out of the loss, advantages recomputed on the assembled rewards."""
  first = rounds[0].sampled
  by_round: list[tuple[_Round, np.ndarray]] = []
  for r, rnd in enumerate(rounds):
    groups = [k for rr, k, _ in picks if rr == r]
    if groups:
      by_round.append((rnd, _rows(groups, g)))
  prompts_host = [  # the host copy when the round kept one: no gather from the trainer mesh (the producer's thread)
      distributed.to_host(rnd.sampled.prompt_ids) if rnd.sampled.prompt_host is None else rnd.sampled.prompt_host
      for rnd, _ in by_round
  ]
  width = max(p.shape[1] for p in prompts_host)
  prompt_ids = np.concatenate([_left_pad(p[rows], width, first.pad_id) for p, (_, rows) in zip(prompts_host, by_round)])
  completion_ids = np.concatenate([rnd.sampled.completion_ids[rows] for rnd, rows in by_round])
  rewards = np.concatenate([rnd.sampled.rewards[rows] for rnd, rows in by_round]).astype(np.float32)
  loss_rows = np.concatenate(
      [
          np.ones(len(rows), bool) if rnd.sampled.loss_rows is None else rnd.sampled.loss_rows[rows]
          for rnd, rows in by_round
      ]
  )
  loss_rows &= np.repeat(np.asarray([trained for _, _, trained in picks], bool), g)
  behaviour = None
  if first.behaviour is not None:
    behaviour = put(np.concatenate([distributed.to_host(rnd.sampled.behaviour)[rows] for rnd, rows in by_round]))
  reward_values = {
      name: [v for rnd, rows in by_round for v in np.asarray(rnd.sampled.reward_values[name])[rows].tolist()]
      for name in first.reward_values
  }
  truncated = np.concatenate([rnd.sampled.truncated[rows] for rnd, rows in by_round])
  token_mask = None  # rl.use_agentic_rollout: every round has one (experience.Sampled.token_mask)
  if first.token_mask is not None:
    token_mask = np.concatenate([rnd.sampled.token_mask[rows] for rnd, rows in by_round])
  routing = None  # MoE routing of each round (experience.Sampled.routing), prompts left-padded to the joined width
  if first.routing is not None:
    t = completion_ids.shape[1]
    routing = np.concatenate([moe.widen_prompt(rnd.sampled.routing[rows], t, width) for rnd, rows in by_round])
  signal = reward_aggregation.signal_of(cfg.rl, rewards, reward_values, g)  # rl.reward_aggregation
  advantages = AlgorithmSettings.from_config(cfg).advantage(signal, g)
  sampled = experience.Sampled(
      [p for rnd, rows in by_round for p in np.asarray(rnd.sampled.prompts, object)[rows].tolist()],
      [t for rnd, rows in by_round for t in np.asarray(rnd.sampled.texts, object)[rows].tolist()],
      put(prompt_ids),
      completion_ids,
      rewards,
      advantages,
      behaviour,
      reward_values,
      first.pad_id,
      first.eos_id,
      loss_rows=None if loss_rows.all() else loss_rows,
      truncated=truncated,
      metrics={"completion/truncated_fraction": float(truncated.mean())},
      token_mask=token_mask,
      routing=routing,
  )
  examples = [rounds[r].examples[k] for r, k, trained in picks if trained]  # the audit (batches.jsonl): trained only
  inputs = {key: [v for r, k, _ in picks for v in rounds[r].inputs[key][k * g : (k + 1) * g]] for key in rounds[0].inputs}
  return examples, inputs, sampled


class DynamicSampler:
  """The rollout producer's `sample_fn` under `rl.dynamic_sampling` (async_rollout.RolloutProducer): batch `index`
  with its zero-variance groups replaced by informative ones from further rounds (module docstring)."""

  def __init__(self, rl_run: Any, position: int, seed_step: Callable[[Any, int], None]):
    self.run = rl_run
    self.position = int(position)
    self._seed_step = seed_step

  def _take(self, n: int) -> list:
    split = self.run.train_split
    out = [split[split.position_index(p)] for p in range(self.position, self.position + n)]
    self.position += n
    return out

  def _sample_round(self, step: int, round_: int, timer: PhaseTimer) -> _Round:
    """Round `round_` of step `step`: the next batch_size prompts of the stream, sampled and scored."""
    cfg = self.run.config
    g = int(cfg.rl.num_generations)
    if round_ == 0:
      self._seed_step(self.run, step)  # what a plain step samples with
    else:
      rc = self.run.rl_cluster.cluster_config.rollout_config[rl_cluster_lib.Mode.TRAIN]
      rc.seed = refill_seed(cfg.rollout_seed, step, round_)
    examples = self._take(int(cfg.batch_size))
    inputs = inputs_of(examples, g)
    sampled = experience.sample(self.run, inputs, self.run.plan, timer)
    kept = reward_aggregation.kept_groups_of(cfg.rl, sampled.rewards, sampled.reward_values, g)  # rl.reward_aggregation
    return _Round(examples, inputs, sampled, kept)

  def __call__(self, index: int, phases: dict[str, float]) -> tuple[list, dict, experience.Sampled]:
    cfg = self.run.config
    g, b = int(cfg.rl.num_generations), int(cfg.batch_size)
    step = index + 1
    timer = PhaseTimer(phases)
    rounds = [_agreed(self._sample_round(step, 0, timer))]
    while sum(int(r.informative.sum()) for r in rounds) < b and len(rounds) <= int(cfg.rl.max_refill_rounds):
      # Between rounds: the batch is abandoned, the last complete step checkpointed (one process: a signal reaches
      # each process of several at its own moment, and a round fewer on one would leave the others' collectives
      # unmatched).
      if signals.stop_requested() and not distributed.is_multiprocess():
        raise signals.StopSampling(f"a stop was requested during step {step}'s refill round {len(rounds)}")
      rounds.append(_agreed(self._sample_round(step, len(rounds), timer)))
    with timer.phase("reward"):
      picks, dropped, short = pick_groups([r.informative for r in rounds], b)
      examples, inputs, sampled = assemble(rounds, picks, g, logps.put_rows(self.run.rl_cluster), cfg)
      sampled.next_position = self.position
      sampled.metrics.update(self._metrics(rounds, dropped, short))
      for rnd in rounds:  # the round's own sampler-side metrics (truncated fraction of all sampled rows, ...)
        for k, v in rnd.sampled.metrics.items():
          if k != "completion/truncated_fraction":
            sampled.metrics.setdefault(k, v)
    return examples, inputs, sampled

  def _metrics(self, rounds: list[_Round], dropped: list[tuple[int, int]], short: int) -> dict[str, float]:
    """The step's dynamic_sampling/* metrics. A dropped group has one reward shared by its completions (what the
    filter reads): `dropped_mean_reward` is their mean. The `dropped_graded_*` counters are the GSM8K grader's verdict
    on the answers (rewards/), whatever the reward functions are: a group every custom reward scores 1.0 may be
    graded all wrong, and the names say which measure they count."""
    cfg = self.run.config
    g, b = int(cfg.rl.num_generations), int(cfg.batch_size)
    correct = {}
    for r in {r for r, _ in dropped}:
      rnd = rounds[r]
      graded = rewards_lib.score_batch(rnd.sampled.texts, rnd.inputs["answer"], rewards_lib.RewardConfig.of(cfg))
      correct[r] = np.asarray([x.correct for x in graded], bool).reshape(-1, g)
    all_correct = sum(bool(correct[r][k].all()) for r, k in dropped)
    all_wrong = sum(bool(~correct[r][k].any()) for r, k in dropped)
    dropped_rewards = [float(rounds[r].sampled.rewards[k * g]) for r, k in dropped]
    informative = sum(int(r.informative.sum()) for r in rounds)
    extra = rounds[1:]
    pad = rounds[0].sampled.pad_id
    return {
        "dynamic_sampling/dropped_groups": float(len(dropped)),
        "dynamic_sampling/dropped_mean_reward": float(np.mean(dropped_rewards)) if dropped else 0.0,
        "dynamic_sampling/dropped_graded_all_correct": float(all_correct),
        "dynamic_sampling/dropped_graded_all_wrong": float(all_wrong),
        "dynamic_sampling/dropped_graded_mixed": float(len(dropped) - all_correct - all_wrong),
        "dynamic_sampling/kept_groups": float(min(informative, b)),
        "dynamic_sampling/first_round_informative_fraction": float(rounds[0].informative.mean()),
        "dynamic_sampling/refill_rounds": float(len(extra)),
        "dynamic_sampling/extra_rollouts": float(len(extra) * b * g),
        "dynamic_sampling/extra_tokens": float(
            sum(shaping.completion_lengths(r.sampled.completion_ids, pad).sum() for r in extra)
        ),
        "dynamic_sampling/surplus_groups": float(max(0, informative - b)),
        "dynamic_sampling/short_groups": float(short),
        "data/next_position": float(self.position),
    }


def _agreed(rnd: _Round) -> _Round:
  """`rnd` with process 0's kept-group flags (the decision made once and shared; module docstring). Every process
  broadcasts once per round, so the rounds stay matched; on one process the flags are unchanged."""
  if distributed.is_multiprocess():
    flags = async_rollout.cross_process(distributed.from_writer_rows, np.asarray(rnd.informative, np.int32))
    rnd.informative = np.asarray(flags, bool)
  return rnd


def sample_fn(rl_run: Any, position: int, plain: Callable, seed_step: Callable[[Any, int], None]) -> Callable:
  """The producer's `sample_fn`: `plain` (run/step.sample_batch) or, under rl.dynamic_sampling, a `DynamicSampler`
  continuing from data position `position`."""
  if not rl_run.config.rl.dynamic_sampling:
    return plain
  return DynamicSampler(rl_run, position, seed_step)
