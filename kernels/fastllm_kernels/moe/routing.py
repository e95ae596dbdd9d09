"""The router of a dropless mixture of experts: top-k of the softmax of its logits, with the
auxiliary losses (load balancing, z-loss) and the sparse map of its choices (sparse_map.py).

On the GPU the routing with its sparse map is two kernels forward (the second shared with
`sparse_map`) and one backward: the many small ops of the torch reference cost more launch
time (some 40 µs of host time per Triton launch on the H200 host) than the grouped matmuls
leave.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.moe.sparse_map import (
    EXPERT_TILE,
    GROUP_ALIGNMENT,
    MAP_TILE,
    SparseMap,
    sparse_map_reference,
    sparse_rows,
)


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


def _route_settings(num_experts: int, k: int) -> tuple[int, int]:
    """(E_BLOCK, BLOCK_T): a (tokens, experts) tile of at most EXPERT_TILE elements, whose entries
    make an (entries, experts) tile of at most MAP_TILE."""
    e_block = triton.next_power_of_2(num_experts)
    k_block = triton.next_power_of_2(k)
    return e_block, max(1, min(EXPERT_TILE // e_block, MAP_TILE // (e_block * k_block)))


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
        sparse = sparse_rows(
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
