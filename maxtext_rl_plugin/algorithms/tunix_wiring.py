"""The plugin's math inside Tunix 0.1.7's learner: its algo config, registry entries and loss entry point.

`GRPOLearner` looks the policy loss and the advantage estimator up by name in Tunix's public function registry;
`register_with_tunix` puts the plugin's there: one policy-loss entry point (`tunix_policy_loss_fn`: the forward of
forward.py, then the objective of loss.py around the `rl.loss_algo` loss the plugin's registry names) and one
advantage entry per registered estimator and scaling. `tunix_algo_config` maps the resolved settings
(settings.AlgorithmSettings) onto `PluginGrpoConfig`, the `GRPOConfig` subclass that names them. Nothing here knows
a loss or an estimator by name: a third party's, registered through entry points, goes the same way (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import dataclasses
from typing import Any, Callable

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import function_registry
from tunix.rl.grpo import grpo_learner

from maxtext_rl_plugin.algorithms import advantages
from maxtext_rl_plugin.algorithms import forward
from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin.algorithms.common import check_choice
from maxtext_rl_plugin.algorithms.divergence import KL_ESTIMATORS
from maxtext_rl_plugin.algorithms.settings import AlgorithmSettings

# Names under which the plugin registers itself in Tunix's function registry.
POLICY_LOSS_FN_NAME = "maxtext_rl_plugin"
# Tunix's `kl_loss_mode` spelling of each estimator (kept consistent on the config for anything reading it).
_TUNIX_KL_MODE = {"k1": "kl", "k3": "low_var_kl"}
# The loss names Tunix's `GRPOConfig.__post_init__` accepts for `loss_algo` (its own loss's two branches).
_TUNIX_LOSS_ALGOS = ("grpo", "gspo-token")


class _AdvantageNames(Mapping):
  """(estimator, scaling) -> the name its entry has in Tunix's registry, for every registered estimator (looked up
  when read, so a third party's installed after import is there too)."""

  def __getitem__(self, key: tuple[str, str]) -> str:
    estimator, norm = key
    if norm not in advantages.get(estimator).norms:
      raise KeyError(key)
    return f"maxtext_rl_plugin/{estimator}/{norm}"

  def __iter__(self) -> Iterator[tuple[str, str]]:
    return iter([(name, norm) for name in advantages.names() for norm in advantages.get(name).norms])

  def __len__(self) -> int:
    return len(list(iter(self)))


ADVANTAGE_ESTIMATOR_NAMES = _AdvantageNames()


@dataclasses.dataclass(kw_only=True)
class PluginGrpoConfig(grpo_learner.GRPOConfig):
  """Tunix `GRPOConfig` whose learner computes the loss with `loss.policy_loss` and `advantages.group_advantages`.

  `GRPOLearner.__init__` looks the loss up by `policy_loss_fn` in Tunix's function registry and the advantage by
  `advantage_estimator`; the defaults below name the functions `register_with_tunix` registers (done on
  construction, so a config can never name an unregistered function). `loss_algo` names any registered policy loss
  (Tunix's own check admits its two; its own loss, the only reader, is not the one the learner runs here).
  """

  policy_loss_fn: str = POLICY_LOSS_FN_NAME
  advantage_estimator: str = "maxtext_rl_plugin/grpo/group_std"
  epsilon_high: float | None = None
  kl_estimator: str = "k3"
  kl_loss_mode: str = "low_var_kl"
  loss_agg_mode: str = "sequence-mean-token-mean"
  # Token entropy of the policy (a metric only, no gradient); costs one [B, T, vocab] softmax per step.
  compute_entropy: bool = True

  def __post_init__(self):
    name = self.loss_algo
    if name not in _TUNIX_LOSS_ALGOS:
      self.loss_algo = "grpo"  # past Tunix's check of its own two names; restored below
    super().__post_init__()
    self.loss_algo = name
    loss_lib.get(name)  # a registered PolicyLoss, else one line listing those that are
    check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    check_choice("loss_agg_mode", self.loss_agg_mode, loss_lib.AGG_MODES)
    if self.epsilon_high is None:
      self.epsilon_high = self.epsilon
    if not 0.0 <= self.epsilon <= 1.0 or self.epsilon_high < 0.0:
      raise ValueError(f"need 0 <= epsilon <= 1 and epsilon_high >= 0; got {self.epsilon}, {self.epsilon_high}")
    if self.beta < 0.0:
      raise ValueError(f"beta must be >= 0; got {self.beta}")
    self.kl_loss_mode = _TUNIX_KL_MODE[self.kl_estimator]
    register_with_tunix()


