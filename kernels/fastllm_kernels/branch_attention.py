"""Shared-prefix attention (a preference pair's prompt and its answers, `branch_ids`) as plain
causal attention over sequences, on CUDA.

A document whose prefix (branch 0) is followed by branches 1, 2, … that never see each other
is, for attention, the sequences `prefix + branch b`, each causal: a branch's query sees the
whole prefix and its own branch's earlier keys, and a prefix query sees the earlier prefix
keys. Each such sequence is a run: `prefix + branch 1` (contiguous in the row), then each later
branch with the prefix gathered again before it. Two forms:

- varlen: the queries stay where they are; each run's keys and values are gathered as
  `prefix + branch`, and torch's varlen flash attention (`torch.nn.attention.varlen`) aligns
  each run's causal mask to its last key, so a later branch's queries see the prefix and their
  own branch. FlashAttention 2, head size 64: some 130 TFLOP/s a DPO step (H100, 103b4f7).
- dense: the queries are gathered as the keys are, every run padded at its end to one length,
  and the runs go to SDPA as one causal batch (cuDNN first, as dense training's attention);
  each position's output is taken from its own run. The prefix's queries are computed again
  for each later branch (their outputs unused) and the padding too, so it is taken only where
  that work is at most DENSE_WORK times the varlen form's.

The gathers' backward takes each position's gradient from its own slot and adds the prefix
copies' (a gather, not torch's index_add with atomics: 2.5 ms a DPO step, H100). A layer that
hands over its fused q/k/v projection (attention.py's `attention_of_qkv`) has the dense form's
runs written by the split kernel itself (qkv_runs.py), with no gathers of q, k and v.
flex_attention measured 40.8 ms forward and 33.8 backward a step for DPO pairs of 512 + 512 +
512 tokens (8 rows of 1,537 positions, llama-1b, H100, bench/results/h100-4b113bc), some 60
TFLOP/s.

A plan is built on the host from the document and branch ids; the engine builds each
micro-batch's from its host copies as it sends them (`plan_ahead`), so that no layer waits for
them to come back. A layout this does not cover (a prefix after a branch, a branch in two
runs) returns None from `branch_plan`: the caller keeps the masked kernel."""

from __future__ import annotations

import dataclasses
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

DenseKernel = Callable[[Tensor, Tensor, Tensor, float | None], Tensor]
"""(q, k, v of (runs, length, heads, dim), scale) → causal attention of each run, (runs,
length, heads, v's dim)."""

DENSE_WORK = 1.5
"""The most attention work (query-key pairs, the dense form's length rounded up to DENSE_TILE)
the dense form may do for each pair the varlen form computes. cuDNN's causal attention ran at
some 420 TFLOP/s forward and backward at head size 64 (sequence 16,384, H200,
bench/results/h200-cd2b34a/attention_probe), the varlen flash kernel at some 130 in a DPO step
(H100, 103b4f7); at the DPO benchmark's rows the dense form does 1.29 times the work."""

DENSE_TILE = 64
"""The dense form's runs are padded to a multiple of this: the kernels' tiles cover it anyway,
and fewer distinct shapes leave cuDNN fewer execution plans to build (0.3-0.6 s each, H100)."""


@dataclass(frozen=True)
class Gathered:
    """Slots holding the flat (batch × seq) positions of each run, `prefix + branch`."""

    index: Tensor
    """(slots,) int64: the flat position each slot takes."""
    own: Tensor
    """(batch × seq,) int64: the slot of each flat position in its own run."""
    copies: tuple[tuple[Tensor, Tensor], ...]
    """The prefix gathered again for later branches, in rounds (a prefix once a round, the copy
    for its document's k-th later branch in round k): each round's flat positions and their
    slots, int64."""
    kept: tuple[Tensor, Tensor] | None = None
    """The flat positions whose outputs are used (not padding) and their slots, where padding
    is left out: its outputs are unspecified and take no gradient (a padding run is not
    computed, its positions sharing a slot past a run's end)."""


@dataclass(frozen=True)
class VarlenRuns:
    """The varlen form: the queries where they are, each run's keys gathered."""

    keys: Gathered
    """The keys' slots, run after run."""
    cu_queries: Tensor
    """(runs + 1,) int32: where each run's queries start in the flat layout."""
    cu_keys: Tensor
    """(runs + 1,) int32: where each run's keys start in `keys`' slots."""
    max_queries: int
    max_keys: int


@dataclass(frozen=True)
class DenseRuns:
    """The dense form, padding left out: run r's slots are r × length + i."""

    slots: Gathered
    runs: int
    length: int
    """The longest run, rounded up to DENSE_TILE (a tile more where padding needs a slot past
    every run's end)."""
    copy_slots: Tensor
    """(rounds × batch × seq,) int64: each flat position's slot in each round of `slots.copies`,
    -1 where it has none that round (for the fused split's backward, qkv_runs.py)."""


