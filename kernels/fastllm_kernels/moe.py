"""Dropless mixture of experts: the router's top-k with its auxiliary losses, the sparse map of
its choices, the permutation of tokens into expert order and back, and the grouped matmul of
the experts' projections.

Each (token, slot) pair the router chose gets one row of a sparse layout in which every
expert's rows are contiguous, its range padded to a multiple of `block`. The layout has a
static worst case of tokens × k + experts × block rows, so no shape waits for the host
(MegaBlocks, Fast-LLM's sparse_copy). In `dispatch`'s output the padding rows (and the rows
past the last expert's range) are zero, so a projection without bias keeps them zero and they
add nothing to a weight gradient; rows past the last expert's range of a grouped matmul's
output are never read back and may hold anything.

On the GPU the routing with the sparse map of its choices is two kernels forward and one
backward (a sparse map alone, `sparse_map`, is two) and each permutation one, which writes
every row of its output, so nothing is zero-filled first: the many small ops of the torch
references cost more launch time (some 40 µs of host time per Triton launch on the H200 host)
than the grouped matmuls leave.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.accumulate import accumulate_
from fastllm_kernels.grouped_matmul import grouped_rows, grouped_weight_gradient_, tma_loadable
from fastllm_kernels.linear import GradientSink

GROUP_ALIGNMENT = 16
"""Default padding of each expert's rows: keeps every group of torch._grouped_mm 16-row
aligned (torchtitan aligns bf16 groups to 8 or 16) at a cost of at most 15 rows per expert."""

_TILE = 4096
"""Elements of the (tokens or blocks, experts) tiles the routing kernels hold."""
_MAP_TILE = 16384
"""Elements of the (entries, experts) tiles of the sparse map: large, since every program of
its second kernel reads all blocks' counts (at 4096, that read took 70 µs on 65,536 entries)."""


class SparseMap(NamedTuple):
    rows: Tensor
    """(tokens, k) int64: the sparse row of each token's k choices."""
    entries: Tensor
    """(num_rows,) int32: the inverse, the (token × k + slot) that each sparse row holds, -1 for
    padding rows and rows past the last expert's range."""
    ends: Tensor
    """(experts,) int32: the end of each expert's padded row range (cumulative)."""
    counts: Tensor
    """(experts,) int64: tokens routed to each expert (its rows before padding)."""
    num_rows: int
    """Rows of the sparse layout: tokens × k + experts × block, whatever the routing."""


class Routing(NamedTuple):
    weights: Tensor
    """(tokens, k) in the requested dtype: each token's routing weights, most probable first."""
    experts: Tensor
    """(tokens, k) int64: the experts they weight."""
    counts: Tensor
    """(experts,) int64: tokens routed to each expert."""
    auxiliary: Tensor
    """() fp32: balance_coefficient × the load-balancing loss + z_coefficient × the z-loss."""
    sparse: SparseMap
    """The sparse layout of `experts`, as `sparse_map` gives it (same kernels on the GPU)."""


def route(
    logits: Tensor,
    k: int,
    renormalize: bool,
    dtype: torch.dtype,
    balance_coefficient: float,
    z_coefficient: float,
    block: int = GROUP_ALIGNMENT,
) -> Routing:
    """Top-k of softmax(logits) (tokens, experts), computed in fp32; with `renormalize` the k
    weights are divided by their sum (Mixtral). The load-balancing loss is Switch
    Transformer's as Hugging Face computes it, E × Σ_e (tokens routed to e over the k slots /
    tokens) × (mean probability of e), the z-loss the mean squared logsumexp of the logits.
    Differentiable in logits through the weights and the auxiliary loss. With the sparse map
    of the choices (each expert's rows padded to `block`): on the GPU all of it is two
    kernels, the second shared with `sparse_map`."""
    if use_triton(logits):
        weights, experts, counts, auxiliary, rows, entries, ends = _RouteFunction.apply(
            logits.contiguous(), k, renormalize, dtype, balance_coefficient, z_coefficient, block
        )
        num_rows = logits.shape[0] * k + logits.shape[1] * block
        sparse = SparseMap(rows, entries, ends, counts, num_rows)
        return Routing(weights, experts, counts, auxiliary, sparse)
    return route_reference(logits, k, renormalize, dtype, balance_coefficient, z_coefficient, block)


