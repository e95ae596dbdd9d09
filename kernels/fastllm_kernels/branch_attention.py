"""Shared-prefix attention (a preference pair's prompt and its answers, `branch_ids`) as plain
causal attention over variable-length sequences, on CUDA.

A document whose prefix (branch 0) is followed by branches 1, 2, … that never see each other
is, for attention, the sequences `prefix + branch b`, each causal: a branch's query sees the
whole prefix and its own branch's earlier keys, and a prefix query sees the earlier prefix
keys. The queries stay where they are, in runs: `prefix + branch 1` (contiguous), then each
later branch alone; the keys and values of each run are gathered as `prefix + branch` (the
prefix copied for every branch but the first), and torch's varlen flash attention
(`torch.nn.attention.varlen`) aligns each run's causal mask to its last key, so a later
branch's queries see the prefix and their own branch. The output is in the queries' own
layout; the gather's backward takes each position's gradient from its own slot (a gather, not
torch's index_add with atomics: 2.5 ms a DPO step, H100) and adds the prefix copies'. The
attention FLOPs are the masked kernel's; flex_attention measured 40.8 ms forward and 33.8
backward a step for DPO pairs of 512 + 512 + 512 tokens (8 rows of 1,537 positions,
llama-1b, H100, bench/results/h100-4b113bc), some 60 TFLOP/s.

A layout this does not cover (a prefix after a branch, a branch in two runs) returns None
from `branch_plan`: the caller keeps the masked kernel."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, float | None], Tensor]
"""(q, k, v of (tokens, heads, dim), cumulative query and key starts of the runs, the longest
of each, scale) → causal attention of each run, aligned to its last key, (q's tokens, heads,
v's dim)."""


@dataclass(frozen=True)
class BranchPlan:
    """The query runs of a flat (batch × seq) layout and the keys each run sees."""

    gather: Tensor
    """(keys of all runs,) int64: the flat position of each run's keys, run after run."""
    cu_queries: Tensor
    """(runs + 1,) int32: where each run's queries start in the flat layout."""
    cu_keys: Tensor
    """(runs + 1,) int32: where each run's keys start in `gather`."""
    max_queries: int
    max_keys: int
    own: Tensor
    """(batch × seq,) int64: the slot in `gather` of each flat position's own key."""
    copies: tuple[tuple[Tensor, Tensor], ...]
    """The prefix keys gathered again for later branches, in rounds (a prefix once a round, the
    copy for its document's k-th later branch in round k): each round's flat positions and
    their slots in `gather`, int64."""


def branch_plan(document_ids: Tensor | None, branch_ids: Tensor) -> BranchPlan | None:
    """The runs of a layout (module docstring), or None where the mask is not theirs. One host
    synchronization; the last plan is kept for the same two tensors, which every layer of a
    forward pass (and the reference model's) is given."""
    key = (document_ids, branch_ids)
    if _last.matches(key):
        return _last.plan
    plan = _build(
        None if document_ids is None else document_ids.cpu().numpy(),
        branch_ids.cpu().numpy(),
        branch_ids.device,
    )
    _last.remember(key, plan)
    return plan


def _build(documents: np.ndarray | None, branches: np.ndarray, device) -> BranchPlan | None:
    batch, seq = branches.shape
    gather: list[np.ndarray] = []
    queries: list[int] = []
    keys: list[int] = []
    own_slots = np.empty(batch * seq, dtype=np.int64)
    rounds: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
    slot = 0
    for row in range(batch):
        base = row * seq
        ids = np.zeros(seq, dtype=np.int64) if documents is None else documents[row]
        for start, end in _runs(ids):
            labels = branches[row, start:end]
            runs = [(start + s, start + e) for s, e in _runs(labels)]
            heads = [int(labels[s - start]) for s, _ in runs]
            if len(runs) > 1 and (0 in heads[1:] or len(set(heads)) < len(heads)):
                return None  # a prefix after a branch, or a branch in two runs
            if heads[0] == 0 and len(runs) > 1:  # the prefix runs with the first branch
                prefix = base + np.arange(*runs[0])
                runs = [(runs[0][0], runs[1][1]), *runs[2:]]
            else:
                prefix = np.empty(0, dtype=np.int64)
            for index, (s, e) in enumerate(runs):
                own = base + np.arange(s, e)
                if index:
                    if len(rounds) < index:
                        rounds.append(([], []))
                    rounds[index - 1][0].append(prefix)
                    rounds[index - 1][1].append(slot + np.arange(len(prefix)))
                    gather.append(np.concatenate([prefix, own]))
                else:
                    gather.append(own)
                own_slots[own] = slot + len(gather[-1]) - len(own) + np.arange(len(own))
                slot += len(gather[-1])
                queries.append(e - s)
                keys.append(len(gather[-1]))
    return BranchPlan(
        _on(np.concatenate(gather), device),
        _cumulative(queries, device),
        _cumulative(keys, device),
        max(queries),
        max(keys),
        _on(own_slots, device),
        tuple(
            (_on(np.concatenate(positions), device), _on(np.concatenate(slots), device))
            for positions, slots in rounds
        ),
    )


def _on(values: np.ndarray, device) -> Tensor:
    return torch.from_numpy(values).to(device, non_blocking=True)


def _cumulative(lengths: list[int], device) -> Tensor:
    starts = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=starts[1:])
    return _on(starts, device)


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of equal values."""
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    ends = np.r_[starts[1:], len(values)]
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


class _LastPlan:
    """The plan of the last (document_ids, branch_ids), held by weak references: a plan is
    reused only while those very tensors live."""

    def __init__(self) -> None:
        self.refs: tuple[weakref.ref | None, ...] = ()
        self.plan: BranchPlan | None = None

    def matches(self, key: tuple[Tensor | None, Tensor]) -> bool:
        if len(self.refs) != len(key):
            return False
        return all(
            (ref is None and t is None) or (ref is not None and ref() is t)
            for ref, t in zip(self.refs, key, strict=True)
        )

    def remember(self, key: tuple[Tensor | None, Tensor], plan: BranchPlan | None) -> None:
        self.refs = tuple(None if t is None else weakref.ref(t) for t in key)
        self.plan = plan


_last = _LastPlan()


def branch_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: BranchPlan, scale: float | None, kernel: VarlenKernel
) -> Tensor:
    """q (batch, seq, heads, dim), k and v (batch, seq, kv_heads, ·) → (batch, seq, heads, v's
    dim), each position attending as `plan` lays it out, through `kernel`."""
    batch, seq = q.shape[:2]
    keys = [_GatherKeys.apply(t.reshape(batch * seq, *t.shape[2:]), plan) for t in (k, v)]
    out = kernel(
        q.reshape(batch * seq, *q.shape[2:]), *keys, plan.cu_queries, plan.cu_keys,
        plan.max_queries, plan.max_keys, scale,
    )  # fmt: skip
    return out.view(batch, seq, *out.shape[1:])


class _GatherKeys(torch.autograd.Function):
    """Each run's keys (or values) in `plan.gather`'s order; the backward gathers each position's
    gradient from its own slot and adds its prefix copies' gradients, with no atomics."""

    @staticmethod
    def forward(ctx: Any, source: Tensor, plan: BranchPlan) -> Tensor:
        ctx.plan = plan
        return source.index_select(0, plan.gather)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        plan: BranchPlan = ctx.plan
        grad_source = grad.index_select(0, plan.own)
        for positions, slots in plan.copies:  # each round's positions are distinct
            summed = grad_source.index_select(0, positions) + grad.index_select(0, slots)
            grad_source.index_copy_(0, positions, summed)
        return grad_source, None


def varlen_flash(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_queries: Tensor,
    cu_keys: Tensor,
    max_queries: int,
    max_keys: int,
    scale: float | None,
) -> Tensor:
    """torch's varlen flash attention, causal (aligned to each run's last key), whichever of
    its signatures torch has (2.9's `is_causal`, later `window_size`; `enable_gqa` and `scale`
    where present: without `enable_gqa` the flash kernel takes fewer key heads as they are)."""
    from torch.nn.attention.varlen import varlen_attn

    options: dict[str, object] = {}
    parameters = _varlen_parameters()
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if "enable_gqa" in parameters:
        options["enable_gqa"] = q.shape[1] != k.shape[1]
    if scale is not None:
        if "scale" in parameters:
            options["scale"] = scale
        else:  # the kernel's own scale is head_dim ** -0.5
            q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, cu_queries, cu_keys, max_queries, max_keys, **options)


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def has_varlen_flash() -> bool:
    """Whether this torch has `torch.nn.attention.varlen` (asked on every attention call with
    branches: answered once)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True
