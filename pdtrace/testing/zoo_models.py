"""Tiny configs of the model families people serve in P/D (issue 47's architecture zoo), for vLLM
to build each one's KV cache groups from the model's own layers (``pdtrace.testing.zoo``).

No weights: the layers are constructed on torch's meta device. Sizes are the smallest each model
class and vLLM's CPU platform accept (the CPU attention backend wants head_dim >= 32). Each entry:
the HF ``config.json`` (``architectures``, ``model_type`` and the fields the vLLM model class
reads), the speculative method the family serves with, and which family it stands for.
"""

from __future__ import annotations

from typing import Any

PROMPTS = (20, 64, 100, 128, 200, 255)  # the zoo's prompt lengths: below and past every window, block-aligned and not

_COMMON = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
           "tie_word_embeddings": False}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": {
        "stands_for": "Llama 3 (full attention)", "spec": "eagle",
        "config": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
                   "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 500000.0,
                   "hidden_act": "silu"},
    },
    "gemma3": {
        "stands_for": "Gemma 3 (5 sliding-window layers to 1 full)", "spec": "draft_model",
        "config": {**_COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                   "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                   "sliding_window": 64, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                   "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32,
                   "hidden_activation": "gelu_pytorch_tanh"},
    },
    "gpt-oss": {
        "stands_for": "gpt-oss (sliding 128 + full, alternating; attention sinks; MoE)", "spec": "eagle",
        "config": {**_COMMON, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 2,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 128,
                   "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
                   "num_experts_per_tok": 2, "experts_per_token": 2, "rope_theta": 150000.0,
                   "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096},
                   "swiglu_limit": 7.0, "attention_bias": True, "hidden_act": "silu"},
    },
    "llama4": {
        "stands_for": "Llama 4 (chunked local attention + full; MoE)", "spec": "draft_model",
        "config": {**_COMMON, "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
                   "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                   "attention_chunk_size": 64, "no_rope_layers": [1, 1, 1, 0], "interleave_moe_layer_step": 2,
                   "num_local_experts": 2, "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
                   "rope_theta": 500000.0, "use_qk_norm": True, "hidden_act": "silu", "attn_temperature_tuning": True,
                   "floor_scale": 8192, "attn_scale": 0.1},
    },
    "deepseek-v3": {
        "stands_for": "DeepSeek-V3 (MLA; MTP, 1 layer)", "spec": "mtp",
        "config": {**_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                   "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 256,
                   "q_lora_rank": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
                   # (MLA's head size, kv_lora_rank + qk_rope_head_dim, must be 320, 512 or 576:
                   # MLACommonBackend.get_supported_head_sizes, vllm/model_executor/layers/attention/mla_attention.py)
                   "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
                   "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                   "norm_topk_prob": True, "num_nextn_predict_layers": 1, "rope_theta": 10000.0, "hidden_act": "silu"},
    },
    "qwen3-next": {
        "stands_for": "Qwen3-Next (gated DeltaNet + full attention; MTP)", "spec": "mtp",
        "config": {**_COMMON, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                   "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                   "full_attention_interval": 4, "linear_num_value_heads": 2, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
                   "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "norm_topk_prob": True,
                   "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "hidden_act": "silu",
                   "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mlp_only_layers": [],
                   "num_nextn_predict_layers": 1, "mtp_num_hidden_layers": 1},
    },
    "nemotron-h": {
        "stands_for": "Nemotron-H (Mamba-2 + attention)", "spec": "ngram",
        "config": {**_COMMON, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                   "num_hidden_layers": 2, "hybrid_override_pattern": "M*", "num_attention_heads": 2, "head_dim": 32,
                   "num_key_value_heads": 2, "mlp_hidden_act": "relu2", "attention_bias": False, "mlp_bias": False,
                   "use_bias": False, "layer_norm_epsilon": 1e-5, "residual_in_fp32": False, "ssm_state_size": 16,
                   "mamba_num_heads": 4, "mamba_n_groups": 1, "mamba_head_dim": 32, "mamba_d_conv": 4,
                   "mamba_expand": 2, "mamba_hidden_act": "silu", "chunk_size": 64, "n_groups": 1, "conv_kernel": 4,
                   "expand": 2},
    },
}


def _reason(exc: BaseException) -> str:
    """Why a family did not build, the same however vLLM raised it: a config validator's ValueError arrives bare or
    wrapped in pydantic's ValidationError ("Value error, ..."), both seen for one release on one host."""
    import re

    msg = str(exc)
    m = re.search(r"Value error, (.*?)(?: \[type=|$)", msg, re.S)
    if type(exc).__name__ == "ValidationError" and m:
        return ("ValueError: " + " ".join(m.group(1).split()))[:300]
    return f"{type(exc).__name__}: {msg[:300]}"
