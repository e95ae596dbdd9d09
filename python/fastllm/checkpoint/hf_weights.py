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
    depth = config.multi_token_prediction.depth if config.multi_token_prediction else 0
    # DeepSeek's checkpoints hold each prediction module's copies of the embedding and the
    # head (model.layers.{num_layers + k}.embed_tokens, .shared_head.head): read from the
    # model's, written as copies of them.
    modules = [f"model.layers.{t.num_layers + k}" for k in range(depth)]
    embedding_copies = [f"{m}.embed_tokens.weight" for m in modules]
    head_copies = [f"{m}.shared_head.head.weight" for m in modules]
    if config.tie_word_embeddings:
        embedding_copies += head_copies
    yield _with_copies("embeddings.weight", "model.embed_tokens.weight", embedding_copies)
    for i in range(t.num_layers):
        yield from _block(config, architecture, f"layers.{i}", f"model.layers.{i}", i)
    for name in _norm_parameters(config):
        yield same(f"final_norm.{name}", f"model.norm.{name}")
    if not config.tie_word_embeddings:
        yield _with_copies("head.weight", "lm_head.weight", head_copies)
    for k, theirs in enumerate(modules):
        ours = f"prediction_modules.{k}"
        for name in _norm_parameters(config):
            for our_norm, their_norm in (
                ("embedding_norm", "enorm"),
                ("hidden_norm", "hnorm"),
                ("output_norm", "shared_head.norm"),
            ):
                yield same(f"{ours}.{our_norm}.{name}", f"{theirs}.{their_norm}.{name}")
        yield same(f"{ours}.projection.weight", f"{theirs}.eh_proj.weight")
        yield from _block(config, architecture, f"{ours}.block", theirs, t.num_layers + k)


def _with_copies(ours: str, theirs: str, copies: list[str]) -> Rule:
    """Ours from theirs; written to theirs and to each of `copies`."""
    if not copies:
        return same(ours, theirs)
    return Rule(ours, (theirs, *copies), lambda ts: ts[0], lambda t: [t] * (1 + len(copies)))


def _block(
    config: BaseModelConfig, architecture: str, ours: str, theirs: str, index: int
) -> Iterator[Rule]:
    """One transformer block's tensors (block `index` from 0: the first dense ones differ)."""
    t = config.transformer
    assert t.kv_channels is not None and t.ffn_hidden_size is not None
    q_size, kv_size = t.num_attention_heads * t.kv_channels, t.head_groups * t.kv_channels
    attention = f"{theirs}.self_attn"
    for our_norm, their_norm in _BLOCK_NORMS[t.normalization_placement]:
        for name in _norm_parameters(config):
            yield same(f"{ours}.{our_norm}.{name}", f"{theirs}.{their_norm}.{name}")
    entry = ARCHITECTURES[architecture]
    if entry.attention_rules is not None:
        yield from entry.attention_rules(config, ours, theirs)
    else:
        yield from _attention(config, ours, attention, q_size, kv_size)
    if t.has_experts(index) or t.num_experts == 1:
        yield from entry.mlp_rules(config, f"{ours}.mlp", theirs)
    else:  # one of the first dense layers of a mixture-of-experts model
        gate_up = (f"{theirs}.mlp.gate_proj.weight", f"{theirs}.mlp.up_proj.weight")
        width = t.dense_ffn_width
        yield concat(f"{ours}.mlp.layer_1.weight", gate_up, [width, width])
        yield same(f"{ours}.mlp.layer_2.weight", f"{theirs}.mlp.down_proj.weight")


def _attention(
    config: BaseModelConfig, ours: str, attention: str, q_size: int, kv_size: int
) -> Iterator[Rule]:
    """The common attention's: q/k/v/o projections and QK-norms."""
    t = config.transformer
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
    for our_norm, their_norm in (("query_norm", "q_norm"), ("key_norm", "k_norm")):
        if getattr(t, our_norm) is not None:  # an rms_norm (formats.inexpressible)
            yield same(f"{ours}.attention.{our_norm}.weight", f"{attention}.{their_norm}.weight")


_BLOCK_NORMS = {
    "pre": (("norm_1", "input_layernorm"), ("norm_2", "post_attention_layernorm")),
    "post": (
        ("post_norm_1", "post_attention_layernorm"),
        ("post_norm_2", "post_feedforward_layernorm"),
    ),
    "sandwich": (
        ("norm_1", "input_layernorm"),
        ("post_norm_1", "post_attention_layernorm"),
        ("norm_2", "pre_feedforward_layernorm"),
        ("post_norm_2", "post_feedforward_layernorm"),
    ),
}
"""A block's norms by `normalization_placement`, ours and Hugging Face's (whose
post_attention_layernorm is the MLP's input norm in a pre-norm block and attention's output
norm in a post-norm or sandwich one)."""


def _norm_parameters(config: BaseModelConfig) -> tuple[str, ...]:
    layer_norm = config.transformer.normalization.__struct_config__.tag == "layer_norm"
    return ("weight", "bias") if layer_norm else ("weight",)
