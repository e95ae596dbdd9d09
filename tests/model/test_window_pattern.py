"""Sliding and global blocks (`global_attention_interval`): each block's window, and the
rotary each kind of block reads (`window_rotary`, none included)."""

from __future__ import annotations

import pytest
import torch

from fastllm.config import BaseModelConfig, build
from fastllm.model import GPTModel

TRANSFORMER = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_layers": 6,
    "ffn_hidden_size": 48,
    "window_size": 4,
    "global_attention_interval": 3,
}


def model_of(**transformer: object) -> GPTModel:
    return GPTModel(build(BaseModelConfig, {"transformer": TRANSFORMER | transformer}))


def test_every_interval_th_block_attends_globally() -> None:
    windows = [block.attention.window_size for block in model_of().layers]
    assert windows == [4, 4, None, 4, 4, None]


@pytest.mark.parametrize(
    ("window_rotary", "sliding"),
    [(None, "global"), ({"type": "default", "theta": 10.0}, "own"), ({"type": "none"}, None)],
    ids=["shared", "own", "none"],
)
def test_sliding_blocks_read_their_own_rotary(window_rotary: dict | None, sliding: str) -> None:
    model = model_of(window_rotary=window_rotary)
    context = model.context(torch.zeros(1, 6, dtype=torch.long))
    for block in model.layers:
        rotary = context.rotary_of(block)
        if block.attention.window_size is None or sliding == "global":
            assert rotary is context.rotary
        elif sliding is None:
            assert rotary is None
        else:
            assert rotary is not None and not torch.equal(rotary[0], context.rotary[0])
