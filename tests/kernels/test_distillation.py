from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm_kernels.distillation import linear_distillation, linear_distillation_reference
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _inputs(n, hidden_size, teacher_size, vocab, dtype=torch.float32):
    hidden = torch.randn(n, hidden_size).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size) * 2 / hidden_size**0.5).to(dtype).requires_grad_()
    teacher_hidden = torch.randn(n, teacher_size).to(dtype)
    teacher_weight = (torch.randn(vocab, teacher_size) * 3 / teacher_size**0.5).to(dtype)
    mask = torch.rand(n) > 0.3
    mask[0] = False
    return hidden, weight, teacher_hidden, teacher_weight, mask


def _torch_loss(hidden, weight, teacher_hidden, teacher_weight, mask, temperature, loss_type):
    """What a user would write: whole logits, torch's KL divergence or soft-target
    cross-entropy, the mean over the masked tokens (TRL's GKD convention)."""
    student = hidden.float() @ weight.float().T / temperature
    teacher = (teacher_hidden.float() @ teacher_weight.float().T / temperature).detach()
    log_s, log_t = F.log_softmax(student, -1), F.log_softmax(teacher, -1)
    if loss_type == "forward_kl":
        losses = F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    elif loss_type == "reverse_kl":
        losses = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    else:
        losses = F.cross_entropy(student, log_t.exp(), reduction="none")
    return losses[mask].sum() / mask.sum()


@triton_on_cpu
@pytest.mark.parametrize("loss_type", ["forward_kl", "reverse_kl", "cross_entropy"])
@pytest.mark.parametrize(("temperature", "chunk_size"), [(1.0, 5), (2.5, None)])
def test_distillation_matches_torch(loss_type, temperature, chunk_size):
    # A wider teacher (24) than student (16), a vocabulary that is not a power of two.
    hidden, weight, *teacher, mask = _inputs(19, 16, 24, 70)
    loss = linear_distillation(hidden, weight, *teacher, mask, temperature, loss_type,
                               chunk_size=chunk_size)  # fmt: skip
    expected = _torch_loss(hidden, weight, *teacher, mask, temperature, loss_type)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(3.0 * loss, [hidden, weight])
    expected_grads = torch.autograd.grad(3.0 * expected, [hidden, weight])
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)
    reference = linear_distillation_reference(
        hidden, weight, *teacher, mask, temperature, loss_type
    )
    assert_close(reference, expected, rtol=1e-5, atol=1e-6)


@triton_on_cpu
@pytest.mark.parametrize("loss_type", ["forward_kl", "reverse_kl", "cross_entropy"])
def test_distillation_from_itself_has_zero_gradient_and_zero_kl(loss_type):
    hidden, weight, _, _, mask = _inputs(12, 16, 16, 50)
    loss = linear_distillation(hidden, weight, hidden.detach(), weight.detach(), mask, 2.0,
                               loss_type, chunk_size=5)  # fmt: skip
    grads = torch.autograd.grad(loss, [hidden, weight])
    assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in grads)
    if loss_type == "cross_entropy":  # the teacher's entropy
        expected = _torch_loss(hidden, weight, hidden, weight, mask, 2.0, loss_type)
        assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    else:
        assert loss == 0


@triton_on_cpu
@pytest.mark.parametrize("loss_type", ["forward_kl", "reverse_kl"])
def test_distillation_bf16_over_several_kernel_blocks(loss_type):
    # bf16 gradients take the first half of each row's fp32 student logits: a vocabulary of three
    # kernel blocks checks that no block's stores reach logits still to be read.
    hidden, weight, *teacher, mask = _inputs(5, 16, 32, 9000, dtype=torch.bfloat16)
    loss = linear_distillation(hidden, weight, *teacher, mask, 1.5, loss_type, chunk_size=3)
    expected = _torch_loss(hidden, weight, *teacher, mask, 1.5, loss_type)
    assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(loss, [hidden, weight])
    for grad, expected_grad in zip(
        grads, torch.autograd.grad(expected, [hidden, weight]), strict=True
    ):
        assert grad.dtype == torch.bfloat16
        # At the scale of the largest entry: one bf16 rounding of a sum.
        assert_close(
            grad, expected_grad.bfloat16(), rtol=2e-2, atol=2e-2 * expected_grad.abs().max().item()
        )


@triton_on_cpu
def test_distillation_under_no_grad_and_without_tokens():
    hidden, weight, *teacher, mask = _inputs(6, 8, 8, 20)
    with torch.no_grad():
        loss = linear_distillation(hidden, weight, *teacher, mask, chunk_size=4)
    assert not loss.requires_grad
    assert_close(loss, _torch_loss(hidden, weight, *teacher, mask, 1.0, "forward_kl").detach())
    loss = linear_distillation(hidden, weight, *teacher, torch.zeros(6, dtype=torch.bool))
    assert loss == 0
    grads = torch.autograd.grad(loss, [hidden, weight])
    assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in grads)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_type": "jsd"}, "loss_type"),
        ({"temperature": 0.0}, "temperature"),
        ({"teacher_weight": torch.zeros(21, 8)}, "teacher_weight"),
        ({"teacher_hidden": torch.zeros(5, 8)}, "teacher_hidden"),
    ],
)
def test_distillation_refuses_bad_arguments(change, message):
    hidden, weight, teacher_hidden, teacher_weight, mask = _inputs(6, 8, 8, 20)
    arguments = {"teacher_hidden": teacher_hidden, "teacher_weight": teacher_weight, **change}
    with pytest.raises(ValueError, match=message):
        linear_distillation(hidden, weight, mask=mask, **arguments)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("loss_type", ["forward_kl", "reverse_kl"])
def test_distillation_at_llama3_vocabulary_matches_the_reference(loss_type):
    # A student of hidden size 1024 and a teacher of 2048, 4096 tokens, a 128K vocabulary.
    hidden, weight, *teacher, mask = _inputs(4096, 1024, 2048, 128256, torch.bfloat16)
    hidden, weight = (x.detach().cuda().requires_grad_() for x in (hidden, weight))
    teacher, mask = [x.cuda() for x in teacher], mask.cuda()
    loss = linear_distillation(hidden, weight, *teacher, mask, 2.0, loss_type)
    expected = linear_distillation_reference(hidden, weight, *teacher, mask, 2.0, loss_type)
    assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(loss, [hidden, weight])
    for grad, expected_grad in zip(
        grads, torch.autograd.grad(expected, [hidden, weight]), strict=True
    ):
        scale = expected_grad.abs().max().item()
        assert_close(grad, expected_grad.bfloat16(), rtol=2e-2, atol=1e-2 * scale)
