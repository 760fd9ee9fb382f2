"""Whether the plugin honours each configuration key, and why it refuses the others.

A MaxText user who switches from MaxText's `train_rl` to this plugin must lose nothing silently: every key of
`PluginRLConfig` (MaxText 0.2.5's `types.RLConfig`, which inherits ~70 mixin classes of MaxText's whole
`MaxTextConfig`, plus the plugin's keys) has a status here:

* `honoured (<where>)`: the key changes the run, in the named place;
* `refused: <why>`: nothing in the RL path reads it, so a user value different from MaxText's own RL default
  (`post_train/rl.yml` over `base.yml`, else the schema default) is an error, not a silent no-op.

MaxText's keys' statuses are given here per mixin class of `RLConfig` (e.g. every `ModelArchitecture` key is read by
MaxText's model code, which the plugin builds through `from_pretrained`; every `Goodput` key is pre-training
telemetry) with per-key overrides. A plugin key's status is its field's rule (config/fields.py, config/rl_fields.py;
`rules.statuses`). A class missing from `CLASS_STATUS` fails tests/config/test_config.py, so a MaxText upgrade that adds
a mixin or a key cannot add a silently ignored key. Keys of the `rl:` block are named `rl.<key>`; keys of MaxText's
other nested blocks (`dataset`, `reward`, `vllm`, ...) are also top-level fields and are named flat, as in
`post_train/rl.yml`.
"""

# The schema (config_types) imports JAX and config/keys.py imports this module: it is imported on first use.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import functools
from typing import Any

from maxtext_rl_plugin.config import rules

MODEL = "honoured (MaxText model code, built by from_pretrained)"
MESH = "honoured (MaxText mesh and sharding of the trainer and rollout models)"
TRAINER = "honoured (trainer)"
ROLLOUT = "honoured (rollout engine)"
VLLM_ROLLOUT = "honoured (rollout/vllm_config.py, passed to vLLM)"
DATA = "honoured (data)"
REWARDS = "honoured (rewards)"
PYCONFIG = "honoured (MaxText pyconfig, while loading the configuration)"
DEVICES = "honoured (run/models.setup_devices: trainer/sampler device split)"
ALGO = "honoured (algorithms: the GRPO/GSPO loss)"
DERIVED = "refused: derived by MaxText from other keys; set those instead"

_AGENTIC_ROLLOUT = (
    "honoured (agentic/episode.py: multi-turn episodes with the rl.agentic_tools tools inside the plugin's own "
    "loop, every engine; not Tunix's AgenticGRPOLearner)"
)
_AGENTIC = (
    "refused: used only by MaxText's own agentic rollout (Tunix's AgenticGRPOLearner); the plugin's episodes "
    "(rl.use_agentic_rollout) take their prompt from the data template"
)
_PRETRAIN = "refused: pre-training only; the RL path never reads it"
_MULTIMODAL = "refused: the plugin's data, rollout and reward paths are text-only"
_TRAIN_LOSS = "refused: a term of MaxText's pre-training loss; the RL loss is the plugin's GRPO/GSPO loss"
_OPTIMIZER = (
    "refused: the plugin's optimizer is AdamW (adam_*, learning_rate, warmup_steps_fraction, "
    "gradient_clipping_threshold)"
)
_CONVERTER = (
    "refused: MaxText's vLLM weight-converter option; the plugin's vLLM engine maps weights itself "
    "(rollout/vllm_mapping.py)"
)

