"""The model formats fastllm reads and writes: the one list that configs, `fastllm convert`
and exports read, and what each Hugging Face architecture can express, so that a config
naming a format its model cannot be written in is refused when it is loaded, not at the first
export (the mappings themselves live in checkpoint/architectures.py, one per name here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from fastllm.config.model import BaseModelConfig

HF_ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "starcoder2")
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
            can.shared_experts and shared and not t.shared_expert_gate,
            "shared_expert_gate",
            False,
            "gated shared experts",
        ),
        (
            can.experts and t.expert_renormalize not in can.renormalize,
            "expert_renormalize",
            t.expert_renormalize,
            "renormalized routing weights",
        ),
    ]
    for failed, key, value, needs in checks:
        if failed:
            return f"model.base_model.transformer.{key} is {value!r} ({architecture} has {needs})"
    return None
