from __future__ import annotations

import pytest
import torch

from fastllm_kernels.activation import (
    ACTIVATIONS,
    gated_activation,
    gated_activation_fused,
    gated_activation_reference,
)
from fastllm_kernels.gated_linear import gated_linear, gated_linear_reference
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")

SHAPES = [(1, 1), (3, 5, 37), (4, 1100)]
TORCH_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
    "relu": torch.relu,
    "squared_relu": lambda g: torch.relu(g) ** 2,
}


def _check_gradients(out, expected, inputs):
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    expected_grads = torch.autograd.grad(expected, inputs, grad_out)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_close(grad, expected_grad)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_matches_torch_activations(activation):
    gate, up = torch.randn(2, 3, 40, dtype=torch.float64).unbind(0)
    expected = TORCH_ACTIVATIONS[activation](gate) * up
    torch.testing.assert_close(gated_activation_reference(gate, up, activation), expected)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_activation_matches_reference(activation, shape, dtype):
    gate = (2 * torch.randn(shape)).to(dtype).requires_grad_()
    up = torch.randn(shape).to(dtype).requires_grad_()
    out = gated_activation(gate, up, activation)
    expected = gated_activation_reference(gate, up, activation)
    assert out.dtype == dtype
    assert_close(out, expected)
    _check_gradients(out, expected, [gate, up])


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_gated_activation_takes_gate_then_up(activation, shape, dtype):
    x = (2 * torch.randn(*shape[:-1], 2 * shape[-1])).to(dtype).requires_grad_()
    gate, up = x.chunk(2, dim=-1)
    out = gated_activation_fused(x, activation)
    expected = gated_activation_reference(gate, up, activation)
    assert_close(out, expected)
    _check_gradients(out, expected, [x])


@triton_on_cpu
def test_gated_activation_reads_views_of_a_fused_tensor():
    x = torch.randn(6, 7, 2 * 50, requires_grad=True)
    gate, up = x.chunk(2, dim=-1)
    out = gated_activation(gate, up, "silu")
    expected = gated_activation_reference(gate, up, "silu")
    assert_close(out, expected)
    _check_gradients(out, expected, [x])


@triton_on_cpu
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5, 37)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_linear_matches_reference(activation, shape, bias):
    x = (2 * torch.randn(*shape[:-1], 2 * shape[-1])).requires_grad_()
    weight = torch.randn(11, shape[-1], requires_grad=True)
    b = torch.randn(11, requires_grad=True) if bias else None
    out = gated_linear(x, weight, b, activation)
    expected = gated_linear_reference(x, weight, b, activation)
    assert out.shape == (*shape[:-1], 11)
    assert_close(out, expected)
    _check_gradients(out, expected, [x, weight] + ([b] if bias else []))


@triton_on_cpu
def test_gated_linear_computes_only_the_gradients_asked_for():
    x = torch.randn(4, 2 * 8, requires_grad=True)
    weight = torch.randn(5, 8)  # frozen
    (grad_x,) = torch.autograd.grad(gated_linear(x, weight, None).sum(), [x])
    expected = torch.autograd.grad(gated_linear_reference(x, weight, None, "silu").sum(), [x])[0]
    assert_close(grad_x, expected)


@triton_on_cpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_linear_weight_gradient_is_the_same_with_and_without_the_input_gradient(activation):
    # With x's gradient the backward kernel recomputes the activation over the activation's
    # gradient; without, a forward pass recomputes it: the weight gradients agree bit for bit.
    x = 2 * torch.randn(2, 7, 2 * 33)
    weight = torch.randn(6, 33, requires_grad=True)
    grad_out = torch.randn(2, 7, 6)
    x_grad = x.clone().requires_grad_()
    with_x = torch.autograd.grad(gated_linear(x_grad, weight, None, activation), [weight], grad_out)
    alone = torch.autograd.grad(gated_linear(x, weight, None, activation), [weight], grad_out)
    torch.testing.assert_close(with_x[0], alone[0], rtol=0, atol=0)
    expected = torch.autograd.grad(
        gated_linear_reference(x, weight, None, activation), [weight], grad_out
    )
    assert_close(alone[0], expected[0])


@triton_on_cpu
def test_gated_linear_stores_its_input_not_the_activation():
    x = torch.randn(6, 2 * 40, requires_grad=True)
    weight = torch.randn(9, 40, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gated_linear(x, weight, None)
    assert sorted(t.numel() for t in saved) == sorted([x.numel(), weight.numel()])


def test_unknown_activation_is_an_error():
    with pytest.raises(ValueError, match="unknown activation"):
        gated_activation(torch.randn(3), torch.randn(3), "swish")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_gated_activation_matches_reference_at_model_size(activation):
    x = torch.randn(8192, 2 * 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = gated_activation_fused(x, activation)
    expected = gated_activation_reference(*x.chunk(2, dim=-1), activation)
    assert_close(out, expected)
    _check_gradients(out, expected, [x])


@pytest.mark.gpu
@cuda
def test_gated_linear_matches_reference_at_model_size():
    x = torch.randn(4096, 2 * 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(4096, 14336, device="cuda") / 120).to(torch.bfloat16).requires_grad_()
    out = gated_linear(x, weight, None, "silu")
    expected = gated_linear_reference(x, weight, None, "silu")
    assert_close(out, expected, rtol=2e-2, atol=2e-2)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, weight], grad_out)
    expected_grads = torch.autograd.grad(expected, [x, weight], grad_out)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert (grad.float() - expected_grad.float()).norm() <= 1e-2 * expected_grad.float().norm()
