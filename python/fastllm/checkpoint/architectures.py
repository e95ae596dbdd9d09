"""The Hugging Face architectures fastllm converts, one entry each: its config keys beyond the
common ones and its MLP's tensors (what it can express is config-level data,
`config.formats.EXPRESSIBLE`, so that configs are checked against it when loaded).
`hf_config` and `hf_weights` do the common part for all of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastllm.checkpoint.deepseek_v3 import (
    deepseek_v3_attention,
    deepseek_v3_from_hf,
    deepseek_v3_from_tensors,
    deepseek_v3_mlp,
    deepseek_v3_to_hf,
)
from fastllm.checkpoint.gemma3 import gemma3_from_hf, gemma3_to_hf
from fastllm.checkpoint.hf_rules import Rule, concat, same, stack
from fastllm.config import BaseModelConfig, ConfigError
from fastllm.config.formats import HF_ARCHITECTURES


@dataclass(frozen=True)
class Architecture:
    name: str
    """Hugging Face `model_type`."""
    hf_class: str
    from_hf: Callable[[dict[str, Any], dict[str, Any]], None]
    """Adjusts the `transformer` section read from the common keys of its config.json."""
    to_hf: Callable[[BaseModelConfig, dict[str, Any]], None]
    """Adds its own keys to a config.json."""
    mlp_rules: Callable[[BaseModelConfig, str, str], Iterator[Rule]]
    """Rules of one block's MLP: (config, our prefix, their layer prefix)."""
    attention_rules: Callable[[BaseModelConfig, str, str], Iterator[Rule]] | None = None
    """Rules of one block's attention, (config, our prefix, their layer prefix), when not
    the common q/k/v/o projections."""
    from_tensors: Callable[[BaseModelConfig, set[str]], None] | None = None
    """Adjusts the model read from config.json by the names of the checkpoint's tensors (what
    its config.json does not say reliably)."""


def _window_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    if hf.get("sliding_window"):
        transformer["window_size"] = hf["sliding_window"]


def _window_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    hf["sliding_window"] = config.transformer.window_size
    hf["rms_norm_eps"] = config.transformer.normalization.epsilon


def _gated_mlp(config: BaseModelConfig, ours: str, theirs: str) -> Iterator[Rule]:
    ffn = config.transformer.ffn_hidden_size
    assert ffn is not None
    for name in ("weight", "bias") if config.transformer.biases_elsewhere else ("weight",):
        gate_up = (f"{theirs}.mlp.gate_proj.{name}", f"{theirs}.mlp.up_proj.{name}")
        yield concat(f"{ours}.layer_1.{name}", gate_up, [ffn, ffn])
        yield same(f"{ours}.layer_2.{name}", f"{theirs}.mlp.down_proj.{name}")


def _llama_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    if hf.get("mlp_bias") and not hf.get("attention_bias"):
        raise ConfigError("config.json:mlp_bias", "biases on the MLP alone are not supported")


def _llama_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    t = config.transformer
    hf["rms_norm_eps"] = t.normalization.epsilon
    hf["attention_bias"] = t.biases_in_attention_qkv
    hf["mlp_bias"] = t.biases_elsewhere


