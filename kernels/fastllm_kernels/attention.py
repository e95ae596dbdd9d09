"""Scaled dot-product attention with causal, sliding-window and packed-document masks, and GQA.

No kernel of our own: the op picks the fastest existing one for the case.
- Dense (no window, no documents) on CUDA: torch SDPA, backends in the order cuDNN, flash,
  memory-efficient, math. On the H200 (causal, head dim 128, seq 4096) cuDNN measured ~580
  TFLOP/s forward / 440 forward+backward against ~310 / 265 for flash, so cuDNN comes first
  even when the flash-attn package is installed.
- Window or documents on CUDA: flash-attn (window_size, varlen for documents) when importable
  and the dtype is fp16/bf16; otherwise torch's compiled flex_attention with a block mask
  (SDPA with a boolean mask below 128 keys, one flex block). Both skip the key blocks the mask
  removes entirely, which an explicit boolean mask given to SDPA cannot (it also costs seq²
  memory and rules out flash). SDPA with a mask on CUDA runs the memory-efficient kernel,
  key/value heads repeated for GQA, not cuDNN, which builds a plan for each new shape.
- CPU: SDPA with an explicit boolean mask.
Masks: query i sees key j when j <= i (causal), i - window_size < j (window; |i - j| < window
when not causal), document_ids[b, i] == document_ids[b, j], and with branch_ids (a shared
prefix: the prompt of a preference pair, branch 0, and its answers, branches 1 and 2, which
never see each other) branch_ids[b, j] is 0 or branch_ids[b, i]; branches go to causal attention of each branch with
its prefix as one sequence on CUDA where the layout allows (branch_attention.py: dense SDPA,
cuDNN first, where padding the sequences to one length costs little, else torch's varlen
flash attention; `attention_of_qkv` takes the fused projection and has the split write the
dense form's runs), else to flex_attention, and to SDPA with a dense mask
elsewhere (CPU, evaluation's `dense_masks`). Each document must be one
contiguous run of positions (as packing produces), which is what flash-attn's varlen assumes.
There may be fewer queries than keys: the queries are then the last positions of the keys (a
later chunk of a sequence that attends to its earlier chunks' keys too), i and j count key
positions, and document_ids covers the keys. Dense SDPA aligns a causal mask to the first
key, so such calls go to the masked kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from fastllm_kernels.branch_attention import (
    DenseRuns,
    branch_attention,
    branch_plan,
    has_varlen_flash,
    runs_attention,
    varlen_flash,
)
from fastllm_kernels.qkv_runs import split_qkv_rotary_into_runs

try:
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # optional: most installs use SDPA / flex_attention
    flash_attn_func = flash_attn_varlen_func = None

_FLEX_MIN_KEYS = 128
"""flex_attention's block size: masks on fewer keys go to SDPA as a dense boolean mask."""

_DENSE_MASKS: contextvars.ContextVar[bool] = contextvars.ContextVar("dense_masks", default=False)


@contextlib.contextmanager
def dense_masks() -> Iterator[None]:
    """Masks (documents, windows, branches) as a dense boolean mask through SDPA where
    flex_attention would run, inside: for batches whose shapes vary (evaluation, generation),
    which flex_attention would compile one by one. flash-attn, when installed, still takes the
    masks it knows."""
    token = _DENSE_MASKS.set(True)
    try:
        yield
    finally:
        _DENSE_MASKS.reset(token)