def tunix_policy_loss_fn(
    model: nnx.Module,
    train_example: Any,
    algo_config: PluginGrpoConfig,
    pad_id: int,
    eos_id: int,
    **unused_kwargs: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Tunix policy-loss entry point (registered as `POLICY_LOSS_FN_NAME`): the forward (forward.py), then the
  objective of the registered loss `algo_config.loss_algo` (loss.policy_loss).

  Same contract as Tunix's `grpo_loss_fn`: the learner calls it inside the trainer's jitted, differentiated step
  with the actor model, a `TrainExample` and its algo config.
  """
  compute_entropy = getattr(algo_config, "compute_entropy", True)
  fwd = forward.policy_forward(
      model, train_example, pad_id, eos_id, getattr(algo_config, "temperature", 1.0), compute_entropy
  )
  beta = float(algo_config.beta)
  loss, aux = loss_lib.policy_loss(
      fwd.per_token_logps,
      train_example.old_per_token_logps,
      train_example.ref_per_token_logps if beta != 0.0 else None,
      train_example.advantages,
      train_example.completion_mask,
      loss_algo=algo_config.loss_algo,
      epsilon=float(algo_config.epsilon),
      epsilon_high=None if algo_config.epsilon_high is None else float(algo_config.epsilon_high),
      beta=beta,
      kl_estimator=getattr(algo_config, "kl_estimator", "k3"),
      loss_agg_mode=algo_config.loss_agg_mode,
      is_weights=getattr(train_example, "sampler_is_weights", None),
  )
  if fwd.lb_loss is not None:  # MaxText's meaning: added to the objective as its pre-training loss adds it
    loss = loss + fwd.lb_loss
    aux["moe_lb_loss"] = fwd.lb_loss
  if compute_entropy:
    aux["entropy"] = loss_lib.token_mean(fwd.entropy, train_example.completion_mask.astype(jnp.float32))
  return loss, aux


def _advantage_estimator(estimator: str, norm: str) -> Callable[..., Any]:
  def fn(rewards: Any, num_generations: int, **unused_kwargs: Any) -> Any:
    return advantages.group_advantages(rewards, num_generations, norm, estimator)

  fn.__name__ = f"group_advantages_{estimator}_{norm}"
  return fn


_ADVANTAGE_FNS: dict[tuple[str, str], Callable[..., Any]] = {}


def register_with_tunix() -> None:
  """Register the policy loss and every registered estimator's advantages in Tunix's default function registry
  (idempotent)."""
  registry = function_registry.default_registry
  wanted = [("policy_loss_fn", POLICY_LOSS_FN_NAME, tunix_policy_loss_fn)]
  for key, name in ADVANTAGE_ESTIMATOR_NAMES.items():
    fn = _ADVANTAGE_FNS.setdefault(key, _advantage_estimator(*key))
    wanted.append(("advantage_estimator", name, fn))
  for category, name, fn in wanted:
    try:
      if registry.get(category, name) is fn:
        continue
    except LookupError:
      pass
    registry.register(category, name)(fn)
    logging.info("Registered %s '%s' with Tunix", category, name)


def rl_metrics_to_log(algo_config: PluginGrpoConfig) -> dict[str, Callable[[Any], Any]]:
  """Aux keys of `tunix_policy_loss_fn` to hand to `actor_trainer.with_rl_metrics_to_log` (the learner logs only
  `kl` and `pg_clipfrac` by default): the objective's and those the loss declares (loss.logged_metrics), and the
  entropy. Each is averaged over the steps of a logging window, but a `*_min` / `*_max` (the ratio's extremes), which
  is reduced as such: the mean of a step's +inf "no token" min and another's 0.9 would be +inf."""
  keys = list(loss_lib.logged_metrics(loss_lib.get(algo_config.loss_algo)))
  if getattr(algo_config, "compute_entropy", True):
    keys.append("entropy")
  return {k: np.min if k.endswith("_min") else np.max if k.endswith("_max") else np.mean for k in keys}


def tunix_algo_config(settings: AlgorithmSettings, **overrides: Any) -> PluginGrpoConfig:
  """The Tunix algo config the learner is built with, from the run's resolved settings (settings.AlgorithmSettings:
  the clip ranges and beta were refused by `validation.validate` when the config loaded)."""
  note = loss_lib.get(settings.loss_algo).on_policy_note
  if note and settings.num_iterations == 1:
    logging.warning(note)
  adv = settings.advantage
  kwargs = {
      "num_generations": settings.num_generations,
      "num_iterations": settings.num_iterations,
      "beta": settings.beta,
      "epsilon": settings.loss.epsilon,
      "epsilon_high": settings.loss.epsilon_high,
      "loss_algo": settings.loss_algo,
      "loss_agg_mode": adv.loss_agg_mode,
      "kl_estimator": settings.kl_estimator,
      "advantage_estimator": ADVANTAGE_ESTIMATOR_NAMES[(adv.estimator, adv.norm)],
  }
  kwargs.update(overrides)
  return PluginGrpoConfig(**kwargs)