def route_reference(
    logits: Tensor,
    k: int,
    renormalize: bool,
    dtype: torch.dtype,
    balance_coefficient: float,
    z_coefficient: float,
    block: int = GROUP_ALIGNMENT,
) -> Routing:
    logits = logits.float()
    tokens, num_experts = logits.shape
    probabilities = logits.softmax(dim=-1)
    weights, experts = probabilities.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    sparse = sparse_map_reference(experts, num_experts, block)
    counts = sparse.counts
    routed = counts.float() / tokens
    auxiliary = balance_coefficient * num_experts * (routed * probabilities.mean(dim=0)).sum()
    if z_coefficient:
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        auxiliary = auxiliary + z_coefficient * z_loss
    return Routing(weights.to(dtype), experts, counts, auxiliary, sparse)


def sparse_map(experts: Tensor, num_experts: int, block: int = GROUP_ALIGNMENT) -> SparseMap:
    """The sparse layout of `experts` (tokens, k), each token's chosen experts. Within an
    expert, rows follow token order (and slot order within a token)."""
    if use_triton(experts):
        return _sparse_map_triton(experts.contiguous(), num_experts, block)
    return sparse_map_reference(experts, num_experts, block)


def sparse_map_reference(experts: Tensor, num_experts: int, block: int) -> SparseMap:
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync on its max
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = (
        torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    )
    rows = torch.empty_like(flat)
    rows[order] = (ends - padded)[sorted_experts] + rank
    num_rows = tokens * k + num_experts * block
    entries = torch.full((num_rows,), -1, dtype=torch.int32, device=flat.device)
    entries[rows] = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    return SparseMap(rows.view(tokens, k), entries, ends.to(torch.int32), counts, num_rows)


def dispatch(x: Tensor, sparse: SparseMap) -> Tensor:
    """(tokens, hidden) → (num_rows, hidden): each token copied to its k sparse rows, every
    other row zero; differentiable in x."""
    if use_triton(x, sparse.rows):
        return _DispatchFunction.apply(x, sparse.rows, sparse.entries)
    return dispatch_reference(x, sparse)


def combine(y: Tensor, sparse: SparseMap, weights: Tensor) -> Tensor:
    """(num_rows, hidden) → (tokens, hidden): each token's k sparse rows of y summed, scaled
    by its (tokens, k) routing `weights`; differentiable in y and weights."""
    if use_triton(y, sparse.rows, weights):
        return _CombineFunction.apply(y, sparse.rows, sparse.entries, weights)
    return combine_reference(y, sparse, weights)


def dispatch_reference(x: Tensor, sparse: SparseMap) -> Tensor:
    k = sparse.rows.shape[1]
    out = x.new_zeros(sparse.num_rows, x.shape[1])
    return out.index_copy(0, sparse.rows.reshape(-1), x.repeat_interleave(k, dim=0))


def combine_reference(y: Tensor, sparse: SparseMap, weights: Tensor) -> Tensor:
    picked = y[sparse.rows].float()  # (tokens, k, hidden)
    return (picked * weights.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)


