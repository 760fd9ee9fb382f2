"""The plugin's configuration schema: MaxText's `types.RLConfig` plus the plugin's own keys.

We extend rather than fork: `PluginRLConfig` subclasses MaxText 0.2.5's pydantic `RLConfig`, so
every key of MaxText's `post_train/rl.yml` keeps its meaning, validation and flat-key routing
(`loss_algo=gspo-token` on the command line lands in `rl.loss_algo`).

The plugin's own keys come in one class per concern, as MaxText's `types.py` keeps one class per concern and combines
them in `RLConfig`: the `rl:` block's (`PluginRL` = the concerns below + MaxText's `types.RL`) and the flat ones
(`PluginKeys`). Each field has a description, which docs/config_reference.md is generated from
(`python -m maxtext_rl_plugin.config.doc`); config/key_status.py gives a concern's status by its class where one line
covers it. A concern's cross-key checks are not pydantic validators here: the first pass runs them on the config as
written, before this module's imports (JAX, MaxText), so they are plain functions in config/validation.py and
config/early_checks.py, named in each class's docstring, and both passes run the same ones.
"""

from __future__ import annotations

from typing import Literal, Optional

from maxtext.configs import types
from pydantic import BaseModel
from pydantic import Field
from pydantic import field_validator


def _yaml_off(value):
  """A bare `off` is False to YAML 1.1 (OmegaConf's CLI parser): back to the choice it names, for the off/first/every_n
  keys."""
  return "off" if value is False else value


class PluginGroup(BaseModel):
  """`rl:` GRPO groups and the loss's estimators (algorithms/); checks: validation._check_algorithm, _check_batches."""

  num_generations: int = Field(
      2, ge=2, description="Responses sampled per prompt (G in the GRPO paper); >= 2 so a group has a variance."
  )
  mini_batch_size: Optional[int] = Field(
      None,
      ge=1,
      description=(
          "Prompts per optimizer update; None = batch_size (one update per rollout batch per iteration), as Tunix's "
          "mini_batch_size / verl's ppo_mini_batch_size."
      ),
  )
  kl_estimator: Literal["k1", "k3"] = Field(
      "k3",
      description=(
          "KL(pi || pi_ref) estimator in the loss: 'k3' = exp(r) - r - 1 with r = logp_ref - logp (the GRPO paper's, "
          "unbiased and >= 0); 'k1' = logp - logp_ref (Tunix 0.1.7's default 'kl')."
      ),
  )
  advantage_norm: Optional[Literal["group_std", "batch_std", "none"]] = Field(
      None,
      description=(
          "Scaling of the baseline-subtracted reward c: c / (std_g(r) + 1e-6) with ddof=1 ('group_std', GRPO), "
          "c / (std of c over the batch + 1e-6) ('batch_std'), or c ('none'); null = the estimator's own (grpo: "
          "group_std; rloo, drgrpo: none, which refuse group_std)."
      ),
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
  )
  mask_truncated_completions: bool = Field(
      False,
      description=(
          "A completion cut by the length limit (all max_target_length - max_prefill_predict_length tokens used, "
          "no stop token) contributes no loss: its completion mask is zeroed (DAPO's overlong filtering)."
      ),
  )
  overlong_buffer_len: int = Field(
      0,
      ge=0,
      description=(
          "L_c of DAPO's soft overlong penalty, in tokens (0 = off): a completion of n tokens gets "
          "min(0, ((T - L_c) - n) / L_c) * rl.overlong_penalty_factor added to its reward, T the completion budget."
      ),
  )
  overlong_penalty_factor: float = Field(
      1.0, ge=0.0, description="The penalty of a completion that uses the whole budget (DAPO's overlong factor)."
  )
  dynamic_sampling: bool = Field(
      False,
      description=(
          "DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage) are dropped and further "
          "batch_size-prompt rounds are sampled until the batch holds batch_size informative groups. Refused with "
          "more than one JAX process."
      ),
  )
  max_refill_rounds: int = Field(
      3,
      ge=0,
      description=(
          "Extra rounds rl.dynamic_sampling samples at most per step, 0 to 100; when they are spent (or a stop is "
          "requested) the step trains on the informative groups it has (the missing groups are masked out: no loss), "
          "reported as dynamic_sampling/short_groups and on the console."
      ),
  )