# One status per mixin class of RLConfig (and of the nested blocks); per-key overrides in _KEY_STATUS.
CLASS_STATUS: dict[str, str] = {
    # Model code: MaxText builds the trainer and rollout models from these.
    "LogitsAndLoss": MODEL,
    "Engram": MODEL,
    "ManifoldConstrainedHyperConnections": MODEL,
    "RematAndOffload": MODEL,
    "Attention": MODEL,
    "Llama4Attention": MODEL,
    "LayoutAndSharding": MESH,
    "InferenceLayout": MODEL,
    "InferenceGeneral": (
        "refused: MaxText's standalone decode/inference-server option; the rollout engine does not read it"
    ),
    "PrefixCaching": "refused: MaxText's inference-server prefix cache; the rollout engine does not read it",
    "Decoding": ROLLOUT,
    "IciParallelism": MESH,
    "DcnParallelism": MESH,
    "PipelineParallelism": "refused: pipeline parallelism is not supported by the RL trainer (Tunix trains one stage)",
    "DilocoParams": "refused: DiLoCo is a pre-training optimizer; the RL path never reads it",
    "HardwareAndMesh": MESH,
    "ModelArchitecture": MODEL,
    "MTP": "refused: multi-token prediction is a pre-training objective; the RL loss does not use it",
    "MoBa": MODEL,
    "MlaAttention": MODEL,
    "CompressedAttention": MODEL,
    "AttentionIndexer": MODEL,
    "SplashAttention": MODEL,
    "Qwen3Next": MODEL,
    "MultimodalGeneral": _MULTIMODAL,
    "Muon": _OPTIMIZER,
    "FineTuning": (
        "refused: MaxText's SFT/DPO trainers' switch; this plugin runs RL (its SFT warm start is " "sft_warmup_steps)"
    ),
    "Distillation": "refused: distillation is a separate MaxText trainer; the RL path never reads it",
    "DatasetGeneral": (
        "refused: MaxText's pre-training input pipeline; RL data is set by dataset_name/train_data_path and " "batch_size"
    ),
    "TfdsDataset": DATA,
    "HfDataset": (
        "refused: MaxText's pre-training Hugging Face pipeline; RL data is dataset_name/hf_subset or " "train_data_path"
    ),
    "GrainDataset": "refused: MaxText's Grain pre-training pipeline; the RL path never reads it",
    "OlmoGrainDataset": "refused: MaxText's Grain pre-training pipeline; the RL path never reads it",
    "EmergencyCheckpointing": "refused: emergency/multi-tier checkpointing is not implemented in the RL trainer",
    "ElasticTraining": "refused: elastic training is not implemented in the RL trainer",
    "InferenceServer": "refused: MaxText's disaggregated inference server; the rollout engine does not read it",
    "InferenceBenchmark": "refused: MaxText's inference microbenchmark; the RL path never reads it",
    "HloDump": "refused: MaxText's train loop dumps HLO; the RL trainer does not (use XLA_FLAGS=--xla_dump_to)",
    "Goodput": "refused: goodput recording is MaxText pre-training telemetry; the RL trainer does not record it",
    "GcpMonitoring": "refused: MaxText pre-training telemetry; the RL trainer does not report it",
    "ManagedMLDiagnostics": "refused: MaxText pre-training telemetry; the RL trainer does not report it",
    "PositionalEmbedding": MODEL,
    "Rope": MODEL,
    "YarnRope": MODEL,
    "MoEGeneral": MODEL,
    "MoEKernels": MODEL,
    "DeepSeekMoE": MODEL,
    "RunInfo": TRAINER,
    "Checkpointing": (
        "refused: a MaxText pre-training checkpoint option; the RL trainer's checkpoints are Orbax via "
        "checkpointing.py"
    ),
    "OrbaxStorage": (
        "honoured (checkpointing.Storage: the format and I/O budgets of the run's, the SFT warm start's and "
        "export_lora's checkpoints, as MaxText passes them to Orbax)"
    ),
    "DataTypes": MODEL,
    "Tokenizer": (
        "refused: MaxText's pre-training tokenization option; the RL path tokenizes with the HF tokenizer at "
        "tokenizer_path"
    ),
    "AdamW": "honoured (trainer: optimizer)",
    "Optimizer": _OPTIMIZER,
    "TrainingLoop": _PRETRAIN,
    "Quantization": MODEL,
    "VisionTower": _MULTIMODAL,
    "VisionProjector": _MULTIMODAL,
    "AudioEncoder": _MULTIMODAL,
    "DevelopmentAndDebugging": "refused: a MaxText pre-training debug option; the RL path never reads it",
    "Profiling": (
        "refused: a MaxText pre-training profiler option; the RL trainer reads profiler, profiler_steps, "
        "skip_first_n_steps_for_profiler"
    ),
    "AOT": "refused: ahead-of-time compilation of MaxText's pre-training step; the RL path never reads it",
    "Metrics": "refused: MaxText pre-training metrics sink; the RL trainer writes TensorBoard and metrics_file",
    "Tensorboard": "refused: Vertex TensorBoard upload is not implemented; logs go to tensorboard_dir",
    "DerivedValues": DERIVED,
    "RL": ALGO,
    "RLCluster": DEVICES,
    "RLDataset": DATA,
    "RLEvaluation": "honoured (trainer: eval)",
    "RLReward": REWARDS,
    "RLSpecialTokens": "honoured (data prompt template and rewards)",
    "VLLM": _CONVERTER,
    "RLConfig": TRAINER,
    "LoRA": "honoured (lora.py: MaxText's lora_utils.apply_lora_to_model on the actor)",
}

