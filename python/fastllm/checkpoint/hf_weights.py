"""Tensor-by-tensor mapping between Hugging Face checkpoints and fastllm's parameter names.

Each rule names one fastllm tensor and the Hugging Face tensors it is made of; `join` builds
ours from theirs, `split` gives theirs back from ours. Both only concatenate, stack or slice,
so a round trip reproduces every tensor bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fastllm.config import BaseModelConfig


@dataclass(frozen=True)
class Rule:
    ours: str
    theirs: tuple[str, ...]
    join: Callable[[list[Tensor]], Tensor]
    split: Callable[[Tensor], list[Tensor]]


def _same(ours: str, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda ts: ts[0], lambda t: [t])


def _concat(ours: str, theirs: tuple[str, ...], sizes: list[int]) -> Rule:
    return Rule(
        ours, theirs, lambda ts: torch.cat(ts, dim=0), lambda t: list(t.split(sizes, dim=0))
    )


def _stack(ours: str, theirs: tuple[str, ...], join_dim_sizes: list[int] | None = None) -> Rule:
    """Experts stacked on a new first dimension; with `join_dim_sizes`, each expert's tensor is
    itself the concatenation of several of theirs (gate and up)."""
    count = len(theirs) // (len(join_dim_sizes) if join_dim_sizes else 1)
    if join_dim_sizes is None:
        return Rule(ours, theirs, lambda ts: torch.stack(ts), lambda t: list(t.unbind(0)))
    parts = len(join_dim_sizes)

    def join(ts: list[Tensor]) -> Tensor:
        return torch.stack([torch.cat(ts[e * parts : (e + 1) * parts]) for e in range(count)])

    def split(t: Tensor) -> list[Tensor]:
        return [piece for expert in t.unbind(0) for piece in expert.split(join_dim_sizes)]

    return Rule(ours, theirs, join, split)


def rules(config: BaseModelConfig, architecture: str) -> Iterator[Rule]:
    """Every tensor of the model, in order, as a rule."""
    t = config.transformer
    assert t.kv_channels is not None and t.ffn_hidden_size is not None
    q_size, kv_size = t.num_attention_heads * t.kv_channels, t.head_groups * t.kv_channels
    yield _same("embeddings.weight", "model.embed_tokens.weight")
    for i in range(t.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        attention = f"{theirs}.self_attn"
        norm_parameters = _norm_parameters(config)
        for name in norm_parameters:
            yield _same(f"{ours}.norm_1.{name}", f"{theirs}.input_layernorm.{name}")
            yield _same(f"{ours}.norm_2.{name}", f"{theirs}.post_attention_layernorm.{name}")
        qkv_parameters = ("weight", "bias") if t.biases_in_attention_qkv else ("weight",)
        for name in qkv_parameters:
            yield _concat(
                f"{ours}.attention.query_key_value.{name}",
                tuple(f"{attention}.{p}_proj.{name}" for p in "qkv"),
                [q_size, kv_size, kv_size],
            )
        dense_parameters = ("weight", "bias") if t.biases_elsewhere else ("weight",)
        for name in dense_parameters:
            yield _same(f"{ours}.attention.dense.{name}", f"{attention}.o_proj.{name}")
        yield from _mlp_rules(config, architecture, f"{ours}.mlp", theirs)
    for name in _norm_parameters(config):
        yield _same(f"final_norm.{name}", f"model.norm.{name}")
    if not config.tie_word_embeddings:
        yield _same("head.weight", "lm_head.weight")


def _norm_parameters(config: BaseModelConfig) -> tuple[str, ...]:
    layer_norm = config.transformer.normalization.__struct_config__.tag == "layer_norm"
    return ("weight", "bias") if layer_norm else ("weight",)


def _mlp_rules(
    config: BaseModelConfig, architecture: str, ours: str, theirs: str
) -> Iterator[Rule]:
    t = config.transformer
    assert t.ffn_hidden_size is not None
    ffn = t.ffn_hidden_size
    if architecture == "mixtral":
        experts = f"{theirs}.block_sparse_moe.experts"
        yield _same(f"{ours}.router.weight", f"{theirs}.block_sparse_moe.gate.weight")
        gate_up = tuple(
            f"{experts}.{e}.{w}.weight" for e in range(t.num_experts) for w in ("w1", "w3")
        )
        yield _stack(f"{ours}.layer_1", gate_up, [ffn, ffn])
        yield _stack(
            f"{ours}.layer_2", tuple(f"{experts}.{e}.w2.weight" for e in range(t.num_experts))
        )
        return
    parameters = ("weight", "bias") if t.biases_elsewhere else ("weight",)
    for name in parameters:
        if architecture == "starcoder2":
            yield _same(f"{ours}.layer_1.{name}", f"{theirs}.mlp.c_fc.{name}")
            yield _same(f"{ours}.layer_2.{name}", f"{theirs}.mlp.c_proj.{name}")
        else:
            gate_up = (f"{theirs}.mlp.gate_proj.{name}", f"{theirs}.mlp.up_proj.{name}")
            yield _concat(f"{ours}.layer_1.{name}", gate_up, [ffn, ffn])
            yield _same(f"{ours}.layer_2.{name}", f"{theirs}.mlp.down_proj.{name}")