class PluginRewardMix(BaseModel):
  """`rl:` several rewards combined into one advantage (algorithms/reward_aggregation.py, docs/rewards.md "Several
  rewards"); checks: reward_aggregation.configured_weights (rewards/loader.check_config, both passes: one weight per
  reward_functions entry)."""

  reward_weights: list[float] = Field(
      [],
      description=(
          "One weight per reward_functions entry (the default stack's three included), in its order; [] = 1 each. "
          "sum: the reward is sum_k w_k r_k; gdpo: sum_k w_k z_k. A weight of 0 keeps a reward's metrics, not its "
          "signal."
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
  )
  reward_model_path: str = Field(
      "",
      description=(
          "A reward model trained by train_rm (its run directory or checkpoints directory): one more reward, named "
          "reward_model, the score of prompt + completion, on the trainer's devices; '' = none. It is built like the "
          "run's model; a checkpoint of another size, vocabulary or tokenizer is refused in one line."
      ),
  )
  reward_model_weight: float = Field(
      1.0, description="The reward model's weight (rl.reward_weights holds the reward functions' weights)."
  )
  reward_model_batch_size: int = Field(
      8, ge=1, description="Texts the reward model scores per forward (the last batch is padded to it)."
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
  )
  agentic_tool_parser: Literal["qwen"] = Field(
      "qwen",
      description=(
          "Tool-call markup (Tunix's tool parser of that model family): 'qwen' = <tool_call>{\"name\": ..., "
          '"arguments": {...}}</tool_call>, answered with <tool_response>...</tool_response>.'
      ),
  )
  agentic_max_turns: int = Field(
      4, ge=1, description="Most assistant turns of one episode (a tool call after the last one ends the episode)."
  )
  agentic_turn_tokens: int = Field(
      0, ge=0, description="Most tokens of one assistant turn; 0 = rl.agentic_max_tokens (the whole budget)."
  )
  agentic_max_tokens: int = Field(
      0,
      ge=0,
      description=(
          "Most tokens of one episode's completion, the assistant's and the tools' together; 0 = the completion "
          "budget max_target_length - max_prefill_predict_length (the most it can be)."
      ),
  )
  agentic_tool_timeout_s: float = Field(
      2.0,
      gt=0.0,
      description="Longest one tool call may run; past it the episode gets an error observation and continues.",
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
  )
  rollout_is_cap: float = Field(2.0, gt=1.0, description="C of rl.rollout_is: the truncation cap / mask range [1/C, C].")


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
  )


class PluginSyncCheck(BaseModel):
  """`rl:` the weight sync's guard (resharding/verify.py); checks: dependent_keys (rl.verify_weight_sync_every)."""

  verify_weight_sync: Literal["off", "first", "every_n"] = Field(
      "first",
      description=(
          "Check after a trainer->sampler weight sync that the sampler holds the new weights: never, "
          "on the first sync, or every `verify_weight_sync_every` syncs."
      ),
  )
  verify_weight_sync_every: int = Field(
      10, ge=1, description="Period (in syncs) of the check when verify_weight_sync=every_n."
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
  )
  parity_check_every: int = Field(10, ge=1, description="Period (in steps) of the check when parity_check=every_n.")
  parity_logp_tolerance_mean: Optional[float] = Field(
      None,
      gt=0.0,
      description=(
          "Largest mean |log p_sampler - log p_trainer| over completion tokens at a checked step; null = the "
          "precision pairing's default, set from its measured floor (run/parity.py): float32/float32 2e-5 on the CPU "
          "or at matmul_precision=highest, 0.05 with a bfloat16 side or float32 at an accelerator's default "
          "(reduced-precision) matmuls."
      ),
  )
  parity_logp_tolerance_max: Optional[float] = Field(
      None,
      gt=0.0,
      description=(
          "Largest max |log p_sampler - log p_trainer| at a checked step; null = the pairing's default "
          "(float32/float32 1e-2 on the CPU or at matmul_precision=highest, else 1.5)."
      ),
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
  )