@dataclass(frozen=True)
class BranchPlan:
    """The runs of a flat (batch × seq) layout in one of the two forms: the dense one where
    it does at most DENSE_WORK times the varlen form's work, else the varlen one."""

    form: VarlenRuns | DenseRuns
    dense_over_varlen: float
    """The dense form's work (query-key pairs, padded) over the varlen form's."""


def branch_plan(document_ids: Tensor | None, branch_ids: Tensor) -> BranchPlan | None:
    """The runs of a layout (module docstring), or None where the mask is not theirs. A plan
    made by `plan_ahead` or here before for these very tensors (every layer of a forward pass,
    and the reference model's, is given the same two); else built now, with one host
    synchronization (the device waits meanwhile: some 1-6 ms a step, H100)."""
    found, plan = _plans.find((document_ids, branch_ids))
    if found:
        return plan
    host_documents = None if document_ids is None else document_ids.cpu()
    return plan_ahead(host_documents, branch_ids.cpu(), document_ids, branch_ids)


def plan_ahead(
    host_document_ids: Tensor | None,
    host_branch_ids: Tensor,
    document_ids: Tensor | None,
    branch_ids: Tensor,
) -> BranchPlan | None:
    """Builds the plan of `document_ids` and `branch_ids` (on their device) from their host
    copies, for `branch_plan` to find while those tensors live: no synchronization in the
    first layer, one copy to the device of all its indices. Returns it."""
    plan = _build(
        None if host_document_ids is None else host_document_ids.numpy(),
        host_branch_ids.numpy(),
        branch_ids.device,
    )
    _plans.remember((document_ids, branch_ids), plan)
    return plan


def plans_taken_on(device: torch.device) -> bool:
    """Whether attention on `device` may take a plan (CUDA; elsewhere masks run): where it is
    worth planning ahead."""
    return device.type == "cuda"


@dataclass
class _Run:
    prefix: np.ndarray
    """The flat positions of the prefix gathered before this run's own (empty for a first run)."""
    own: np.ndarray
    """The flat positions of this run's queries."""
    padding: bool
    """Whether its queries are padding (branch -1), which no other query sees."""

    def keys(self) -> np.ndarray:
        return np.concatenate([self.prefix, self.own])

    def __len__(self) -> int:
        return len(self.prefix) + len(self.own)


