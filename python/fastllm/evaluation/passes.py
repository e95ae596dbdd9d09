"""lm-eval's forward passes under the layout the model trains with.

Under sequence-tensor parallelism a pass's rows are padded at the end to a length the tensor
ranks divide: padding after a causal row changes none of its positions, and a generation
step's padded keys and values are read in that step only, never cached. Under sequence-data
parallelism the rows are padded to a length its chunks split evenly, each rank runs its
chunks, and the final hidden states are all-gathered over the group (a generation step
reads the whole sequence: the attention of these ranks splits it, so no cache). Under pipeline
parallelism a pass runs through the stages in order, each on its pipeline rank, the residual
stream sent from one stage's rank to the next one's; what the last stage computes (scores, a
generation step's logits) is broadcast from its rank to the other pipeline ranks, so that
every rank gives lm-eval the same answers. The tensor, pipeline, sequence-data and expert
ranks of one document group answer the same documents, so they run the same passes in the
same order (which the expert all-to-alls need too). Under ZeRO-3 each stage's weights are
gathered as it runs."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fastllm.config.layout import pipeline_rank_of
from fastllm.engine.model_stages import ModelStages
from fastllm.model import GPTModel
from fastllm.model.gpt import Context
from fastllm.parallel import point_to_point
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.tensor import gathered_vocabulary


class LayoutPasses:
    """The forward passes of `model`, this rank's part of it: the stages of `stages` that its
    pipeline rank runs (without `stages`: the whole model)."""

    def __init__(self, model: GPTModel, stages: ModelStages | None) -> None:
        self.model, self.stages = model, stages
        self.tensor = model.tensor
        self.pipeline = Dimension() if stages is None else stages.mesh.pipeline
        num_layers = model.config.transformer.num_layers
        self.positions = (
            [(0, num_layers + 1)] if stages is None else [s.positions for s in stages.stages]
        )
        """Each stage's first and last model positions."""
        self.ranks = [pipeline_rank_of(s, self.pipeline.size) for s in range(len(self.positions))]
        """Each stage's pipeline rank."""
        self.device = (
            next(p for p in model.parameters() if not p.is_meta).device
            if stages is None
            else stages.device
        )
        self.dtype = model.embeddings.weight.dtype if stages is None else stages.compute_dtype
        """The residual stream's."""
        self.has_last = self.ranks[-1] == self.pipeline.rank
        """This rank runs the last stage: the final hidden states are here."""
        here = [s for s, rank in enumerate(self.ranks) if rank == self.pipeline.rank]
        self.first_block = max(self.positions[here[0]][0] - 1, 0)
        """The first block this rank runs, whose cache says how many tokens were generated."""

    def padded(self, length: int) -> int:
        """`length` rounded up to a length that the sequence-data ranks' chunks split evenly,
        and each chunk the tensor ranks under sequence-tensor parallelism."""
        sequence_data, multiple = self.model.sequence_data, 1
        if sequence_data.split:
            multiple = sequence_data.size * (2 if sequence_data.chunking == "head_tail" else 1)
        if self.tensor.sequence_tensor_parallel:
            multiple *= self.tensor.size
        return -(-length // multiple) * multiple

    def hidden_states(self, input_ids: Tensor, **options: Any) -> Tensor | None:
        """The final-normed hidden states (batch, length, hidden) of whole rows `input_ids`
        (batch, a `padded` length) on the rank of the last stage; None on the other pipeline
        ranks. `options` go to `GPTModel.context`, whole rows too (under sequence-data
        parallelism each rank reads its chunks of the rows, and their hidden states are
        gathered)."""
        sequence_data = self.model.sequence_data
        if sequence_data.split:
            input_ids = sequence_data.chunk(input_ids)
            if options.get("position_ids") is not None:
                options["position_ids"] = sequence_data.chunk(options["position_ids"])
        hidden = self._run_stages(input_ids, self.model.context(input_ids, **options))
        if hidden is None or not sequence_data.split:
            return hidden
        return self._whole_rows(hidden)

    def _run_stages(self, input_ids: Tensor, context: Context) -> Tensor | None:
        """The final-normed hidden states of `input_ids` (this rank's chunks of the rows) on
        the rank of the last stage; None on the other pipeline ranks."""

        def run(stage: int, x: Tensor) -> Tensor:
            if self.stages is not None:
                self.stages.gather_for_forward(stage)
            return self.model.run_positions(*self.positions[stage], x, context)[0]

        def receive_into() -> Tensor:
            shape = self._stream_shape(input_ids)
            return torch.empty(shape, dtype=self.dtype, device=self.device)

        x = point_to_point.through_stages(
            input_ids, self.ranks, self.pipeline.rank, run, receive_into, self._global
        )
        return x if self.has_last else None

    def from_last_stage(self, value: Tensor | None, shape: tuple[int, ...]) -> Tensor:
        """`value` (on the rank of the last stage; None elsewhere, which gets a tensor of
        `shape`) on every pipeline rank."""
        if self.pipeline.size == 1:
            assert value is not None
            return value
        if value is None:
            value = torch.empty(shape, dtype=torch.float32, device=self.device)
        value = value.float().contiguous()
        dist.broadcast(value, self._global(self.ranks[-1]), group=self.pipeline.group)
        return value

    def logits(
        self,
        input_ids: Tensor,
        *,
        cache: Any = None,
        logits_to_keep: int = 0,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """A generation step (what `GPTModel.forward` takes from the `transformers` wrapper):
        the logits (batch, `logits_to_keep` or all positions, vocab) on every rank, `cache`
        extended by the real positions' keys and values."""
        batch, length = input_ids.shape
        pad = self.padded(length) - length
        position_ids = None
        if cache is not None and document_ids is None:
            # After the cached ones, as the cache of this rank's first block counts them (under
            # the pipeline, layer 0's may be another rank's).
            start = cache.get_seq_length(self.first_block)
            position_ids = torch.arange(start, start + length + pad, device=input_ids.device)
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            if document_ids is not None:  # the padding continues the last document
                document_ids = F.pad(document_ids, (0, pad), value=1)
            if cache is not None:
                cache = _RealPositionsCached(cache, length)
        hidden = self.hidden_states(
            input_ids, document_ids=document_ids, position_ids=position_ids, cache=cache
        )
        kept = logits_to_keep if logits_to_keep > 0 else length
        logits = None
        if hidden is not None:
            logits = F.linear(hidden[:, length - kept : length], self.model.head_weight)
            if self.tensor.split:
                logits = gathered_vocabulary(logits, self.tensor)
        vocab = self.model.config.vocab_size
        return self.from_last_stage(logits, (batch, kept, vocab)).to(self.dtype)

    def _whole_rows(self, hidden: Tensor) -> Tensor:
        """The rows' hidden states (batch, length, hidden) from each sequence-data rank's
        chunks of them (batch, length / ranks, hidden)."""
        sequence_data, local = self.model.sequence_data, hidden.shape[1]
        gathered = hidden.new_empty((sequence_data.size, *hidden.shape))
        dist.all_gather_into_tensor(
            gathered.view(-1), hidden.contiguous().view(-1), group=sequence_data.group
        )
        whole = hidden.new_empty((hidden.shape[0], local * sequence_data.size, hidden.shape[2]))
        for rank in range(sequence_data.size):
            offset = 0
            for start, end in sequence_data.spans_of(rank, local):
                whole[:, start:end] = gathered[rank, :, offset : offset + end - start]
                offset += end - start
        return whole

    def _stream_shape(self, input_ids: Tensor) -> tuple[int, int, int]:
        """The residual stream between stages: the rows' chunk of this tensor rank under
        sequence-tensor parallelism."""
        batch, length = input_ids.shape
        if self.tensor.sequence_tensor_parallel:
            length //= self.tensor.size
        return batch, length, self.model.config.transformer.hidden_size

    def _global(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.pipeline.group, pipeline_rank)


class _RealPositionsCached:
    """A generation cache as a padded step reads it: the keys and values of the step's first
    `real` positions appended to it, the padding's only returned with them."""

    def __init__(self, cache: Any, real: int) -> None:
        self.cache, self.real = cache, real

    def update(self, keys: Tensor, values: Tensor, layer_index: int) -> tuple[Tensor, Tensor]:
        """As `Cache.update` (batch, heads, positions, head size)."""
        real = self.real
        cached_keys, cached_values = self.cache.update(
            keys[:, :, :real], values[:, :, :real], layer_index
        )
        return (
            torch.cat([cached_keys, keys[:, :, real:]], dim=2),
            torch.cat([cached_values, values[:, :, real:]], dim=2),
        )