class PluginRL(
    PluginParity,
    PluginSyncCheck,
    PluginRouterReplay,
    PluginRolloutCorrection,
    PluginAgentic,
    PluginRewardMix,
    PluginDapo,
    PluginGroup,
    PluginLossName,
    types.RL,
):
  """`rl:` block: MaxText's RL keys, with GRPO-group validation and the plugin's concerns above.

  Bases in reverse: pydantic orders fields from the last base to the first, so the keys keep the order of this module
  (print_config, docs/config_reference.md)."""


class PluginCli(BaseModel):
  """The command line (train_rl)."""

  print_config: bool = Field(False, description="Print the resolved configuration as YAML and exit without training.")


class PluginRollout(BaseModel):
  """The rollout engine (rollout/); checks: early_checks.check_engine_name, check_engine (the engine's own, from its
  `EngineSpec`)."""

  rollout_engine: str = Field(
      "auto",
      description=(
          "A name registered in the maxtext_rl_plugin.rollout_engines entry points (rollout/engines.py; `maxtext-rl "
          "list` shows them), or 'auto'. Built in: 'embedded': the plugin's JAX KV-cache engine on MaxText's model code "
          "(CPU/GPU/TPU); 'vllm': vLLM-TPU (needs the [tpu] extra); 'auto': vllm on a TPU/Pathways backend when vllm is "
          "importable, else embedded."
      ),
  )
  rollout_prefill_buckets: list[int] = Field(
      [32, 64, 128, 256, 512, 1024, 2048],
      description="Prompt lengths are padded up to the next bucket so the engine compiles once per bucket, not per step.",
  )
  rollout_batch_buckets: list[int] = Field(
      [1, 2, 4, 8, 16, 32, 64, 128, 256],
      description="Rollout batch sizes are padded up to the next bucket (same reason as rollout_prefill_buckets).",
  )
  stop_token_ids: list[int] = Field([], description="Extra token ids that end a completion, besides the tokenizer's EOS.")
  rollout_seed: int = Field(
      0,
      description=(
          "Seed of rollout sampling; step k samples with a key derived from (rollout_seed, k), so "
          "resumed runs sample identically."
      ),
  )


class PluginData(BaseModel):
  """Prompts and answers (data/); checks: validation._check_synthetic."""

  train_data_path: str = Field(
      "",
      description=(
          "Local JSONL or Parquet file(s) of GSM8K-style rows (question, answer '... #### N'); "
          "overrides dataset_name for training."
      ),
  )
  eval_data_path: str = Field(
      "", description="Local JSONL or Parquet file(s) for evaluation; overrides eval_dataset_name."
  )
  synthetic_seed: int = Field(
      1234, description="Seed of the built-in synthetic arithmetic problem generator (dataset_name=synthetic)."
  )
  synthetic_num_eval: int = Field(
      256, ge=1, description="Size of the held-out synthetic eval split (disjoint from training problems)."
  )
  synthetic_min_steps: int = Field(1, ge=1, description="Fewest arithmetic operations in a synthetic problem.")
  synthetic_max_steps: int = Field(2, ge=1, description="Most arithmetic operations in a synthetic problem.")
  synthetic_max_value: int = Field(20, ge=2, description="Largest operand in a synthetic problem.")
  synthetic_teacher_error_rate: float = Field(
      0.0,
      ge=0.0,
      le=1.0,
      description="Fraction of synthetic training problems whose worked solution (the SFT warm start's demonstration) "
      "comes from a flawed teacher that adds every pair of numbers whatever the wording says. Models an imperfect SFT "
      "corpus; rewards and eval always use the true answer.",
  )
  synthetic_task: Literal["word_problems", "products"] = Field(
      "word_problems",
      description=(
          "The synthetic task: arithmetic word problems, or 'products' (\"What is 47 * 86?\", operands in "
          "[10, synthetic_max_value]), where the calculator tool of rl.use_agentic_rollout matters."
      ),
  )
  synthetic_tool_rate: float = Field(
      0.0,
      ge=0.0,
      le=1.0,
      description=(
          "synthetic_task=products: fraction of the SFT warm start's demonstrations that call the calculator "
          "(<tool_call>...</tool_call>) instead of answering from the head."
      ),
  )
  use_chat_template: bool = Field(
      True,
      description="Build prompts with the tokenizer's chat template (else the plain template of data_template_path).",
  )


