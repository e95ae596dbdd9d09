"""The losses of the output head (`model.base_model.head.losses`), each a mean over the trained
tokens of the hidden states it is given, by name. Every one runs through a fused chunked head:
neither the model's logits nor a teacher's exist whole. Under tensor parallelism the vocabulary
is split and the vocab-parallel forms run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import Tensor

from fastllm.config.model import DistillationLossConfig, LabelLossConfig, Loss
from fastllm.model.gpt import GPTModel
from fastllm.parallel.tensor import vocab_parallel_cross_entropy
from fastllm.parallel.vocab_parallel_losses import vocab_parallel_distillation
from fastllm_kernels.cross_entropy import linear_cross_entropy
from fastllm_kernels.distillation import linear_distillation

IGNORED = -100


@dataclass(frozen=True)
class Teacher:
    """A reference model's final-normed hidden states for the same tokens, and its head."""

    hidden: Tensor
    head_weight: Tensor


@dataclass(frozen=True)
class HeadTargets:
    labels: Tensor
    """Next-token labels (IGNORED: no loss)."""
    teachers: Mapping[str, Teacher] = field(default_factory=dict)
    """By reference model name."""


def head_losses(
    model: GPTModel, hidden: Tensor, targets: HeadTargets, losses: Mapping[str, Loss]
) -> dict[str, Tensor]:
    """Each loss of `losses` on the final-normed `hidden` (batch, sequence, hidden)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    labels = targets.labels.reshape(-1)
    tensor, weight = model.tensor, model.head_weight
    values = {}
    for name, loss in losses.items():
        if isinstance(loss, LabelLossConfig):
            values[name] = (
                vocab_parallel_cross_entropy(rows, weight, labels, tensor, recipe=model.head_recipe)
                if tensor.split
                else linear_cross_entropy(rows, weight, labels)
            )
        elif isinstance(loss, DistillationLossConfig):
            teacher = targets.teachers[loss.reference_model]
            teacher_rows = teacher.hidden.reshape(-1, teacher.hidden.shape[-1])
            inputs = (rows, weight, teacher_rows, teacher.head_weight, labels != IGNORED)
            options = {"temperature": loss.temperature, "loss_type": loss.loss_type}
            if tensor.split:
                values[name] = vocab_parallel_distillation(
                    *inputs, tensor, recipe=model.head_recipe, **options
                )
            else:
                values[name] = linear_distillation(*inputs, **options)
        else:
            raise TypeError(f"unknown loss {loss!r}")
    return values
