from __future__ import annotations

import numpy as np
import pytest
import torch

from fastllm_kernels.moe.grouped_linear import grouped_linear, grouped_linear_reference
from fastllm_kernels.moe.routing import route, route_reference
from fastllm_kernels.moe.sparse_copy import (
    combine,
    combine_reference,
    dispatch,
    dispatch_reference,
)
from fastllm_kernels.moe.sparse_map import sparse_map, sparse_map_reference
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu


def sparse_map_numpy(experts: np.ndarray, num_experts: int, block: int):
    """The layout spelled out: experts in order, each one's (token, slot) pairs in token order,
    its range padded to the block."""
    tokens, k = experts.shape
    rows = np.full((tokens, k), -1)
    ends, position = [], 0
    for expert in range(num_experts):
        for token in range(tokens):
            for slot in range(k):
                if experts[token, slot] == expert:
                    rows[token, slot] = position
                    position += 1
        position = -(-position // block) * block
        ends.append(position)
    return rows, np.array(ends)


def top_k(tokens: int, num_experts: int, k: int, skew: float = 0.0) -> torch.Tensor:
    """Distinct experts per token; `skew` favours the low experts (some may get none)."""
    scores = torch.rand(tokens, num_experts) - skew * torch.arange(num_experts)
    return scores.topk(k, dim=-1).indices


@pytest.mark.parametrize(
    ("tokens", "num_experts", "k", "block", "skew"),
    [
        (1, 8, 1, 16, 0.0),
        (37, 8, 2, 16, 0.0),
        (50, 16, 8, 4, 0.0),
        (29, 128, 4, 16, 0.0),
        (40, 8, 2, 8, 0.5),
        (11, 6, 2, 4, 0.0),
    ],
)
@pytest.mark.parametrize("kernel", [sparse_map, sparse_map_reference], ids=["op", "reference"])
def test_sparse_map_matches_numpy(kernel, tokens, num_experts, k, block, skew) -> None:
    experts = top_k(tokens, num_experts, k, skew)
    sparse = kernel(experts, num_experts, block)
    rows, ends = sparse_map_numpy(experts.numpy(), num_experts, block)
    np.testing.assert_array_equal(sparse.rows.numpy(), rows)
    np.testing.assert_array_equal(sparse.ends.numpy(), ends)
    np.testing.assert_array_equal(
        sparse.counts.numpy(), np.bincount(experts.numpy().ravel(), minlength=num_experts)
    )
    assert sparse.num_rows == tokens * k + num_experts * block >= ends[-1]
    entries = np.full(sparse.num_rows, -1)
    entries[rows.ravel()] = np.arange(tokens * k)
    np.testing.assert_array_equal(sparse.entries.numpy(), entries)
    if skew:
        assert (sparse.counts == 0).any(), "the skewed case should leave an expert without tokens"


@triton_on_cpu
@pytest.mark.parametrize(
    ("tokens", "num_experts", "k", "renormalize"),
    [
        (37, 8, 2, True),
        (50, 16, 8, False),
        (29, 128, 4, True),
        (5, 6, 1, False),
        (70, 4, 4, True),
        (23, 8, 3, True),
    ],
)
def test_route_matches_its_reference(tokens, num_experts, k, renormalize, poisoned_empty) -> None:
    logits = (torch.randn(tokens, num_experts) * 2).requires_grad_()
    grad_weights = torch.randn(tokens, k)
    results = []
    for kernel in (route, route_reference):
        routing = kernel(logits, k, renormalize, torch.float32, 0.1, 0.01)
        loss = (routing.weights * grad_weights).sum() + 3.0 * routing.auxiliary
        results.append((routing, torch.autograd.grad(loss, logits)[0]))
    (ours, grad), (theirs, expected_grad) = results
    assert torch.equal(ours.experts, theirs.experts) and torch.equal(ours.counts, theirs.counts)
    for name in ("rows", "entries", "ends", "counts"):  # the sparse map made in passing
        assert torch.equal(getattr(ours.sparse, name), getattr(theirs.sparse, name)), name
    assert ours.sparse.num_rows == theirs.sparse.num_rows
    assert_close(ours.weights, theirs.weights)
    assert_close(ours.auxiliary, theirs.auxiliary)
    assert_close(grad, expected_grad, atol=1e-5)
    # The auxiliary loss alone, and the weights alone.
    for pick in (lambda r: r.auxiliary, lambda r: r.weights.sum()):
        grads = [
            torch.autograd.grad(
                pick(kernel(logits, k, renormalize, torch.float32, 0.1, 0.01)), logits
            )[0]
            for kernel in (route, route_reference)
        ]
        assert_close(grads[0], grads[1], atol=1e-5)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "num_experts", "k"),
    [(13, 40, 8, 2), (6, 24, 8, 8), (9, 7, 4, 1), (5, 33, 16, 3), (3, 1100, 8, 8)],
)
def test_dispatch_and_combine_match_their_references(
    dtype, tokens, hidden, num_experts, k, poisoned_empty
) -> None:
    experts = top_k(tokens, num_experts, k)
    sparse = sparse_map(experts, num_experts, 4)
    x = torch.randn(tokens, hidden).to(dtype).requires_grad_()
    weights = torch.rand(tokens, k).to(dtype).requires_grad_()
    y = torch.randn(sparse.num_rows, hidden).to(dtype).requires_grad_()
    grad_sparse = torch.randn(sparse.num_rows, hidden).to(dtype)
    grad_dense = torch.randn(tokens, hidden).to(dtype)

    out = dispatch(x, sparse)
    expected = dispatch_reference(x, sparse)
    assert_close(out, expected)
    (d_x,) = torch.autograd.grad(out, x, grad_sparse)
    (expected_d_x,) = torch.autograd.grad(expected, x, grad_sparse)
    assert_close(d_x, expected_d_x)

    out = combine(y, sparse, weights)
    expected = combine_reference(y.float(), sparse, weights.float())
    assert_close(out, expected.to(dtype))
    grads = torch.autograd.grad(out, (y, weights), grad_dense)
    expected_grads = torch.autograd.grad(expected, (y, weights), grad_dense.float())
    for actual, reference in zip(grads, expected_grads, strict=True):
        assert_close(actual, reference.to(dtype), atol=1e-4 if dtype == torch.float32 else 2e-2)


