"""The plugin's own flat keys, one pydantic class per concern, each field with its type, default, bounds and rules.

The `rl:` block's keys are in config/rl_fields.py. A field is the one place of a plugin key: its type (a
`Literal[...]` gives its choices), default, bounds (`ge`/`gt`/`le`/`lt`), `description` (docs/config_reference.md's
meaning column) and, in `json_schema_extra`, its `KeyRule` (config/key_rule.py): where it is honoured, what a resume
does when it changes, the switch it depends on. The checks' tables are derived from these fields (config/rules.py).
One class per concern, as MaxText's `types.py` keeps one class per concern; config/schema.py combines them with
MaxText's `types.RLConfig`.

Pydantic only, no JAX or MaxText: the first pass (config/precheck) reads the rules before the schema's imports. A
concern's cross-key checks are plain functions in config/validation.py and config/early_checks.py, named in each
class's docstring, which both passes run.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel
from pydantic import Field

from maxtext_rl_plugin.config.key_rule import EXEMPT
from maxtext_rl_plugin.config.key_rule import INVARIANT
from maxtext_rl_plugin.config.key_rule import NOTED
from maxtext_rl_plugin.config.key_rule import rule

# Statuses several keys share (config/key_status.py keeps MaxText's keys' statuses).
ROLLOUT = "honoured (rollout engine)"
DATA = "honoured (data)"
REWARDS = "honoured (rewards)"
_SFT = "honoured (sft: warm start)"
_SFT_RESUME = EXEMPT + "the SFT warm start runs before the first RL step; a resumed run does not run it again"
_SFT_DATA = EXEMPT + "the SFT warm start's demonstrations, which a resumed run does not train on again"
_EVAL = "honoured (trainer: eval)"


class PluginCli(BaseModel):
  """The command line (train_rl)."""

  print_config: bool = Field(
      False,
      description="Print the resolved configuration as YAML and exit without training.",
      json_schema_extra=rule(
          "honoured (train_rl: print the resolved configuration and exit)",
          EXEMPT + "prints the configuration and exits: no step runs",
      ),
  )


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
      json_schema_extra=rule(ROLLOUT, NOTED),
  )
  rollout_prefill_buckets: list[int] = Field(
      [32, 64, 128, 256, 512, 1024, 2048],
      description="Prompt lengths are padded up to the next bucket so the engine compiles once per bucket, not per step.",
      json_schema_extra=rule(
          ROLLOUT,
          EXEMPT + "compiled prompt shapes: the same sampling, padded differently",
          items="lengths",
          items_ge=1,
          nonempty=True,
      ),
  )
  rollout_batch_buckets: list[int] = Field(
      [1, 2, 4, 8, 16, 32, 64, 128, 256],
      description="Rollout batch sizes are padded up to the next bucket (same reason as rollout_prefill_buckets).",
      json_schema_extra=rule(
          ROLLOUT,
          EXEMPT + "compiled batch shapes: the same sampling, padded differently",
          items="batch sizes",
          items_ge=1,
          nonempty=True,
      ),
  )
  stop_token_ids: list[int] = Field(
      [],
      description="Extra token ids that end a completion, besides the tokenizer's EOS.",
      json_schema_extra=rule(ROLLOUT, NOTED, items="token ids", items_ge=0),
  )
  rollout_quantization: Literal["", "int8", "fp8"] = Field(
      "",
      description=(
          "The sampler's own weight precision ('' = weight_dtype, as MaxText's `quantization`); the trainer is "
          "unchanged. 'int8' or 'fp8' (float8 e4m3fn): at every "
          "sync the sampler's matmul kernels are quantized symmetrically per output channel (Qwix's layout, which "
          "tpu-inference consumes), on device and in chunks, and read back in its decode program; the embedding, "
          "head, norms and MoE router stay in weight_dtype (resharding/quantize.py). The parity gate's pairing and "
          "tolerances follow it (run/parity.py). The embedded engine and vLLM's native route (Llama 3.1, dense Qwen3: "
          "tpu-inference's Qwix PTQ, whose QArray kernels the sync writes, rollout/vllm_quantized.py); vLLM's "
          "MaxTextForCausalLM route is refused (rollout/vllm_spec.py says why)."
      ),
      json_schema_extra=rule(
          "honoured (rollout/quantized_weights.py: the embedded engine samples with int8/FP8 kernels, quantized at "
          "every sync, guarded; rollout/vllm_quantized.py: vLLM's native route, its engine Qwix-quantized and synced "
          "as quantized kernels, guarded; rollout/precision.py refuses the routes that cannot)",
          NOTED,
      ),
  )
  rollout_seed: int = Field(
      0,
      description=(
          "Seed of rollout sampling; step k samples with a key derived from (rollout_seed, k), so "
          "resumed runs sample identically."
      ),
      json_schema_extra=rule(ROLLOUT, INVARIANT, any_value="any integer seeds the rollout's sampling keys"),
  )


class PluginData(BaseModel):
  """Prompts and answers (data/); checks: validation._check_synthetic."""

  train_data_path: str = Field(
      "",
      description=(
          "Local JSONL or Parquet file(s) of GSM8K-style rows (question, answer '... #### N'); "
          "overrides dataset_name for training."
      ),
      json_schema_extra=rule(DATA, INVARIANT),
  )
  eval_data_path: str = Field(
      "",
      description="Local JSONL or Parquet file(s) for evaluation; overrides eval_dataset_name.",
      json_schema_extra=rule(DATA, INVARIANT),
  )
  synthetic_seed: int = Field(
      1234,
      description="Seed of the built-in synthetic arithmetic problem generator (dataset_name=synthetic).",
      json_schema_extra=rule(DATA, INVARIANT, any_value="any integer seeds the synthetic generator"),
  )
  synthetic_num_eval: int = Field(
      256,
      ge=1,
      description="Size of the held-out synthetic eval split (disjoint from training problems).",
      json_schema_extra=rule(DATA, INVARIANT),
  )
  synthetic_min_steps: int = Field(
      1, ge=1, description="Fewest arithmetic operations in a synthetic problem.", json_schema_extra=rule(DATA, INVARIANT)
  )
  synthetic_max_steps: int = Field(
      2, ge=1, description="Most arithmetic operations in a synthetic problem.", json_schema_extra=rule(DATA, INVARIANT)
  )
  synthetic_max_value: int = Field(
      20, ge=2, description="Largest operand in a synthetic problem.", json_schema_extra=rule(DATA, INVARIANT)
  )
  synthetic_teacher_error_rate: float = Field(
      0.0,
      ge=0.0,
      le=1.0,
      description="Fraction of synthetic training problems whose worked solution (the SFT warm start's demonstration) "
      "comes from a flawed teacher that adds every pair of numbers whatever the wording says. Models an imperfect SFT "
      "corpus; rewards and eval always use the true answer.",
      json_schema_extra=rule(DATA, _SFT_DATA),
  )
  synthetic_task: Literal["word_problems", "products"] = Field(
      "word_problems",
      description=(
          "The synthetic task: arithmetic word problems, or 'products' (\"What is 47 * 86?\", operands in "
          "[10, synthetic_max_value]), where the calculator tool of rl.use_agentic_rollout matters."
      ),
      json_schema_extra=rule(DATA, INVARIANT),
  )
  synthetic_tool_rate: float = Field(
      0.0,
      ge=0.0,
      le=1.0,
      description=(
          "synthetic_task=products: fraction of the SFT warm start's demonstrations that call the calculator "
          "(<tool_call>...</tool_call>) instead of answering from the head."
      ),
      json_schema_extra=rule(DATA, _SFT_DATA, needs="synthetic_task=products"),
  )
  use_chat_template: bool = Field(
      True,
      description="Build prompts with the tokenizer's chat template (else the plain template of data_template_path).",
      json_schema_extra=rule(DATA, INVARIANT),
  )


class PluginRewards(BaseModel):
  """Reward computation (rewards/); checks: the schema's bounds."""

  reward_item_timeout_seconds: float = Field(
      2.0,
      gt=0,
      description="Per-completion timeout for the math_verify fallback; a completion that exceeds it scores as wrong.",
      json_schema_extra=rule(REWARDS, NOTED),
  )
  reward_call_timeout_seconds: float = Field(
      300.0,
      gt=0,
      description="Longest one call of a reward function (over one rollout batch) may take; past it the run stops with "
      "one line naming the function (a user function that never returns cannot hang the run).",
      json_schema_extra=rule("honoured (rewards/loader.py: RewardFn, per call)", NOTED),
  )


