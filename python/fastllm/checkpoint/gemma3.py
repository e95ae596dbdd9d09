"""Gemma 3 (text, `Gemma3ForCausalLM`) config.json ↔ `transformer`: zero-centered RMSNorms
around attention and the MLP (sandwich) and over each query and key head, GeGLU with tanh
GELU, embeddings scaled by sqrt(hidden_size), sliding blocks with one global block every
`sliding_window_pattern` (transformers 5: `layer_types`), each kind with its own rotary, and
the attention scaled by query_pre_attn_scalar ** -0.5. Its tensors are the common ones
(checkpoint/hf_weights.py) and a gated MLP's."""

from __future__ import annotations

from typing import Any

from fastllm.config import BaseModelConfig, ConfigError

_SLIDING, _FULL = "sliding_attention", "full_attention"
_LOCAL_THETA = 10000.0
"""transformers' default rotary base of the sliding layers (rope_local_base_freq)."""


def gemma3_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ConfigError(f"config.json:{key}", "logit softcapping is not supported")
    for key in ("use_bidirectional_attention", "attention_bias"):
        if hf.get(key):
            raise ConfigError(f"config.json:{key}", "is not supported (Gemma 3 has it false)")
    activation = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ConfigError("config.json:hidden_activation", f"{activation!r} is not supported")
    norm = {"type": "rms_norm", "epsilon": hf.get("rms_norm_eps", 1e-6), "zero_centered": True}
    transformer |= {
        "normalization": norm,
        "normalization_placement": "sandwich",
        "query_norm": norm,
        "key_norm": norm,
        "query_key_norm_scope": "head",
        "activation_type": "gelu",
        "scale_embeddings": True,
        "attention_scale": hf.get("query_pre_attn_scalar", 256) ** -0.5,
    }
    if not hf.get("rope_parameters") and "rope_theta" not in hf:
        transformer["rotary"]["theta"] = 1_000_000.0  # transformers' default for global layers
    # transformers' default for Gemma 3 (the common keys, read after this, default to untied)
    hf.setdefault("tie_word_embeddings", True)
    _windows_from_hf(hf, transformer)


def _windows_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", 6)  # before transformers 5's layer_types
    kinds = hf.get("layer_types") or [
        _SLIDING if (i + 1) % pattern else _FULL for i in range(layers)
    ]
    if set(kinds) - {_SLIDING, _FULL} or len(kinds) != layers:
        raise ConfigError(
            "config.json:layer_types", f"must list {layers} of {_SLIDING} and {_FULL}: {kinds}"
        )
    window = hf.get("sliding_window")
    if _SLIDING not in kinds:
        return
    transformer["window_size"] = window
    if _FULL not in kinds:  # every layer slides, with the sliding layers' rotary
        transformer["rotary"] = _sliding_rotary(hf)
        return
    if window is None:
        raise ConfigError("config.json:sliding_window", "is null but layer_types mixes kinds")
    interval = kinds.index(_FULL) + 1
    if kinds != [_FULL if (i + 1) % interval == 0 else _SLIDING for i in range(layers)]:
        raise ConfigError(
            "config.json:layer_types",
            f"only one global layer every n is supported (global_attention_interval): {kinds}",
        )
    transformer["global_attention_interval"] = interval
    transformer["window_rotary"] = _sliding_rotary(hf)


def _sliding_rotary(hf: dict[str, Any]) -> dict[str, Any]:
    """The sliding layers' rotary: transformers 5's rope_parameters.sliding_attention, or an
    older config.json's rope_local_base_freq; a plain one, as Gemma 3's are."""
    parameters = dict((hf.get("rope_parameters") or {}).get(_SLIDING) or {})
    if not parameters:
        parameters = {"rope_theta": hf.get("rope_local_base_freq", _LOCAL_THETA)}
    kind = parameters.get("rope_type", "default")
    if kind != "default":
        raise ConfigError(
            "config.json:rope_parameters", f"{_SLIDING}: rotary type {kind!r} is not supported"
        )
    return {"type": "default", "theta": parameters["rope_theta"]}


def gemma3_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    """Gemma's keys; the rotary of the global layers is the common rope_theta and
    rope_scaling (`formats.inexpressible` has checked what the others cannot express)."""
    t = config.transformer
    assert t.kv_channels is not None
    scale = t.kv_channels**-0.5 if t.attention_scale is None else t.attention_scale
    sliding = t.window_rotary or t.rotary
    hf.pop("hidden_act", None)
    hf |= {
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": t.normalization.epsilon,
        "attention_bias": False,
        "query_pre_attn_scalar": round(scale**-2),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "sliding_window": t.window_size,
        "layer_types": [_FULL if t.window_of(i) is None else _SLIDING for i in range(t.num_layers)],
        "rope_local_base_freq": getattr(sliding, "theta", _LOCAL_THETA),
    }
    if t.global_attention_interval is None:
        hf.pop("sliding_window_pattern", None)
    else:  # what transformers before 5 read
        hf["sliding_window_pattern"] = t.global_attention_interval
