"""The plugin's keys of the `rl:` block, one pydantic class per concern, each field with its rules (as config/fields.py).

config/schema.PluginRL adds `PluginRLKeys` to MaxText's `types.RL`. Pydantic only, no JAX or MaxText (the first pass
reads the rules before the schema's imports).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel
from pydantic import Field
from pydantic import field_validator

from maxtext_rl_plugin.config.key_rule import EXEMPT
from maxtext_rl_plugin.config.key_rule import INVARIANT
from maxtext_rl_plugin.config.key_rule import NOTED
from maxtext_rl_plugin.config.key_rule import rule

# Statuses several keys share (config/key_status.py keeps MaxText's keys' statuses).
ALGO = "honoured (algorithms: the GRPO/GSPO loss)"
_OVERLONG = "honoured (experience: DAPO's soft overlong penalty added to the reward, in tokens)"
_DYNAMIC = "honoured (dynamic_sampling: zero-variance groups dropped, batch refilled)"
_REWARD_MIX = (
    "honoured (algorithms/reward_aggregation.py: the rewards' weights and their combination; reward_model.py: the "
    "reward model)"
)
_AGENTIC = "honoured (agentic/: the episodes of rl.use_agentic_rollout)"
_ROLLOUT_IS = "honoured (algorithms: rollout importance sampling)"
_ROUTER_REPLAY = (
    "honoured (moe.py: the embedded rollout's routing replayed in the trainer's old-policy and policy forwards, forced "
    "by MaxText or at the MoE modules by the plugin; refused for engines that do not report routing)"
)
_SYNC_CHECK = "honoured (resharding: post-sync check)"
_PARITY = "honoured (run/parity.py: sampler vs trainer log-probs of the sampled tokens, stop before the update)"
_PARITY_RESUME = EXEMPT + "a check of sampler-trainer agreement, not the update"


def _yaml_off(value):
  """A bare `off` is False to YAML 1.1 (OmegaConf's CLI parser): back to the choice it names, for the off/first/every_n
  keys."""
  return "off" if value is False else value


class PluginGroup(BaseModel):
  """`rl:` GRPO groups and the loss's estimators (algorithms/); checks: validation._check_algorithm, _check_batches."""

  num_generations: int = Field(
      2,
      ge=2,
      description="Responses sampled per prompt (G in the GRPO paper); >= 2 so a group has a variance.",
      json_schema_extra=rule(ALGO, INVARIANT),
  )
  mini_batch_size: Optional[int] = Field(
      None,
      ge=1,
      description=(
          "Prompts per optimizer update; None = batch_size (one update per rollout batch per iteration), as Tunix's "
          "mini_batch_size / verl's ppo_mini_batch_size."
      ),
      json_schema_extra=rule("honoured (trainer)", INVARIANT),
  )
  kl_estimator: Literal["k1", "k3"] = Field(
      "k3",
      description=(
          "KL(pi || pi_ref) estimator in the loss: 'k3' = exp(r) - r - 1 with r = logp_ref - logp (the GRPO paper's, "
          "unbiased and >= 0); 'k1' = logp - logp_ref (Tunix 0.1.7's default 'kl')."
      ),
      json_schema_extra=rule(ALGO, NOTED),
  )
  advantage_norm: Optional[Literal["group_std", "batch_std", "none"]] = Field(
      None,
      description=(
          "Scaling of the baseline-subtracted reward c: c / (std_g(r) + 1e-6) with ddof=1 ('group_std', GRPO), "
          "c / (std of c over the batch + 1e-6) ('batch_std'), or c ('none'); null = the estimator's own (grpo: "
          "group_std; rloo, drgrpo: none, which refuse group_std)."
      ),
      json_schema_extra=rule(ALGO, NOTED),
  )


class PluginDapo(BaseModel):
  """`rl:` DAPO and kin: baselines, truncation and overlong shaping, dynamic sampling (algorithms/, run/experience.py,
  run/dynamic_sampling.py); checks: validation._check_algorithm, dependent_keys (rl.max_refill_rounds)."""

  advantage_estimator: str = Field(
      "grpo",
      description=(
          "Baseline of the advantage, by its registered name: 'grpo' r - mean_g; 'rloo' r - mean of the group's other "
          "G-1 rewards; 'drgrpo' (Dr. GRPO) r - mean_g, unscaled, with the loss normalised by the constant completion "
          "budget instead of each completion's length (needs rl.loss_agg_mode=sequence-mean-token-mean, which it "
          "replaces); or an estimator another package registers in the maxtext_rl_plugin.advantage_estimators "
          "entry-point group (docs/extending.md)."
      ),
      json_schema_extra=rule("honoured (algorithms: advantage baseline; drgrpo also the loss aggregation)", NOTED),
  )
  mask_truncated_completions: bool = Field(
      False,
      description=(
          "A completion cut by the length limit (all max_target_length - max_prefill_predict_length tokens used, "
          "no stop token) contributes no loss: its completion mask is zeroed (DAPO's overlong filtering)."
      ),
      json_schema_extra=rule("honoured (experience: completion mask of truncated completions zeroed)", NOTED),
  )
  overlong_buffer_len: int = Field(
      0,
      ge=0,
      description=(
          "L_c of DAPO's soft overlong penalty, in tokens (0 = off): a completion of n tokens gets "
          "min(0, ((T - L_c) - n) / L_c) * rl.overlong_penalty_factor added to its reward, T the completion budget."
      ),
      json_schema_extra=rule(_OVERLONG, NOTED),
  )
  overlong_penalty_factor: float = Field(
      1.0,
      ge=0.0,
      description="The penalty of a completion that uses the whole budget (DAPO's overlong factor).",
      json_schema_extra=rule(_OVERLONG, NOTED, needs="rl.overlong_buffer_len > 0"),
  )
  dynamic_sampling: bool = Field(
      False,
      description=(
          "DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage) are dropped and further "
          "batch_size-prompt rounds are sampled until the batch holds batch_size informative groups. Refused with "
          "more than one JAX process."
      ),
      json_schema_extra=rule(_DYNAMIC, NOTED),
  )
  max_refill_rounds: int = Field(
      3,
      ge=0,
      le=100,
      description=(
          "Extra rounds rl.dynamic_sampling samples at most per step, 0 to 100; when they are spent (or a stop is "
          "requested) the step trains on the informative groups it has (the missing groups are masked out: no loss), "
          "reported as dynamic_sampling/short_groups and on the console."
      ),
      json_schema_extra=rule(
          _DYNAMIC,
          NOTED,
          needs="rl.dynamic_sampling=true",
          why="each round samples a whole batch; when they are spent the step trains on the informative groups it found",
      ),
  )


class PluginRewardMix(BaseModel):
  """`rl:` several rewards combined into one advantage (algorithms/reward_aggregation.py, docs/rewards.md "Several
  rewards"); checks: reward_aggregation.configured_weights (rewards/loader.check, both passes: one weight per
  reward_functions entry)."""

  reward_weights: list[float] = Field(
      [],
      description=(
          "One weight per reward_functions entry (the default stack's three included), in its order; [] = 1 each. "
          "sum: the reward is sum_k w_k r_k; gdpo: sum_k w_k z_k. A weight of 0 keeps a reward's metrics, not its "
          "signal."
      ),
      json_schema_extra=rule(
          _REWARD_MIX,
          NOTED,
          any_value="any finite weight: 0 keeps a reward's metrics and drops its signal, a negative one penalises",
      ),
  )
  reward_aggregation: Literal["sum", "gdpo"] = Field(
      "sum",
      description=(
          "'sum': the weighted sum of the rewards, then the advantage estimator (the plain sum with unit weights). "
          "'gdpo': each reward standardised within its group of num_generations first, (r - mean_g) / (std_g(ddof=1) "
          "+ 1e-6), 0 where it does not vary, then weighted, summed, and the advantage estimator on the result, so a "
          "reward with a narrow spread is not drowned by a wide one (NeMo-RL's GDPO; docs/rewards.md)."
      ),
      json_schema_extra=rule(_REWARD_MIX, NOTED),
  )
  reward_model_path: str = Field(
      "",
      description=(
          "A reward model trained by train_rm (its run directory or checkpoints directory): one more reward, named "
          "reward_model, the score of prompt + completion, on the trainer's devices; '' = none. It is built like the "
          "run's model; a checkpoint of another size, vocabulary or tokenizer is refused in one line."
      ),
      json_schema_extra=rule(_REWARD_MIX, NOTED),
  )
  reward_model_weight: float = Field(
      1.0,
      description="The reward model's weight (rl.reward_weights holds the reward functions' weights).",
      json_schema_extra=rule(
          _REWARD_MIX,
          NOTED,
          any_value="any finite weight: 0 logs the reward model's scores only, a negative one penalises",
      ),
  )
  reward_model_batch_size: int = Field(
      8,
      ge=1,
      description="Texts the reward model scores per forward (the last batch is padded to it).",
      json_schema_extra=rule(
          _REWARD_MIX, EXEMPT + "texts per reward-model forward: the same scores, batched differently"
      ),
  )


class PluginAgentic(BaseModel):
  """`rl:` multi-turn episodes with tools (agentic/; `rl.use_agentic_rollout` is MaxText's key, the plugin's meaning);
  checks: validation._check_agentic, dependent_keys (rl.agentic_*)."""

  agentic_tools: list[Literal["calculator"]] = Field(
      ["calculator"],
      description=(
          "Tools an episode may call under rl.use_agentic_rollout (Tunix's tool classes by name: 'calculator' is "
          'Tunix\'s CalculatorTool, {"a": number, "b": number, "op": "+"|"-"|"*"|"/"}).'
      ),
      json_schema_extra=rule(_AGENTIC, NOTED, needs="rl.use_agentic_rollout=true"),
  )
  agentic_tool_parser: Literal["qwen"] = Field(
      "qwen",
      description=(
          "Tool-call markup (Tunix's tool parser of that model family): 'qwen' = <tool_call>{\"name\": ..., "
          '"arguments": {...}}</tool_call>, answered with <tool_response>...</tool_response>.'
      ),
      json_schema_extra=rule(_AGENTIC, NOTED, needs="rl.use_agentic_rollout=true"),
  )
  agentic_max_turns: int = Field(
      4,
      ge=1,
      description="Most assistant turns of one episode (a tool call after the last one ends the episode).",
      json_schema_extra=rule(_AGENTIC, NOTED, needs="rl.use_agentic_rollout=true"),
  )
  agentic_turn_tokens: int = Field(
      0,
      ge=0,
      description="Most tokens of one assistant turn; 0 = rl.agentic_max_tokens (the whole budget).",
      json_schema_extra=rule(_AGENTIC, NOTED, needs="rl.use_agentic_rollout=true"),
  )
  agentic_max_tokens: int = Field(
      0,
      ge=0,
      description=(
          "Most tokens of one episode's completion, the assistant's and the tools' together; 0 = the completion "
          "budget max_target_length - max_prefill_predict_length (the most it can be)."
      ),
      json_schema_extra=rule(_AGENTIC, NOTED, needs="rl.use_agentic_rollout=true"),
  )
  agentic_tool_timeout_s: float = Field(
      2.0,
      gt=0.0,
      description="Longest one tool call may run; past it the episode gets an error observation and continues.",
      json_schema_extra=rule(_AGENTIC, NOTED, needs="rl.use_agentic_rollout=true"),
  )


class PluginRolloutCorrection(BaseModel):
  """`rl:` importance weights for the sampler-trainer mismatch (algorithms/divergence.py); checks: dependent_keys."""

  rollout_is: Literal["off", "truncate", "mask"] = Field(
      "off",
      description=(
          "Rollout importance sampling between the behaviour policy (the sampler's log-probs at sampling time) and "
          "pi_old (the trainer's forward at the batch's starting weights): 'truncate' weights each token's policy "
          "gradient by min(pi_old/pi_behaviour, rollout_is_cap) (TIS); 'mask' drops sequences whose geometric-mean "
          "ratio leaves [1/cap, cap]. Needs rl.use_rollout_logps=false (pi_old must be the trainer's)."
      ),
      json_schema_extra=rule(_ROLLOUT_IS, NOTED),
  )
  rollout_is_cap: float = Field(
      2.0,
      gt=1.0,
      description="C of rl.rollout_is: the truncation cap / mask range [1/C, C].",
      json_schema_extra=rule(_ROLLOUT_IS, NOTED, needs="rl.rollout_is=truncate or mask"),
  )


class PluginRouterReplay(BaseModel):
  """`rl:` mixture-of-experts routing replay (moe.py); checks: early_checks.check_router_replay."""

  router_replay: bool = Field(
      False,
      description=(
          "Mixture-of-experts router replay (R3): the embedded rollout records the experts every MoE layer routed each "
          "prompt and completion token to, and the trainer's old-policy and policy forwards use them "
          "(MaxText's forced_routed_experts) instead of their own router's choice, so sampler and trainer score the "
          "same network (docs/moe.md). Every MoE family (MaxText forces Mixtral, Qwen3.5 and Gemma 4; the plugin "
          "forces Qwen3-MoE, gpt-oss and DeepSeek at their MoE modules), on the embedded engine only; the reference "
          "model keeps its own routing."
      ),
      json_schema_extra=rule(_ROUTER_REPLAY, NOTED),
  )


class PluginSyncCheck(BaseModel):
  """`rl:` the weight sync's guard (resharding/verify.py); checks: dependent_keys (rl.verify_weight_sync_every)."""

  verify_weight_sync: Literal["off", "first", "every_n"] = Field(
      "first",
      description=(
          "Check after a trainer->sampler weight sync that the sampler holds the new weights: never, "
          "on the first sync, or every `verify_weight_sync_every` syncs."
      ),
      json_schema_extra=rule(_SYNC_CHECK, EXEMPT + "a check of the weight sync, not the update"),
  )
  verify_weight_sync_every: int = Field(
      10,
      ge=1,
      description="Period (in syncs) of the check when verify_weight_sync=every_n.",
      json_schema_extra=rule(
          _SYNC_CHECK, EXEMPT + "a check of the weight sync, not the update", needs="rl.verify_weight_sync=every_n"
      ),
  )

  # Its own name: PluginRL inherits every concern's validators, and a shared name would keep only one of them.
  _sync_off = field_validator("verify_weight_sync", mode="before")(_yaml_off)


class PluginParity(BaseModel):
  """`rl:` the parity gate (run/parity.py): sampler vs trainer log-probs at a checked step; checks: dependent_keys
  (rl.parity_check_every), early_checks.CHOICES."""

  parity_check: Literal["off", "first", "every_n"] = Field(
      "first",
      description=(
          "The parity gate (run/parity.py): at a checked step the trainer scores the sampled tokens and compares with "
          "the sampler's own log-probs (mean and max |log p difference|, for MoE the fraction of tokens routed to "
          "other experts), logged as parity/* metrics; past a tolerance the run stops before the step's update. "
          "Never, on each launch's first step (a fresh run's step 1, the first step after a resume), or also every "
          "`parity_check_every` steps of the launch."
      ),
      json_schema_extra=rule(_PARITY, EXEMPT + "a check of sampler-trainer agreement (run/parity.py), not the update"),
  )
  parity_check_every: int = Field(
      10,
      ge=1,
      description="Period (in steps) of the check when parity_check=every_n.",
      json_schema_extra=rule(_PARITY, _PARITY_RESUME, needs="rl.parity_check=every_n"),
  )
  parity_logp_tolerance_mean: Optional[float] = Field(
      None,
      gt=0.0,
      description=(
          "Largest mean |log p_sampler - log p_trainer| over completion tokens at a checked step; null = the "
          "precision pairing's default, set from its measured floor (run/parity.py): float32/float32 2e-5 on the CPU "
          "or at matmul_precision=highest, 0.05 with a bfloat16 side or float32 at an accelerator's default "
          "(reduced-precision) matmuls."
      ),
      json_schema_extra=rule(_PARITY, _PARITY_RESUME),
  )
  parity_logp_tolerance_max: Optional[float] = Field(
      None,
      gt=0.0,
      description=(
          "Largest max |log p_sampler - log p_trainer| at a checked step; null = the pairing's default "
          "(float32/float32 1e-2 on the CPU or at matmul_precision=highest, else 1.5)."
      ),
      json_schema_extra=rule(_PARITY, _PARITY_RESUME),
  )
  parity_routing_tolerance: Optional[float] = Field(
      None,
      ge=0.0,
      le=1.0,
      description=(
          "MoE: largest fraction of (token, MoE layer) pairs the sampler routed to other experts than the trainer "
          "at a checked step (not checked under rl.router_replay); null = the pairing's default (float32/float32 "
          "0.01 on the CPU or at matmul_precision=highest, else 0.10)."
      ),
      json_schema_extra=rule(_PARITY, _PARITY_RESUME),
  )

  _parity_off = field_validator("parity_check", mode="before")(_yaml_off)


class PluginLossName(BaseModel):
  """MaxText's `loss_algo` (flat and in `rl:`), typed `Literal["grpo", "gspo-token"]` there: here any registered policy
  loss (the `maxtext_rl_plugin.policy_losses` entry points; MaxText's two names keep their meaning). The first pass
  refuses a name nobody registered in one line listing those that are (early_checks.check_algorithm_names)."""

  loss_algo: str = Field(
      "grpo",
      description=(
          "Policy loss, by its registered name: 'grpo' (per-token clipped ratio), 'gspo-token' (GSPO's sequence ratio, "
          "per token), or a loss another package registers in the maxtext_rl_plugin.policy_losses entry-point group "
          "(docs/extending.md)."
      ),
      json_schema_extra=rule(
          "honoured (algorithms: the registered policy loss of that name, policy_losses entry points)", INVARIANT
      ),
  )


class PluginRLKeys(
    PluginParity,
    PluginSyncCheck,
    PluginRouterReplay,
    PluginRolloutCorrection,
    PluginAgentic,
    PluginRewardMix,
    PluginDapo,
    PluginGroup,
    PluginLossName,
):
  """The plugin's `rl:` keys (config/schema.PluginRL adds them to MaxText's `types.RL`); bases in reverse: pydantic
  orders fields from the last base to the first, so the keys keep the order of this module (print_config,
  docs/config_reference.md)."""