def _layer_windows_from_hf(
    hf: dict[str, Any], transformer: dict[str, Any], slides: Callable[[int, int], bool]
) -> None:
    """Qwen's sliding windows, with use_sliding_window: in the layers transformers 5 lists in
    layer_types, or for an older config.json, in each layer i for which
    slides(i, max_window_layers); in all layers or none."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    layers = hf["num_hidden_layers"]
    first = hf.get("max_window_layers", layers)
    kinds = hf.get("layer_types") or [
        "sliding_attention" if slides(i, first) else "full_attention" for i in range(layers)
    ]
    sliding = bool(window) and "sliding_attention" in kinds
    if sliding and "full_attention" in kinds:
        raise ConfigError(
            "config.json:layer_types",
            "sliding windows in some layers only (max_window_layers) are not supported",
        )
    if sliding:
        transformer["window_size"] = window


def _layer_windows_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    t = config.transformer
    sliding = t.window_size is not None
    hf["rms_norm_eps"] = t.normalization.epsilon
    hf["use_sliding_window"] = sliding
    hf["sliding_window"] = t.window_size
    hf["max_window_layers"] = 0 if sliding else t.num_layers
    hf["layer_types"] = [("sliding" if sliding else "full") + "_attention"] * t.num_layers


def _from_max_window_layers(layer: int, max_window_layers: int) -> bool:
    """Qwen2's and Qwen3's sliding layers: those from max_window_layers on."""
    return layer >= max_window_layers


def _qwen2_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    transformer["add_linear_biases"] = "only_attn_qkv"
    _layer_windows_from_hf(hf, transformer, _from_max_window_layers)


def _refuse_attention_biases(hf: dict[str, Any]) -> None:
    if hf.get("attention_bias"):
        raise ConfigError(
            "config.json:attention_bias",
            "biases on q, k, v and the output projection but not the MLP are not supported",
        )


def _rms_norm(hf: dict[str, Any]) -> dict[str, Any]:
    return {"type": "rms_norm", "epsilon": hf.get("rms_norm_eps", 1e-6)}


def _qwen3_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    _refuse_attention_biases(hf)
    _layer_windows_from_hf(hf, transformer, _from_max_window_layers)
    transformer["query_norm"] = transformer["key_norm"] = _rms_norm(hf)
    transformer["query_key_norm_scope"] = "head"


def _qwen3_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    _layer_windows_to_hf(config, hf)
    hf["attention_bias"] = False


def _olmo2_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    _refuse_attention_biases(hf)
    transformer["normalization_placement"] = "post"
    transformer["query_norm"] = transformer["key_norm"] = _rms_norm(hf)
    transformer["query_key_norm_scope"] = "projection"


def _olmo2_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    hf["rms_norm_eps"] = config.transformer.normalization.epsilon
    hf["attention_bias"] = False


def _mixtral_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    _window_from_hf(hf, transformer)
    transformer["num_experts"] = hf["num_local_experts"]
    transformer["num_experts_per_token"] = hf["num_experts_per_tok"]
    transformer["expert_auxiliary_loss_coefficient"] = hf.get("router_aux_loss_coef", 0.001)


def _mixtral_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    t = config.transformer
    _window_to_hf(config, hf)
    hf["num_local_experts"] = t.num_experts
    hf["num_experts_per_tok"] = t.num_experts_per_token
    hf["router_aux_loss_coef"] = t.expert_auxiliary_loss_coefficient
    hf["output_router_logits"] = False


def _mixtral_mlp(config: BaseModelConfig, ours: str, theirs: str) -> Iterator[Rule]:
    t = config.transformer
    assert t.ffn_hidden_size is not None
    experts = f"{theirs}.block_sparse_moe.experts"
    yield same(f"{ours}.router.weight", f"{theirs}.block_sparse_moe.gate.weight")
    gate_up = tuple(f"{experts}.{e}.{w}.weight" for e in range(t.num_experts) for w in ("w1", "w3"))
    yield stack(f"{ours}.layer_1", gate_up, [t.ffn_hidden_size, t.ffn_hidden_size])
    yield stack(f"{ours}.layer_2", tuple(f"{experts}.{e}.w2.weight" for e in range(t.num_experts)))


def _qwen_moe_dense_layers_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    """Qwen-MoE's dense layers: layer i has a dense MLP of intermediate_size when
    mlp_only_layers lists it or decoder_sparse_step does not divide i + 1. Only the first
    layers can (`first_dense_layers`)."""
    layers = hf["num_hidden_layers"]
    listed = sorted(set(hf.get("mlp_only_layers") or ()) & set(range(layers)))
    if listed != list(range(len(listed))):
        raise ConfigError(
            "config.json:mlp_only_layers",
            f"{listed}: dense MLP layers other than the first ones are not supported (they "
            "become first_dense_layers)",
        )
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError("config.json:decoder_sparse_step", f"must be 1 or more, got {step!r}")
    dense = [i for i in range(layers) if i < len(listed) or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise ConfigError(
            "config.json:decoder_sparse_step",
            f"{step} makes layers {dense} dense: dense MLP layers other than the first ones are "
            "not supported (they become first_dense_layers)",
        )
    if dense:
        transformer["first_dense_layers"] = len(dense)
        transformer["dense_ffn_hidden_size"] = hf["intermediate_size"]


def _qwen_moe_dense_layers_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    t = config.transformer
    hf["decoder_sparse_step"] = 1
    hf["mlp_only_layers"] = list(range(t.first_dense_layers))
    if t.first_dense_layers:
        hf["intermediate_size"] = t.dense_ffn_width


def _qwen2_moe_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    # Qwen2-MoE's sliding layers: every other one, from the first, below max_window_layers.
    _layer_windows_from_hf(hf, transformer, lambda i, first: i % 2 == 0 and i < first)
    _qwen_moe_dense_layers_from_hf(hf, transformer)
    ffn, shared = hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"]
    if shared <= 0 or shared % ffn:
        raise ConfigError(
            "config.json:shared_expert_intermediate_size",
            f"must be a positive multiple of moe_intermediate_size ({ffn}), got {shared}",
        )
    transformer["add_linear_biases"] = "only_attn_qkv" if hf.get("qkv_bias", True) else False
    transformer["ffn_hidden_size"] = ffn
    transformer["num_experts"] = hf["num_experts"]
    transformer["num_experts_per_token"] = hf["num_experts_per_tok"]
    transformer["expert_renormalize"] = bool(hf.get("norm_topk_prob", False))
    transformer["expert_auxiliary_loss_coefficient"] = hf.get("router_aux_loss_coef", 0.001)
    transformer["num_shared_experts"] = shared // ffn
    transformer["shared_expert_gate"] = True


def _qwen2_moe_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    t = config.transformer
    assert t.ffn_hidden_size is not None
    _layer_windows_to_hf(config, hf)
    hf["qkv_bias"] = t.biases_in_attention_qkv
    hf["moe_intermediate_size"] = t.ffn_hidden_size
    hf["shared_expert_intermediate_size"] = t.num_shared_experts * t.ffn_hidden_size
    hf["num_experts"] = t.num_experts
    hf["num_experts_per_tok"] = t.num_experts_per_token
    hf["norm_topk_prob"] = t.expert_renormalize
    hf["router_aux_loss_coef"] = t.expert_auxiliary_loss_coefficient
    _qwen_moe_dense_layers_to_hf(config, hf)
    hf["output_router_logits"] = False


def _qwen_moe_experts(config: BaseModelConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """The router and the routed experts of Qwen2-MoE and Qwen3-MoE."""
    t = config.transformer
    assert t.ffn_hidden_size is not None
    mlp, ffn = f"{theirs}.mlp", t.ffn_hidden_size
    yield same(f"{ours}.router.weight", f"{mlp}.gate.weight")
    gate_up = tuple(
        f"{mlp}.experts.{e}.{w}_proj.weight" for e in range(t.num_experts) for w in ("gate", "up")
    )
    yield stack(f"{ours}.layer_1", gate_up, [ffn, ffn])
    down = tuple(f"{mlp}.experts.{e}.down_proj.weight" for e in range(t.num_experts))
    yield stack(f"{ours}.layer_2", down)


def _qwen2_moe_mlp(config: BaseModelConfig, ours: str, theirs: str) -> Iterator[Rule]:
    t = config.transformer
    assert t.ffn_hidden_size is not None
    mlp, ffn = f"{theirs}.mlp", t.ffn_hidden_size
    yield from _qwen_moe_experts(config, ours, theirs)
    shared = f"{mlp}.shared_expert"
    width = t.num_shared_experts * ffn
    gate_up_shared = (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")
    yield concat(f"{ours}.shared.layer_1.weight", gate_up_shared, [width, width])
    yield same(f"{ours}.shared.layer_2.weight", f"{shared}.down_proj.weight")
    yield same(f"{ours}.shared_gate.weight", f"{mlp}.shared_expert_gate.weight")


def _qwen3_moe_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    _refuse_attention_biases(hf)
    _qwen_moe_dense_layers_from_hf(hf, transformer)
    if hf.get("use_sliding_window") and hf.get("sliding_window"):  # in every layer
        transformer["window_size"] = hf["sliding_window"]
    transformer["query_norm"] = transformer["key_norm"] = _rms_norm(hf)
    transformer["query_key_norm_scope"] = "head"
    transformer["ffn_hidden_size"] = hf["moe_intermediate_size"]
    # The Hub's config.json name; transformers 5 writes num_local_experts.
    transformer["num_experts"] = hf.get("num_experts") or hf["num_local_experts"]
    transformer["num_experts_per_token"] = hf["num_experts_per_tok"]
    transformer["expert_renormalize"] = bool(hf.get("norm_topk_prob", False))
    transformer["expert_auxiliary_loss_coefficient"] = hf.get("router_aux_loss_coef", 0.001)


def _qwen3_moe_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    t = config.transformer
    hf["rms_norm_eps"] = t.normalization.epsilon
    hf["attention_bias"] = False
    hf["use_sliding_window"] = t.window_size is not None
    hf["sliding_window"] = t.window_size
    hf["moe_intermediate_size"] = t.ffn_hidden_size
    hf.pop("num_local_experts", None)
    hf["num_experts"] = t.num_experts
    hf["num_experts_per_tok"] = t.num_experts_per_token
    hf["norm_topk_prob"] = t.expert_renormalize
    hf["router_aux_loss_coef"] = t.expert_auxiliary_loss_coefficient
    _qwen_moe_dense_layers_to_hf(config, hf)
    hf["output_router_logits"] = False


def _starcoder2_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    _window_from_hf(hf, transformer)
    transformer["normalization"] = {"type": "layer_norm", "epsilon": hf.get("norm_epsilon", 1e-5)}
    transformer["gated"] = False
    transformer["add_linear_biases"] = bool(hf.get("use_bias", True))


def _starcoder2_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    t = config.transformer
    hf["sliding_window"] = t.window_size
    hf["norm_epsilon"] = t.normalization.epsilon
    hf["use_bias"] = t.biases_elsewhere


def _starcoder2_mlp(config: BaseModelConfig, ours: str, theirs: str) -> Iterator[Rule]:
    for name in ("weight", "bias") if config.transformer.biases_elsewhere else ("weight",):
        yield same(f"{ours}.layer_1.{name}", f"{theirs}.mlp.c_fc.{name}")
        yield same(f"{ours}.layer_2.{name}", f"{theirs}.mlp.c_proj.{name}")


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture(
            "llama",
            "LlamaForCausalLM",
            from_hf=_llama_from_hf,
            to_hf=_llama_to_hf,
            mlp_rules=_gated_mlp,
        ),
        Architecture(
            "mistral",
            "MistralForCausalLM",
            from_hf=_window_from_hf,
            to_hf=_window_to_hf,
            mlp_rules=_gated_mlp,
        ),
        Architecture(
            "mixtral",
            "MixtralForCausalLM",
            from_hf=_mixtral_from_hf,
            to_hf=_mixtral_to_hf,
            mlp_rules=_mixtral_mlp,
        ),
        Architecture(
            "qwen2",
            "Qwen2ForCausalLM",
            from_hf=_qwen2_from_hf,
            to_hf=_layer_windows_to_hf,
            mlp_rules=_gated_mlp,
        ),
        Architecture(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            from_hf=_qwen2_moe_from_hf,
            to_hf=_qwen2_moe_to_hf,
            mlp_rules=_qwen2_moe_mlp,
        ),
        Architecture(
            "qwen3",
            "Qwen3ForCausalLM",
            from_hf=_qwen3_from_hf,
            to_hf=_qwen3_to_hf,
            mlp_rules=_gated_mlp,
        ),
        Architecture(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            from_hf=_qwen3_moe_from_hf,
            to_hf=_qwen3_moe_to_hf,
            mlp_rules=_qwen_moe_experts,
        ),
        Architecture(
            "olmo2",
            "Olmo2ForCausalLM",
            from_hf=_olmo2_from_hf,
            to_hf=_olmo2_to_hf,
            mlp_rules=_gated_mlp,
        ),
        Architecture(
            "gemma3_text",
            "Gemma3ForCausalLM",
            from_hf=gemma3_from_hf,
            to_hf=gemma3_to_hf,
            mlp_rules=_gated_mlp,
        ),
        Architecture(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            from_hf=deepseek_v3_from_hf,
            to_hf=deepseek_v3_to_hf,
            mlp_rules=deepseek_v3_mlp,
            attention_rules=deepseek_v3_attention,
            from_tensors=deepseek_v3_from_tensors,
        ),
        Architecture(
            "starcoder2",
            "Starcoder2ForCausalLM",
            from_hf=_starcoder2_from_hf,
            to_hf=_starcoder2_to_hf,
            mlp_rules=_starcoder2_mlp,
        ),
    )
}
if tuple(ARCHITECTURES) != HF_ARCHITECTURES:
    raise ImportError("checkpoint.architectures and config.formats list different architectures")
