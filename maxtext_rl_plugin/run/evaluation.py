r"""Evaluation on the held-out split with MaxText's eval keys and definitions (`post_train/rl/evaluate_rl.py`).

Each eval problem is answered `k = num_eval_passes` times with the sampling of
`generation_configs[eval_sampling_strategy]` (MaxText's `greedy` strategy is exact greedy here: top_k = 1). With
c_j in {0, 1} the correctness of pass j of a problem, averaged over problems:

    pass@k   = max_j c_j                          (MaxText eval_mode=pass)
    maj@k    = correctness of the most frequent extracted answer (ties: first seen)   (eval_mode=maj)
    pass@1   = (1/k) sum_j c_j                    (eval_mode=pass_at_1, an unbiased pass@1 estimate)

`eval/accuracy` is the metric of the configured `eval_mode` (for k = 1 all three are the greedy accuracy), so numbers
are comparable with MaxText's `evaluate`. `eval/strict_accuracy` is the same metric with a sample counted correct
only when its answer is also in the required format (`format_ok`: inside the answer tags), so the reward's lenient
last-number fallback cannot hide a model that stopped using the format.

With `rl.use_agentic_rollout` every pass is a multi-turn episode with the tools (agentic/episode.py), and the eval
also reports its episode figures (`eval/agentic/tool_call_rate`, turns, tool errors, masked tokens).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Sequence

from absl import logging
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib

from maxtext_rl_plugin import rewards as rewards_lib
from maxtext_rl_plugin.agentic import episode as episode_lib

EVAL_MODES = ("pass", "maj", "pass_at_1")


def sampling_for(config: Any) -> dict[str, Any]:
  """(temperature, top_k, top_p) of `generation_configs[eval_sampling_strategy]`; greedy is exact (top_k = 1)."""
  strategy = config.eval_sampling_strategy
  gen = dict(config.generation_configs or {})
  if strategy == "greedy":
    return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
  if strategy not in gen:
    raise KeyError(strategy)
  s = gen[strategy]
  top_k = s.get("eval_top_k")
  return {
      "temperature": float(s.get("eval_temperature", 1.0)),
      "top_k": int(top_k) if top_k and top_k > 0 else None,
      "top_p": float(s.get("eval_top_p", 1.0)),
  }


def _majority_correct(results: Sequence[Any]) -> tuple[bool, bool]:
  """(correct, strictly correct) of the most frequent extracted answer among `results` (None answers never win)."""
  answers = [r.extracted for r in results if r.extracted is not None]
  if not answers:
    return False, False
  top = collections.Counter(answers).most_common(1)[0][0]
  voters = [r for r in results if r.extracted == top]
  return any(r.correct for r in voters), any(r.correct and r.format_ok for r in voters)


def problem_scores(results: Sequence[Any]) -> dict[str, float]:
  """Per-problem pass@k / maj@k / pass@1 and their strict variants, from the k passes' `ScoreResult`s."""
  c = np.asarray([bool(r.correct) for r in results], dtype=np.float64)
  s = np.asarray([bool(r.correct) and bool(r.format_ok) for r in results], dtype=np.float64)
  maj, maj_strict = _majority_correct(results)
  return {
      "pass": float(c.max()),
      "pass_strict": float(s.max()),
      "maj": float(maj),
      "maj_strict": float(maj_strict),
      "pass_at_1": float(c.mean()),
      "pass_at_1_strict": float(s.mean()),
      "format": float(np.mean([bool(r.format_ok) for r in results])),
      "partial": float(np.mean([bool(getattr(r, "partial", r.correct)) for r in results])),
      "reward": float(np.mean([r.reward for r in results])),
  }


def aggregate(per_problem: Sequence[dict[str, float]], k: int, eval_mode: str) -> dict[str, float]:
  """Eval metrics over problems (see the module docstring)."""
  mean = {key: float(np.mean([p[key] for p in per_problem])) for key in per_problem[0]}
  out = {
      "accuracy": mean[eval_mode],
      "strict_accuracy": mean[f"{eval_mode}_strict"],
      "format_accuracy": mean["format"],
      "partial_accuracy": mean["partial"],
      "reward_mean": mean["reward"],
  }
  if k > 1:
    out[f"pass@{k}"] = mean["pass"]
    out[f"maj@{k}"] = mean["maj"]
    out["pass@1"] = mean["pass_at_1"]
  return out


def evaluate(run: Any, step: int) -> dict[str, float]:
  """Answer the eval split `num_eval_passes` times; metrics as in the module docstring."""
  config = run.config
  k = max(1, int(config.num_eval_passes))
  bs = config.eval_batch_size if config.eval_batch_size > 0 else config.batch_size
  n = min(len(run.eval_split), bs * max(1, config.num_test_batches))
  examples = [run.eval_split[i] for i in range(n)]
  eval_rc = run.rl_cluster.cluster_config.rollout_config[rl_cluster_lib.Mode.EVAL]
  t = time.perf_counter()
  passes: list[list[Any]] = [[] for _ in range(n)]
  episodes = []
  for p in range(k):
    # A sampled eval is reproducible: pass p of the eval at `step` uses a seed derived from (rollout_seed, step, p).
    eval_rc.seed = (int(config.rollout_seed) * 1_000_003 + 7919 * step + p + 1) % (2**31 - 1)
    for s in range(0, n, bs):
      chunk = examples[s : s + bs]
      if config.rl.use_agentic_rollout:
        out, eps = episode_lib.generate(run, [e.prompt for e in chunk], rl_cluster_lib.Mode.EVAL)
        episodes.extend(eps)
      else:
        out = run.rl_cluster.generate(prompts=[e.prompt for e in chunk], mode=rl_cluster_lib.Mode.EVAL)
      for i, r in enumerate(
          rewards_lib.score_batch(out.text, [e.answer for e in chunk], rewards_lib.RewardConfig.of(config))
      ):
        passes[s + i].append(r)
  metrics = aggregate([problem_scores(p) for p in passes], k, config.eval_mode)
  metrics["num_examples"] = float(n)
  if episodes:
    metrics.update(episode_lib.metrics(episodes))
  metrics["seconds"] = time.perf_counter() - t
  logging.info("eval at step %d on %d examples x %d passes: %s", step, n, k, metrics)
  return metrics


def should_evaluate(config: Any, step: int, last_step: int) -> bool:
  """MaxText's `eval_interval`: every N RL steps (<= 0: never during training); the final eval is separate."""
  n = int(config.eval_interval)
  return n > 0 and config.num_test_batches > 0 and step % n == 0 and step != last_step
