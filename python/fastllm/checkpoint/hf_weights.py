"""Every tensor of a model as a rule between fastllm's names and a Hugging Face architecture's:
the parts all architectures share, and each one's MLP from its registry entry."""

from __future__ import annotations

from collections.abc import Iterator

from fastllm.checkpoint.architectures import ARCHITECTURES
from fastllm.checkpoint.hf_rules import Rule, concat, same
from fastllm.config import BaseModelConfig


def rules(config: BaseModelConfig, architecture: str) -> Iterator[Rule]:
    """Every tensor of the model, in order, as a rule."""
    t = config.transformer
    assert t.kv_channels is not None and t.ffn_hidden_size is not None
    q_size, kv_size = t.num_attention_heads * t.kv_channels, t.head_groups * t.kv_channels
    yield same("embeddings.weight", "model.embed_tokens.weight")
    for i in range(t.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        attention = f"{theirs}.self_attn"
        norm_parameters = _norm_parameters(config)
        for name in norm_parameters:
            yield same(f"{ours}.norm_1.{name}", f"{theirs}.input_layernorm.{name}")
            yield same(f"{ours}.norm_2.{name}", f"{theirs}.post_attention_layernorm.{name}")
        qkv_parameters = ("weight", "bias") if t.biases_in_attention_qkv else ("weight",)
        for name in qkv_parameters:
            yield concat(
                f"{ours}.attention.query_key_value.{name}",
                tuple(f"{attention}.{p}_proj.{name}" for p in "qkv"),
                [q_size, kv_size, kv_size],
            )
        dense_parameters = ("weight", "bias") if t.biases_elsewhere else ("weight",)
        for name in dense_parameters:
            yield same(f"{ours}.attention.dense.{name}", f"{attention}.o_proj.{name}")
        yield from ARCHITECTURES[architecture].mlp_rules(config, f"{ours}.mlp", theirs)
    for name in _norm_parameters(config):
        yield same(f"final_norm.{name}", f"model.norm.{name}")
    if not config.tie_word_embeddings:
        yield same("head.weight", "lm_head.weight")


def _norm_parameters(config: BaseModelConfig) -> tuple[str, ...]:
    layer_norm = config.transformer.normalization.__struct_config__.tag == "layer_norm"
    return ("weight", "bias") if layer_norm else ("weight",)