def grouped_linear(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """x (rows, in) in expert order, weight (experts, out, in): the rows of expert e's range
    (ends[e - 1]:ends[e]) times weight[e]ᵀ; rows past ends[-1] are unspecified.
    Differentiable in x and weight, the weight's gradient handed to its gradient sink if it
    has one (linear.py). The row products run in torch._grouped_mm for bf16 on CUDA, else in
    grouped_matmul's kernels; the weight gradient, for a sink, in ours (fp32, into the
    buffer), else as the row products. The reference (a loop that waits for the host) is left for
    tensors TMA cannot load and for torch.compile's tracing of anything but bf16 on CUDA."""
    if torch.compiler.is_compiling():
        if _cutlass(x, weight):
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
        return grouped_linear_reference(x, weight, ends)
    if use_triton(x, weight) and tma_loadable(x, weight):
        return _GroupedLinearFunction.apply(x, weight, ends)
    return grouped_linear_reference(x, weight, ends)


def _cutlass(x: Tensor, weight: Tensor) -> bool:
    return x.is_cuda and x.dtype == weight.dtype == torch.bfloat16


def _weight_gradient_into_(
    out: Tensor, grad: Tensor, x: Tensor, ends: Tensor, accumulate: bool
) -> None:
    """A grouped weight gradient written (or added) into its fp32 buffer `out`. Our kernel
    writes it there. To add it, for bf16 on CUDA, CUTLASS's bf16 product and a pass that adds
    it: on the H200 our kernel's adding was faster on three of the four projections of
    bench/grouped_gemm_probe.py but 17% slower on Mixtral's second (4.47 against 3.81 ms), and
    adding in our kernel throughout cost Mixtral training 2.8% (bench/results/h200-987f9b2)."""
    if accumulate and _cutlass(x, grad):
        accumulate_(out, torch._grouped_mm(grad.T, x, offs=ends))
    else:
        grouped_weight_gradient_(out, grad, x, ends, accumulate)


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ends):
        ctx.save_for_backward(x, weight, ends)
        if _cutlass(x, weight):
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
        return grouped_rows(x, weight, ends, b_transposed=True)

    @staticmethod
    def backward(ctx, grad):
        x, weight, ends = ctx.saved_tensors
        need_x, need_weight, _ = ctx.needs_input_grad
        grad = grad.contiguous()
        grad_x = grad_weight = None
        if need_x:
            if _cutlass(x, weight):
                grad_x = torch._grouped_mm(grad, weight, offs=ends)
            else:
                grad_x = grouped_rows(grad, weight, ends, b_transposed=False)
        if need_weight:
            sink: GradientSink | None = getattr(weight, "gradient_sink", None)
            if sink is not None:
                sink(lambda out, accumulate: _weight_gradient_into_(out, grad, x, ends, accumulate))
            elif _cutlass(x, weight):
                grad_weight = torch._grouped_mm(grad.T, x, offs=ends)
            else:
                grad_weight = torch.empty_like(weight)
                grouped_weight_gradient_(grad_weight, grad, x, ends, accumulate=False)
        return grad_x, grad_weight, None


