"""The plugin's math inside Tunix 0.1.7's learner: its algo config, registry entries and loss entry point.

`GRPOLearner` looks the policy loss and the advantage estimator up by name in Tunix's public function registry;
`register_with_tunix` puts the plugin's there (loss.py, advantages.py) and `tunix_algo_config` maps the `rl:` keys onto
`PluginGrpoConfig`, the `GRPOConfig` subclass that names them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from tunix.rl import common as tunix_common
from tunix.rl import function_registry
from tunix.rl.grpo import grpo_learner

from maxtext_rl_plugin.algorithms import advantages
from maxtext_rl_plugin.algorithms import loss as loss_lib
from maxtext_rl_plugin.algorithms.common import check_choice
from maxtext_rl_plugin.algorithms.divergence import KL_ESTIMATORS
from maxtext_rl_plugin.algorithms import packing
from maxtext_rl_plugin import moe
from maxtext_rl_plugin.errors import ConfigError

# Names under which the plugin registers itself in Tunix's function registry.
POLICY_LOSS_FN_NAME = "maxtext_rl_plugin"
ADVANTAGE_ESTIMATOR_NAMES = {
    (est, norm): f"maxtext_rl_plugin/{est}/{norm}" for est, norms in advantages.ESTIMATOR_NORMS.items() for norm in norms
}
# Tunix's `kl_loss_mode` spelling of each estimator (kept consistent on the config for anything reading it).
_TUNIX_KL_MODE = {"k1": "kl", "k3": "low_var_kl"}


@dataclasses.dataclass(kw_only=True)
class PluginGrpoConfig(grpo_learner.GRPOConfig):
  """Tunix `GRPOConfig` whose learner computes the loss with `loss.policy_loss` and `advantages.group_advantages`.

  `GRPOLearner.__init__` looks the loss up by `policy_loss_fn` in Tunix's function registry and the advantage by
  `advantage_estimator`; the defaults below name the functions `register_with_tunix` registers (done on
  construction, so a config can never name an unregistered function).
  """

  policy_loss_fn: str = POLICY_LOSS_FN_NAME
  advantage_estimator: str = ADVANTAGE_ESTIMATOR_NAMES[("grpo", "group_std")]
  epsilon_high: float | None = None
  kl_estimator: str = "k3"
  kl_loss_mode: str = "low_var_kl"
  loss_agg_mode: str = "sequence-mean-token-mean"
  # Token entropy of the policy (a metric only, no gradient); costs one [B, T, vocab] softmax per step.
  compute_entropy: bool = True

  def __post_init__(self):
    super().__post_init__()
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
  """Tunix policy-loss entry point (registered as `POLICY_LOSS_FN_NAME`): model forward, then `loss.policy_loss`.

  Same contract as Tunix's `grpo_loss_fn`: the learner calls it inside the trainer's jitted, differentiated step
  with the actor model, a `TrainExample` and its algo config.
  """
  compute_entropy = getattr(algo_config, "compute_entropy", True)
  graphdef, state = nnx.split(model)
  # MoE (moe.py): replay the sampler's routing (rl.router_replay) and add MaxText's load-balancing term.
  maxtext_config = getattr(getattr(model, "base", None), "config", None)
  forced = getattr(train_example, "routed_experts", None)
  lb_weight = float(getattr(maxtext_config, "load_balance_loss_weight", 0.0) or 0.0)
  lb_loss = None
  entropy = None
  if getattr(train_example, "packed_tokens", None) is not None:  # max_seq_token_per_tpu (packing.py)
    per_token_logps, entropy, lb_loss = packing.packed_forward(
        model,
        train_example.packed_tokens,
        train_example.packed_positions,
        train_example.packed_segments,
        train_example.src_row,
        train_example.src_col,
        train_example.src_valid,
        temperature=getattr(algo_config, "temperature", 1.0),
        with_entropy=compute_entropy,
        forced=getattr(train_example, "packed_routing", None),
        lb_config=maxtext_config if lb_weight > 0 and moe.is_moe(maxtext_config) else None,
    )
    logits = None
  elif forced is not None or (lb_weight > 0 and moe.is_moe(maxtext_config)):
    per_token_logps, logits, _, lb_loss = moe.forward_logps(
        graphdef,
        state,
        train_example.prompt_ids,
        train_example.completion_ids,
        pad_id,
        eos_id,
        temperature=getattr(algo_config, "temperature", 1.0),
        forced=forced,
        config=maxtext_config,
    )
  else:
    per_token_logps, logits = tunix_common.compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens=train_example.prompt_ids,
        completion_tokens=train_example.completion_ids,
        pad_id=pad_id,
        eos_id=eos_id,
        stop_gradient=False,
        return_logits=True,
        segment_ids=getattr(train_example, "segment_ids", None),
        segment_positions=getattr(train_example, "segment_positions", None),
        temperature=getattr(algo_config, "temperature", 1.0),
    )
  beta = float(algo_config.beta)
  loss, aux = loss_lib.policy_loss(
      per_token_logps,
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
  if lb_loss is not None:  # MaxText's meaning: added to the objective as its pre-training loss adds it
    loss = loss + lb_loss
    aux["moe_lb_loss"] = lb_loss
  if compute_entropy:
    if entropy is None:
      entropy = loss_lib.token_entropy(logits)
    aux["entropy"] = loss_lib.token_mean(entropy, train_example.completion_mask.astype(jnp.float32))
  return loss, aux


def _advantage_estimator(estimator: str, norm: str) -> Callable[..., Any]:
  def fn(rewards: Any, num_generations: int, **unused_kwargs: Any) -> Any:
    return advantages.group_advantages(rewards, num_generations, norm, estimator)

  fn.__name__ = f"group_advantages_{estimator}_{norm}"
  return fn


_ADVANTAGE_ESTIMATORS = {key: _advantage_estimator(*key) for key in ADVANTAGE_ESTIMATOR_NAMES}


def register_with_tunix() -> None:
  """Register the policy loss and advantage estimators in Tunix's default function registry (idempotent)."""
  registry = function_registry.default_registry
  wanted = [("policy_loss_fn", POLICY_LOSS_FN_NAME, tunix_policy_loss_fn)]
  wanted += [("advantage_estimator", ADVANTAGE_ESTIMATOR_NAMES[n], fn) for n, fn in _ADVANTAGE_ESTIMATORS.items()]
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
  `kl` and `pg_clipfrac` by default); each is averaged over the steps of a logging window, but the ratio's min and
  max, which are reduced as such."""
  keys = [
      "kl",
      "pg_clipfrac",
      "pg_loss",
      "kl_loss",
      "ppo_kl",
      "ratio_mean",
      "ratio_min",
      "ratio_max",
      "clip_fraction_low",
      "clip_fraction_high",
  ]
  if algo_config.loss_algo == "gspo-token":
    keys += ["seq_ratio_mean", "seq_clip_fraction"]
  if getattr(algo_config, "compute_entropy", True):
    keys.append("entropy")
  # A window's extremes are the extremes of its steps (the mean of a step's +inf "no token" min and another's 0.9
  # would be +inf).
  return {k: np.min if k == "ratio_min" else np.max if k == "ratio_max" else np.mean for k in keys}


def tunix_algo_config(config: Any, **overrides: Any) -> PluginGrpoConfig:
  """Map the plugin's MaxText config (`config.rl.*`) to the Tunix algo config the learner is built with.

  The clip ranges and beta were refused by `validation.validate` (its RANGES table) when the config was loaded;
  raises `ConfigError` naming the key for a loss aggregation the loss cannot use.
  """
  rl = config.rl
  epsilon = float(rl.grpo_epsilon)
  epsilon_high = None if rl.epsilon_high is None else float(rl.epsilon_high)
  if rl.loss_agg_mode not in loss_lib.LOSS_AGG_MODES:
    raise ConfigError(f"rl.loss_agg_mode={rl.loss_agg_mode!r}: expected one of {', '.join(loss_lib.LOSS_AGG_MODES)}")
  estimator, norm, loss_agg_mode = advantages.advantage_config(rl)
  if rl.loss_algo == "gspo-token" and int(rl.num_iterations) == 1:
    logging.warning(
        "loss_algo=gspo-token with num_iterations=1: on-policy ratios are 1, so the gradient is exactly "
        "GRPO's under the same loss_agg_mode (GSPO differs only through its sequence-level clipping)"
    )
  kwargs = {
      "num_generations": int(rl.num_generations),
      "num_iterations": int(rl.num_iterations),
      "beta": float(rl.grpo_beta),
      "epsilon": epsilon,
      "epsilon_high": epsilon_high,
      "loss_algo": rl.loss_algo,
      "loss_agg_mode": loss_agg_mode,
      "kl_estimator": rl.kl_estimator,
      "advantage_estimator": ADVANTAGE_ESTIMATOR_NAMES[(estimator, norm)],
  }
  kwargs.update(overrides)
  return PluginGrpoConfig(**kwargs)
