"""Where a block normalizes (`normalization_placement`), against the block written out in
plain torch; post-norm blocks are also OLMo 2's, tested against `transformers` in
test_parity.py. A block of another package (defined here, named by import path) is built,
counted and frozen through its contract."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config import BaseModelConfig, ModelConfig, build, registry
from fastllm.config.flops import flops_per_token
from fastllm.config.model import BlockConfig, LoRAConfig, TransformerConfig
from fastllm.model import GPTModel
from fastllm.model.block import TransformerBlock
from fastllm.model.freeze import apply_freeze
from fastllm.model.gpt import Context
from fastllm.model.init import initialize
from fastllm.model.normalization import (
    NoNormalization,
    Normalization,
    NormalizationLayer,
    normalization,
)
from fastllm.model.parameters import parameter_metas
from fastllm.parallel.mesh import ParallelMesh

HIDDEN = 32
HERE = "tests.model.test_block_norms"


def block_of(placement: str, normalization: str) -> TransformerBlock:
    transformer = {
        "normalization": {"type": normalization},
        "normalization_placement": placement,
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "ffn_hidden_size": 48,
        "gated": True,
        "add_linear_biases": False,
    }
    config = build(BaseModelConfig, {"transformer": transformer}).transformer
    torch.manual_seed(0)
    block = TransformerBlock(config.block, config, 0)
    with torch.no_grad():  # norms far from the identity, so that each one shows
        for name, parameter in block.named_parameters():
            parameter.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return block


def normed(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    assert isinstance(norm, Normalization)
    if norm.bias is None:
        return F.rms_norm(x, (HIDDEN,), norm.weight, norm.epsilon)
    return F.layer_norm(x, (HIDDEN,), norm.weight, norm.bias, norm.epsilon)


@pytest.mark.parametrize("normalization", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_blocks_normalize_where_the_placement_says(placement: str, normalization: str) -> None:
    block = block_of(placement, normalization)
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    pre, post = placement in ("pre", "sandwich"), placement in ("post", "sandwich")
    assert isinstance(block.norm_1, Normalization) == pre
    assert (block.post_norm_1 is not None) == post
    none = NoNormalization()

    def before(h: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return normed(h, norm) if pre else h

    def after(out: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
        return normed(out, norm) if post and norm is not None else out

    h = x + after(block.attention(before(x, block.norm_1), none, None), block.post_norm_1)
    expected = h + after(block.mlp(before(h, block.norm_2), none)[0], block.post_norm_2)
    assert torch.allclose(block(x, None)[0], expected, rtol=1e-5, atol=1e-5)


def test_zero_centered_norm_of_a_bfloat16_weight_adds_the_offset_in_fp32() -> None:
    """1 + weight in fp32, as transformers' Gemma3RMSNorm adds it: in bf16 the sum would keep
    only about 8 bits of a small offset (the input is fp32 here, so that the output's rounding
    does not hide the scale's)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from fastllm.config.model import RMSNormConfig

    generator = torch.Generator().manual_seed(7)
    ours = Normalization(RMSNormConfig(epsilon=1e-6, zero_centered=True), HIDDEN)
    theirs = Gemma3RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(HIDDEN, generator=generator) * 0.01)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.bfloat16(), theirs.bfloat16()
    x = torch.randn(3, 5, HIDDEN, generator=generator)
    expected = theirs(x)
    torch.testing.assert_close(ours(x), expected, rtol=1e-6, atol=1e-6)
    in_bf16 = F.rms_norm(x, (HIDDEN,), eps=1e-6) * (1 + ours.weight).float()
    assert (in_bf16 - expected).abs().max() > 1e-4


class SharedNormsBlockConfig(BlockConfig, tag="test_shared_norms_block"):
    """x + output_norm(mixer(norm(x)) + mlp(norm(x))): two norms, each read by both layers."""

    implementation = f"{HERE}:SharedNormsBlock"

    def num_norm_parameters(self, transformer: TransformerConfig) -> int:
        return 2 * transformer.normalization.num_parameters(transformer.hidden_size)