def _build(documents: np.ndarray | None, branches: np.ndarray, device) -> BranchPlan | None:
    runs = _split(documents, branches)
    if runs is None:
        return None
    staged = _Staging(device)
    positions = branches.size
    queries = [len(r.own) for r in runs]
    key_counts = [len(r) for r in runs]
    varlen_work = sum(k * q - q * (q - 1) / 2 for q, k in zip(queries, key_counts, strict=True))
    kept = [r for r in runs if not r.padding]
    longest = max((len(r) for r in kept), default=0)
    length = -(-longest // DENSE_TILE) * DENSE_TILE
    if len(kept) < len(runs) and all(len(r) == length for r in kept):
        length += DENSE_TILE  # a slot past every run's end for the padding
    dense_work = len(kept) * length * (length + 1) / 2
    ratio = dense_work / varlen_work if varlen_work else float("inf")
    if kept and ratio <= DENSE_WORK:
        padded = [_padded(r.keys(), length) for r in kept]
        spare = None
        if len(kept) < len(runs):  # the last slot of a run padded at its end
            short = next(i for i, r in enumerate(kept) if len(r) < length)
            spare = (short + 1) * length - 1
        rounds = _copy_rounds(padded, kept)
        padding = branches.ravel() == -1
        slots = _gathered(staged, padded, kept, positions, rounds, spare, padding)
        copy_slots = np.full((len(rounds), positions), -1, dtype=np.int64)
        for row, (at, copies) in zip(copy_slots, rounds, strict=True):
            row[at] = copies
        form: VarlenRuns | DenseRuns = DenseRuns(
            slots, len(kept), length, staged.add(copy_slots.ravel())
        )
    else:
        key_slots = [r.keys() for r in runs]
        keys = _gathered(staged, key_slots, runs, positions, _copy_rounds(key_slots, runs))
        cu_queries, cu_keys = (staged.add(_starts(counts)) for counts in (queries, key_counts))
        form = VarlenRuns(keys, cu_queries, cu_keys, max(queries), max(key_counts))
    staged.send()
    return BranchPlan(staged.resolve(form), ratio)


def _split(documents: np.ndarray | None, branches: np.ndarray) -> list[_Run] | None:
    """Each document's runs, row after row, or None where the layout is not runs."""
    batch, seq = branches.shape
    none = np.empty(0, dtype=np.int64)
    result: list[_Run] = []
    for row in range(batch):
        base = row * seq
        ids = np.zeros(seq, dtype=np.int64) if documents is None else documents[row]
        for start, end in _runs(ids):
            labels = branches[row, start:end]
            runs = [(start + s, start + e) for s, e in _runs(labels)]
            heads = [int(labels[s - start]) for s, _ in runs]
            if len(runs) > 1 and (0 in heads[1:] or len(set(heads)) < len(heads)):
                return None  # a prefix after a branch, or a branch in two runs
            prefix = none
            if heads[0] == 0 and len(runs) > 1:  # the prefix runs with the first branch
                prefix = base + np.arange(*runs[0])
                runs, heads = [(runs[0][0], runs[1][1]), *runs[2:]], heads[1:]
            for index, ((s, e), head) in enumerate(zip(runs, heads, strict=True)):
                merged = index == 0 and len(prefix) > 0  # the prefix's queries are its own
                own = base + np.arange(s, e)
                result.append(_Run(none if index == 0 else prefix, own, head == -1 and not merged))
    return result


def _gathered(
    staged: _Staging,
    slots: list[np.ndarray],
    runs: list[_Run],
    positions: int,
    rounds: list[tuple[np.ndarray, np.ndarray]],
    spare: int | None = None,
    padding: np.ndarray | None = None,
) -> Gathered:
    """`slots[r]`: run r's slots (its prefix, its own positions, any padding after them), and
    `rounds` their `_copy_rounds`; positions of no run (left-out padding) take the slot `spare`;
    with `padding` (each flat position's), the outputs kept are the other positions'. Its
    indices are staged."""
    own = np.full(positions, -1 if spare is None else spare, dtype=np.int64)
    starts = np.cumsum([0] + [len(taken) for taken in slots[:-1]])
    for run, start in zip(runs, starts.tolist(), strict=True):
        own[run.own] = start + len(run.prefix) + np.arange(len(run.own))
    kept = None
    if padding is not None and padding.any():
        used = np.flatnonzero(~padding)
        kept = (staged.add(used), staged.add(own[used]))
    return Gathered(
        staged.add(np.concatenate(slots)),
        staged.add(own),
        tuple((staged.add(at), staged.add(taken)) for at, taken in rounds),
        kept,
    )


def _copy_rounds(slots: list[np.ndarray], runs: list[_Run]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The prefix gathered again for later branches, in rounds (`Gathered.copies`): each
    round's flat positions and their slots."""
    rounds: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
    start = 0
    later = 0  # the runs since the last one without a prefix: the round of the next copy
    for run, taken in zip(runs, slots, strict=True):
        later = later + 1 if len(run.prefix) else 0
        if later:
            if len(rounds) < later:
                rounds.append(([], []))
            rounds[later - 1][0].append(run.prefix)
            rounds[later - 1][1].append(start + np.arange(len(run.prefix)))
        start += len(taken)
    return [(np.concatenate(at), np.concatenate(taken)) for at, taken in rounds]


class _Staging:
    """A plan's index arrays, sent to the device as one int64 buffer (pinned for an
    asynchronous copy on CUDA) and handed out as views of it. `add` returns a placeholder
    that `resolve` replaces with its view once `send` has run."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.parts: list[np.ndarray] = []
        self.sent: Tensor | None = None
        self.offsets: list[int] = []

    def add(self, values: np.ndarray) -> _Staged:
        self.parts.append(np.asarray(values, dtype=np.int64))
        return _Staged(len(self.parts) - 1, values.dtype == np.int32)

    def send(self) -> None:
        host = torch.from_numpy(np.concatenate(self.parts))
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.sent = host.to(self.device, non_blocking=True)
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts]).tolist()

    def resolve(self, value: Any) -> Any:
        """`value` with each placeholder in it (in dataclasses and tuples) replaced."""
        if isinstance(value, _Staged):
            assert self.sent is not None
            view = self.sent[self.offsets[value.index] : self.offsets[value.index + 1]]
            return view.to(torch.int32) if value.int32 else view
        if isinstance(value, tuple):
            return tuple(self.resolve(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value,
                **{f.name: self.resolve(getattr(value, f.name)) for f in dataclasses.fields(value)},
            )
        return value


@dataclass(frozen=True)
class _Staged:
    index: int
    int32: bool


def _starts(lengths: list[int]) -> np.ndarray:
    """(len(lengths) + 1,) int32: where each length's run starts, then the end."""
    starts = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=starts[1:])
    return starts


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of equal values."""
    # (Not np.r_, which took a fifth of the host time of a DPO batch's plan.)
    starts = [0, *(np.flatnonzero(values[1:] != values[:-1]) + 1).tolist()]
    return list(zip(starts, [*starts[1:], len(values)], strict=True))


def _padded(keys: np.ndarray, length: int) -> np.ndarray:
    """`keys` with its last one repeated up to `length`: np.pad's edge mode, which took a
    fifth of the host time of a DPO batch's plan."""
    return np.concatenate([keys, np.full(length - len(keys), keys[-1], dtype=keys.dtype)])


class _Plans:
    """The plans of live (document_ids, branch_ids) pairs, held by weak references: a plan is
    found only while those very tensors live (a step's micro-batches, planned ahead)."""

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[weakref.ref | None, ...], BranchPlan | None]] = []

    def find(self, key: tuple[Tensor | None, Tensor]) -> tuple[bool, BranchPlan | None]:
        for refs, plan in self.entries:
            if _same(refs, key):
                return True, plan
        return False, None

    def remember(self, key: tuple[Tensor | None, Tensor], plan: BranchPlan | None) -> None:
        live = [(refs, p) for refs, p in self.entries if _alive(refs) and not _same(refs, key)]
        self.entries = [*live, (tuple(None if t is None else weakref.ref(t) for t in key), plan)]


