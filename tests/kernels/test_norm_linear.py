from __future__ import annotations

import pytest
import torch

from fastllm_kernels.norm_linear import norm_linear, norm_linear_reference
from fastllm_kernels.recipe import WeightRecipe
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")

KINDS = [  # (rms, norm bias, linear bias)
    (True, False, False),
    (True, False, True),
    (False, True, True),
    (False, False, False),
]


def _inputs(kind, hidden, out, dtype, device="cpu"):
    _, norm_bias, bias = kind
    x = torch.randn(2, 5, hidden, device=device)
    tensors = [
        x,
        1 + 0.1 * torch.randn(hidden, device=device),
        0.1 * torch.randn(hidden, device=device) if norm_bias else None,
        torch.randn(out, hidden, device=device) / hidden**0.5,
        torch.randn(out, device=device) if bias else None,
    ]
    return [None if t is None else t.to(dtype).requires_grad_() for t in tensors]


def _call(fn, inputs, rms, eps=1e-5, recipe=None):
    x, norm_weight, norm_bias, weight, bias = inputs
    return fn(x, norm_weight, norm_bias, eps, rms, weight, bias, recipe)


@triton_on_cpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("hidden", "dtype"), [(24, torch.float32), (40, torch.bfloat16)])
def test_norm_linear_matches_reference(kind, hidden, dtype) -> None:
    inputs = _inputs(kind, hidden, 7, dtype)
    reference_inputs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    out = _call(norm_linear, inputs, kind[0])
    expected = _call(norm_linear_reference, reference_inputs, kind[0])
    # bf16: the normalized activations may round differently (the interpreter truncates).
    assert_close(out, expected, atol=1e-5 if dtype == torch.float32 else 5e-2)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for ours, theirs in zip(inputs, reference_inputs, strict=True):
        if ours is not None:
            assert_close(ours.grad, theirs.grad, atol=1e-4 if dtype == torch.float32 else 5e-2)


@triton_on_cpu
def test_norm_linear_stores_its_input_not_the_normalized_activations() -> None:
    inputs = _inputs(KINDS[0], 32, 8, torch.float32)
    activation_sized = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == inputs[0].numel():
            activation_sized.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _call(norm_linear, inputs, True)
    assert len(activation_sized) == 1
    assert activation_sized[0].data_ptr() == inputs[0].data_ptr()


@triton_on_cpu
def test_norm_linear_hands_the_weight_gradient_to_the_sink() -> None:
    inputs = _inputs(KINDS[1], 16, 6, torch.float32)
    reference_inputs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    weight, main = inputs[3], torch.zeros(inputs[3].shape)
    recipe = WeightRecipe(gradient_sink=lambda product: product(main, True))
    _call(norm_linear, inputs, True, recipe=recipe).sum().backward()
    _call(norm_linear_reference, reference_inputs, True).sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(main, reference_inputs[3].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs[0].grad, reference_inputs[0].grad, rtol=1e-5, atol=1e-5)


@triton_on_cpu
@pytest.mark.parametrize("kind", KINDS)
def test_weight_gradient_is_the_same_with_and_without_the_input_gradient(kind) -> None:
    # With x's gradient the norm's backward pass recomputes its output over the gradient it
    # reads; without, a forward pass recomputes it: the weight gradients agree bit for bit.
    x, norm_weight, norm_bias, weight, bias = _inputs(kind, 40, 7, torch.bfloat16)
    grad = torch.randn(2, 5, 7).to(torch.bfloat16)
    outputs = []
    for needs_x in (True, False):
        x_in = x.detach().clone().requires_grad_(needs_x)
        norm_in = [None if t is None else t.detach() for t in (norm_weight, norm_bias)]
        out = norm_linear(x_in, norm_in[0], norm_in[1], 1e-5, kind[0], weight, bias)
        outputs.append(torch.autograd.grad(out, [weight], grad)[0])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_rms_norm_linear_refuses_a_norm_bias() -> None:
    inputs = _inputs(KINDS[2], 8, 4, torch.float32)
    with pytest.raises(ValueError, match="no bias"):
        _call(norm_linear, inputs, True)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_norm_linear_matches_reference_on_gpu(kind) -> None:
    inputs = _inputs(kind, 4096, 1024, torch.bfloat16, device="cuda")
    reference_inputs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    out = _call(norm_linear, inputs, kind[0])
    expected = _call(norm_linear_reference, reference_inputs, kind[0])
    assert_close(out, expected, atol=2e-2)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for ours, theirs in zip(inputs, reference_inputs, strict=True):
        if ours is not None:
            scale = theirs.grad.abs().max().item()
            assert_close(ours.grad, theirs.grad, rtol=2e-2, atol=2e-2 * scale)
