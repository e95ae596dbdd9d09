from __future__ import annotations

import pytest
import torch

from fastllm_kernels.norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")

SHAPES = [(1, 8), (3, 5, 33), (64, 100), (50, 300), (9, 1000)]


def _inputs(shape, dtype, device="cpu", bias=True):
    n = shape[-1]
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    weight = (1 + 0.2 * torch.randn(n, device=device)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_() if bias else None
    return x, weight, b


def _compare(op, reference, args, dtype):
    out = op(*args)
    expected = reference(*args)
    assert out.dtype == dtype
    assert_close(out, expected)
    grad_out = torch.randn_like(out)
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    for grad, expected_grad, a in zip(grads, expected_grads, inputs, strict=True):
        assert grad.dtype == a.dtype
        # Weight/bias gradients sum over rows in a different order: allow for that in bf16.
        assert_close(grad, expected_grad, **({"atol": 5e-2} if dtype == torch.bfloat16 else {}))


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    x, weight, _ = _inputs(shape, dtype, bias=False)
    _compare(rms_norm, rms_norm_reference, (x, weight, 1e-5), dtype)


@triton_on_cpu
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_reference(shape, dtype, bias):
    x, weight, b = _inputs(shape, dtype, bias=bias)
    _compare(layer_norm, layer_norm_reference, (x, weight, b, 1e-5), dtype)


def test_layer_norm_reference_matches_torch():
    x, weight, b = _inputs((4, 37), torch.float32)
    expected = torch.nn.functional.layer_norm(x, (37,), weight, b, 1e-6)
    assert_close(layer_norm_reference(x, weight, b, 1e-6), expected)


def test_rms_norm_reference_matches_torch():
    x, weight, _ = _inputs((4, 37), torch.float32, bias=False)
    expected = torch.nn.functional.rms_norm(x, (37,), weight, 1e-6)
    assert_close(rms_norm_reference(x, weight, 1e-6), expected)


@triton_on_cpu
def test_norm_of_fp32_weight_keeps_bf16_activations():
    x, _, _ = _inputs((6, 48), torch.bfloat16)
    _, weight, b = _inputs((6, 48), torch.float32)
    _compare(layer_norm, layer_norm_reference, (x, weight, b, 1e-5), torch.bfloat16)


@triton_on_cpu
def test_norm_reads_strided_input():
    base = torch.randn(5, 7, 80).requires_grad_()
    x = base[..., 10:74]  # rows with a stride of 80
    weight = (1 + 0.2 * torch.randn(64)).requires_grad_()
    _compare(rms_norm, rms_norm_reference, (x, weight, 1e-6), torch.float32)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_matches_reference_at_model_size(kind):
    x, weight, b = _inputs((8192, 4096), torch.bfloat16, device="cuda")
    if kind == "rms":
        _compare(rms_norm, rms_norm_reference, (x, weight, 1e-5), torch.bfloat16)
    else:
        _compare(layer_norm, layer_norm_reference, (x, weight, b, 1e-5), torch.bfloat16)
