"""The enumerated keys of the schema and their choices, light (no JAX): the first pass refuses a value outside them.

pydantic refuses such a value too, but only in the schema pass (its imports: JAX, MaxText, ~10 s on a loaded machine),
so `loss_algo=no_such_name` cost ten seconds for one line. The table holds every `Literal[...]` and `Enum` field of
`schema.PluginRLConfig` (list-valued fields and model_name, which `config_files.check_model_name` refuses with a
suggestion, excepted): MaxText's, restated here, and the plugin's, read from their own fields (`rules.choices`; the
plugin's fields are light). Plus `remat_policy`, a plain string in MaxText's schema whose values the decoder's
`get_remat_policy` alone decides (an unknown one is an AssertionError at the first forward). tests/test_bad_input.py
derives both from MaxText 0.2.5 and the schema and compares them with this table.
"""

from __future__ import annotations

from typing import Any

from maxtext_rl_plugin.config import rules

# Choice sets MaxText declares for several keys: each remat-policy tensor's placement, and the mesh rules of training and
# of evaluation.
_OFFLOAD = ("remat", "device", "offload")
_MESH_RULES = (
    "",
    "pure-fsdp",
    "cp-as-ep",
    "ep-as-cp",
    "pipeline-large-moe",
    "2d-fsdp",
    "ep-as-dp",
    "shard-exp-on-fsdp",
    "fsdp-as-dp-for-attn",
)

CHOICES: dict[str, tuple[Any, ...]] = {
    "attention_out": _OFFLOAD,
    "attention_type": ("global", "local_sliding", "chunk", "mla", "full", "compressed", "block_diffusion"),
    "block_diffusion_canvas_policy": ("all_masked", "seed_and_mask"),
    "block_diffusion_logit_alignment": ("same_position", "shifted"),
    "context": _OFFLOAD,
    "context_parallel_reorder_strategy": ("auto", "dual_chunk_swap", "striped"),
    "custom_mesh_and_rule": _MESH_RULES,
    "custom_mesh_and_rule_for_eval": _MESH_RULES,
    "dataset_type": ("synthetic", "hf", "grain", "tfds", "c4_mlperf", "olmo_grain"),
    "decode_sampling_strategy": ("greedy", "weighted", "nucleus", "topk", "composite"),
    "decoder_block": (
        "default",
        "llama2",
        "mistral",
        "mixtral",
        "deepseek",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma4",
        "gemma4_small",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen3_custom_moe",
        "qwen3_next",
        "qwen3_5",
        "gpt3",
        "gpt_oss",
        "simple",
        "simple_mlp",
        "llama4",
        "olmo3",
        "deepseek4",
        "envy",
    ),
    "decoder_layer_input": _OFFLOAD,
    "distill_alpha_schedule": ("constant", "linear", "cosine"),
    "distill_beta_schedule": ("constant", "linear", "cosine"),
    "distill_feature_loss_type": ("cosine", "l2"),
    "distill_temperature_schedule": ("constant", "linear", "cosine"),
    "dtype": ("bfloat16", "float32", "float16", "float8_e4m3fn", "float8_e5m2"),
    "engram": _OFFLOAD,
    "eval_mode": ("pass", "maj", "pass_at_1"),
    "evaluation.eval_mode": ("pass", "maj", "pass_at_1"),
    "grad_dtype": ("bfloat16", "float32", "float16", "float8_e4m3fn", "float8_e5m2"),
    "grain_index_storage_option": ("in_memory", "offloaded"),
    "grain_packing_type": ("first_fit", "best_fit", "concat_then_split"),
    "hardware": ("tpu", "gpu", "gpu_multiprocess", "cpu"),
    "indexer_cutoff_threshold": _OFFLOAD,
    "key_proj": _OFFLOAD,
    "kv_proj": _OFFLOAD,
    "kv_quant_axis": ("", "dkv", "heads_and_dkv"),
    "kv_quant_dtype": ("int8", "int4"),
    "kv_wa_proj": _OFFLOAD,
    "loss_agg_mode": ("token-mean", "sequence-mean", "sequence-mean-token-mean"),
    "lr_schedule_type": ("cosine", "wsd"),
    "matmul_precision": ("default", "high", "highest", "bfloat16", "float32"),
    "mla_kv": _OFFLOAD,
    "mla_q": _OFFLOAD,
    "mlpwi": _OFFLOAD,
    "mlpwi_0": _OFFLOAD,
    "mlpwi_1": _OFFLOAD,
    "mlpwo": _OFFLOAD,
    "moe_dropless_fallback": ("step", "layer"),
    "moe_mlpwi_0": _OFFLOAD,
    "moe_mlpwi_1": _OFFLOAD,
    "moe_mlpwo": _OFFLOAD,
    "moe_routing_maps": _OFFLOAD,
    "moe_x_sorted": _OFFLOAD,
    "opt_type": ("adamw", "adam_pax", "sgd", "muon"),
    "out_proj": _OFFLOAD,
    "profiler": ("", "xplane", "nsys"),
    "qkv_proj": _OFFLOAD,
    "quantization": (
        "",
        "fp4",
        "int4",
        "int8",
        "intmp",
        "fp8_e5m2",
        "fp8_e4m3",
        "fp8",
        "nanoo_fp8",
        "fp8_nanoo",
        "fp8_gpu",
        "fp8_full",
        "te_no_quant",
        "te_fp8_delayedscaling",
        "te_fp8_currentscaling",
        "te_mxfp8",
        "te_nvfp4",
        "te_nvfp4_no_rht",
        "serve_fp8_weight",
    ),
    "query_proj": _OFFLOAD,
    "query_wa_proj": _OFFLOAD,
    "rl.loss_agg_mode": ("token-mean", "sequence-mean", "sequence-mean-token-mean"),
    "rollout_backend": ("maxtext", "vllm_torchax"),
    "rope_type": ("default", "llama3.1", "yarn"),
    "shard_mode": ("auto", "explicit"),
    "sharding_strategy": ("experimental",),
    "source_checkpoint_layout": ("orbax", "safetensors", "safetensors_dynamic"),
    "te_gmm_quantization": ("", "te_no_quant", "te_mxfp8"),
    "tokenizer_type": ("sentencepiece", "huggingface", "tiktoken"),
    "training_objective": ("causal_lm", "block_diffusion"),
    "value_proj": _OFFLOAD,
    "vision_encoder_block": ("none", "gemma3", "llama4", "qwen3_omni", "gemma4", "qwen3_5", "qwen3_vl"),
    "vllm.rollout_backend": ("maxtext", "vllm_torchax"),
    "weight_dtype": ("bfloat16", "float32", "float16", "float8_e4m3fn", "float8_e5m2"),
    "wsd_decay_style": ("linear", "cosine"),
    "xprof_tpu_power_trace_level": (0, 1, 2),
}

# MaxText 0.2.5's remat policies: `types.RematPolicy` and the further names `nnx_decoders.get_remat_policy` reads
# ("none" and null: no rematerialisation).
REMAT_POLICIES: tuple[str, ...] = (
    "full",
    "minimal",
    "save_dot_with_context_except_mlp",
    "save_dot_except_mlpwi",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "qkv_proj_offloaded",
    "custom",
    "minimal_offloaded",
    "save_out_proj",
    "minimal_with_context",
    "minimal_flash",
    "minimal_with_quantization",
    "minimal_with_context_and_quantization",
    "none",
)
CHOICES["remat_policy"] = REMAT_POLICIES
# The plugin's own enumerated keys: their fields' `Literal[...]` types (config/rules.py).
CHOICES.update(rules.choices())
