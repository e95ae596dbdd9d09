"""Small random Hugging Face models of each architecture, built by `transformers` itself."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = {
    "vocab_size": 97,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

CONFIGS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
        },
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 5, "head_dim": 8, "tie_word_embeddings": False},
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"rope_theta": 1000000.0, "tie_word_embeddings": True},
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "norm_topk_prob": False,
            "rope_theta": 1000000.0,
        },
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {
            "head_dim": 16,  # not hidden_size / heads: a per-head norm of its own size
            "rope_theta": 1000000.0,
            "use_sliding_window": True,
            "sliding_window": 5,
            "max_window_layers": 0,  # every layer slides
            "rms_norm_eps": 1e-6,
        },
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
            "rope_theta": 1000000.0,
            "use_sliding_window": True,
            "sliding_window": 5,
            "rms_norm_eps": 1e-6,
        },
    ),
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_parameters": {  # each kind its own base; the global layers' scaled
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            "query_pre_attn_scalar": 20,  # not head_dim: a scale of its own
            "rms_norm_eps": 1e-6,
        },
    ),
    "olmo2": (
        transformers.Olmo2Config,
        transformers.Olmo2ForCausalLM,
        {"rope_theta": 500000.0, "rms_norm_eps": 1e-6},
    ),
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        {
            "num_key_value_heads": 6,
            "q_lora_rank": 24,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 10,
            "qk_rope_head_dim": 6,
            "v_head_dim": 12,  # none of the three is another's size
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "n_group": 4,
            "topk_group": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_theta": 50000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    "starcoder2": (
        transformers.Starcoder2Config,
        transformers.Starcoder2ForCausalLM,
        {"sliding_window": 6, "use_bias": True, "norm_epsilon": 1e-5},
    ),
}


def hf_model(architecture: str, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    config_class, model_class, extra = CONFIGS[architecture]
    torch.manual_seed(seed)
    config = config_class(**(COMMON | extra | overrides))
    config._attn_implementation = "eager"
    model = model_class(config).float().eval()
    with torch.no_grad():  # random norms and biases too, so their mapping is exercised
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's routing bias
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def save_hf_model(
    architecture: str, directory: Path, seed: int = 0, **overrides: object
) -> transformers.PreTrainedModel:
    model = hf_model(architecture, seed, **overrides)
    model.save_pretrained(directory)
    return model
