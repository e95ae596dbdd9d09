"""The one transformer: embedding, blocks, final norm, head (logits or fused loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config import registry
from fastllm.config.model import BaseModelConfig, LoRAConfig, RotaryConfig
from fastllm.model.multi_token_prediction import PredictionModule, prediction_loss
from fastllm.model.normalization import normalization
from fastllm.model.parameters import TensorSplit, describe, set_layer
from fastllm.model.rotary import positions_in_documents
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.tensor import (
    TensorDimension,
    enter,
    gathered_vocabulary,
    vocab_parallel_embedding,
)
from fastllm.parallel.vocab_parallel_losses import vocab_parallel_label_losses
from fastllm_kernels.cross_entropy import linear_cross_entropy
from fastllm_kernels.recipe import WeightRecipe


@dataclass(frozen=True)
class Context:
    """What every layer of a batch reads besides the residual stream."""

    rotary: tuple[Tensor, Tensor] | None
    """cos and sin of the global blocks (of every block without `window_rotary`)."""
    document_ids: Tensor | None
    cache: Any = None
    """A Hugging Face cache, when generating."""
    branch_ids: Tensor | None = None
    """Preference pairs (batch, seq): 0 the shared prompt, 1 and 2 its answers, which attend to
    the prompt and never to each other (`kernels.attention`)."""
    window_rotary: tuple[Tensor, Tensor] | None = None
    """cos and sin of the sliding blocks (`rotary` unless they have a rotary of their own)."""
    input_ids: Tensor | None = None
    """The token ids, which multi-token prediction embeds again, shifted (else None)."""
    labels: Tensor | None = None
    """The next-token labels, which multi-token prediction is trained on, shifted (None when
    the model has no such modules, or nothing is trained)."""

    def rotary_of(self, block: torch.nn.Module) -> tuple[Tensor, Tensor] | None:
        # The sliding tables where one of the block's layers slides (fastllm's attention); a
        # mixer of another package slides over no window of ours: the global tables.
        sliding = any(getattr(m, "window_size", None) is not None for m in block.children())
        return self.window_rotary if sliding else self.rotary


class Embedding(torch.nn.Embedding):
    """The input embedding; vocab-parallel over the tensor ranks; with `scaled`, multiplied
    by sqrt(hidden_size) rounded to the weight's dtype, as Gemma does."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tensor: TensorDimension, scaled: bool = False
    ) -> None:
        super().__init__(vocab_size // tensor.size, hidden_size)
        self.tensor = tensor
        self.scale = hidden_size**0.5 if scaled else None

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tensor.split:
            x = vocab_parallel_embedding(input_ids, self.weight, self.tensor)
        else:
            x = super().forward(input_ids)
        if self.scale is None:
            return x
        # Rounded as transformers rounds it, to fp32 then to the compute dtype (on the host:
        # no copy to the device).
        return x * float(torch.tensor(self.scale, dtype=torch.float32).to(x.dtype))


class GPTModel(torch.nn.Module):
    """A decoder-only transformer configured by `model.base_model`.

    `forward(input_ids)` returns logits; `loss(input_ids, labels)` returns the mean
    next-token cross-entropy (labels -100 are ignored) plus the router losses, without ever
    materializing the logits.

    On a `mesh` of more than one tensor rank, this rank's slice of the model: a vocab-parallel
    embedding and head, column- and row-parallel projections (parallel/tensor.py). With more
    than one sequence-data rank, the inputs are this rank's chunk of each sequence
    (parallel/sequence_data.py). With more than one expert rank, each mixture of experts holds
    this rank's share of the experts (parallel/expert.py). Every parameter carries a
    `ParameterMeta` (model/parameters.py)."""

    def __init__(self, config: BaseModelConfig, mesh: ParallelMesh | None = None) -> None:
        super().__init__()
        transformer = config.transformer
        assert transformer.kv_channels is not None, "validate the config first"
        self.config = config
        mesh = mesh or ParallelMesh.single()
        self.tensor, self.sequence_data = mesh.tensor, mesh.sequence_data
        vocab, hidden = config.vocab_size // self.tensor.size, transformer.hidden_size
        vocab_split = TensorSplit(0, (config.vocab_size,))
        self.embeddings = Embedding(
            config.vocab_size, hidden, self.tensor, transformer.scale_embeddings
        )
        describe(
            self.embeddings,
            "weight",
            weight_decay=False,
            tensor_split=vocab_split,
            tied=config.tie_word_embeddings,
        )
        lora = config.peft if isinstance(config.peft, LoRAConfig) else None
        block = registry.implementation(transformer.block)
        self.layers = torch.nn.ModuleList(
            block(transformer.block, transformer, i, mesh, lora)
            for i in range(transformer.num_layers)
        )
        self.final_norm = normalization(transformer.normalization, hidden)
        self.head = (
            None if config.tie_word_embeddings else torch.nn.Linear(hidden, vocab, bias=False)
        )
        self.head_recipe = None if self.head is None else WeightRecipe()
        """None for a tied head: the embedding's weight, whose gradient autograd returns."""
        if self.head is not None:
            describe(
                self.head,
                "weight",
                weight_decay=True,
                tensor_split=vocab_split,
                recipe=self.head_recipe,
            )
        prediction = config.multi_token_prediction
        self.prediction_modules = torch.nn.ModuleList(
            PredictionModule(transformer, transformer.num_layers + k, mesh)
            for k in range(prediction.depth if prediction is not None else 0)
        )
        """DeepSeek-V3's multi-token prediction modules (model/multi_token_prediction.py),
        with the head at the last model position."""
        for layer, modules in enumerate(self.layer_modules()):
            for module in modules:
                set_layer(module, layer)
        self.rotary = _rotary_tables(transformer.rotary, transformer.rotary_channels)
        window_rotary = transformer.window_rotary
        self.window_rotary = (
            self.rotary
            if window_rotary is None
            else _rotary_tables(window_rotary, transformer.rotary_channels)
        )
        """The sliding blocks' tables (`rotary` unless they have their own; None: no rotary)."""

    @property
    def head_weight(self) -> Tensor:
        return self.embeddings.weight if self.head is None else self.head.weight

    def layer_modules(self) -> list[list[torch.nn.Module]]:
        """The modules at each model position, in the order the forward pass runs them: the
        embedding, each block, the final norm with the head and the multi-token prediction
        modules (which read the head)."""
        last = [self.final_norm] + ([self.head] if self.head is not None else [])
        last += list(self.prediction_modules)
        return [[self.embeddings], *([block] for block in self.layers), last]

    def context(
        self,
        input_ids: Tensor,
        *,
        document_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Any = None,
        branch_ids: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Context:
        """What every layer of one batch reads besides the residual stream.

        `document_ids` (batch, seq) keeps attention inside documents of packed samples, and
        positions restart with each document unless `position_ids` are given; `branch_ids`
        (preference pairs) keep each answer from the other's. With
        sequence-data parallelism `input_ids` are this rank's chunks of the sequences and
        `document_ids` cover them up to the end of the last one."""
        length = input_ids.shape[1]
        if position_ids is None:
            if document_ids is not None:
                positions = positions_in_documents(document_ids)
                split = self.sequence_data.split
                position_ids = (
                    self.sequence_data.take(positions, length) if split else positions[:, -length:]
                )
            elif cache is not None:
                start = cache.get_seq_length()
                position_ids = torch.arange(start, start + length, device=input_ids.device)
            else:
                position_ids = self.sequence_data.positions(length, input_ids.device)
        rotary = None if self.rotary is None else self.rotary(position_ids)
        window_rotary = rotary
        if self.window_rotary is not self.rotary:
            tables = self.window_rotary
            window_rotary = None if tables is None else tables(position_ids)
        if not self.prediction_modules:
            return Context(rotary, document_ids, cache, branch_ids, window_rotary)
        return Context(rotary, document_ids, cache, branch_ids, window_rotary, input_ids, labels)

    def run_positions(
        self,
        first: int,
        last: int,
        x: Tensor,
        context: Context,
        labels: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Model positions `first` … `last` (0 the embedding, then the blocks, then the final
        norm with the head: `layer_modules`' order) on `x` (the token ids when `first` is 0,
        else the residual stream), and the summed auxiliary loss of their blocks.

        Returns the residual stream; through the last position, the final-normed hidden
        states, or with `labels` the mean next-token loss (a pipeline stage is such a run)."""
        num_layers = len(self.layers)
        if first == 0:
            x = self.embeddings(x)
        auxiliary: Tensor | None = None
        for layer in self.layers[max(first, 1) - 1 : min(last, num_layers)]:
            x, layer_auxiliary = layer(
                x, context.rotary_of(layer), context.document_ids, context.cache, context.branch_ids
            )
            if layer_auxiliary is not None:
                auxiliary = layer_auxiliary if auxiliary is None else auxiliary + layer_auxiliary
        if last <= num_layers:
            return x, auxiliary
        blocks_output = x
        x = self.final_norm(enter(x, self.tensor))
        targets = labels if labels is not None else context.labels
        if self.prediction_modules and targets is not None and context.input_ids is not None:
            prediction = self.config.multi_token_prediction
            assert prediction is not None
            predicted = prediction_loss(
                self.prediction_modules, blocks_output, context.input_ids, targets,
                self.embeddings, self.head_weight, context, prediction.loss_weight, self.tensor,
            )  # fmt: skip
            auxiliary = predicted if auxiliary is None else auxiliary + predicted
        if labels is None:
            return x, auxiliary
        hidden, labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
        if self.tensor.split:
            loss, _ = vocab_parallel_label_losses(
                hidden, self.head_weight, labels, self.tensor, recipe=self.head_recipe
            )
            return loss, auxiliary
        return linear_cross_entropy(hidden, self.head_weight, labels), auxiliary

    def hidden_states(self, input_ids: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """The final-normed hidden states (batch, seq, hidden) and the summed auxiliary loss
        (`context` takes the keyword arguments)."""
        return self.run_positions(
            0, len(self.layers) + 1, input_ids, self.context(input_ids, **kwargs)
        )

    def forward(self, input_ids: Tensor, logits_to_keep: int = 0, **kwargs: Any) -> Tensor:
        """Logits (batch, seq, vocab); of the last `logits_to_keep` positions only when it is
        positive (what generation reads of a prompt: its logits are never all formed). Under
        tensor parallelism, each rank's vocabulary slice gathered, without autograd."""
        if self.tensor.split and torch.is_grad_enabled():
            raise ValueError(
                "differentiable logits of a tensor-parallel model: merge it first "
                "(fastllm convert), or read them under torch.no_grad()"
            )
        hidden, _ = self.hidden_states(input_ids, **kwargs)
        if logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        logits = F.linear(hidden, self.head_weight)
        return gathered_vocabulary(logits, self.tensor) if self.tensor.split else logits

    def loss(self, input_ids: Tensor, labels: Tensor, **kwargs: Any) -> Tensor:
        context = self.context(input_ids, **kwargs)
        loss, auxiliary = self.run_positions(0, len(self.layers) + 1, input_ids, context, labels)
        return loss if auxiliary is None else loss + auxiliary


def _rotary_tables(config: RotaryConfig, head_size: int) -> Any:
    """The tables of a rotary component (its implementation built for `head_size`); None for
    one without (no rotary)."""
    if config.implementation is None:
        return None
    return registry.implementation(config)(config, head_size)
