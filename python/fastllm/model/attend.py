"""The attention kernels over a mixer's queries, keys and values, for each way a block runs:
whole sequences, this rank's chunks under sequence-data parallelism, or after the cached keys
and values of generation and micro-sequences. Grouped-query attention (attention.py) and latent
attention (latent_attention.py) both end here."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastllm.parallel.sequence_data import SequenceDataDimension
from fastllm_kernels.attention import attention


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    sequence_data: SequenceDataDimension,
    layer_index: int,
    window_size: int | None,
    scale: float | None,
    document_ids: Tensor | None,
    cache: Any,
    branch_ids: Tensor | None,
) -> Tensor:
    """Causal attention of q (batch, seq, heads, ·) over k, v (batch, key_seq, heads, ·);
    `document_ids` and `branch_ids` cover the keys (with sequence-data parallelism, the
    sequence up to the end of this rank's chunk)."""
    if sequence_data.split:
        # The queries of each of this rank's chunks attend to the keys (the causal prefix,
        # gathered) up to that chunk's end.
        outs, offset = [], 0
        for start, end in sequence_data.spans(q.shape[1]):
            length = end - start
            outs.append(
                attention(
                    q[:, offset : offset + length],
                    k[:, :end],
                    v[:, :end],
                    causal=True,
                    window_size=window_size,
                    document_ids=None if document_ids is None else document_ids[:, :end],
                    scale=scale,
                    branch_ids=None if branch_ids is None else branch_ids[:, :end],
                )
            )
            offset += length
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if cache is None:
        return attention(
            q, k, v, causal=True, window_size=window_size, document_ids=document_ids,
            scale=scale, branch_ids=branch_ids,
        )  # fmt: skip
    # Generation (a transformers Cache) and micro-sequences (engine/micro_sequences.py):
    # `cache.update` appends the new keys and values, in its (batch, heads, seq, head) layout,
    # to the earlier ones and returns all of them; the new queries are the last positions.
    keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), layer_index)
    return attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), causal=True, window_size=window_size,
        document_ids=document_ids, scale=scale, branch_ids=branch_ids,
    )  # fmt: skip
