from __future__ import annotations

import pytest
import torch

from fastllm_kernels.rotary import (
    apply_rotary,
    apply_rotary_reference,
    split_qkv_rotary,
    split_qkv_rotary_reference,
)
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _angles(batch, seq, head_dim, per_batch, device="cpu"):
    shape = (batch, seq, head_dim // 2) if per_batch else (seq, head_dim // 2)
    angles = torch.rand(shape, device=device) * 100
    return angles.cos(), angles.sin()


def _rotate_half_formula(x, cos, sin):
    """Hugging Face's apply_rotary_pos_emb, spelled out in fp32."""
    cos = torch.cat([cos, cos], dim=-1).reshape(-1, x.shape[1], 1, x.shape[3])
    sin = torch.cat([sin, sin], dim=-1).reshape(-1, x.shape[1], 1, x.shape[3])
    x1, x2 = x.float().chunk(2, dim=-1)
    return x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin


@pytest.mark.parametrize("per_batch", [False, True])
def test_reference_is_rotate_half(per_batch):
    x = torch.randn(2, 5, 3, 12)
    cos, sin = _angles(2, 5, 12, per_batch)
    assert_close(apply_rotary_reference(x, cos, sin), _rotate_half_formula(x, cos, sin))


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 5, 3, 10), (3, 7, 4, 64), (1, 3, 70, 16)])
def test_rotary_of_qkv_slice_matches_reference(shape, per_batch, dtype):
    batch, seq, heads, head_dim = shape
    # x is the k part of a fused qkv projection: a strided view that is rotated in place.
    qkv = torch.randn(batch, seq, 3, heads, head_dim).to(dtype).requires_grad_()
    cos, sin = _angles(batch, seq, head_dim, per_batch)
    expected = apply_rotary_reference(qkv[:, :, 1], cos, sin)
    fused = qkv * 1  # a non-leaf the kernel may overwrite
    out = apply_rotary(fused[:, :, 1], cos, sin)
    assert out.data_ptr() == fused[:, :, 1].data_ptr()  # in place
    assert_close(out, expected)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    (expected_grad,) = torch.autograd.grad(expected, qkv, grad_out)
    assert_close(grad, expected_grad)


@triton_on_cpu
def test_rotary_backward_leaves_shared_gradient_alone():
    x = torch.randn(2, 6, 4, 8, requires_grad=True)
    y = torch.randn(2, 6, 4, 8, requires_grad=True)
    cos, sin = _angles(2, 6, 8, per_batch=False)
    grad_out = torch.randn(2, 6, 4, 8)
    # The addition hands one gradient tensor to both branches; rotating it in place would
    # corrupt y's gradient.
    (apply_rotary(x, cos, sin) + y).backward(grad_out)
    assert_close(y.grad, grad_out)
    (expected,) = torch.autograd.grad(apply_rotary_reference(x, cos, sin), x, grad_out)
    assert_close(x.grad, expected)


@triton_on_cpu
def test_rotary_rejects_mismatched_angles():
    x = torch.randn(2, 6, 4, 8)
    cos, sin = _angles(2, 5, 8, per_batch=False)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rotary(x, cos, sin)


def _transposed_like(x):
    """A gradient as cuDNN attention returns it: a (batch, heads, seq, dim)-contiguous view."""
    batch, seq, heads, head_dim = x.shape
    return torch.randn(batch, heads, seq, head_dim, device=x.device).to(x.dtype).transpose(1, 2)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("angles", ["shared", "per_batch", None])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (4, 2, 12), (3, 3, 12), (5, 1, 6)])
def test_split_qkv_rotary_matches_reference(heads, kv_heads, head_dim, angles, dtype):
    batch, seq = 2, 5
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim).to(dtype).requires_grad_()
    cos, sin = (
        (None, None) if angles is None else _angles(batch, seq, head_dim, angles == "per_batch")
    )
    out = split_qkv_rotary(qkv, heads, kv_heads, cos, sin)
    expected = split_qkv_rotary_reference(qkv, heads, kv_heads, cos, sin)
    grads = [_transposed_like(x) for x in expected]
    (dqkv,) = torch.autograd.grad(out, qkv, grads)
    (expected_dqkv,) = torch.autograd.grad(expected, qkv, grads)
    # fp32 is exact: both compute the same fp32 expressions; NaN shows an element left unwritten.
    tolerances = {"rtol": 0, "atol": 1e-6} if dtype == torch.float32 else {}
    for actual, reference in zip([*out, dqkv], [*expected, expected_dqkv], strict=True):
        assert actual.is_contiguous()
        assert_close(actual, reference, **tolerances)


