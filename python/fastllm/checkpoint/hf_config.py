"""Hugging Face `config.json` ↔ `model.base_model`, for the architectures fastllm converts."""

from __future__ import annotations

from typing import Any

from fastllm.checkpoint.architectures import ARCHITECTURES
from fastllm.config import BaseModelConfig, ConfigError, build
from fastllm.config.formats import inexpressible

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
    # Per layer type (Gemma 3): the global layers' (the architecture reads the sliding ones').
    parameters = dict(parameters.get("full_attention", parameters))
    if not parameters:
        parameters = dict(hf.get("rope_scaling") or {})
        parameters["rope_theta"] = hf.get("rope_theta", 10000.0)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    rotary: dict[str, Any] = {"theta": parameters["rope_theta"]}
    if kind == "default":
        return {"type": "default", **rotary}
    if kind == "linear":
        return {"type": "linear", **rotary, "scale_factor": parameters["factor"]}
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
    ARCHITECTURES[architecture].from_hf(hf, transformer)
    raw = {
        "transformer": transformer,
        "vocab_size": hf["vocab_size"],
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    return architecture, build(BaseModelConfig, raw)


def _rotary_to_hf(config: BaseModelConfig) -> dict[str, Any]:
    rotary = config.transformer.rotary
    kind = getattr(type(rotary).__struct_config__, "tag", None)
    fields: dict[str, Any] = {"rope_theta": rotary.theta}  # type: ignore[attr-defined]
    if kind == "llama3":
        fields["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rotary.scale_factor,  # type: ignore[attr-defined]
            "low_freq_factor": rotary.low_frequency_factor,  # type: ignore[attr-defined]
            "high_freq_factor": rotary.high_frequency_factor,  # type: ignore[attr-defined]
            "original_max_position_embeddings": rotary.original_context_length,  # type: ignore[attr-defined]
        }
    elif kind == "linear":
        fields["rope_scaling"] = {"rope_type": "linear", "factor": rotary.scale_factor}  # type: ignore[attr-defined]
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
    if reason := inexpressible(config, architecture):
        raise ConfigError("output.format", f"{architecture} cannot express the model: {reason}")
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
            "architectures": [ARCHITECTURES[architecture].hf_class],
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
    ARCHITECTURES[architecture].to_hf(config, hf)
    return hf


def _context_length(config: BaseModelConfig) -> int:
    rotary = config.transformer.rotary
    original = getattr(rotary, "original_context_length", None)
    return int(original * rotary.scale_factor) if original else 4096  # type: ignore[attr-defined]