def grouped_linear_reference(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """One matmul per expert; its row ranges come to the host (a sync)."""
    pieces, start = [], 0
    for expert, end in enumerate(ends.tolist()):
        pieces.append(x[start:end] @ weight[expert].T)
        start = end
    pieces.append(x.new_zeros(x.shape[0] - start, weight.shape[1]))
    return torch.cat(pieces)


# --- routing ---------------------------------------------------------------------------------


def _route_settings(num_experts: int, k: int) -> tuple[int, int]:
    """(E_BLOCK, BLOCK_T): a (tokens, experts) tile of at most _TILE elements, whose entries
    make an (entries, experts) tile of at most _MAP_TILE."""
    e_block = triton.next_power_of_2(num_experts)
    k_block = triton.next_power_of_2(k)
    return e_block, max(1, min(_TILE // e_block, _MAP_TILE // (e_block * k_block)))


class _RouteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, renormalize, dtype, balance, z, block):
        tokens, num_experts = logits.shape
        e_block, block_t = _route_settings(num_experts, k)
        blocks = triton.cdiv(tokens, block_t)
        device = logits.device
        weights = torch.empty(tokens, k, dtype=dtype, device=device)
        experts = torch.empty(tokens, k, dtype=torch.int64, device=device)
        probability_sums = torch.empty(blocks, num_experts, dtype=torch.float32, device=device)
        block_counts = torch.empty(blocks, num_experts, dtype=torch.int32, device=device)
        z_sums = torch.empty(blocks, dtype=torch.float32, device=device)
        _route_kernel[(blocks,)](
            logits, weights, experts, probability_sums, block_counts, z_sums, tokens,
            E=num_experts, E_BLOCK=e_block, K=k, K_BLOCK=triton.next_power_of_2(k),
            BLOCK_T=block_t, RENORMALIZE=renormalize,
        )  # fmt: skip
        auxiliary = torch.empty((), dtype=torch.float32, device=device)
        sparse = _sparse_rows(
            experts, block_counts, block_t * k, num_experts, block,
            (probability_sums, z_sums, auxiliary, tokens, balance, z),
        )  # fmt: skip
        ctx.save_for_backward(logits, experts, sparse.counts)
        ctx.settings = (renormalize, balance, z)
        outputs = (experts, sparse.counts, sparse.rows, sparse.entries, sparse.ends)
        ctx.mark_non_differentiable(*outputs)
        return weights, experts, sparse.counts, auxiliary, sparse.rows, sparse.entries, sparse.ends

    @staticmethod
    def backward(ctx, grad_weights, _experts, _counts, grad_auxiliary, *_sparse):
        logits, experts, counts = ctx.saved_tensors
        renormalize, balance, z = ctx.settings
        tokens, num_experts = logits.shape
        k = experts.shape[1]
        e_block, block_t = _route_settings(num_experts, k)
        grad_logits = torch.empty_like(logits)
        _route_backward_kernel[(triton.cdiv(tokens, block_t),)](
            logits, experts,
            grad_weights.contiguous() if grad_weights is not None else logits,
            counts,
            grad_auxiliary if grad_auxiliary is not None else logits,
            grad_logits, tokens, balance, z,
            E=num_experts, E_BLOCK=e_block, K=k, BLOCK_T=block_t, RENORMALIZE=renormalize,
            WEIGHTS=grad_weights is not None, AUXILIARY=grad_auxiliary is not None,
        )  # fmt: skip
        return grad_logits, None, None, None, None, None, None


@triton.jit
def _softmax_rows(logits_ptr, tokens, block, E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_T):
    """A block of rows of logits (-inf past the experts, 0 past the tokens), their softmax
    and logsumexp, in fp32."""
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    columns = tl.arange(0, E_BLOCK)
    mask = (rows < tokens)[:, None] & (columns < E)[None, :]
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + columns[None, :], mask=mask)
    logits = tl.where((columns < E)[None, :], logits.to(tl.float32), float("-inf"))
    logits = tl.where((rows < tokens)[:, None], logits, tl.where(columns < E, 0.0, logits))
    maximum = tl.max(logits, axis=1)
    exponentials = tl.exp(logits - maximum[:, None])
    total = tl.sum(exponentials, axis=1)
    return rows, columns, logits, exponentials / total[:, None], maximum + tl.log(total)


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, experts_ptr, probability_sums_ptr, counts_ptr, z_sums_ptr, tokens,
    E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr, K_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    rows, columns, logits, probabilities, lse = _softmax_rows(
        logits_ptr, tokens, block, E, E_BLOCK, BLOCK_T
    )
    valid = rows < tokens
    slots = tl.arange(0, K_BLOCK)
    chosen_weights = tl.zeros([BLOCK_T, K_BLOCK], dtype=tl.float32)
    chosen_experts = tl.zeros([BLOCK_T, K_BLOCK], dtype=tl.int32)
    counts = tl.zeros([E_BLOCK], dtype=tl.int32)
    remaining = logits
    for slot in tl.static_range(K):
        choice = tl.argmax(remaining, axis=1)
        picked = columns[None, :] == choice[:, None]
        weight = tl.sum(tl.where(picked, probabilities, 0.0), axis=1)
        remaining = tl.where(picked, float("-inf"), remaining)
        chosen_weights = tl.where(slots[None, :] == slot, weight[:, None], chosen_weights)
        chosen_experts = tl.where(slots[None, :] == slot, choice[:, None], chosen_experts)
        counts += tl.sum((picked & valid[:, None]).to(tl.int32), axis=0)
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=1)[:, None]
    offsets = rows[:, None].to(tl.int64) * K + slots[None, :]
    mask = valid[:, None] & (slots < K)[None, :]
    tl.store(weights_ptr + offsets, chosen_weights.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(experts_ptr + offsets, chosen_experts.to(tl.int64), mask=mask)
    sums = tl.sum(tl.where(valid[:, None], probabilities, 0.0), axis=0)
    tl.store(probability_sums_ptr + block * E + columns, sums, mask=columns < E)
    tl.store(counts_ptr + block * E + columns, counts, mask=columns < E)
    tl.store(z_sums_ptr + block, tl.sum(tl.where(valid, lse * lse, 0.0), axis=0))


@triton.jit
def _route_backward_kernel(
    logits_ptr, experts_ptr, grad_weights_ptr, counts_ptr, grad_auxiliary_ptr, grad_logits_ptr,
    tokens, balance, z, E: tl.constexpr, E_BLOCK: tl.constexpr, K: tl.constexpr,
    BLOCK_T: tl.constexpr, RENORMALIZE: tl.constexpr, WEIGHTS: tl.constexpr,
    AUXILIARY: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    rows, columns, _, probabilities, lse = _softmax_rows(
        logits_ptr, tokens, block, E, E_BLOCK, BLOCK_T
    )
    valid = rows < tokens
    n = tokens.to(tl.float32)
    grad = tl.zeros([BLOCK_T, E_BLOCK], dtype=tl.float32)  # of the probabilities
    if AUXILIARY:
        grad_auxiliary = tl.load(grad_auxiliary_ptr).to(tl.float32)
        counts = tl.load(counts_ptr + columns, mask=columns < E, other=0).to(tl.float32)
        grad += (grad_auxiliary * balance * E / (n * n) * counts)[None, :]
    if WEIGHTS:
        picked_grad = tl.zeros([BLOCK_T, E_BLOCK], dtype=tl.float32)
        chosen = tl.zeros([BLOCK_T, E_BLOCK], dtype=tl.int1)
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        dot = tl.zeros([BLOCK_T], dtype=tl.float32)
        for slot in tl.static_range(K):
            offsets = rows.to(tl.int64) * K + slot
            expert = tl.load(experts_ptr + offsets, mask=valid, other=-1)
            grad_weight = tl.load(grad_weights_ptr + offsets, mask=valid, other=0.0)
            grad_weight = grad_weight.to(tl.float32)
            picked = columns[None, :] == expert[:, None]
            probability = tl.sum(tl.where(picked, probabilities, 0.0), axis=1)
            picked_grad += tl.where(picked, grad_weight[:, None], 0.0)
            chosen = chosen | picked
            total += probability
            dot += grad_weight * probability
        if RENORMALIZE:  # w_i = p_i / S: d/dp_m = (g_m - Σ_i g_i p_i / S) / S
            total = tl.where(valid, total, 1.0)
            picked_grad = (picked_grad - tl.where(chosen, (dot / total)[:, None], 0.0)) / total[
                :, None
            ]
        grad += picked_grad
    grad_logits = probabilities * (grad - tl.sum(probabilities * grad, axis=1)[:, None])
    if AUXILIARY:
        grad_logits += (grad_auxiliary * z * 2.0 / n) * lse[:, None] * probabilities
    mask = valid[:, None] & (columns < E)[None, :]
    offsets = rows[:, None].to(tl.int64) * E + columns[None, :]
    tl.store(grad_logits_ptr + offsets, grad_logits.to(grad_logits_ptr.dtype.element_ty), mask=mask)


# --- sparse map ------------------------------------------------------------------------------


def _sparse_map_triton(experts: Tensor, num_experts: int, block: int) -> SparseMap:
    entries_count = experts.numel()
    block_n = max(16, _MAP_TILE // triton.next_power_of_2(num_experts))
    blocks = triton.cdiv(entries_count, block_n)
    block_counts = torch.empty(blocks, num_experts, dtype=torch.int32, device=experts.device)
    _histogram_kernel[(blocks,)](
        experts, block_counts, entries_count, E=num_experts,
        E_BLOCK=triton.next_power_of_2(num_experts), BLOCK_N=block_n, num_warps=8,
    )  # fmt: skip
    return _sparse_rows(experts, block_counts, block_n, num_experts, block)


def _sparse_rows(
    experts: Tensor,
    block_counts: Tensor,
    per_block: int,
    num_experts: int,
    block: int,
    auxiliary: tuple[Tensor, Tensor, Tensor, int, float, float] | None = None,
) -> SparseMap:
    """The sparse map from the experts' counts in each block of `per_block` entries; with
    `auxiliary` = (probability sums and z sums per block, the output, tokens, coefficients),
    also the router's auxiliary loss."""
    tokens, k = experts.shape
    entries_count = tokens * k
    num_rows = entries_count + num_experts * block
    blocks = block_counts.shape[0]
    device = experts.device
    rows = torch.empty(tokens, k, dtype=torch.int64, device=device)
    entries = torch.empty(num_rows, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    sums, z_sums, out, n, balance, z = auxiliary or (counts, counts, counts, 1, 0.0, 0.0)
    e_block = triton.next_power_of_2(num_experts)
    _sparse_rows_kernel[(blocks,)](
        experts, block_counts, rows, entries, ends, counts, sums, z_sums, out, n, balance, z,
        entries_count, blocks, num_rows, triton.cdiv(num_rows, blocks), E=num_experts,
        E_BLOCK=e_block, PER_BLOCK=per_block, BLOCK_N=triton.next_power_of_2(per_block),
        ALIGN=block, BLOCKS=max(1, _TILE // e_block), AUXILIARY=auxiliary is not None,
        num_warps=8,
    )  # fmt: skip
    return SparseMap(rows, entries, ends, counts, num_rows)


@triton.jit
def _histogram_kernel(
    experts_ptr, block_counts_ptr, n, E: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr
):
    block = tl.program_id(0)
    entries = block * BLOCK_N + tl.arange(0, BLOCK_N)
    experts = tl.load(experts_ptr + entries, mask=entries < n, other=-1)
    columns = tl.arange(0, E_BLOCK)
    counts = tl.sum((experts[:, None] == columns[None, :]).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + block * E + columns, counts, mask=columns < E)


@triton.jit
def _sparse_rows_kernel(
    experts_ptr, block_counts_ptr, rows_ptr, entries_ptr, ends_ptr, counts_ptr,
    probability_sums_ptr, z_sums_ptr, auxiliary_ptr, tokens, balance, z, n, blocks, num_rows,
    rows_per_block, E: tl.constexpr, E_BLOCK: tl.constexpr, PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, ALIGN: tl.constexpr, BLOCKS: tl.constexpr, AUXILIARY: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    columns = tl.arange(0, E_BLOCK)
    expert_mask = columns < E
    before = tl.zeros([E_BLOCK], dtype=tl.int32)  # this expert's entries in earlier blocks
    counts = tl.zeros([E_BLOCK], dtype=tl.int32)
    for start in range(0, blocks, BLOCKS):
        others = start + tl.arange(0, BLOCKS)
        mask = (others < blocks)[:, None] & expert_mask[None, :]
        tile = tl.load(
            block_counts_ptr + others[:, None] * E + columns[None, :], mask=mask, other=0
        )
        counts += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((others < block)[:, None], tile, 0), axis=0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if block == 0:
        tl.store(ends_ptr + columns, ends, mask=expert_mask)
        tl.store(counts_ptr + columns, counts.to(tl.int64), mask=expert_mask)
        if AUXILIARY:  # the router's losses, from every block's sums
            sums = tl.zeros([E_BLOCK], dtype=tl.float32)
            z_total = tl.zeros([BLOCKS], dtype=tl.float32)
            for start in range(0, blocks, BLOCKS):
                others = start + tl.arange(0, BLOCKS)
                mask = (others < blocks)[:, None] & expert_mask[None, :]
                offsets = others[:, None] * E + columns[None, :]
                sums += tl.sum(tl.load(probability_sums_ptr + offsets, mask=mask, other=0.0), 0)
                z_total += tl.load(z_sums_ptr + others, mask=others < blocks, other=0.0)
            t = tokens.to(tl.float32)
            balance_loss = E * tl.sum(counts.to(tl.float32) * sums, axis=0) / (t * t)
            tl.store(auxiliary_ptr, balance * balance_loss + z * tl.sum(z_total, axis=0) / t)
    # This block's entries: their expert's start, the entries of that expert in earlier blocks,
    # and those before them in this block.
    local = tl.arange(0, BLOCK_N)
    entries = block * PER_BLOCK + local
    valid = (local < PER_BLOCK) & (entries < n)
    experts = tl.load(experts_ptr + entries, mask=valid, other=-1)
    picked = (experts[:, None] == columns[None, :]).to(tl.int32)
    earlier = tl.cumsum(picked, axis=0) - picked
    offset = (starts + before)[None, :] + earlier
    rows = tl.sum(tl.where(picked != 0, offset, 0), axis=1)
    tl.store(rows_ptr + entries, rows.to(tl.int64), mask=valid)
    tl.store(entries_ptr + rows, entries.to(tl.int32), mask=valid)
    # -1 for the padding rows and those past the last range, in this block's share of the rows.
    limits = tl.where(expert_mask, ends, num_rows)
    filled = tl.where(expert_mask, starts + counts, num_rows)
    for start in range(block * rows_per_block, (block + 1) * rows_per_block, BLOCK_N):
        sparse_rows = start + tl.arange(0, BLOCK_N)
        inside = (sparse_rows < num_rows) & (sparse_rows < (block + 1) * rows_per_block)
        expert = tl.sum((sparse_rows[:, None] >= limits[None, :]).to(tl.int32), axis=1)
        here = (expert[:, None] == columns[None, :]) & expert_mask[None, :]
        used = tl.sum(tl.where(here & (sparse_rows[:, None] < filled[None, :]), 1, 0), axis=1)
        tl.store(entries_ptr + sparse_rows, -1, mask=inside & (used == 0))


# --- permutations ----------------------------------------------------------------------------


def _gather_settings(hidden: int, k: int) -> tuple[int, int]:
    """(K_BLOCK, BLOCK): a (k, columns) tile of at most 8192 elements (on the H200, 8 × 1024
    bf16 at 4 warps gathered at about the speed of a copy, twice as fast as 8 × 512)."""
    k_block = triton.next_power_of_2(k)
    return k_block, min(triton.next_power_of_2(hidden), max(16, 8192 // k_block))


def _row_settings(hidden: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H): a (rows, columns) tile of 4096 elements at most, 16 × 256 where the
    rows are long enough (on the H200 faster than 4 × 1024 or 8 × 512)."""
    block_h = min(triton.next_power_of_2(hidden), 256)
    return max(1, 4096 // block_h), block_h


def _rows_from_tokens(
    x: Tensor,
    entries: Tensor,
    k: int,
    weights: Tensor | None = None,
    dot_with: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """out[r] = x[entries[r] // k] (× weights.flat[entries[r]]), zero where entries[r] < 0;
    with `dot_with` (and weights), also ⟨x[t], dot_with[rows[t, j]]⟩ per entry t × k + j,
    summed in fp32, in the weights' dtype."""
    tokens, hidden = x.shape
    num_rows = entries.shape[0]
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    dots = None
    if dot_with is not None:
        assert weights is not None
        dots = torch.empty(tokens, k, dtype=weights.dtype, device=x.device)
    block_r, block_h = _row_settings(hidden)
    # Each program one tile (more in flight for these memory-bound copies), or, to sum its
    # rows' dot products, the whole of its rows.
    column_blocks = 1 if dot_with is not None else triton.cdiv(hidden, block_h)
    _rows_kernel[(triton.cdiv(num_rows, block_r), column_blocks)](
        x, entries, weights if weights is not None else x, out,
        dot_with if dot_with is not None else x, dots if dots is not None else x,
        num_rows, hidden, K=k, BLOCK_R=block_r, BLOCK_H=block_h,
        SCALE=weights is not None, DOT=dot_with is not None,
    )  # fmt: skip
    return out, dots


def _gather(y: Tensor, rows: Tensor, weights: Tensor | None = None) -> Tensor:
    """out[t] = Σ_j y[rows[t, j]] (× weights[t, j]), summed in fp32."""
    tokens, k = rows.shape
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    k_block, block = _gather_settings(hidden, k)
    _gather_kernel[(tokens, triton.cdiv(hidden, block))](
        y,
        rows,
        weights if weights is not None else y,
        out,
        hidden,
        K=k,
        K_BLOCK=k_block,
        BLOCK=block,
        SCALE=weights is not None,
    )
    return out


class _DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, entries):
        ctx.save_for_backward(rows)
        return _rows_from_tokens(x.contiguous(), entries, rows.shape[1])[0]

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return _gather(grad.contiguous(), rows), None, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows, entries, weights):
        y, rows, weights = y.contiguous(), rows.contiguous(), weights.contiguous()
        ctx.save_for_backward(y, rows, entries, weights)
        return _gather(y, rows, weights)

    @staticmethod
    def backward(ctx, grad):
        y, rows, entries, weights = ctx.saved_tensors
        need_weights = ctx.needs_input_grad[3]
        grad_y, dots = _rows_from_tokens(
            grad.contiguous(), entries, rows.shape[1], weights, y if need_weights else None
        )
        return grad_y, None, None, dots


@triton.jit
def _rows_kernel(
    x_ptr, entries_ptr, weights_ptr, out_ptr, dot_ptr, dots_ptr, num_rows, hidden,
    K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, SCALE: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = rows < num_rows
    entries = tl.load(entries_ptr + rows, mask=inside, other=-1).to(tl.int64)
    used = entries >= 0
    tokens = tl.where(used, entries // K, 0)
    if SCALE:
        weights = tl.load(weights_ptr + entries, mask=used, other=0.0).to(tl.float32)
    dots = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(tl.program_id(1) * BLOCK_H, hidden, tl.num_programs(1) * BLOCK_H):
        columns = start + tl.arange(0, BLOCK_H)
        column_mask = columns < hidden
        mask = used[:, None] & column_mask[None, :]
        x = tl.load(x_ptr + tokens[:, None] * hidden + columns[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        offsets = rows[:, None] * hidden + columns[None, :]
        if DOT:
            other = tl.load(dot_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            dots += tl.sum(x * other, axis=1)
        if SCALE:
            x = x * weights[:, None]
        tl.store(
            out_ptr + offsets,
            x.to(out_ptr.dtype.element_ty),
            mask=inside[:, None] & column_mask[None, :],
        )
    if DOT:
        tl.store(dots_ptr + entries, dots.to(dots_ptr.dtype.element_ty), mask=used)


@triton.jit
def _gather_kernel(
    y_ptr,
    rows_ptr,
    weights_ptr,
    out_ptr,
    hidden,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_BLOCK)
    slot_mask = slots < K
    rows = tl.load(rows_ptr + token * K + slots, mask=slot_mask, other=0).to(tl.int64)
    if SCALE:
        weights = tl.load(weights_ptr + token * K + slots, mask=slot_mask, other=0.0)
        weights = weights.to(tl.float32)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    column_mask = columns < hidden
    offsets = rows[:, None] * hidden + columns[None, :]
    mask = slot_mask[:, None] & column_mask[None, :]
    tile = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALE:
        tile = tile * weights[:, None]
    out = tl.sum(tile, axis=0)
    tl.store(out_ptr + token * hidden + columns, out.to(out_ptr.dtype.element_ty), mask=column_mask)
