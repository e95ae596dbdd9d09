from __future__ import annotations

import pytest
import torch

from fastllm_kernels.qk_norm_rotary import (
    split_qkv_norm_rotary,
    split_qkv_norm_rotary_reference,
)
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _angles(batch, seq, head_dim, per_batch, device="cpu"):
    shape = (batch, seq, head_dim // 2) if per_batch else (seq, head_dim // 2)
    angles = torch.rand(shape, device=device) * 100
    return angles.cos(), angles.sin()


def _transposed_like(x):
    """A gradient as cuDNN attention returns it: a (batch, heads, seq, dim)-contiguous view."""
    batch, seq, heads, head_dim = x.shape
    return torch.randn(batch, heads, seq, head_dim, device=x.device).to(x.dtype).transpose(1, 2)


def _check(heads, kv_heads, head_dim, angles, norms, dtype, device="cpu", batch=2, seq=5):
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim, device=device) * 3
    qkv = qkv.to(dtype).requires_grad_()
    cos, sin = (None, None)
    if angles is not None:
        cos, sin = _angles(batch, seq, head_dim, angles == "per_batch", device)
    weights = [
        (torch.rand(head_dim, device=device) + 0.5).to(dtype).requires_grad_()
        if name in norms
        else None
        for name in ("query", "key")
    ]
    inputs = [qkv, *(w for w in weights if w is not None)]
    out = split_qkv_norm_rotary(qkv, heads, kv_heads, cos, sin, *weights, 1e-6)
    # The reference in fp32 from the same values: the kernel rounds once, at its stores (the
    # reference in bf16 would round the norm's output before rotating it).
    exact = [None if x is None else x.detach().float().requires_grad_() for x in (qkv, *weights)]
    expected = split_qkv_norm_rotary_reference(
        exact[0], heads, kv_heads, cos, sin, *exact[1:], 1e-6
    )
    grads = [_transposed_like(x).to(dtype) for x in expected]
    actual_grads = torch.autograd.grad(out, inputs, grads)
    exact_inputs = [x for x in exact if x is not None]
    expected_grads = torch.autograd.grad(expected, exact_inputs, [g.float() for g in grads])
    # fp32: the same fp32 expressions up to summation order; NaN shows an element left unwritten.
    tolerances = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2}
    for actual, reference in zip([*out, *actual_grads], [*expected, *expected_grads], strict=True):
        if actual.dim() == 1 and dtype == torch.float32:
            # A norm weight's gradient sums batch x seq x heads terms in another order: its
            # rounding grows with their number (3.8e-5 on 16,384 terms of about 3 on a GPU).
            terms = qkv.numel() // head_dim  # at most batch x seq x (heads + 2 kv_heads)
            scale = max(1.0, (terms / 64) ** 0.5)
            assert_close(actual, reference, rtol=1e-5 * scale, atol=1e-5 * scale)
            continue
        assert_close(actual, reference.to(dtype), **tolerances)
    assert all(x.is_contiguous() for x in out)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("angles", ["shared", "per_batch", None])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (3, 3, 12), (5, 1, 6)])
def test_split_qkv_norm_rotary_matches_reference(heads, kv_heads, head_dim, angles, dtype):
    _check(heads, kv_heads, head_dim, angles, ("query", "key"), dtype)


@triton_on_cpu
@pytest.mark.parametrize("norms", [("query",), ("key",), ()])
def test_a_part_without_a_norm_is_only_rotated(norms):
    _check(4, 2, 8, "shared", norms, torch.float32)


@triton_on_cpu
def test_without_rotary_an_odd_head_dim_is_normalized_whole():
    _check(2, 1, 7, None, ("query", "key"), torch.float32)


@triton_on_cpu
def test_the_weight_gradients_sum_over_many_programs():
    # 40 heads of head_dim 64 take two head blocks a token: partial sums from 2 x 18 programs.
    _check(32, 4, 64, "per_batch", ("query", "key"), torch.float32, batch=2, seq=9)


def test_split_qkv_norm_rotary_rejects_a_weight_of_another_size():
    qkv = torch.randn(1, 2, 4 * 8)
    with pytest.raises(ValueError, match="query_weight must be"):
        split_qkv_norm_rotary(qkv, 2, 1, None, None, torch.ones(4), None, 1e-6)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_qkv_norm_rotary_on_gpu_at_model_size(dtype):
    _check(32, 8, 128, "shared", ("query", "key"), dtype, device="cuda", batch=2, seq=256)
