from __future__ import annotations

import pytest
import torch

from fastllm_kernels.moe.grouped_linear import grouped_linear, grouped_linear_reference
from fastllm_kernels.moe.grouped_matmul import grouped_weight_gradient_
from fastllm_kernels.moe.sparse_copy import dispatch
from fastllm_kernels.moe.sparse_map import sparse_map
from fastllm_kernels.recipe import WeightRecipe
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu
from tests.kernels.test_moe import top_k


def routed_rows(tokens: int, num_experts: int, k: int, hidden: int, skew: float, **kw):
    """Tokens dispatched into a sparse layout (padding rows zero), and its map."""
    sparse = sparse_map(
        top_k(tokens, num_experts, k, skew).to(kw.get("device", "cpu")), num_experts
    )
    return dispatch(torch.randn(tokens, hidden, **kw), sparse), sparse


def sink_into(buffer: torch.Tensor) -> WeightRecipe:
    """A recipe with a gradient sink as the engine's: the product writes, then adds, into
    `buffer`."""
    state = {"fresh": True}

    def sink(product) -> None:
        product(buffer, not state["fresh"])
        state["fresh"] = False

    return WeightRecipe(gradient_sink=sink)


@triton_on_cpu
@pytest.mark.parametrize(
    ("tokens", "num_experts", "k", "hidden", "out", "skew"),
    [(37, 6, 2, 40, 24, 0.0), (50, 8, 3, 32, 64, 0.6), (9, 5, 1, 16, 8, 2.0)],
)
def test_grouped_linear_matches_the_reference(
    tokens, num_experts, k, hidden, out, skew, poisoned_empty
) -> None:
    x, sparse = routed_rows(tokens, num_experts, k, hidden, skew)
    if skew >= 2.0:
        assert (sparse.counts == 0).any()  # an expert that receives no token
    x.requires_grad_()
    weight = torch.randn(num_experts, out, hidden, requires_grad=True)
    used = int(sparse.ends[-1])
    y = grouped_linear(x, weight, sparse.ends)
    expected = grouped_linear_reference(x, weight, sparse.ends)
    assert_close(y, expected, atol=1e-5)  # with the rows past the last expert's range: zero
    y, expected = y[:used], expected[:used]
    grad = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, weight), grad)
    expected_grads = torch.autograd.grad(expected, (x, weight), grad)
    assert_close(grads[0][:used], expected_grads[0][:used], atol=1e-5)
    assert_close(grads[1], expected_grads[1], atol=1e-5)


def test_compiled_on_the_cpu_it_traces_grouped_mm_in_one_graph() -> None:
    # Not the reference, whose host sync would break the graph at every call.
    compiled = torch.compile(grouped_linear, fullgraph=True)
    weight = torch.randn(4, 24, 16, requires_grad=True)
    for tokens in (20, 31):  # rows of another count
        x, sparse = routed_rows(tokens, 4, 2, 16, 0.0)
        x.requires_grad_()
        used = int(sparse.ends[-1])
        y, reference, grads, expected = _with_reference(compiled, x, weight, sparse.ends)
        assert_close(y, reference, atol=1e-5)
        assert_close(grads[0][:used], expected[0][:used], atol=1e-5)
        assert_close(grads[1], expected[1], atol=1e-5)


@triton_on_cpu
def test_widths_that_tma_cannot_load_take_the_reference() -> None:
    # 6 fp32 outputs: 24-byte rows of the output gradient, which a TMA descriptor refuses.
    x, sparse = routed_rows(20, 4, 2, 16, 0.0)
    x.requires_grad_()
    weight = torch.randn(4, 6, 16, requires_grad=True)
    _, _, grads, expected = _with_reference(grouped_linear, x, weight, sparse.ends)
    assert_close(grads[0], expected[0], atol=1e-5)
    assert_close(grads[1], expected[1], atol=1e-5)


