"""The model formats fastllm reads and writes: the one list that configs, `fastllm convert`
and exports read, and what each Hugging Face architecture can express, so that a config
naming a format its model cannot be written in is refused when it is loaded, not at the first
export (the mappings themselves live in checkpoint/architectures.py, one per name here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fastllm.config import registry

if TYPE_CHECKING:
    from fastllm.config.model import BaseModelConfig

HF_ARCHITECTURES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "olmo2",
    "gemma3_text",
    "deepseek_v3",
    "starcoder2",
)
"""Hugging Face `model_type`s that fastllm converts to and from."""
MODEL_FORMATS = ("fastllm", "distributed", "peft", *HF_ARCHITECTURES)
"""fastllm (safetensors + config.yaml), distributed (what training writes: per-rank shards and
a manifest), peft (a LoRA model's adapters alone, as PEFT saves them; written only) and the
Hugging Face architectures."""

ModelFormat = Literal[MODEL_FORMATS]  # type: ignore[valid-type]

Biases = tuple[bool, bool]
"""(biases on q/k/v, biases elsewhere)."""


@dataclass(frozen=True)
class Expressible:
    """What a Hugging Face architecture's config.json and tensors can express."""

    layer_norm: bool
    """LayerNorm with bias (else RMSNorm)."""
    gated: bool
    experts: bool
    window: bool
    """Has a sliding-window key."""
    biases: frozenset[Biases]
    """The bias placements it can express."""
    shared_experts: bool = False
    """Its experts come with gated shared experts, which a model must then have (Qwen2-MoE)."""
    renormalize: frozenset[bool] = frozenset({True, False})
    """The `expert_renormalize` values it can express."""
    placement: str = "pre"
    """Where its blocks normalize (`normalization_placement`)."""
    query_key_norm: str | None = None
    """The `query_key_norm_scope` of its QK-norm, an RMSNorm of both the queries and the keys
    with the blocks' epsilon (which it must then have); None: it has none."""
    gemma: bool = False
    """Gemma 3's options, which a model must then have: zero-centered norms (all of them),
    embeddings scaled by sqrt(hidden_size), tanh GELU; and those it may have: sliding and global blocks
    (`global_attention_interval`, a plain `window_rotary`) and an `attention_scale` of
    n ** -0.5 for a whole n. The other architectures have none of them."""
    dense_layers: bool = False
    """Its mixtures of experts may come after dense MLP layers (`first_dense_layers`)."""
    deepseek: bool = False
    """DeepSeek-V3's attention and routing: latent attention (which a model must then have,
    and no other architecture can express), sigmoid scores with a correction bias,
    ungated shared experts; the other architectures route by softmax alone."""


_NO_BIASES: frozenset[Biases] = frozenset({(False, False)})
_BIAS_NAMES = {
    (False, False): "nowhere",
    (True, True): "everywhere",
    (True, False): "only_attn_qkv",
}

EXPRESSIBLE = {
    "llama": Expressible(
        layer_norm=False,
        gated=True,
        experts=False,
        window=False,
        biases=frozenset({(False, False), (True, True)}),
    ),
    "mistral": Expressible(
        layer_norm=False, gated=True, experts=False, window=True, biases=_NO_BIASES
    ),
    "mixtral": Expressible(
        layer_norm=False,
        gated=True,
        experts=True,
        window=True,
        biases=_NO_BIASES,
        renormalize=frozenset({True}),
    ),
    "qwen2": Expressible(
        layer_norm=False, gated=True, experts=False, window=True, biases=frozenset({(True, False)})
    ),
    "qwen2_moe": Expressible(
        layer_norm=False,
        gated=True,
        experts=True,
        window=True,
        biases=frozenset({(True, False), (False, False)}),
        shared_experts=True,
        dense_layers=True,
    ),
    "qwen3": Expressible(
        layer_norm=False,
        gated=True,
        experts=False,
        window=True,
        biases=_NO_BIASES,
        query_key_norm="head",
    ),
    "qwen3_moe": Expressible(
        layer_norm=False,
        gated=True,
        experts=True,
        window=True,
        biases=_NO_BIASES,
        query_key_norm="head",
        dense_layers=True,
    ),
    "olmo2": Expressible(
        layer_norm=False,
        gated=True,
        experts=False,
        window=False,
        biases=_NO_BIASES,
        placement="post",
        query_key_norm="projection",
    ),
    "gemma3_text": Expressible(
        layer_norm=False,
        gated=True,
        experts=False,
        window=True,
        biases=_NO_BIASES,
        placement="sandwich",
        query_key_norm="head",
        gemma=True,
    ),
    "deepseek_v3": Expressible(
        layer_norm=False,
        gated=True,
        experts=True,
        window=False,
        biases=_NO_BIASES,
        shared_experts=True,
        dense_layers=True,
        deepseek=True,
    ),
    "starcoder2": Expressible(
        layer_norm=True,
        gated=False,
        experts=False,
        window=True,
        biases=frozenset({(True, True), (False, False)}),
    ),
}
if tuple(EXPRESSIBLE) != HF_ARCHITECTURES:
    raise ImportError("EXPRESSIBLE must list every Hugging Face architecture, in order")


def inexpressible(config: BaseModelConfig, architecture: str) -> str | None:
    """Why `architecture` cannot express the model `config` describes (its first setting that
    the architecture has no field for), or None when it can."""
    t, can = config.transformer, EXPRESSIBLE[architecture]
    for key, component in registry.components(t):
        if not registry.is_builtin(type(component)):
            name = registry.name_of(type(component))
            return f"model.base_model.transformer.{key}.type is {name!r} (not fastllm's)"
    norm = t.normalization.__struct_config__.tag
    shared = t.num_shared_experts > 0
    biases = " or ".join(sorted(_BIAS_NAMES[b] for b in can.biases))
    checks = [
        (
            (norm == "layer_norm") != can.layer_norm,
            "normalization.type",
            norm,
            "layer_norm" if can.layer_norm else "rms_norm",
        ),
        (
            type(t.rotary).__struct_config__.tag == "none",
            "rotary.type",
            "none",
            "rotary embeddings",
        ),
        (t.gated != can.gated, "gated", t.gated, "a gated MLP" if can.gated else "no MLP gate"),
        (
            (t.num_experts > 1) != can.experts,
            "num_experts",
            t.num_experts,
            "experts" if can.experts else "no experts",
        ),
        (
            t.window_size is not None and not can.window,
            "window_size",
            t.window_size,
            "no sliding window",
        ),
        (
            (t.biases_in_attention_qkv, t.biases_elsewhere) not in can.biases,
            "add_linear_biases",
            t.add_linear_biases,
            f"biases {biases}",
        ),
        (
            can.experts and shared != can.shared_experts,
            "num_shared_experts",
            t.num_shared_experts,
            "shared experts" if can.shared_experts else "no shared experts",
        ),
        (
            can.shared_experts and shared and t.shared_expert_gate == can.deepseek,
            "shared_expert_gate",
            t.shared_expert_gate,
            "ungated shared experts" if can.deepseek else "gated shared experts",
        ),
        (
            can.experts and t.first_dense_layers != 0 and not can.dense_layers,
            "first_dense_layers",
            t.first_dense_layers,
            "no dense layers among the mixtures",
        ),
        (
            can.experts and t.expert_renormalize not in can.renormalize,
            "expert_renormalize",
            t.expert_renormalize,
            "renormalized routing weights",
        ),
        (
            t.normalization_placement != can.placement,
            "normalization_placement",
            t.normalization_placement,
            f"{can.placement}-norm blocks",
        ),
        *_query_key_norm_checks(config, can),
        *_deepseek_checks(config, can),
        *_gemma_checks(config, can.gemma),
    ]
    for failed, key, value, needs in checks:
        if failed:
            path = key if key.startswith("model.") else f"model.base_model.transformer.{key}"
            return f"{path} is {value!r} ({architecture} has {needs})"
    return None


Check = tuple[bool, str, object, str]
"""(failed, key, its value, what the architecture has)."""
_SCOPES = {"head": "each head", "projection": "all heads together"}


def _query_key_norm_checks(config: BaseModelConfig, can: Expressible) -> list[Check]:
    """The checks of `inexpressible` for QK-norm: both norms, as the architecture has them,
    or neither."""
    t = config.transformer
    norms = {key: getattr(t, key) for key in ("query_norm", "key_norm")}
    if can.query_key_norm is None:
        return [(n is not None, key, _norm_type(n), "no QK-norm") for key, n in norms.items()]
    needs = f"an rms_norm of the queries and of the keys over {_SCOPES[can.query_key_norm]}"
    scope = t.query_key_norm_scope
    checks: list[Check] = [(scope != can.query_key_norm, "query_key_norm_scope", scope, needs)]
    epsilon = t.normalization.epsilon
    for key, norm in norms.items():
        checks.append((_norm_type(norm) != "rms_norm", key, _norm_type(norm), needs))
        if norm is not None:
            one = f"one epsilon, normalization.epsilon {epsilon}"
            checks.append((norm.epsilon != epsilon, f"{key}.epsilon", norm.epsilon, one))
    return checks


def _gemma_checks(config: BaseModelConfig, gemma: bool) -> list[Check]:
    """The checks of `inexpressible` for Gemma 3's options (`Expressible.gemma`)."""
    t = config.transformer
    assert t.kv_channels is not None
    has = "Gemma's options" if gemma else "none of Gemma's options"
    norms = {"normalization": t.normalization, "query_norm": t.query_norm, "key_norm": t.key_norm}
    checks: list[Check] = [
        (norm.zero_centered != gemma, f"{key}.zero_centered", norm.zero_centered, has)
        for key, norm in norms.items()
        if norm is not None
    ]
    checks.append((t.scale_embeddings != gemma, "scale_embeddings", t.scale_embeddings, has))
    if not gemma:
        interval = t.global_attention_interval
        checks.append((interval is not None, "global_attention_interval", interval, has))
        scale = t.attention_scale
        default = scale is None or scale == t.kv_channels**-0.5
        checks.append((not default, "attention_scale", scale, "kv_channels ** -0.5"))
        return checks
    activation = t.activation_type
    checks.append((activation != "gelu", "activation_type", activation, "tanh GELU (GeGLU)"))
    scale = t.kv_channels**-0.5 if t.attention_scale is None else t.attention_scale
    whole = round(scale**-2) ** -0.5 == scale
    checks.append((not whole, "attention_scale", scale, "n ** -0.5 for a whole n"))
    # Its sliding blocks have a plain rotary: the window_rotary, or rotary when all slide.
    sliding, key = t.window_rotary, "window_rotary.type"
    if sliding is None and t.window_size is not None:
        sliding, key = t.rotary, "rotary.type"
    kind = None if sliding is None else sliding.__struct_config__.tag
    plain = "a plain (default) rotary in its sliding blocks"
    checks.append((kind not in (None, "default"), key, kind, plain))
    return checks


def _norm_type(norm: object) -> str:
    return "none" if norm is None else norm.__struct_config__.tag  # type: ignore[attr-defined]


def _deepseek_checks(config: BaseModelConfig, can: Expressible) -> list[Check]:
    """The checks of `inexpressible` for DeepSeek-V3's latent attention and routing."""
    t = config.transformer
    latent = t.latent_mixer
    mixer = registry.name_of(type(t.mixer))
    if not can.deepseek:
        return [
            (
                config.multi_token_prediction is not None,
                "model.base_model.multi_token_prediction",
                "set",
                "no multi-token prediction",
            ),
            (latent is not None, "mixer.type", mixer, "no latent attention"),
            (
                t.expert_score_function != "softmax",
                "expert_score_function",
                t.expert_score_function,
                "softmax routing",
            ),
            (t.expert_bias, "expert_bias", True, "no expert bias"),
            (t.expert_groups != 1, "expert_groups", t.expert_groups, "no expert groups"),
            (
                t.expert_routed_scaling_factor != 1.0,
                "expert_routed_scaling_factor",
                t.expert_routed_scaling_factor,
                "unscaled routing weights",
            ),
        ]
    rotary = type(t.rotary).__struct_config__.tag
    return [
        (latent is None, "mixer.type", mixer, "a latent_attention mixer"),
        (
            latent is not None and latent.latent_norm_epsilon != 1e-6,
            "mixer.latent_norm_epsilon",
            getattr(latent, "latent_norm_epsilon", None),
            "latent norms of epsilon 1e-06",
        ),
        (
            latent is not None and bool(latent.mscale_all_dim) and rotary != "yarn",
            "mixer.mscale_all_dim",
            getattr(latent, "mscale_all_dim", None),
            "mscale_all_dim with yarn rotary only",
        ),
        (rotary not in ("default", "yarn"), "rotary.type", rotary, "default or yarn rotary"),
        (
            t.expert_score_function != "sigmoid",
            "expert_score_function",
            t.expert_score_function,
            "sigmoid routing",
        ),
        (not t.expert_bias, "expert_bias", False, "an expert bias"),
        (t.activation_type != "silu", "activation_type", t.activation_type, "silu"),
    ]
