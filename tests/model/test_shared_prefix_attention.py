"""The attention layer hands its fused q/k/v projection to shared prefixes' dense form
(`attention_of_qkv`, which writes the runs in the split) where that form runs: on CUDA. Here
its CUDA-only conditions are forced on CPU, the dense kernel being the reference."""

from __future__ import annotations

import torch

from fastllm.config import BaseModelConfig, build
from fastllm.model.attention import Attention
from fastllm.model.normalization import NoNormalization
from tests.kernels.test_attention import _dense_reference, _packed_pairs
from tests.kernels.test_rotary import _angles


def test_a_layer_of_pairs_gives_the_runs_split_its_projection(monkeypatch) -> None:
    import fastllm_kernels.attention as kernels
    import fastllm_kernels.branch_attention as branch

    transformer = {"hidden_size": 32, "num_attention_heads": 4, "head_groups": 2}
    config = build(BaseModelConfig, {"transformer": transformer}).transformer
    torch.manual_seed(0)
    layer = Attention(config, 0)
    documents, branches = _packed_pairs()  # a prompt with three answers, and padding
    batch, seq = branches.shape
    x = torch.randn(batch, seq, 32, requires_grad=True)
    rotary = _angles(batch, seq, 8, per_batch=True)  # head size 32 / 4
    used = (branches != -1)[..., None]  # the dense form leaves padding out
    grad_out = torch.randn(batch, seq, 32) * used
    inputs = [x, *layer.parameters()]

    masked = layer(x, NoNormalization(), rotary, documents, None, branches)
    wants = torch.autograd.grad(masked, inputs, grad_out)

    monkeypatch.setattr(kernels, "_branch_kernels", lambda x: True)
    monkeypatch.setattr(kernels, "varlen_flash", None)  # any call of it fails
    monkeypatch.setattr(kernels, "_dense_causal", _dense_reference)
    monkeypatch.setattr(branch, "DENSE_WORK", float("inf"))
    monkeypatch.setattr(branch, "DENSE_TILE", 4)
    splits = []
    split = kernels.split_qkv_rotary_into_runs
    monkeypatch.setattr(
        kernels, "split_qkv_rotary_into_runs", lambda *a: splits.append(1) or split(*a)
    )
    runs = layer(x, NoNormalization(), rotary, documents, None, branches)
    assert splits == [1]
    torch.testing.assert_close(runs * used, masked * used)
    grads = torch.autograd.grad(runs, inputs, grad_out)
    for grad, want in zip(grads, wants, strict=True):
        torch.testing.assert_close(grad, want)
