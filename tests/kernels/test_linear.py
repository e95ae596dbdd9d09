from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm_kernels.gated_linear import gated_linear, gated_linear_reference
from fastllm_kernels.linear import linear, matmul_into_fp32_
from fastllm_kernels.recipe import WeightRecipe
from tests.kernels.conftest import cuda, triton_on_cpu


def _with_sink(weight: torch.Tensor) -> tuple[torch.Tensor, WeightRecipe, torch.Tensor]:
    """A leaf copy of weight, and a recipe whose sink accumulates its gradient into the fp32
    buffer returned third."""
    leaf = weight.detach().clone().requires_grad_()
    main = torch.zeros(weight.shape)
    return leaf, WeightRecipe(gradient_sink=lambda product: product(main, True)), main


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_hands_the_weight_gradient_to_the_sink(dtype, bias) -> None:
    x = torch.randn(2, 5, 12).to(dtype).requires_grad_()
    weight = torch.randn(7, 12).to(dtype)
    b = torch.randn(7).to(dtype).requires_grad_() if bias else None
    grad = torch.randn(2, 5, 7).to(dtype)
    reference_weight = weight.clone().requires_grad_()
    F.linear(x, reference_weight, b).backward(grad)
    expected = (x.grad.clone(), None if b is None else b.grad.clone())
    x.grad = None
    if b is not None:
        b.grad = None

    sunk, recipe, main = _with_sink(weight)
    out = linear(x, sunk, b, recipe)
    torch.testing.assert_close(out, F.linear(x, weight, b))
    out.backward(grad)
    out = linear(x, sunk, b, recipe)  # a second micro-batch accumulates
    out.backward(grad)
    assert sunk.grad is None
    product = grad.reshape(-1, 7).float().T @ x.detach().reshape(-1, 12).float()
    torch.testing.assert_close(main, 2 * product, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, 2 * expected[0])
    if b is not None:
        torch.testing.assert_close(b.grad, 2 * expected[1])


def test_linear_without_a_sink_is_f_linear() -> None:
    x = torch.randn(3, 8, requires_grad=True)
    weight = torch.randn(4, 8, requires_grad=True)
    linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, torch.ones(3, 4).T @ x.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_into_fp32_overwrites_or_accumulates(dtype) -> None:
    a, b = torch.randn(6, 9).to(dtype), torch.randn(9, 4).to(dtype)
    out = torch.full((6, 4), 7.0)
    matmul_into_fp32_(out, a, b, accumulate=False)
    product = a.float() @ b.float()
    torch.testing.assert_close(out, product)
    matmul_into_fp32_(out, a, b, accumulate=True)
    torch.testing.assert_close(out, 2 * product)


@triton_on_cpu
def test_gated_linear_hands_the_weight_gradient_to_the_sink() -> None:
    x = torch.randn(2, 3, 16, requires_grad=True)
    weight = torch.randn(5, 8)
    grad = torch.randn(2, 3, 5)
    reference = weight.clone().requires_grad_()
    gated_linear_reference(x, reference, None, "silu").backward(grad)
    expected_dx = x.grad.clone()
    x.grad = None
    sunk, recipe, main = _with_sink(weight)
    gated_linear(x, sunk, None, "silu", recipe).backward(grad)
    assert sunk.grad is None
    torch.testing.assert_close(main, reference.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, expected_dx, rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.gpu
def test_matmul_into_fp32_on_gpu_accumulates_bf16_products_in_fp32() -> None:
    a = torch.randn(512, 4096, device="cuda").bfloat16()
    b = torch.randn(4096, 384, device="cuda").bfloat16()
    out = torch.zeros(512, 384, device="cuda")
    matmul_into_fp32_(out, a, b, accumulate=False)
    matmul_into_fp32_(out, a, b, accumulate=True)
    torch.testing.assert_close(out, 2 * (a.float() @ b.float()), rtol=1e-4, atol=1e-3)
