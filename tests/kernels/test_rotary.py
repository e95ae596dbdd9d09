from __future__ import annotations

import pytest
import torch

from fastllm_kernels.rotary import apply_rotary, apply_rotary_reference
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