_KEY_STATUS: dict[str, str] = {
    # --- model code / mesh exceptions ---
    # --- ahead-of-time compilation (aot/: the RL step's programs for a TPU topology, instead of training) ---
    "compile_topology": "honoured (aot: compile the run's programs for this MaxText topology name instead of training)",
    "compile_topology_num_slices": "honoured (aot: slices of compile_topology; -1 = 1)",
    "z_loss_multiplier": _TRAIN_LOSS,
    "num_vocab_tiling": (
        "refused: vocab tiling is part of MaxText's pre-training loss; the RL loss computes full logits"
    ),
    "vocab_tiling_ag_once": (
        "refused: vocab tiling is part of MaxText's pre-training loss; the RL loss computes full logits"
    ),
    "optimizer_memory_host_offload": (
        "refused: offloads MaxText's pre-training optimizer state; the RL optimizer is Tunix's"
    ),
    "parameter_memory_host_offload": (
        "refused: offloads MaxText's pre-training train state; the RL train state is Tunix's"
    ),
    "internal_compile": _PRETRAIN,
    "internal_compile_num_devices": _PRETRAIN,
    "compile_xla_flags": _PRETRAIN,
    "logical_axis_rules_for_eval": _PRETRAIN,
    "custom_mesh_and_rule_for_eval": _PRETRAIN,
    "max_target_length": "honoured (rollout engine: prompt + completion budget; trainer sequence length)",
    "max_prefill_predict_length": "honoured (data: prompt length limit; rollout engine)",
    "enable_prefix_caching": VLLM_ROLLOUT,
    "decode_sampling_strategy": (
        "refused: the rollout samples with decode_sampling_temperature/top_k/nucleus_p; the strategy name is " "not read"
    ),
    "ici_diloco_parallelism": "refused: DiLoCo is a pre-training optimizer; the RL path never reads it",
    "dcn_diloco_parallelism": "refused: DiLoCo is a pre-training optimizer; the RL path never reads it",
    "ici_pipeline_parallelism": (
        "refused: pipeline parallelism is not supported by the RL trainer (Tunix trains one stage)"
    ),
    "dcn_pipeline_parallelism": (
        "refused: pipeline parallelism is not supported by the RL trainer (Tunix trains one stage)"
    ),
    "indexer_sparse_training": _TRAIN_LOSS,
    "indexer_loss_scaling_factor": _TRAIN_LOSS,
    # --- mixture of experts (moe.py, docs/moe.md) ---
    "load_balance_loss_weight": (
        "honoured (algorithms/tunix_wiring + moe.lb_loss: MaxText's moe_lb_loss, already weighted, averaged over MoE "
        "layers and added to the RL loss as MaxText's pre-training loss adds it)"
    ),
    "moe_use_megatron_seq_aux_loss": "honoured (moe.lb_loss: the sequence-wise aux loss summed over MoE layers)",
    "routed_bias_update_rate": "refused: MaxText's pre-training step updates the routing bias; the RL step does not",
    "return_routed_experts": (
        "honoured (rollout/vllm_routing.py: rollout_engine=vllm captures each token's experts, vLLM's "
        "enable_return_routed_experts with MaxText's own key in the adapter's maxtext_config, and the step logs the "
        "sampler-trainer routing mismatch; rl.router_replay=true turns it on and replays it; the embedded engine "
        "records every MoE model's routing anyway; a dense model or a DeepSeek-style router is refused by "
        "config/early_checks)"
    ),
    "capacity_factor": (
        "honoured (MaxText MoE, dropless -1 by default; > 0 refused by config/early_checks.check_dropless: token "
        "dropping depends on how many tokens share a forward, one per decode step vs the whole sequence in the trainer)"
    ),
    **dict.fromkeys(
        ("ragged_buffer_factor", "eval_ragged_buffer_factor"),
        "refused: a bounded ragged buffer drops tokens depending on the batch's routing, differently in the rollout's "
        "decode and the trainer's forward; RL keeps MaxText's worst-case (dropless) buffer",
    ),
    **dict.fromkeys(
        (
            "moe_dropless_fallback",
            "retry_dropless_first_steps",
            "first_phase_ragged_buffer_factor",
            "log_required_ragged_buffer_factor",
            "warmup_programs_in_init",
            "moe_log_max_load_ratio",
            "te_ep_overflow_check_every_n_steps",
            "log_moe_bias_norms",
            "log_step_diagnostics",
        ),
        "refused: MaxText's pre-training step logic or logging; the RL step logs moe/*_load_max (moe.py) instead",
    ),
    "use_random_routing": (
        "refused: debug routing drawn at random per call, so the sampler and the trainer route differently by "
        "construction"
    ),
    "use_batch_split_schedule": "refused: a DeepSeek-V3 pre-training schedule; the RL trainer does not run it",
    "use_lineage": "refused: Google-internal DeepSeek-V3 execution; not in the pinned MaxText",
    "use_qwix_quantization": (
        "refused: Qwix quantized training needs MaxText's train step; the RL trainer does not wrap the model"
    ),
    "weight_sparsity_n": "refused: weight sparsity is applied by MaxText's pre-training step; the RL step does not",
    "weight_sparsity_m": "refused: weight sparsity is applied by MaxText's pre-training step; the RL step does not",
    "weight_sparsity_update_step": (
        "refused: weight sparsity is applied by MaxText's pre-training step; the RL step does not"
    ),
    "weight_sparsity_start_step": (
        "refused: weight sparsity is applied by MaxText's pre-training step; the RL step does not"
    ),
    "te_comm_gemm_overlap": "refused: Transformer Engine (GPU) option of MaxText's pre-training step",
    "grad_dtype": "refused: gradients are computed by Tunix's trainer in the parameter dtype",
    "vocab_size": MODEL,
    "num_slices": "refused: derived by MaxText's RLConfig from num_trainer_slices/num_samplers_slices; set those",
    "scan_layers": MODEL,
    "param_scan_axis": MODEL,
    # --- run info ---
    "base_config": "honoured (yml chain)",
    "use_m3_model": "refused: MaxText-internal model variant switch; the RL path never reads it",
    "log_config": PYCONFIG,
    "debug_sharding": _PRETRAIN,
    "enable_mllog": _PRETRAIN,
    "mllog_file": _PRETRAIN,
    "sharding_strategy": _PRETRAIN,
    "override_model_config": PYCONFIG,
    "override_logical_axis_rules": PYCONFIG,
    "model_name": MODEL,
    # --- checkpointing ---
    "convert_checkpoint_if_possible": MODEL,
    "load_parameters_path": MODEL,
    "checkpoint_is_quantized": MODEL,
    "enable_checkpointing": "honoured (trainer: checkpoints)",
    "async_checkpointing": "honoured (trainer: checkpoints)",
    "checkpoint_period": "honoured (trainer: checkpoints)",
    "max_num_checkpoints_to_keep": "honoured (trainer: checkpoints)",
    # MaxText's validator overwrites both with <base_output_directory>/<run_name>/{checkpoints,tensorboard}/ (its own
    # train_rl uses them the same way): honoured as derived, and a value set by hand is refused, not dropped.
    "checkpoint_dir": DERIVED + " (base_output_directory/run_name; the trainer's checkpoints live there)",
    "tensorboard_dir": DERIVED + " (base_output_directory/run_name; the trainer's TensorBoard logs live there)",
    # --- tokenizer / data ---
    "tokenizer_path": "honoured (data/tokenizer.load_tokenizer; vLLM model id)",
    "tokenizer_type": MODEL,
    "data_template_path": DATA,
    "chat_template": "refused: prompts use the tokenizer's own chat template (use_chat_template) or data_template_path",
    "chat_template_path": (
        "refused: prompts use the tokenizer's own chat template (use_chat_template) or data_template_path"
    ),
    "dataset_path": "refused: a TFDS data directory; RL data is dataset_name/hf_subset or train_data_path",
    "hf_access_token": "honoured (tokenizer, data and checkpoint downloads)",
    "num_epoch": TRAINER,
    # --- optimizer ---
    "learning_rate": "honoured (trainer: optimizer)",
    "warmup_steps_fraction": "honoured (trainer: optimizer)",
    "learning_rate_schedule_steps": "honoured (trainer: optimizer)",
    "gradient_clipping_threshold": "honoured (trainer: optimizer)",
    "adamw_mask": "refused: the RL optimizer applies weight decay to every parameter",
    "mu_dtype": "refused: the RL optimizer keeps its moments in the parameter dtype",
    # --- training loop ---
    "log_period": TRAINER,
    "eval_interval": TRAINER,
    "enable_dropout": (
        "refused: the RL path calls MaxText's model with its default; dropout is set by dropout_rate (0 = off)"
    ),
    "dropout_rate": MODEL,
    "init_weights_seed": MODEL,
    "data_shuffle_seed": DATA,
    "steps": "refused: RL steps are num_batches x num_epoch x train_fraction (MaxText's RLConfig derives steps)",
    # --- debugging ---
    "jax_cache_dir": PYCONFIG,
    "jax_distributed_initialization_timeout": PYCONFIG,
    "jax_debug_log_modules": PYCONFIG,
    "skip_jax_distributed_system": PYCONFIG,
    "enable_single_controller": PYCONFIG,
    # --- profiling / metrics ---
    "profiler": "honoured (trainer: profiler)",
    "profiler_steps": "honoured (trainer: profiler)",
    "skip_first_n_steps_for_profiler": "honoured (trainer: profiler)",
    "metrics_file": "honoured (trainer: metrics)",
    "enable_tensorboard": "refused: the RL trainer always writes TensorBoard logs (tensorboard_dir)",
    # --- RLConfig's own ---
    "enable_tunix_perf_metrics": "refused: Tunix's perf-metrics collection is not wired into the plugin's trainer",
    "debug": "refused: MaxText train_rl's debug printing; the plugin logs with absl (--verbosity)",
    # --- rl: block ---
    "rl.num_iterations": TRAINER,
    "rl.use_rollout_logps": TRAINER,
    "rl.force_on_policy_ratio": TRAINER,
    "rl.log_sampler_trainer_agreement": TRAINER,
    "rl.epsilon_high": ALGO,
    "rl.use_agentic_rollout": _AGENTIC_ROLLOUT,
    "rl.off_policy_steps": "honoured (async_rollout: rollouts up to N RL steps ahead of the trainer, every engine)",
    "rl.max_concurrency": _AGENTIC,
    "rl.system_prompt": _AGENTIC,
    "rl.reshard_chunk_size": "honoured (resharding: trainer->sampler sync chunk)",
    # --- cluster ---
    "rollout_data_parallelism": VLLM_ROLLOUT,
    "rollout_tensor_parallelism": VLLM_ROLLOUT,
    "rollout_expert_parallelism": VLLM_ROLLOUT,
    "inference_replicas": (
        "refused: MaxText's multi-replica vLLM rollout; the plugin runs one rollout engine per sampler mesh"
    ),
    "inference_devices_per_replica": (
        "refused: MaxText's multi-replica vLLM rollout; the plugin runs one rollout engine per sampler mesh"
    ),
    "inference_rollouts": (
        "refused: MaxText's multi-replica vLLM rollout; the plugin runs one rollout engine per sampler mesh"
    ),
    "use_pathways_reshard": (
        "refused: resharding/backend.py chooses pathwaysutils' reshard itself when the backend is Pathways"
    ),
    "gc_collect_after_weight_sync": (
        "refused: the plugin's weight sync frees buffers chunk by chunk (reshard_donate); it does not call " "gc.collect"
    ),
    # --- dataset ---
    "batch_size": TRAINER,
    "num_batches": TRAINER,
    "num_test_batches": "honoured (trainer: eval)",
    "eval_batch_size": "honoured (trainer: eval)",
    "train_fraction": TRAINER,
    "train_micro_batch_size": TRAINER,
    "rollout_micro_batch_size": TRAINER,
    "hf_train_files": "refused: MaxText's HF file list; give local files as train_data_path (JSONL/Parquet)",
    "hf_eval_files": "refused: MaxText's HF file list; give local files as eval_data_path (JSONL/Parquet)",
    "test_batch_start_index": "refused: the plugin's eval split starts at its first row",
    "max_seq_token_per_tpu": (
        "honoured (trainer: algorithms/packing.py, the reference, old-policy and update forwards on packed rows; "
        "the loss on the batch layout; MoE batches pack with their routing)"
    ),
    "dataset_processor_path": (
        "refused: custom dataset processors are not supported; use train_data_path with GSM8K-style rows"
    ),
    # --- evaluation ---
    "eval_sampling_strategy": (
        "honoured (trainer: run/evaluation.py, the sampling of eval passes; greedy is exact greedy)"
    ),
    "generation_configs": "honoured (trainer: run/evaluation.py, eval_temperature/eval_top_k/eval_top_p per strategy)",
    "eval_corr_lst": "refused: MaxText's eval response lists are not produced by the plugin's eval",
    "eval_make_lst": "refused: MaxText's eval response lists are not produced by the plugin's eval",
    # --- rewards ---
    "math_verify_timeout": "refused: the plugin's per-completion timeout is reward_item_timeout_seconds",
    "reward_num_workers": (
        "refused: rewards are scored in-process with a math_verify pool (math_verify_num_procs); Tunix's "
        "reward worker pool is not used"
    ),
    "reward_worker_timeout_seconds": "refused: Tunix's reward worker pool is not used; see reward_item_timeout_seconds",
    "reward_functions_path": REWARDS,
    "reward_functions": REWARDS,
    # --- vLLM (passed on by rollout/vllm.py) ---
    "kv_cache_buffer": VLLM_ROLLOUT,
    "hbm_utilization_vllm": VLLM_ROLLOUT,
    "enable_dp_attention": VLLM_ROLLOUT,
    "enable_expert_parallel": VLLM_ROLLOUT,
    "async_scheduling": VLLM_ROLLOUT,
    "max_num_batched_tokens": VLLM_ROLLOUT,
    "max_num_seqs": VLLM_ROLLOUT,
    "vllm_block_size": VLLM_ROLLOUT,
    "stop_strings": "honoured (rollout engines: stop sequences)",
    # --- vLLM routes (rollout/vllm_maxtext.py: MaxText's MaxTextForCausalLM inside vLLM; docs/vllm.md) ---
    "vllm_additional_config": (
        "honoured (rollout/vllm_config.py, passed to vLLM; its maxtext_config configures MaxText's MaxTextForCausalLM, "
        "derived from the trainer's config when absent: rollout/vllm_maxtext.py)"
    ),
    "vllm_hf_overrides": (
        "honoured (rollout/vllm_config.py, passed to vLLM; architectures=[MaxTextForCausalLM] selects MaxText's own "
        "decoder inside vLLM, as in MaxText's train_rl: rollout/vllm_maxtext.py)"
    ),
    "use_weight_converter": (
        "refused: only MaxText's default (true) is supported: the plugin's vLLM sync is always an explicit converter "
        "(MaxText's MaxTextToMaxTextConverter for MaxTextForCausalLM, rollout/vllm_mapping.py for native classes); "
        "false selects MaxText's legacy Tunix transfer_state_directly, which intersects the two trees and can leave "
        "layers at vLLM's dummy weights"
    ),
    "vllm_hf_config_path": VLLM_ROLLOUT,
    "free_kv_cache_during_weight_sync": "honoured (rollout/vllm.py: weight sync)",
    "weight_sync_debug": (
        "refused: MaxText's converter debug logging; the plugin checks syncs with rl.verify_weight_sync"
    ),
    "log_weight_sync_time": "refused: MaxText's converter timing log; the plugin logs every sync's time and bytes",
}