@triton_on_cpu
@pytest.mark.parametrize("per_batch", [False, True])
def test_split_qkv_rotary_matches_rotary_of_slices(per_batch):
    batch, seq, heads, kv_heads, head_dim = 2, 4, 4, 2, 12
    qkv = torch.randn(batch, seq, 8 * head_dim, requires_grad=True)
    cos, sin = _angles(batch, seq, head_dim, per_batch)
    q, k, v = split_qkv_rotary(qkv, heads, kv_heads, cos, sin)
    parts = (qkv * 1).view(batch, seq, 8, head_dim)
    expected = (
        apply_rotary(parts[:, :, :heads], cos, sin),
        apply_rotary(parts[:, :, heads : heads + kv_heads], cos, sin),
        parts[:, :, heads + kv_heads :],
    )
    grads = [_transposed_like(x) for x in expected]
    (dqkv,) = torch.autograd.grad((q, k, v), qkv, grads)
    (expected_dqkv,) = torch.autograd.grad(expected, qkv, grads)
    for actual, reference in zip((q, k, v, dqkv), (*expected, expected_dqkv), strict=True):
        assert_close(actual, reference)


def _check_against_reference(qkv, heads, kv_heads, cos, sin, **tolerances):
    """Outputs and dqkv (from transposed output gradients) against the reference."""
    out = split_qkv_rotary(qkv, heads, kv_heads, cos, sin)
    expected = split_qkv_rotary_reference(qkv, heads, kv_heads, cos, sin)
    grads = [_transposed_like(x) for x in expected]
    (dqkv,) = torch.autograd.grad(out, qkv, grads)
    (expected_dqkv,) = torch.autograd.grad(expected, qkv, grads)
    for actual, reference in zip([*out, dqkv], [*expected, expected_dqkv], strict=True):
        assert_close(actual, reference, **tolerances)


@triton_on_cpu
def test_split_qkv_rotary_reads_a_strided_qkv():
    batch, seq, heads, kv_heads, head_dim = 2, 3, 4, 2, 8
    # (seq, batch)-major and wider than its 8 heads, as a slice of a larger projection would be.
    qkv = torch.randn(seq, batch, 9 * head_dim).transpose(0, 1)[..., : 8 * head_dim]
    qkv.requires_grad_()
    cos, sin = _angles(batch, seq, head_dim, per_batch=True)
    _check_against_reference(qkv, heads, kv_heads, cos, sin, rtol=0, atol=1e-6)


@triton_on_cpu
@pytest.mark.parametrize("used", [(0,), (1,), (2,), (0, 2)])
def test_split_qkv_rotary_gradient_of_unused_outputs_is_zero(used):
    qkv = torch.randn(2, 3, 8 * 8, requires_grad=True)
    cos, sin = _angles(2, 3, 8, per_batch=False)
    out = split_qkv_rotary(qkv, 4, 2, cos, sin)
    expected = split_qkv_rotary_reference(qkv, 4, 2, cos, sin)
    grads = [_transposed_like(out[i]) for i in used]
    (dqkv,) = torch.autograd.grad([out[i] for i in used], qkv, grads)
    (expected_dqkv,) = torch.autograd.grad([expected[i] for i in used], qkv, grads)
    assert_close(dqkv, expected_dqkv, rtol=0, atol=1e-6)


@triton_on_cpu
def test_split_qkv_rotary_rejects_bad_shapes():
    cos, sin = _angles(2, 5, 8, per_batch=False)
    with pytest.raises(ValueError, match="heads"):
        split_qkv_rotary(torch.randn(2, 5, 8 * 8 + 2), 4, 2, cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        split_qkv_rotary(torch.randn(2, 6, 8 * 8), 4, 2, cos, sin)
    with pytest.raises(ValueError, match="both"):
        split_qkv_rotary(torch.randn(2, 5, 8 * 8), 4, 2, cos, None)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("per_batch", [False, True])
def test_rotary_matches_reference_at_model_size(per_batch):
    batch, seq, heads, head_dim = 4, 4096, 32, 128
    qkv = torch.randn(batch, seq, 48, head_dim, device="cuda", dtype=torch.bfloat16)
    qkv.requires_grad_()
    cos, sin = _angles(batch, seq, head_dim, per_batch, device="cuda")
    expected = apply_rotary_reference(qkv[:, :, :heads], cos, sin)
    out = apply_rotary((qkv * 1)[:, :, :heads], cos, sin)
    assert_close(out, expected)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    (expected_grad,) = torch.autograd.grad(expected, qkv, grad_out)
    assert_close(grad, expected_grad)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("per_batch", [False, True])
def test_split_qkv_rotary_matches_reference_at_model_size(per_batch):
    batch, seq, heads, kv_heads, head_dim = 2, 4096, 32, 8, 128
    qkv = torch.randn(batch, seq, 48 * head_dim, device="cuda", dtype=torch.bfloat16)
    qkv.requires_grad_()
    cos, sin = _angles(batch, seq, head_dim, per_batch, device="cuda")
    _check_against_reference(qkv, heads, kv_heads, cos, sin)