@triton_on_cpu
def test_the_weight_gradient_goes_into_the_sink_and_adds_there() -> None:
    x, sparse = routed_rows(40, 6, 2, 32, 0.8)
    weight = torch.randn(6, 16, 32, requires_grad=True)
    buffer = torch.full((6, 16, 32), float("nan"))
    recipe = sink_into(buffer)
    used = int(sparse.ends[-1])
    grad = torch.randn(used, 16)
    expected = torch.autograd.grad(
        grouped_linear_reference(x, weight, sparse.ends)[:used], weight, grad
    )[0]
    for passes in (1, 2):
        y = grouped_linear(x, weight, sparse.ends, recipe)[:used]
        y.backward(grad)
        assert weight.grad is None
        assert_close(buffer, passes * expected, atol=1e-5)


@triton_on_cpu
def test_the_weight_gradient_sums_only_each_experts_rows() -> None:
    # Rows ends[e-1]:ends[e] only, with ranges not a multiple of the kernel's row block (32):
    # the tail of each range is loaded masked, never the next expert's rows.
    ends = torch.tensor([5, 5, 45, 70, 71], dtype=torch.int32)
    g, x = torch.randn(80, 8), torch.randn(80, 16)
    out = torch.full((5, 8, 16), float("nan"))
    grouped_weight_gradient_(out, g, x, ends, accumulate=False)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        assert_close(out[expert], g[start:end].T @ x[start:end], atol=1e-5)
        start = end


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("num_experts", "skew"), [(64, 0.0), (8, 0.8), (4, 0.0)])
def test_the_weight_gradient_written_then_added_into_the_sink_on_gpu(num_experts, skew) -> None:
    # Written by our kernel on a step's first pass, added after by our kernel too (128 and
    # 1,024 rows an expert) or through torch._grouped_mm and a pass (2,048).
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x, sparse = routed_rows(4096, num_experts, 2, 512, skew, **bf16)
    weight = (torch.randn(num_experts, 768, 512, **bf16) / 16).requires_grad_()
    used = int(sparse.ends[-1])
    grad = torch.randn(used, 768, **bf16)
    exact = weight.detach().double().requires_grad_()  # a bf16 leaf's gradient would be bf16
    reference = grouped_linear_reference(x.double(), exact, sparse.ends)[:used]
    expected = torch.autograd.grad(reference, exact, grad.double())[0]
    buffer = torch.empty(num_experts, 768, 512, device="cuda")
    recipe = sink_into(buffer)
    for passes, rtol, atol in ((1, 1e-4, 1e-3), (2, 4e-3, 1e-2)):  # the second adds bf16
        grouped_linear(x, weight, sparse.ends, recipe)[:used].backward(grad)
        assert_close(buffer, passes * expected.float(), rtol=rtol, atol=atol)


@cuda
@pytest.mark.gpu
def test_grouped_linear_in_fp32_on_gpu(poisoned_empty) -> None:
    x, sparse = routed_rows(2048, 16, 2, 256, 0.5, device="cuda")
    x.requires_grad_()
    weight = (torch.randn(16, 384, 256, device="cuda") / 16).requires_grad_()
    y = grouped_linear(x, weight, sparse.ends)
    reference = grouped_linear_reference(x.double(), weight.double(), sparse.ends)
    assert_close(y, reference.float(), rtol=1e-4, atol=1e-4)
    grad = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, weight), grad)
    expected = torch.autograd.grad(reference, (x, weight), grad.double())
    used = int(sparse.ends[-1])
    assert_close(grads[0][:used], expected[0][:used].float(), rtol=1e-4, atol=1e-4)
    assert_close(grads[1], expected[1].float(), rtol=1e-4, atol=1e-3)  # sums of ~256 terms


def _with_reference(function, x, weight, ends):
    """`function`'s product of the used rows and the reference's, and their gradients in x
    and the weight for one random output gradient."""
    used = int(ends[-1])
    y = function(x, weight, ends)[:used]
    grad = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, weight), grad)
    reference = grouped_linear_reference(x, weight, ends)[:used]
    expected = torch.autograd.grad(reference, (x, weight), grad)
    return y, reference, grads, expected