def _same(refs: tuple[weakref.ref | None, ...], key: tuple[Tensor | None, Tensor]) -> bool:
    return all(
        (ref is None and t is None) or (ref is not None and ref() is t)
        for ref, t in zip(refs, key, strict=True)
    )


def _alive(refs: tuple[weakref.ref | None, ...]) -> bool:
    return all(ref is None or ref() is not None for ref in refs)


_plans = _Plans()


def branch_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: BranchPlan,
    scale: float | None,
    varlen: VarlenKernel,
    dense: DenseKernel,
) -> Tensor:
    """q (batch, seq, heads, dim), k and v (batch, seq, kv_heads, ·) → (batch, seq, heads, v's
    dim), each position attending as `plan` lays it out: through `dense` where the plan has
    the dense form, else through `varlen`."""
    batch, seq = q.shape[:2]
    form = plan.form
    if isinstance(form, DenseRuns):
        return runs_attention(*gather_runs(q, k, v, form), form, scale, dense, batch)
    q, k, v = (t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v))
    keys = [_Gather.apply(t, form.keys) for t in (k, v)]
    out = varlen(q, *keys, form.cu_queries, form.cu_keys, form.max_queries, form.max_keys, scale)
    return out.view(batch, seq, *out.shape[1:])


def gather_runs(q: Tensor, k: Tensor, v: Tensor, runs: DenseRuns) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (batch, seq, ·, ·) → (runs, length, ·, ·): each slot of the dense form holding
    its position's."""
    q, k, v = (
        _Gather.apply(t.flatten(0, 1), runs.slots).view(runs.runs, runs.length, *t.shape[2:])
        for t in (q, k, v)
    )
    return q, k, v


def runs_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    runs: DenseRuns,
    scale: float | None,
    dense: DenseKernel,
    batch: int,
) -> Tensor:
    """q, k, v (runs, length, ·, ·) of the dense form → (batch, seq, heads, v's dim): causal
    attention of each run through `dense`, each position's output from its own slot."""
    out = _Own.apply(dense(q, k, v, scale).flatten(0, 1), runs.slots)
    return out.view(batch, -1, *out.shape[1:])


class _Gather(torch.autograd.Function):
    """The flat positions into their slots; the backward gathers each position's gradient from
    its own slot and adds its prefix copies' gradients, with no atomics (padding slots have
    none: no query sees a key after its own, and no output of theirs is used)."""

    @staticmethod
    def forward(ctx: Any, source: Tensor, slots: Gathered) -> Tensor:
        ctx.slots = slots
        return source.index_select(0, slots.index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        slots: Gathered = ctx.slots
        grad_source = grad.index_select(0, slots.own)
        for positions, copies in slots.copies:  # each round's positions are distinct
            summed = grad_source.index_select(0, positions) + grad.index_select(0, copies)
            grad_source.index_copy_(0, positions, summed)
        return grad_source, None


class _Own(torch.autograd.Function):
    """Each flat position's output from its own slot; the backward puts the gradients back in
    those slots (the other slots' outputs are unused: zero), with no atomics, left-out
    padding's gradients dropped."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, slots: Gathered) -> Tensor:
        ctx.slots = slots
        ctx.shape = out.shape
        return out.index_select(0, slots.own)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        slots: Gathered = ctx.slots
        grad_out = grad.new_zeros(ctx.shape)
        if slots.kept is None:
            return grad_out.index_copy_(0, slots.own, grad), None
        positions, kept = slots.kept
        return grad_out.index_copy_(0, kept, grad.index_select(0, positions)), None


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