# Refused keys whose MaxText RL default means something the plugin does not do: the text says what it does instead
# (issue 42's audit; the table in docs/DEVELOPMENT.md, "Where the plugin differs from MaxText's RL defaults", and
# tests/config/test_key_audit.py keep the list).
_KEY_STATUS.update(
    {
        **dict.fromkeys(
            ("abort_on_nan_loss", "abort_on_inf_loss"),
            "refused: MaxText's pre-training loop stops on a NaN/Inf loss; the RL trainer logs a warning for a "
            "non-finite step metric and goes on",
        ),
        "save_checkpoint_on_start": (
            "refused: MaxText's pre-training saves a checkpoint before the first step; the RL trainer's first "
            "checkpoint is at checkpoint_period (and every run ends on one)"
        ),
        "save_checkpoint_on_completion": "refused: the RL trainer always saves the last step (MaxText's default)",
        **dict.fromkeys(
            ("lr_schedule_type", "learning_rate_final_fraction"),
            "refused: the RL schedule is MaxText RL's (utils_rl.get_optimizer): linear warmup, then cosine decay to 0, "
            "not pre-training's cosine to learning_rate_final_fraction x learning_rate",
        ),
        **dict.fromkeys(
            ("add_bos", "add_eos"),
            "refused: MaxText's pre-training tokenizer adds BOS/EOS to every text; RL prompts are encoded with the "
            "HF tokenizer's own defaults (a doubled leading BOS collapsed) and no EOS is appended",
        ),
        "use_truncation": (
            "refused: MaxText's pre-training truncates long texts; the RL data drops prompts longer than "
            "max_prefill_predict_length, as MaxText's RL data does"
        ),
        "vllm_load_format": (
            "refused: rollout/vllm.py always starts vLLM from dummy weights (MaxText's RL default) and syncs the "
            "trainer's into it"
        ),
        "swap_space_vllm_gb": (
            "refused: rollout/vllm.py does not pass a CPU swap space to vLLM (vLLM's own default applies, not 2 GB)"
        ),
        # use_weight_converter: with the vLLM routes' rows above (rollout/vllm_maxtext.py uses MaxText's converter).
        "rollout_backend": (
            "refused: MaxText's vLLM weight converter is not used; the plugin's vLLM engine maps weights itself "
            "(rollout/vllm_mapping.py)"
        ),
    }
)

