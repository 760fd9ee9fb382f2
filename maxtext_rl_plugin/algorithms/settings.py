"""The algorithm's settings, built from the config in one place: what the loss, the advantages and the length shaping
read, and nothing else of the config (as run/updates.UpdatePlan.from_config does for the batch sizes).

`AlgorithmSettings.from_config` is the only function of algorithms/ that sees the whole config; it resolves the
choices that depend on each other (the estimator's own scaling and aggregation, `rl.epsilon_high: null`) and refuses a
combination that makes no sense in one line. validation.validate builds it once when the config loads (so a bad
combination is refused there), run/build.py and aot/programs.py for the learner's algo config
(tunix_wiring.tunix_algo_config), run/experience.py for the advantages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxtext_rl_plugin.algorithms import advantages
from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Shaping:
  """DAPO's soft overlong penalty (shaping.overlong_penalty): `rl.overlong_buffer_len` (0 = off) and its factor, with
  the completion budget T = max_target_length - max_prefill_predict_length it counts from."""

  buffer_len: int = 0
  penalty_factor: float = 1.0
  completion_budget: int = 0


@dataclasses.dataclass(frozen=True)
class AlgorithmSettings:
  """The `rl:` keys of the algorithm, resolved (module docstring)."""

  loss_algo: str = "grpo"
  loss: loss_lib.LossSettings = loss_lib.LossSettings()
  beta: float = 0.0
  kl_estimator: str = "k3"
  advantage: advantages.AdvantageSettings = advantages.AdvantageSettings()
  num_generations: int = 2
  num_iterations: int = 1
  shaping: Shaping = Shaping()

  @classmethod
  def from_config(cls, config: Any) -> "AlgorithmSettings":
    """The settings of `config` (the typed config); a name no package registered (loss, estimator) or a combination
    the loss cannot use is a one-line `ConfigError` naming the key."""
    rl = config.rl
    loss_lib.get(rl.loss_algo)  # registered, and a PolicyLoss
    if rl.loss_agg_mode not in loss_lib.LOSS_AGG_MODES:
      raise ConfigError(f"rl.loss_agg_mode={rl.loss_agg_mode!r}: expected one of {', '.join(loss_lib.LOSS_AGG_MODES)}")
    epsilon = float(rl.grpo_epsilon)
    budget = int(config.max_target_length) - int(config.max_prefill_predict_length)
    shaping = Shaping(int(rl.overlong_buffer_len), float(rl.overlong_penalty_factor), budget)
    if shaping.buffer_len > budget:
      raise ConfigError(
          f"invalid value for 'rl.overlong_buffer_len'={rl.overlong_buffer_len}: must be at most the completion "
          f"budget max_target_length - max_prefill_predict_length = {budget} tokens"
      )
    return cls(
        loss_algo=rl.loss_algo,
        loss=loss_lib.LossSettings(epsilon, epsilon if rl.epsilon_high is None else float(rl.epsilon_high)),
        beta=float(rl.grpo_beta),
        kl_estimator=rl.kl_estimator,
        advantage=advantages.AdvantageSettings.resolve(rl.advantage_estimator, rl.advantage_norm, rl.loss_agg_mode),
        num_generations=int(rl.num_generations),
        num_iterations=int(rl.num_iterations),
        shaping=shaping,
    )
