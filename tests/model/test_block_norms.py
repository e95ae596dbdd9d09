"""Where a block normalizes (`normalization_placement`), against the block written out in
plain torch; post-norm blocks are also OLMo 2's, tested against `transformers` in
test_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm.config import BaseModelConfig, build
from fastllm.model.block import TransformerBlock
from fastllm.model.normalization import NoNormalization, Normalization

HIDDEN = 32


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
    block = TransformerBlock(config, 0)
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