# MaxText's `lora:` block (its SFT keys), read by lora.py with train_sft's meaning; QLoRA is refused.
_QLORA = (
    "refused: QLoRA (a quantized frozen base) is not implemented: the reference model is the float base and the "
    "embedded engine merges adapters into float base kernels"
)
_KEY_STATUS.update(
    {
        "lora.enable_lora": "honoured (lora.py: MaxText's lora_utils.apply_lora_to_model on the actor; adapters-only "
        "training, sync and checkpoints; rollout_engine=vllm gets the adapted kernels merged on the trainer side)",
        "lora.lora_rank": "honoured (lora.py: qwix LoraProvider rank)",
        "lora.lora_alpha": "honoured (lora.py: qwix LoraProvider alpha; the update is alpha/rank * A @ B)",
        "lora.lora_module_path": "honoured (lora.py: modules to adapt; empty = MaxText's post_train/lora_module_path.yml "
        "entry for model_name)",
        "lora.lora_restore_path": "honoured (lora.py: MaxText's restore_lora_from_path before training; ignored on "
        "resume, as in MaxText)",
        "lora.lora_weight_qtype": _QLORA,
        "lora.lora_tile_size": _QLORA,
    }
)

# The key names the enumeration skips: containers whose inner keys carry the status.
BLOCKS = ("rl", "cluster", "dataset", "reward", "special_tokens", "evaluation", "vllm")
# Blocks whose inner keys have no flat twin: named `<block>.<key>` (`rl.` above, and the plugin's `lora:` block).
DOTTED_BLOCKS = ("rl", "lora")
# Every field of the schema that is a nested block (tests/config/test_config.py compares it with the schema).
NESTED_BLOCKS = (*DOTTED_BLOCKS, *(b for b in BLOCKS if b not in DOTTED_BLOCKS))

