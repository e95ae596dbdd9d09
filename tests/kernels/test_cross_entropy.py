from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm_kernels.cross_entropy import (
    cross_entropy,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    linear_label_losses,
    linear_label_losses_reference,
)
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _inputs(n, hidden_size, vocab, dtype=torch.float32, device="cpu", ignored_every=4):
    hidden = torch.randn(n, hidden_size, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=device) * 2 / hidden_size**0.5).to(dtype)
    labels = torch.randint(0, vocab, (n,), device=device)
    labels[ignored_every - 1 :: ignored_every] = -100
    return hidden, weight.requires_grad_(), labels


def _torch_loss(hidden, weight, labels, z_loss=0.0, label_smoothing=0.0, reduction="mean"):
    """What a user would write: full fp32 logits, torch's cross-entropy, z-loss on top."""
    logits = hidden.float() @ weight.float().T
    loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing, reduction="sum")
    valid = labels != -100
    loss = loss + z_loss * (torch.logsumexp(logits, -1)[valid] ** 2).sum()
    return loss / valid.sum() if reduction == "mean" else loss


def _check(loss, expected, inputs, grad_tolerances=None):
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    # A grad_output other than 1 must scale the gradients computed during forward.
    grads = torch.autograd.grad(3.0 * loss, inputs)
    expected_grads = torch.autograd.grad(3.0 * expected, inputs)
    for grad, expected_grad, x in zip(grads, expected_grads, inputs, strict=True):
        assert grad.dtype == x.dtype
        assert_close(grad, expected_grad.to(x.dtype), **(grad_tolerances or {}))


@triton_on_cpu
@pytest.mark.parametrize("chunk_size", [None, 1, 16])
@pytest.mark.parametrize(("n", "hidden_size", "vocab"), [(1, 8, 5), (37, 16, 100), (64, 24, 257)])
def test_linear_cross_entropy_matches_torch(n, hidden_size, vocab, chunk_size):
    hidden, weight, labels = _inputs(n, hidden_size, vocab, ignored_every=max(n // 4, 2))
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    _check(loss, _torch_loss(hidden, weight, labels), [hidden, weight])


@triton_on_cpu
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("z_loss", "label_smoothing"), [(1e-2, 0.0), (0.0, 0.1), (1e-3, 0.2)])
def test_linear_cross_entropy_z_loss_and_label_smoothing(z_loss, label_smoothing, reduction):
    hidden, weight, labels = _inputs(29, 16, 70)
    options = {"z_loss": z_loss, "label_smoothing": label_smoothing, "reduction": reduction}
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8, **options)
    expected = _torch_loss(hidden, weight, labels, **options)
    _check(loss, expected, [hidden, weight])
    reference = linear_cross_entropy_reference(hidden, weight, labels, **options)
    assert_close(reference, expected)