class PluginResharding(BaseModel):
  """The trainer-to-sampler weight sync (resharding/)."""

  reshard_donate: bool = Field(
      True,
      description=(
          "Free the sampler's previous weight buffers chunk by chunk just before the new ones land (the sampler is "
          "idle during a sync), so a sync needs about one chunk of extra memory instead of a second full copy."
      ),
      json_schema_extra=rule(
          "honoured (resharding: trainer->sampler sync)", EXEMPT + "how the weights move to the sampler, not which"
      ),
  )


class PluginRunLoop(BaseModel):
  """The run around the RL steps (run/loop.py, sft.py, run/summary.py): warm start, eval, the plot."""

  sft_warmup_steps: int = Field(
      0,
      ge=0,
      description="Supervised warm-start steps on gold solutions before RL (0 = off); checkpointed so a rerun skips it.",
      json_schema_extra=rule(_SFT, _SFT_RESUME),
  )
  sft_learning_rate: float = Field(
      1e-3,
      gt=0,
      description="Learning rate of the SFT warm start.",
      json_schema_extra=rule(_SFT, _SFT_RESUME, needs="sft_warmup_steps > 0"),
  )
  sft_batch_size: int = Field(
      16,
      ge=1,
      description="Batch size of the SFT warm start.",
      json_schema_extra=rule(_SFT, _SFT_RESUME, needs="sft_warmup_steps > 0"),
  )
  eval_before_training: bool = Field(
      True,
      description="Greedy eval on the eval split before the first RL step (logged at step 0).",
      json_schema_extra=rule(_EVAL, EXEMPT + "evaluation, not the update"),
  )
  eval_after_training: bool = Field(
      True,
      description="Greedy eval after the last RL step.",
      json_schema_extra=rule(_EVAL, EXEMPT + "evaluation, not the update"),
  )
  write_plot: bool = Field(
      True,
      description="Write reward/accuracy-per-step PNG (summary.png) into the run directory at the end.",
      json_schema_extra=rule("honoured (summary: summary.png)", EXEMPT + "the summary plot, not the update"),
  )
  overwrite_run: bool = Field(
      False,
      description="Let a run with nothing to resume from (enable_checkpointing=false) start over in the directory of "
      "a finished run, replacing its records, summary and plot (refused otherwise).",
      json_schema_extra=rule(
          "honoured (run/identity.check_overwrite: a finished run without checkpoints is replaced)",
          EXEMPT + "applies to a run without checkpoints, which nothing resumes",
      ),
  )


class PluginKeys(PluginRunLoop, PluginResharding, PluginRewards, PluginData, PluginRollout, PluginCli):
  """Top-level keys the plugin adds (flat, like MaxText's), one class per concern (bases in reverse: see
  rl_fields.PluginRLKeys)."""
