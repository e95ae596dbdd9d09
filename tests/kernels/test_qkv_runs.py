from __future__ import annotations

import pytest
import torch

from fastllm_kernels.attention import attention_reference
from fastllm_kernels.rotary import split_qkv_rotary_reference
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu
from tests.kernels.test_attention import _dense_reference, _never, _packed_pairs, _pairs
from tests.kernels.test_rotary import _angles


@triton_on_cpu
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_split_into_runs_attends_as_the_mask_says(heads, kv_heads, rotate, monkeypatch, request):
    import fastllm_kernels.branch_attention as branch
    from fastllm_kernels.qkv_runs import (
        split_qkv_rotary_into_runs,
        split_qkv_rotary_into_runs_reference,
    )

    request.getfixturevalue("poisoned_empty")  # a slot or gradient left unwritten shows as NaN
    monkeypatch.setattr(branch, "DENSE_WORK", float("inf"))
    monkeypatch.setattr(branch, "DENSE_TILE", 4)  # padding past the longest run, too
    documents, branches = _packed_pairs()  # a prompt with three answers: two copy rounds
    batch, seq = branches.shape
    head_dim = 8
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim, requires_grad=True)
    # Angles per row: positions restart in each document.
    cos, sin = _angles(batch, seq, head_dim, per_batch=True) if rotate else (None, None)
    plan = branch.branch_plan(documents, branches)
    assert plan is not None and isinstance(plan.form, branch.DenseRuns)
    assert len(plan.form.slots.copies) == 2
    runs = split_qkv_rotary_into_runs(qkv, heads, kv_heads, cos, sin, plan.form)
    expected_runs = split_qkv_rotary_into_runs_reference(qkv, heads, kv_heads, cos, sin, plan.form)
    for got, want in zip(runs, expected_runs, strict=True):  # every slot, padding's too
        assert_close(got, want, rtol=0, atol=1e-6)
    out = branch.runs_attention(*runs, plan.form, 0.4, _dense_reference, batch)
    q, k, v = split_qkv_rotary_reference(qkv, heads, kv_heads, cos, sin)
    options = {"document_ids": documents, "branch_ids": branches, "scale": 0.4}
    expected = attention_reference(q, k, v, **options)
    used = branches != -1  # padding is left out: unused outputs, no gradient
    assert_close(out[used], expected[used])
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    (want,) = torch.autograd.grad(expected, qkv, grad_out * used[..., None, None])
    assert_close(grad, want, atol=1e-5)


@pytest.mark.gpu
@cuda
def test_attention_of_qkv_writes_the_runs_on_gpu(monkeypatch):
    import fastllm_kernels.attention as module
    import fastllm_kernels.branch_attention as branch

    if not branch.has_varlen_flash():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    monkeypatch.setattr(branch, "DENSE_WORK", float("inf"))
    monkeypatch.setattr(module, "varlen_flash", _never)
    monkeypatch.setattr(module, "_flex", None)  # any call of it fails
    documents, branches = _pairs(3, 300, 200, 201, device="cuda")
    documents[1, 400:] = 1  # a row of two documents: the second one has no prompt
    branches[2, 650:] = -1  # padding
    heads, kv_heads, head_dim = 16, 4, 64
    qkv = torch.randn(3, 701, (heads + 2 * kv_heads) * head_dim, device="cuda")
    qkv = qkv.to(torch.bfloat16).requires_grad_()
    cos, sin = _angles(3, 701, head_dim, per_batch=True, device="cuda")
    options = {"document_ids": documents, "branch_ids": branches, "scale": 0.1}
    out = module.attention_of_qkv(qkv, heads, kv_heads, cos, sin, **options)
    assert out is not None
    expected = attention_reference(
        *split_qkv_rotary_reference(qkv, heads, kv_heads, cos, sin), **options
    )
    used = branches != -1
    assert_close(out[used], expected[used], atol=2e-2)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    (want,) = torch.autograd.grad(expected, qkv, grad_out * used[..., None, None])
    assert_close(grad, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