@triton_on_cpu
@pytest.mark.parametrize(("label_weight", "z_loss"), [(1.0, 0.0), (0.7, 0.05), (0.0, 0.1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_losses_mix_cross_entropy_and_z_loss_by_weight(label_weight, z_loss, dtype):
    hidden, weight, labels = _inputs(29, 16, 70, dtype=dtype)
    total, parts = linear_label_losses(
        hidden, weight, labels, label_weight=label_weight, z_loss=z_loss, chunk_size=8
    )
    # Plain torch: the cross-entropy, and the mean of logsumexp² over the labelled tokens.
    logits = hidden.float() @ weight.float().T
    valid = labels != -100
    cross_entropy = F.cross_entropy(logits, labels)
    z = (torch.logsumexp(logits, -1)[valid] ** 2).mean()
    assert not parts.requires_grad
    assert_close(parts, torch.stack([cross_entropy, z]).detach(), rtol=1e-5, atol=1e-5)
    tolerances = {"rtol": 2e-2, "atol": 2e-3} if dtype == torch.bfloat16 else None
    _check(total, label_weight * cross_entropy + z_loss * z, [hidden, weight], tolerances)
    reference, reference_parts = linear_label_losses_reference(
        hidden, weight, labels, label_weight, z_loss
    )
    assert_close(reference, label_weight * cross_entropy + z_loss * z, rtol=1e-5, atol=1e-5)
    assert_close(reference_parts, parts, rtol=1e-5, atol=1e-5)


@triton_on_cpu
def test_linear_cross_entropy_bf16():
    hidden, weight, labels = _inputs(40, 32, 300, dtype=torch.bfloat16)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=16, z_loss=1e-3)
    expected = _torch_loss(hidden, weight, labels, z_loss=1e-3)
    # bf16 gradients are rounded once at the end: compare at the scale of the largest entry.
    _check(loss, expected, [hidden, weight], {"rtol": 2e-2, "atol": 2e-3})


@triton_on_cpu
def test_linear_cross_entropy_bf16_gradients_over_their_rows_logits():
    # The bf16 gradient takes the first half of each row's fp32 logits: a vocabulary of three
    # kernel blocks checks that no block's stores reach logits still to be read.
    hidden, weight, labels = _inputs(6, 16, 9000, dtype=torch.bfloat16)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=4, label_smoothing=0.1)
    expected = _torch_loss(hidden, weight, labels, label_smoothing=0.1)
    _check(loss, expected, [hidden, weight], {"rtol": 2e-2, "atol": 2e-3})


@triton_on_cpu
def test_linear_cross_entropy_ignored_rows_get_no_gradient():
    hidden, weight, labels = _inputs(12, 16, 40, ignored_every=100)
    labels[5:9] = -1
    loss = linear_cross_entropy(hidden, weight, labels, ignore_index=-1, chunk_size=4)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert torch.equal(grad[5:9], torch.zeros_like(grad[5:9]))
    expected = F.cross_entropy(hidden.float() @ weight.float().T, labels, ignore_index=-1)
    assert_close(loss, expected)


@triton_on_cpu
def test_linear_cross_entropy_all_ignored_is_zero():
    hidden, weight, labels = _inputs(6, 8, 10)
    labels[:] = -100
    loss = linear_cross_entropy(hidden, weight, labels)
    grads = torch.autograd.grad(loss, [hidden, weight])
    assert loss.item() == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@triton_on_cpu
def test_linear_cross_entropy_with_frozen_weight_and_without_grad():
    hidden, weight, labels = _inputs(20, 16, 33)
    weight.requires_grad_(False)
    _check(
        linear_cross_entropy(hidden, weight, labels), _torch_loss(hidden, weight, labels), [hidden]
    )
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels)
    assert_close(loss, _torch_loss(hidden, weight, labels), rtol=1e-5, atol=1e-5)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_of_logits_matches_torch(dtype):
    logits = (3 * torch.randn(33, 130)).to(dtype).requires_grad_()
    labels = torch.randint(0, 130, (33,))
    labels[::3] = -100
    loss = cross_entropy(logits, labels, label_smoothing=0.1)
    expected = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
    _check(loss, expected, [logits])


@pytest.mark.gpu
@cuda
def test_linear_cross_entropy_at_llama3_size_stays_small():
    n, hidden_size, vocab = 8192, 4096, 128256
    hidden, weight, labels = _inputs(n, hidden_size, vocab, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(hidden, weight, labels, z_loss=1e-4)
    grad_hidden, grad_weight = torch.autograd.grad(loss, [hidden, weight])
    peak = torch.cuda.max_memory_allocated() - baseline
    # The fp32 weight-gradient accumulator, then either the chunk buffer (2048 rows of fp32
    # logits, the bf16 gradient in their place) or the final bf16 weight gradient, and the
    # hidden gradient: the unfused loss needs over 11 GiB.
    chunk_buffers = 2048 * vocab * 4
    budget = weight.numel() * 4 + max(chunk_buffers, weight.numel() * 2) + hidden.numel() * 2
    assert peak < budget + 2**27, f"peak {peak / 2**30:.2f} GiB > {budget / 2**30:.2f} GiB"
    expected = _torch_loss(hidden, weight, labels, z_loss=1e-4)
    assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    for grad, expected_grad in zip([grad_hidden, grad_weight], expected_grads, strict=True):
        scale = expected_grad.abs().max().item()
        assert_close(grad, expected_grad.bfloat16(), rtol=2e-2, atol=1e-2 * scale)