_SDPA_PRIORITY = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window_size: int | None = None,
    document_ids: Tensor | None = None,
    scale: float | None = None,
    branch_ids: Tensor | None = None,
) -> Tensor:
    """q (batch, seq, heads, head_dim), k (batch, key_seq ≥ seq, kv_heads, head_dim), v like k
    but for its head size (latent attention's differs) → (batch, seq, heads, v's head size);
    document_ids and branch_ids (batch, key_seq)."""
    _check(q, k, v, window_size, document_ids, branch_ids)
    if window_size is not None and window_size >= k.shape[1]:
        window_size = None  # masks nothing: keep the fastest (dense) kernels
    offset = k.shape[1] - q.shape[1]
    masked = window_size is not None or document_ids is not None or (causal and offset > 0)
    # Fewer keys than one flex block leave nothing to skip; and torch 2.11's inductor found no
    # flex kernel config for head dim 128 at 48 keys (H200).
    flex = q.is_cuda and q.shape[1] >= _FLEX_MIN_KEYS and not _DENSE_MASKS.get()
    if branch_ids is not None:  # only the masked kernels of a mask function know branches
        if _varlen_branches(q, v, causal, window_size, offset):
            plan = branch_plan(document_ids, branch_ids)
            if plan is not None:
                return branch_attention(q, k, v, plan, scale, varlen_flash, _dense_causal)
        if flex:
            return _flex(q, k, v, causal, window_size, document_ids, scale, branch_ids)
        mask = _dense_mask(q, k, causal, window_size, document_ids, branch_ids)
        return _sdpa(q, k, v, attn_mask=mask, scale=scale)
    if q.is_cuda and not masked:
        with sdpa_kernel(_SDPA_PRIORITY, set_priority=True):
            return _sdpa(q, k, v, is_causal=causal, scale=scale)
    flash = flash_attn_func is not None and q.dtype in (torch.float16, torch.bfloat16)
    flash = flash and v.shape[3] == q.shape[3]  # flash-attn has one head size
    # flash-attn aligns causal masks to the last key, but its varlen path would need the
    # query and key document offsets apart.
    if q.is_cuda and flash and (document_ids is None or offset == 0):
        return _flash_attn(q, k, v, causal, window_size, document_ids, scale)
    if flex:
        return _flex(q, k, v, causal, window_size, document_ids, scale)
    mask = _dense_mask(q, k, causal, window_size, document_ids)
    if mask is None:
        return _sdpa(q, k, v, is_causal=causal, scale=scale)
    return _sdpa(q, k, v, attn_mask=mask, scale=scale)


def _dense_causal(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Causal attention of (batch, seq, heads, dim) tensors through the dense training
    backends (cuDNN first): shared prefixes' dense form (branch_attention.py)."""
    with sdpa_kernel(_SDPA_PRIORITY, set_priority=True):
        return _sdpa(q, k, v, is_causal=True, scale=scale)


def attention_of_qkv(
    qkv: Tensor,
    heads: int,
    kv_heads: int,
    cos: Tensor | None,
    sin: Tensor | None,
    *,
    document_ids: Tensor | None,
    branch_ids: Tensor | None,
    scale: float | None,
) -> Tensor | None:
    """`attention(*split_qkv_rotary(qkv, heads, kv_heads, cos, sin), causal=True, …)` straight
    from the fused projection (batch, seq, (heads + 2 * kv_heads) * head_dim) where shared
    prefixes take the dense form: the split writes q, k and v into its runs (qkv_runs.py), so
    there are no gathers. None elsewhere: the caller splits and calls `attention`."""
    if branch_ids is None or not _branch_kernels(qkv):
        return None
    plan = branch_plan(document_ids, branch_ids)
    if plan is None or not isinstance(plan.form, DenseRuns):
        return None
    q, k, v = split_qkv_rotary_into_runs(qkv, heads, kv_heads, cos, sin, plan.form)
    return runs_attention(q, k, v, plan.form, scale, _dense_causal, qkv.shape[0])


def _varlen_branches(q: Tensor, v: Tensor, causal: bool, window_size, offset: int) -> bool:
    """Whether shared prefixes can run as causal sequences (branch_attention.py): causal,
    unwindowed, whole sequences, one head size, on the kernels that take them."""
    whole = causal and window_size is None and offset == 0
    return whole and v.shape[3] == q.shape[3] and _branch_kernels(q)


def _branch_kernels(x: Tensor) -> bool:
    """Whether shared prefixes in x's (batch, seq, …) may take the causal kernels rather than
    flex_attention's mask: on CUDA where flex would run, in a dtype flash takes."""
    flex = x.is_cuda and x.shape[1] >= _FLEX_MIN_KEYS and not _DENSE_MASKS.get()
    return flex and x.dtype in (torch.float16, torch.bfloat16) and has_varlen_flash()


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window_size: int | None = None,
    document_ids: Tensor | None = None,
    scale: float | None = None,
    branch_ids: Tensor | None = None,
) -> Tensor:
    """softmax(q·kᵀ·scale + mask)·v in fp32, spelled out."""
    _check(q, k, v, window_size, document_ids, branch_ids)
    group = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = qf @ kf.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    mask = _dense_mask(q, k, causal, window_size, document_ids, branch_ids)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).transpose(1, 2).to(q.dtype)