class SharedNormsBlock(torch.nn.Module):
    def __init__(
        self,
        config: SharedNormsBlockConfig,
        transformer: TransformerConfig,
        layer_index: int,
        mesh: ParallelMesh,
        lora: LoRAConfig | None,
    ) -> None:
        super().__init__()
        t = transformer
        self.norm = normalization(t.normalization, t.hidden_size)
        self.mixer = registry.implementation(t.mixer)(t.mixer, t, layer_index, mesh, lora)
        self.mlp = registry.implementation(t.mlp)(t.mlp, t, layer_index, mesh, lora)
        self.output_norm = normalization(t.normalization, t.hidden_size, tensor_partial=False)

    def forward(
        self,
        x: Tensor,
        rotary: tuple[Tensor, Tensor] | None,
        document_ids: Tensor | None,
        cache: Any,
        branch_ids: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        mixed = self.mixer(x, self.norm, rotary, document_ids, cache, branch_ids)
        out, auxiliary = self.mlp(x, self.norm)
        return x + self.output_norm(mixed + out), auxiliary


def test_a_block_of_another_package_is_built_counted_frozen_and_trained() -> None:
    transformer = {
        "block": {"type": f"{HERE}:SharedNormsBlockConfig"},
        "normalization": {"type": "layer_norm"},
        "num_layers": 2,
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "ffn_hidden_size": 48,
        "window_size": 4,
        "global_attention_interval": 2,  # block 0 slides, block 1 does not
        "window_rotary": {"type": "default", "theta": 100.0},
    }
    base = {"transformer": transformer, "vocab_size": 31}
    predicting = build(BaseModelConfig, {**base, "multi_token_prediction": {}})
    model = GPTModel(predicting)
    assert isinstance(model.prediction_modules[0].block, SharedNormsBlock)
    assert predicting.num_parameters() == sum(p.numel() for p in model.parameters())
    config = build(ModelConfig, {"base_model": base, "freeze": {"norms": True}})
    model = GPTModel(config.base_model)
    block = model.layers[0]
    assert isinstance(block, SharedNormsBlock)
    assert config.base_model.num_parameters() == sum(p.numel() for p in model.parameters())
    norms = [m for m in block.modules() if isinstance(m, NormalizationLayer)]
    counts = config.base_model.parameter_counts()
    assert counts.block_norms == sum(p.numel() for m in norms for p in m.parameters())
    flops = flops_per_token(config.base_model, 8)
    sandwich = {**transformer, "block": {}, "normalization_placement": "sandwich"}
    decoder = build(BaseModelConfig, {**base, "transformer": sandwich})
    # the sandwich decoder's two more norms, 6 FLOPs per parameter in each block
    assert flops_per_token(decoder, 8) - flops == 2 * 6 * 2 * 2 * HIDDEN
    apply_freeze(model, config.freeze)
    frozen = {name for name, meta in parameter_metas(model).items() if meta.frozen}
    named = dict(model.named_parameters())
    assert sum(named[name].numel() for name in frozen) == config.num_frozen_parameters()
    assert "layers.0.output_norm.weight" in frozen and "layers.0.mixer.dense.weight" not in frozen
    context = Context(torch.zeros(1), None, window_rotary=torch.ones(1))  # type: ignore[arg-type]
    assert context.rotary_of(block) is context.window_rotary
    assert context.rotary_of(model.layers[1]) is context.rotary

    initialize(model, torch.Generator().manual_seed(0))
    with torch.no_grad():  # norms far from the identity, so that each one shows
        for norm in norms:
            norm.weight.normal_(1.0, 0.3)
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    none = NoNormalization()
    with torch.no_grad():
        h = F.layer_norm(x, (HIDDEN,), block.norm.weight, block.norm.bias, block.norm.epsilon)
        sum_ = block.mixer(h, none, None, None, None, None) + block.mlp(h, none)[0]
        out = block.output_norm
        expected = x + F.layer_norm(sum_, (HIDDEN,), out.weight, out.bias, out.epsilon)
        torch.testing.assert_close(block(x, None, None, None, None)[0], expected)
    ids = torch.randint(0, 31, (2, 7), generator=torch.Generator().manual_seed(2))
    model.loss(ids, ids.roll(-1, dims=1)).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
