"""Hugging Face `config.json` ↔ `model.base_model`, for the architectures fastllm converts."""

from __future__ import annotations

from typing import Any

from fastllm.config import BaseModelConfig, ConfigError, build

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
}
_ACTIVATIONS = {
    "silu": "silu",
    "gelu": "gelu_pytorch_tanh",
    "relu": "relu",
    "squared_relu": "relu2",
}
_HF_ACTIVATIONS = {hf: ours for ours, hf in _ACTIVATIONS.items()} | {"gelu_new": "gelu"}


def _rotary_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters`; earlier versions `rope_theta` + `rope_scaling`.
    parameters = dict(hf.get("rope_parameters") or {})
    if not parameters:
        parameters = dict(hf.get("rope_scaling") or {})
        parameters["rope_theta"] = hf.get("rope_theta", 10000.0)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    rotary: dict[str, Any] = {"theta": parameters["rope_theta"]}
    if kind == "default":
        return {"type": "default", **rotary}
    original = parameters.get("original_max_position_embeddings")
    if kind == "llama3":
        return {
            "type": "llama3",
            **rotary,
            "scale_factor": parameters["factor"],
            "low_frequency_factor": parameters["low_freq_factor"],
            "high_frequency_factor": parameters["high_freq_factor"],
            "original_context_length": original,
        }
    if kind == "yarn":
        yarn = {"type": "yarn", **rotary, "scale_factor": parameters["factor"]}
        yarn["original_context_length"] = original or hf["max_position_embeddings"]
        for theirs, ours in (
            ("attention_factor", "attention_factor"),
            ("beta_fast", "beta_fast"),
            ("beta_slow", "beta_slow"),
        ):
            if parameters.get(theirs) is not None:
                yarn[ours] = parameters[theirs]
        return yarn
    raise ConfigError("config.json:rope_parameters", f"rotary type {kind!r} is not supported")


def from_hf_config(hf: dict[str, Any]) -> tuple[str, BaseModelConfig]:
    """The architecture name and the equivalent `model.base_model`."""
    architecture = hf.get("model_type")
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            "config.json:model_type",
            f"{architecture!r} is not supported; expected one of {', '.join(ARCHITECTURES)}",
        )
    heads = hf["num_attention_heads"]
    transformer: dict[str, Any] = {
        "normalization": {"type": "rms_norm", "epsilon": hf.get("rms_norm_eps", 1e-6)},
        "rotary": _rotary_from_hf(hf),
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "head_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "gated": True,
        "activation_type": _HF_ACTIVATIONS[hf.get("hidden_act", "silu")],
        "add_linear_biases": bool(hf.get("attention_bias", False)),
    }
    if architecture in ("mistral", "mixtral", "starcoder2") and hf.get("sliding_window"):
        transformer["window_size"] = hf["sliding_window"]
    if architecture == "qwen2":
        transformer["add_linear_biases"] = "only_attn_qkv"
        if hf.get("use_sliding_window") and hf.get("sliding_window"):
            if hf.get("max_window_layers", hf["num_hidden_layers"]) < hf["num_hidden_layers"]:
                raise ConfigError(
                    "config.json:max_window_layers", "per-layer sliding windows are not supported"
                )
            transformer["window_size"] = hf["sliding_window"]
    if architecture == "llama" and hf.get("mlp_bias") and not hf.get("attention_bias"):
        raise ConfigError("config.json:mlp_bias", "biases on the MLP alone are not supported")
    if architecture == "mixtral":
        transformer["num_experts"] = hf["num_local_experts"]
        transformer["num_experts_per_token"] = hf["num_experts_per_tok"]
        transformer["expert_auxiliary_loss_coefficient"] = hf.get("router_aux_loss_coef", 0.001)
    if architecture == "starcoder2":
        transformer["normalization"] = {
            "type": "layer_norm",
            "epsilon": hf.get("norm_epsilon", 1e-5),
        }
        transformer["gated"] = False
        transformer["add_linear_biases"] = bool(hf.get("use_bias", True))
    raw = {
        "transformer": transformer,
        "vocab_size": hf["vocab_size"],
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    return architecture, build(BaseModelConfig, raw)


def _rotary_to_hf(config: BaseModelConfig) -> dict[str, Any]:
    rotary = config.transformer.rotary
    kind = getattr(type(rotary).__struct_config__, "tag", None)
    if kind == "none":
        raise ConfigError(
            "model.base_model.transformer.rotary", "Hugging Face models need rotary embeddings"
        )
    fields: dict[str, Any] = {"rope_theta": rotary.theta}  # type: ignore[attr-defined]
    if kind == "llama3":
        fields["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rotary.scale_factor,  # type: ignore[attr-defined]
            "low_freq_factor": rotary.low_frequency_factor,  # type: ignore[attr-defined]
            "high_freq_factor": rotary.high_frequency_factor,  # type: ignore[attr-defined]
            "original_max_position_embeddings": rotary.original_context_length,  # type: ignore[attr-defined]
        }
    elif kind == "yarn":
        fields["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": rotary.scale_factor,  # type: ignore[attr-defined]
            "attention_factor": rotary.attention_factor,  # type: ignore[attr-defined]
            "beta_fast": rotary.beta_fast,  # type: ignore[attr-defined]
            "beta_slow": rotary.beta_slow,  # type: ignore[attr-defined]
            "original_max_position_embeddings": rotary.original_context_length,  # type: ignore[attr-defined]
        }
    else:
        fields["rope_scaling"] = None
    return fields


def to_hf_config(
    config: BaseModelConfig, architecture: str, template: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `config.json` of `architecture` for this model. Keys of `template` (the config the
    model was converted from, if any) that fastllm does not model are kept as they were."""
    if architecture not in ARCHITECTURES:
        raise ConfigError("output.format", f"unknown architecture {architecture!r}")
    t = config.transformer
    path = "model.base_model.transformer"
    problems = _unsupported(config, architecture)
    if problems:
        key, message = problems[0]
        raise ConfigError(f"{path}.{key}", f"{message}, which {architecture} cannot express")
    hf: dict[str, Any] = (
        dict(template or {}) if (template or {}).get("model_type") == architecture else {}
    )
    for stale in (
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "architectures",
        "transformers_version",
    ):
        hf.pop(stale, None)
    hf.update(
        {
            "architectures": [ARCHITECTURES[architecture]],
            "model_type": architecture,
            "vocab_size": config.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.ffn_hidden_size,
            "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.head_groups,
            "head_dim": t.kv_channels,
            "hidden_act": _ACTIVATIONS[t.activation_type or "silu"],
            "tie_word_embeddings": config.tie_word_embeddings,
            "initializer_range": t.init_method_std,
            **_rotary_to_hf(config),
        }
    )
    hf.setdefault("max_position_embeddings", _context_length(config))
    if architecture == "starcoder2":
        hf["norm_epsilon"] = t.normalization.epsilon
        hf["use_bias"] = t.biases_elsewhere
    else:
        hf["rms_norm_eps"] = t.normalization.epsilon
    if architecture == "llama":
        hf["attention_bias"] = t.biases_in_attention_qkv
        hf["mlp_bias"] = t.biases_elsewhere
    if architecture in ("mistral", "mixtral", "starcoder2"):
        hf["sliding_window"] = t.window_size
    if architecture == "qwen2":
        hf["use_sliding_window"] = t.window_size is not None
        hf["sliding_window"] = t.window_size
        hf["max_window_layers"] = t.num_layers
    if architecture == "mixtral":
        hf["num_local_experts"] = t.num_experts
        hf["num_experts_per_tok"] = t.num_experts_per_token
        hf["router_aux_loss_coef"] = t.expert_auxiliary_loss_coefficient
        hf["output_router_logits"] = False
    return hf


def _context_length(config: BaseModelConfig) -> int:
    rotary = config.transformer.rotary
    original = getattr(rotary, "original_context_length", None)
    return int(original * rotary.scale_factor) if original else 4096  # type: ignore[attr-defined]


def _unsupported(config: BaseModelConfig, architecture: str) -> list[tuple[str, str]]:
    """(key, problem) for each feature of the model that `architecture` has no field for."""
    t = config.transformer
    problems: list[tuple[str, str]] = []
    layer_norm = t.normalization.__struct_config__.tag == "layer_norm"
    if layer_norm != (architecture == "starcoder2"):
        problems.append(
            ("normalization.type", f"the model uses {t.normalization.__struct_config__.tag}")
        )
    if t.gated == (architecture == "starcoder2"):
        problems.append(("gated", f"the model's MLP is {'gated' if t.gated else 'not gated'}"))
    if (t.num_experts > 1) != (architecture == "mixtral"):
        problems.append(("num_experts", f"the model has {t.num_experts} experts"))
    if t.window_size is not None and architecture == "llama":
        problems.append(("window_size", "the model uses sliding-window attention"))
    biases = (t.biases_in_attention_qkv, t.biases_elsewhere)
    allowed = {
        "llama": {(False, False), (True, True)},
        "mistral": {(False, False)},
        "mixtral": {(False, False)},
        "qwen2": {(True, False)},
        "starcoder2": {(True, True), (False, False)},
    }[architecture]
    if biases not in allowed:
        problems.append(
            ("add_linear_biases", f"the model has add_linear_biases={t.add_linear_biases!r}")
        )
    return problems