class PluginRewards(BaseModel):
  """Reward computation (rewards/); checks: the schema's bounds."""

  reward_item_timeout_seconds: float = Field(
      2.0,
      gt=0,
      description="Per-completion timeout for the math_verify fallback; a completion that exceeds it scores as wrong.",
  )
  reward_call_timeout_seconds: float = Field(
      300.0,
      gt=0,
      description="Longest one call of a reward function (over one rollout batch) may take; past it the run stops with "
      "one line naming the function (a user function that never returns cannot hang the run).",
  )


class PluginResharding(BaseModel):
  """The trainer-to-sampler weight sync (resharding/)."""

  reshard_donate: bool = Field(
      True,
      description=(
          "Free the sampler's previous weight buffers chunk by chunk just before the new ones land (the sampler is "
          "idle during a sync), so a sync needs about one chunk of extra memory instead of a second full copy."
      ),
  )


class PluginRunLoop(BaseModel):
  """The run around the RL steps (run/loop.py, sft.py, run/summary.py): warm start, eval, the plot."""

  sft_warmup_steps: int = Field(
      0,
      ge=0,
      description="Supervised warm-start steps on gold solutions before RL (0 = off); checkpointed so a rerun skips it.",
  )
  sft_learning_rate: float = Field(1e-3, gt=0, description="Learning rate of the SFT warm start.")
  sft_batch_size: int = Field(16, ge=1, description="Batch size of the SFT warm start.")
  eval_before_training: bool = Field(
      True, description="Greedy eval on the eval split before the first RL step (logged at step 0)."
  )
  eval_after_training: bool = Field(True, description="Greedy eval after the last RL step.")
  write_plot: bool = Field(
      True, description="Write reward/accuracy-per-step PNG (summary.png) into the run directory at the end."
  )
  overwrite_run: bool = Field(
      False,
      description="Let a run with nothing to resume from (enable_checkpointing=false) start over in the directory of "
      "a finished run, replacing its records, summary and plot (refused otherwise).",
  )


class PluginKeys(PluginRunLoop, PluginResharding, PluginRewards, PluginData, PluginRollout, PluginCli):
  """Top-level keys the plugin adds (flat, like MaxText's), one class per concern (bases in reverse: see PluginRL)."""


class PluginRLConfig(PluginKeys, PluginLossName, types.RLConfig):
  """MaxText's RLConfig + the plugin's keys; passed to pyconfig as `config_class`."""

  rl: PluginRL = Field(default_factory=PluginRL, description="RL algorithm configuration (GRPO/GSPO).")
  # MaxText keeps `lora:` in MaxTextConfig (its SFT trainer reads it) but not in RLConfig; the plugin adds the same
  # block so `lora.enable_lora=true` means what it means in MaxText's train_sft (read by maxtext_rl_plugin.lora).
  lora: types.LoRA = Field(default_factory=types.LoRA, description="LoRA / QLoRA adapters (MaxText's `lora:` block).")