# The schema's key names without importing it (config_keys.light_keys, for refusing an unknown key before JAX loads):
# the shipped defaults' keys (MaxText's base.yml under configs/rl.yml) less YML_ONLY_KEYS (in base.yml, not in the
# schema: MaxText drops them) plus SCHEMA_ONLY_KEYS (fields with no yml default: derived values, flat twins of
# `rl.` keys, keys MaxText's base.yml leaves out). tests/config/test_config.py keeps both exact.
YML_ONLY_KEYS: frozenset[str] = frozenset(
    {
        "blend_cache_dir",
        "blend_index_dir",
        "eod_mask_loss",
        "mmap_eod_id",
        "mmap_npy_split",
        "mmap_split_sentences",
        "packing_max_segments_per_sample",
        "reset_attention_mask",
    }
)
SCHEMA_ONLY_KEYS: frozenset[str] = frozenset(
    {
        "attention_for_vit",
        "attn_module_name",
        "checkpoint_dir",
        "dcn_parallelism",
        "distill_student_weights_share_map",
        "distill_weights_copy_map",
        "emb_dim",
        "enable_expert_parallel",
        "epsilon_high",
        "force_on_policy_ratio",
        "formatting_func_kwargs",
        "formatting_func_path",
        "fuse_expert_scales",
        "gdn_mamba_block_size",
        "global_batch_size_to_eval_on",
        "global_batch_size_to_load",
        "global_batch_size_to_load_eval",
        "global_batch_size_to_load_increment",
        "global_batch_size_to_load_start",
        "global_batch_size_to_train_on",
        "grpo_beta",
        "grpo_epsilon",
        "ici_parallelism",
        "inference_devices_per_replica",
        "inference_replicas",
        "inference_rollouts",
        "learn_to_init_mode",
        "load_checkpoint_only_once",
        "log_moe_bias_norms",
        "log_sampler_trainer_agreement",
        "log_weight_sync_time",
        "loss_agg_mode",
        "loss_algo",
        "lti_layer_indices",
        "lti_use_general_linear_map",
        "managed_mldiagnostics_dir",
        "max_concurrency",
        "metrics_dir",
        "micro_batch_size_to_eval_on",
        "micro_batch_size_to_train_on",
        "mlp_dim",
        "moe_mlp_dim",
        "num_decoder_layers",
        "num_diloco_replicas",
        "num_generations",
        "num_iterations",
        "num_kv_heads",
        "num_query_heads",
        "num_target_devices",
        "off_policy_steps",
        "offline_data_dir",
        "padded_base_moe_mlp_dim",
        "prefuse_moe_weights",
        "ragged_sort_use_single_sparsecore",
        "rampup_end_step",
        "rampup_samples_per_increment_to_load",
        "replicator_backup_interval_minutes",
        "reshard_chunk_size",
        "sharding_strategy",
        "student_overrides",
        "student_params_to_update",
        "system_prompt",
        "teacher_overrides",
        "tensorboard_dir",
        "tensors_on_device",
        "tensors_to_offload",
        "use_agentic_rollout",
        "use_grpo",
        "use_pathways_reshard",
        "use_replicator_service",
        "use_rollout_logps",
        "use_standalone_converter",
        "use_tunix_gradient_accumulation",
        "using_pipeline_parallelism",
        "vision_connector_activation",
        "vision_connector_hidden_size",
        "vision_connector_num_layers",
        "vision_connector_use_bias",
        "vision_encoder_block",
        "vision_projector_type",
        "rl.force_on_policy_ratio",
        "rl.log_sampler_trainer_agreement",
        "rl.mini_batch_size",
        "rl.rollout_is",
        "rl.rollout_is_cap",
        "rl.use_rollout_logps",
    }
)