def test_grouped_linear_reference_multiplies_each_range_by_its_expert() -> None:
    x = torch.randn(12, 5)
    weight = torch.randn(3, 4, 5)
    ends = torch.tensor([4, 4, 10], dtype=torch.int32)
    out = grouped_linear_reference(x, weight, ends)
    torch.testing.assert_close(out[:4], x[:4] @ weight[0].T)
    torch.testing.assert_close(out[4:10], x[4:10] @ weight[2].T)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("num_experts", "skew"), [(8, 0.0), (64, 0.0), (8, 0.8)])
def test_grouped_mm_matches_the_reference_on_gpu(num_experts, skew) -> None:
    experts = top_k(2048, num_experts, 2, skew).cuda()
    sparse = sparse_map(experts, num_experts)
    x = dispatch(torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16), sparse)
    x.requires_grad_()
    weight = (torch.randn(num_experts, 384, 256, device="cuda") / 16).bfloat16().requires_grad_()
    grad = torch.randn(sparse.num_rows, 384, device="cuda", dtype=torch.bfloat16)
    out = grouped_linear(x, weight, sparse.ends)
    expected = grouped_linear_reference(x.float(), weight.float(), sparse.ends)
    used = int(sparse.ends[-1])
    assert_close(out[:used], expected[:used].bfloat16())
    grad[used:] = 0  # rows past the last range are never read back, so get no gradient
    grads = torch.autograd.grad(out[:used], (x, weight), grad[:used])
    expected_grads = torch.autograd.grad(expected[:used], (x, weight), grad[:used].float())
    assert_close(grads[0][:used], expected_grads[0][:used].bfloat16(), atol=1e-2)
    assert_close(grads[1], expected_grads[1].bfloat16(), atol=1e-2)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("num_experts", "k"), [(64, 8), (8, 2), (128, 4)])
def test_routing_sparse_map_and_permutations_match_their_references_on_gpu(num_experts, k) -> None:
    tokens, hidden = 8192, 512
    # Distinct logits per token, exact in bf16: no top-k tie for the two to break differently.
    ranks = torch.rand(tokens, num_experts, device="cuda").argsort(dim=-1)
    logits = ((ranks - num_experts / 2) / 8).bfloat16().requires_grad_()
    grad_weights = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    routings, grads = [], []
    for kernel in (route, route_reference):
        routing = kernel(logits, k, True, torch.bfloat16, 0.01, 0.001)
        loss = (routing.weights.float() * grad_weights.float()).sum() + 100.0 * routing.auxiliary
        grads.append(torch.autograd.grad(loss, logits)[0])
        routings.append(routing)
    ours, theirs = routings
    assert torch.equal(ours.experts, theirs.experts) and torch.equal(ours.counts, theirs.counts)
    assert_close(ours.weights, theirs.weights)
    assert_close(ours.auxiliary, theirs.auxiliary)
    assert_close(grads[0], grads[1], atol=1e-2)
    expected = sparse_map_reference(ours.experts, num_experts, 16)
    for sparse in (sparse_map(ours.experts, num_experts, 16), ours.sparse):
        for name in ("rows", "entries", "ends", "counts"):
            assert torch.equal(getattr(sparse, name), getattr(expected, name)), name
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(dispatch(x, sparse), dispatch_reference(x, sparse))
    y = torch.randn(sparse.num_rows, hidden, device="cuda", dtype=torch.bfloat16)
    y.requires_grad_()
    weights = ours.weights.detach().requires_grad_()
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    outs = [f(y, sparse, weights) for f in (combine, combine_reference)]
    assert_close(outs[0], outs[1], atol=2e-2)
    grads = [torch.autograd.grad(out, (y, weights), grad) for out in outs]
    for actual, reference in zip(*grads, strict=True):
        assert_close(actual, reference, atol=5e-2)
