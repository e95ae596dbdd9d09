from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fastllm_kernels.attention import attention, attention_reference
from tests.kernels.conftest import assert_close, cuda


def _qkv(batch, seq, heads, kv_heads, head_dim, dtype=torch.float32, device="cpu"):
    q = torch.randn(batch, seq, heads, head_dim, device=device)
    k = torch.randn(batch, seq, kv_heads, head_dim, device=device)
    v = torch.randn(batch, seq, kv_heads, head_dim, device=device)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _documents(batch, seq, device="cpu"):
    """Packed documents of random lengths: contiguous runs of equal ids per row."""
    starts = torch.rand(batch, seq, device=device) < 0.2
    starts[:, 0] = True
    return starts.cumsum(dim=1)


def _naive(q, k, v, causal, window_size, document_ids, scale):
    """One query at a time: softmax over the keys it may see, in float64."""
    batch, seq, heads, head_dim = q.shape
    group = heads // k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros(batch, seq, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                keys = [
                    j
                    for j in range(seq)
                    if (not causal or j <= i)
                    and (window_size is None or abs(i - j) < window_size)
                    and (document_ids is None or document_ids[b, i] == document_ids[b, j])
                ]
                kk = k[b, keys, h // group].double()
                weights = torch.softmax(kk @ q[b, i, h].double() * scale, dim=0)
                out[b, i, h] = weights @ v[b, keys, h // group].double()
    return out


CASES = [
    {"causal": True},
    {"causal": False},
    {"causal": True, "window_size": 4},
    {"causal": False, "window_size": 3},
    {"causal": True, "window_size": 19},  # as long as the sequence (19): masks nothing
    {"causal": False, "window_size": 25},
    {"causal": True, "documents": True},
    {"causal": False, "documents": True},
    {"causal": True, "window_size": 3, "documents": True, "scale": 0.3},
]
HEADS = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_naive_loop(case, heads, kv_heads):
    q, k, v = _qkv(2, 11, heads, kv_heads, 8)
    documents = _documents(2, 11) if case.get("documents") else None
    options = {
        "causal": case["causal"],
        "window_size": case.get("window_size"),
        "document_ids": documents,
        "scale": case.get("scale"),
    }
    expected = _naive(q, k, v, *options.values())
    assert_close(attention_reference(q, k, v, **options), expected.float())


@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_reference(case, heads, kv_heads):
    q, k, v = _qkv(2, 19, heads, kv_heads, 16)
    documents = _documents(2, 19) if case.get("documents") else None
    options = {
        "causal": case["causal"],
        "window_size": case.get("window_size"),
        "document_ids": documents,
        "scale": case.get("scale"),
    }
    out = attention(q, k, v, **options)
    expected = attention_reference(q, k, v, **options)
    assert out.shape == q.shape
    assert_close(out, expected)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    expected_grads = torch.autograd.grad(expected, [q, k, v], grad_out)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_queries_of_a_later_chunk_see_the_keys_of_the_earlier_ones(case):
    """q of the last 7 of 19 positions against all 19 keys: the last 7 rows of the whole
    sequence's attention, with the gradients of those rows."""
    q, k, v = _qkv(2, 19, 4, 2, 16)
    documents = _documents(2, 19) if case.get("documents") else None
    options = {
        "causal": case["causal"],
        "window_size": case.get("window_size"),
        "document_ids": documents,
        "scale": case.get("scale"),
    }
    grad_out = torch.randn(2, 7, 4, 16)
    whole = attention_reference(q, k, v, **options)[:, 12:]
    expected_grads = torch.autograd.grad(whole, [q, k, v], grad_out)
    chunk = q.detach()[:, 12:].clone().requires_grad_()
    for implementation in (attention, attention_reference):
        out = implementation(chunk, k, v, **options)
        assert_close(out, whole)
        grads = torch.autograd.grad(out, [chunk, k, v], grad_out)
        assert_close(grads[0], expected_grads[0][:, 12:], rtol=1e-5, atol=1e-5)
        for grad, expected_grad in zip(grads[1:], expected_grads[1:], strict=True):
            assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_attention_bf16_matches_fp32_reference():
    q, k, v = _qkv(2, 23, 4, 2, 16, dtype=torch.bfloat16)
    documents = _documents(2, 23)
    out = attention(q, k, v, window_size=5, document_ids=documents)
    expected = attention_reference(q, k, v, window_size=5, document_ids=documents)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, atol=2e-2)


def test_attention_rejects_bad_head_counts():
    q, k, v = _qkv(1, 4, 6, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, v)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_reference_on_gpu(case):
    # Dense cases take SDPA (cuDNN first); windows and documents take flash-attn or flex_attention.
    q, k, v = _qkv(2, 2048, 16, 4, 128, dtype=torch.bfloat16, device="cuda")
    documents = _documents(2, 2048, device="cuda") if case.get("documents") else None
    window = case.get("window_size") and case["window_size"] * 100
    options = {
        "causal": case["causal"],
        "window_size": window,
        "document_ids": documents,
        "scale": case.get("scale"),
    }
    out = attention(q, k, v, **options)
    expected = attention_reference(q, k, v, **options)
    assert_close(out, expected, atol=2e-2)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    expected_grads = torch.autograd.grad(expected, [q, k, v], grad_out)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        scale = expected_grad.abs().max().item()
        assert_close(grad, expected_grad, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("documents", [False, True])
def test_queries_of_a_later_chunk_on_gpu(documents):
    q, k, v = _qkv(1, 1024, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    ids = _documents(1, 1024, device="cuda") if documents else None
    chunk = q.detach()[:, 768:].clone().requires_grad_()
    out = attention(chunk, k, v, document_ids=ids)
    expected = attention_reference(q, k, v, document_ids=ids)[:, 768:]
    assert_close(out, expected, atol=2e-2)


@pytest.mark.gpu
@cuda
def test_masked_attention_on_fewer_keys_than_a_flex_block_on_gpu():
    # Head dim 128 at 48 keys: torch 2.11's flex_attention found no kernel config for it.
    q, k, v = _qkv(2, 48, 8, 2, 128, dtype=torch.bfloat16, device="cuda")
    documents = _documents(2, 48, device="cuda")
    options = {"causal": True, "window_size": 32, "document_ids": documents}
    out = attention(q, k, v, **options)
    assert_close(out, attention_reference(q, k, v, **options), atol=2e-2)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.gpu
@cuda
def test_dense_masks_take_sdpa_where_flex_would_run_with_the_same_result_on_gpu(monkeypatch):
    # Evaluation's batches vary in shape: flex_attention would compile each.
    import fastllm_kernels.attention as module
    from fastllm_kernels.attention import dense_masks

    q, k, v = _qkv(2, 256, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    documents = _documents(2, 256, device="cuda")
    branches = (torch.arange(256, device="cuda") >= 200).int().expand(2, -1).contiguous()
    flexed = attention(q, k, v, document_ids=documents, branch_ids=branches)
    monkeypatch.setattr(module, "_flex", None)  # any call of it fails
    with dense_masks():
        dense = attention(q, k, v, document_ids=documents, branch_ids=branches)
        plain = attention(q, k, v, document_ids=documents)
    assert_close(dense, flexed, atol=2e-2)
    assert_close(plain, attention_reference(q, k, v, document_ids=documents), atol=2e-2)


def _pairs(batch: int, prompt: int, chosen: int, rejected: int, device="cpu"):
    """Rows of one preference pair each: document ids and branch ids (0 the prompt, 1 and 2
    its answers), as `engine.batch.Pairs` has them."""
    branches = torch.tensor([0] * prompt + [1] * chosen + [2] * rejected, device=device)
    branches = branches.expand(batch, -1).contiguous()
    return torch.zeros_like(branches), branches


def _apart(q, k, v, branches, part):
    """Attention of one answer's queries over `prompt + answer` alone, as if computed apart."""
    mine = (branches[0] == 0) | (branches[0] == part)
    out = attention_reference(q[:, mine], k[:, mine], v[:, mine], causal=True)
    return out[:, (branches[0] == part)[mine]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_each_answer_of_a_pair_attends_as_if_alone_with_its_prompt(device):
    torch.manual_seed(0)
    sizes = (80, 40, 48) if device == "cuda" else (5, 4, 6)  # CUDA: the flex path (>= 128 keys)
    documents, branches = _pairs(2, *sizes, device=device)
    q, k, v = _qkv(2, sum(sizes), 4, 2, 16, device=device)
    out = attention(q, k, v, causal=True, document_ids=documents, branch_ids=branches)
    torch.testing.assert_close(
        out, attention_reference(q, k, v, causal=True, document_ids=documents, branch_ids=branches)
    )
    for part in (1, 2):
        torch.testing.assert_close(out[:, branches[0] == part], _apart(q, k, v, branches, part))
    prompt = branches[0] == 0
    torch.testing.assert_close(
        out[:, prompt], attention_reference(q[:, prompt], k[:, prompt], v[:, prompt], causal=True)
    )


def _varlen_reference(q, k, v, cu_queries, cu_keys, max_queries, max_keys, scale):
    """Causal attention of each run apart, aligned to its last key (torch's varlen flash)."""
    queries = list(itertools.pairwise(cu_queries.tolist()))
    keys = list(itertools.pairwise(cu_keys.tolist()))
    outs = [
        attention_reference(q[None, s:e], k[None, a:b], v[None, a:b], causal=True, scale=scale)[0]
        for (s, e), (a, b) in zip(queries, keys, strict=True)
    ]
    assert max(e - s for s, e in queries) == max_queries
    assert max(b - a for a, b in keys) == max_keys
    return torch.cat(outs)


def _packed_pairs():
    """Two rows: pairs of several sizes (prefix 0, answers 1 and 2, the rejected answer's
    part first), a pair whose parts run 0, 2, 1, a prompt with three answers (its prefix
    copied twice), a document without answers, padding (-1)."""
    rows = [
        [(0, 5), (1, 3), (2, 4), None, (0, 2), (1, 6), (2, 1), None, (-1, 3)],
        [(0, 7), (2, 2), (1, 5), None, (0, 3), (1, 2), (3, 1), (2, 2), None, (0, 1), (-1, 1)],
    ]
    documents, branches = [], []
    for row in rows:
        doc, ids, bran = 0, [], []
        for run in row:
            if run is None:
                doc += 1
                continue
            ids += [doc] * run[1]
            bran += [run[0]] * run[1]
        documents.append(ids)
        branches.append(bran)
    assert len(branches[0]) == len(branches[1])
    return torch.tensor(documents), torch.tensor(branches)


def _dense_reference(q, k, v, scale):
    return attention_reference(q, k, v, causal=True, scale=scale)


def _never(*args):
    raise AssertionError("the plan's other form ran")


@pytest.mark.parametrize("form", ["varlen", "dense"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_shared_prefixes_as_causal_sequences_match_the_mask(heads, kv_heads, form, monkeypatch):
    import fastllm_kernels.branch_attention as module

    monkeypatch.setattr(module, "DENSE_WORK", 0.0 if form == "varlen" else float("inf"))
    monkeypatch.setattr(module, "DENSE_TILE", 4)  # padding past the longest run, too
    documents, branches = _packed_pairs()
    q, k, v = _qkv(2, branches.shape[1], heads, kv_heads, 8)
    plan = module.branch_plan(documents, branches)
    assert plan is not None and module.branch_plan(documents, branches) is plan  # for the layers
    assert isinstance(plan.form, module.VarlenRuns if form == "varlen" else module.DenseRuns)
    kernels = (_varlen_reference, _never) if form == "varlen" else (_never, _dense_reference)
    out = module.branch_attention(q, k, v, plan, 0.4, *kernels)
    options = {"document_ids": documents, "branch_ids": branches, "scale": 0.4}
    expected = attention_reference(q, k, v, **options)
    # The dense form leaves padding out: its outputs are unused and take no gradient.
    used = (branches != -1) | (form == "varlen")
    torch.testing.assert_close(out[used], expected[used])
    grad_out = torch.randn_like(out)  # padding's too: the dense form drops them
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    wants = torch.autograd.grad(expected, [q, k, v], grad_out * used[..., None, None])
    assert form == "varlen" or plan.form.slots.kept is not None  # padding left out
    for grad, want in zip(grads, wants, strict=True):
        torch.testing.assert_close(grad, want)


def test_the_dense_form_is_planned_only_where_its_padding_costs_little():
    from fastllm_kernels.branch_attention import DENSE_TILE, DenseRuns, VarlenRuns, branch_plan

    documents, branches = _pairs(4, 512, 512, 513)  # the DPO benchmark's rows
    plan = branch_plan(documents, branches)
    assert plan is not None and isinstance(plan.form, DenseRuns)
    assert (plan.form.runs, plan.form.length) == (8, -(-1025 // DENSE_TILE) * DENSE_TILE)
    documents, branches = _pairs(4, 900, 20, 30)  # short answers: prompts run twice
    documents[:, 950:] = 1  # and a short document of its own
    plan = branch_plan(documents, branches)
    assert plan is not None and isinstance(plan.form, VarlenRuns)


def test_plans_made_ahead_from_host_copies_are_found_for_their_tensors(monkeypatch):
    import fastllm_kernels.branch_attention as module

    layouts = [_packed_pairs(), _pairs(2, 5, 4, 6)]
    made = [module.branch_plan(*layout) for layout in layouts]  # built on first use
    # Each micro-batch's tensors as the device has them, planned ahead from host copies.
    ahead = [(documents.clone(), branches.clone()) for documents, branches in layouts]
    for (documents, branches), (host_documents, host_branches) in zip(ahead, layouts, strict=True):
        module.plan_ahead(host_documents, host_branches, documents, branches)

    def no_build(*args):
        raise AssertionError("planned again")

    monkeypatch.setattr(module, "_build", no_build)
    for (documents, branches), want in zip(ahead, made, strict=True):
        got = module.branch_plan(documents, branches)
        assert got is not None and want is not None
        assert type(got.form) is type(want.form)
        assert got.dense_over_varlen == want.dense_over_varlen
        for a, b in zip(plan_tensors(got.form), plan_tensors(want.form), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(AssertionError, match="planned again"):  # other tensors, same values
        module.branch_plan(*(t.clone() for t in ahead[0]))


def plan_tensors(value):
    """Every tensor in a plan's form, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [t for v in value for t in plan_tensors(v)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in plan_tensors(getattr(value, f.name))]
    return []


def test_a_prefix_after_a_branch_keeps_the_masked_kernel():
    from fastllm_kernels.branch_attention import branch_plan

    branches = torch.tensor([[0, 0, 1, 1, 0, 2]])
    assert branch_plan(None, branches) is None
    assert branch_plan(None, torch.tensor([[0, 1, 2, 1]])) is None  # branch 1 in two runs
    assert branch_plan(None, torch.tensor([[0, 0, 1, 2]])) is not None


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("form", ["varlen", "dense"])
def test_shared_prefixes_take_the_causal_kernels_on_gpu(form, monkeypatch):
    import fastllm_kernels.attention as module
    import fastllm_kernels.branch_attention as branch
    from fastllm_kernels.branch_attention import has_varlen_flash

    if not has_varlen_flash():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    monkeypatch.setattr(branch, "DENSE_WORK", 0.0 if form == "varlen" else float("inf"))
    monkeypatch.setattr(module, "_dense_causal" if form == "varlen" else "varlen_flash", _never)
    documents, branches = _pairs(3, 300, 200, 201, device="cuda")
    documents[1, 400:] = 1  # a row of two documents: the second one has no prompt
    q, k, v = _qkv(3, 701, 16, 4, 64, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(module, "_flex", None)  # any call of it fails
    options = {"document_ids": documents, "branch_ids": branches, "scale": 0.1}
    out = attention(q, k, v, **options)
    expected = attention_reference(q, k, v, **options)
    assert_close(out, expected, atol=2e-2)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], grad_out)
    for grad, want in zip(grads, torch.autograd.grad(expected, [q, k, v], grad_out), strict=True):
        assert_close(grad, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