def _config_class():
  """The schema, imported when first needed: it imports MaxText's types (and JAX), and config/keys.py, which
  would give it to us, imports this module."""
  from maxtext_rl_plugin.config.schema import PluginRLConfig

  return PluginRLConfig


@functools.cache
def _declaring_class() -> dict[str, str]:
  """key -> name of the most-derived class that declares it (`rl.<key>` for the rl block)."""
  cls = _config_class()
  out: dict[str, str] = {}

  def own(klass) -> list[str]:
    return [f for f in vars(klass).get("__annotations__", {}) if f in getattr(klass, "model_fields", {})]

  for klass in cls.__mro__:
    for name in own(klass):
      out.setdefault(name, klass.__name__)
  for block in DOTTED_BLOCKS:
    for klass in cls.model_fields.get(block).annotation.__mro__:
      for name in own(klass):
        out.setdefault(f"{block}.{name}", klass.__name__)
  return out


@functools.cache
def _rl_block_classes() -> frozenset[str]:
  """The classes the `rl:` block is made of (MaxText's `RL` and the plugin's concerns): a flat key one of them declares
  is a twin of an `rl:` key."""
  return frozenset(
      k.__name__ for k in _config_class().model_fields.get("rl").annotation.__mro__ if "model_fields" in dir(k)
  )