def _check(q, k, v, window_size, document_ids, branch_ids=None) -> None:
    if (
        q.dim() != 4
        or k.shape[:3] != v.shape[:3]
        or q.shape[0] != k.shape[0]
        or q.shape[1] > k.shape[1]
        or q.shape[3] != k.shape[3]
    ):
        raise ValueError(
            f"bad attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    if window_size is not None and window_size < 1:
        raise ValueError(f"window_size must be positive, got {window_size}")
    for name, ids in (("document_ids", document_ids), ("branch_ids", branch_ids)):
        if ids is not None and ids.shape != k.shape[:2]:
            raise ValueError(f"{name} must be (batch, key_seq) = {tuple(k.shape[:2])}")


def _dense_mask(
    q: Tensor, k: Tensor, causal, window_size, document_ids, branch_ids=None
) -> Tensor | None:
    """Boolean (batch or 1, 1, seq, key_seq) mask, True where attention is allowed; None if
    all."""
    if not causal and window_size is None and document_ids is None and branch_ids is None:
        return None
    seq, key_seq = q.shape[1], k.shape[1]
    i = torch.arange(key_seq - seq, key_seq, device=q.device)[:, None]
    j = torch.arange(key_seq, device=q.device)[None, :]
    mask = j <= i if causal else torch.ones(seq, key_seq, dtype=torch.bool, device=q.device)
    if window_size is not None:
        mask = mask & (i - j < window_size) & (j - i < window_size)
    mask = mask[None, None]
    if document_ids is not None:
        queries = document_ids[:, key_seq - seq :]
        mask = mask & (queries[:, None, :, None] == document_ids[:, None, None, :])
    if branch_ids is not None:
        queries, keys = branch_ids[:, key_seq - seq :, None], branch_ids[:, None, :]
        mask = mask & ((keys == 0) | (keys == queries))[:, None]
    return mask


_MASKED_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The backends of SDPA with a mask on CUDA. cuDNN, which torch may otherwise pick, builds an
execution plan for each new shape: 300-620 ms a call on the H100 at evaluation's shapes
(bench/masked_sdpa_probe.py), where every batch and every decoding step has its own length;
the memory-efficient kernel then takes 0.4-0.5 ms."""


def _sdpa(q, k, v, **kwargs) -> Tensor:
    """SDPA on (batch, seq, heads, dim) tensors; GQA handled by the kernel (enable_gqa), or,
    with a mask on CUDA, by key/value heads repeated for the memory-efficient kernel (which
    has no GQA)."""
    backends = contextlib.nullcontext()
    if q.is_cuda and kwargs.get("attn_mask") is not None:
        group = q.shape[2] // k.shape[2]
        if group > 1:
            k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        backends = sdpa_kernel(_MASKED_SDPA)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    with backends:
        out = scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kwargs)
    return out.transpose(1, 2)


def _flash_attn(q, k, v, causal, window_size, document_ids, scale) -> Tensor:
    # flash-attn's window (left, right) counts keys on each side: i - left <= j <= i + right.
    left = -1 if window_size is None else window_size - 1
    window = (left, 0 if causal else left)
    if document_ids is None:
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window)
    batch, seq = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    cu_seqlens = torch.nonzero(starts.flatten()).flatten()
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([batch * seq])]).to(torch.int32)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # one host sync per call
    flat = (t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v))
    out = flash_attn_varlen_func(
        *flat, cu_seqlens, cu_seqlens, max_len, max_len, softmax_scale=scale, causal=causal,
        window_size=window,
    )  # fmt: skip
    return out.view(q.shape)


def _flex(q, k, v, causal, window_size, document_ids, scale, branch_ids=None) -> Tensor:
    seq, key_seq = q.shape[1], k.shape[1]
    if document_ids is None and branch_ids is None:  # the same for every batch: build it once
        block_mask = _cached_block_mask(seq, key_seq, causal, window_size, q.device)
    else:
        block_mask = _block_mask(
            seq, key_seq, causal, window_size, document_ids, q.device, branch_ids
        )
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = _compiled_flex_attention()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


@functools.lru_cache(maxsize=16)
def _cached_block_mask(seq, key_seq, causal, window_size, device):
    return _block_mask(seq, key_seq, causal, window_size, None, device)


def _block_mask(seq, key_seq, causal, window_size, document_ids, device, branch_ids=None):
    offset = key_seq - seq  # query q is key position q + offset

    def mask_mod(b, h, q, j):
        i = q + offset
        keep = (j <= i) if causal else (i >= 0)
        if window_size is not None:
            keep = keep & (i - j < window_size) & (j - i < window_size)
        if document_ids is not None:
            keep = keep & (document_ids[b, i] == document_ids[b, j])
        if branch_ids is not None:
            keep = keep & ((branch_ids[b, j] == 0) | (branch_ids[b, j] == branch_ids[b, i]))
        return keep

    ids = document_ids if document_ids is not None else branch_ids
    batch = None if ids is None else ids.shape[0]
    return _compiled_create_block_mask()(mask_mod, batch, None, seq, key_seq, device=device)