def all_keys() -> list[str]:
  """Every key of the schema: top-level fields (minus block containers) and `rl.<key>`."""
  return sorted(k for k in _declaring_class() if k not in BLOCKS + DOTTED_BLOCKS)


def canonical(key: str) -> str:
  """The status-table name of a user key: `dataset.batch_size` -> `batch_size`, `rl.x` stays, flat `loss_algo`
  (a top-level twin of an `rl:` key, which MaxText routes into the block) -> `rl.loss_algo`."""
  head, _, tail = key.partition(".")
  if tail and head in DOTTED_BLOCKS:
    return f"{head}.{tail.split('.')[0]}"
  if tail and head in BLOCKS:
    return tail.split(".")[0]
  if tail:
    return head  # a dict-valued field such as generation_configs.greedy.eval_top_k
  if _declaring_class().get(key) in _rl_block_classes():
    return f"rl.{key}"
  return key


def status(key: str) -> str | None:
  """`honoured (...)` or `refused: ...` for a key (any spelling `canonical` accepts); None when unknown. A plugin key's
  is its field's (config/rules.statuses); MaxText's come from the tables above."""
  key = canonical(key)
  if key in rules.statuses():
    return rules.statuses()[key]
  if key in _KEY_STATUS:
    return _KEY_STATUS[key]
  owner = _declaring_class().get(key)
  return CLASS_STATUS.get(owner) if owner else None


def refusal(key: str) -> str | None:
  """The reason a key is refused, or None when it is honoured."""
  s = status(key) or ""
  return s[len("refused: ") :] if s.startswith("refused: ") else None


def same_value(a: Any, b: Any) -> bool:
  """Equality of a user value and a default as YAML/CLI spell them (`null`/`None`, 1 vs 1.0, tuples vs lists)."""

  def norm(v):
    """A yml value as MaxText compares it: 'none'/'null'/'~' are None, tuples are lists."""
    if isinstance(v, str) and v.strip().lower() in ("none", "null", "~"):
      return None
    if isinstance(v, tuple):
      return [norm(x) for x in v]
    if isinstance(v, list):
      return [norm(x) for x in v]
    if isinstance(v, dict):
      return {k: norm(x) for k, x in v.items()}
    if hasattr(v, "value") and not isinstance(v, (int, float, str, bool)):  # enums
      return v.value
    return v

  a, b = norm(a), norm(b)
  numbers = [isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)]
  if all(numbers):
    return float(a) == float(b)
  return a == b
