"""The losses of the output head (`model.base_model.head.losses`), by name: each a mean over the
trained tokens of the hidden states it is given (DPO's over their preference pairs). Every one
runs through a fused chunked head: neither the model's logits nor a teacher's exist whole.
Under tensor parallelism the vocabulary is split and the vocab-parallel forms run.

A `head_loss` component of another package (config/registry.py) names a function as its
implementation, called as `loss(config, model, hidden, targets)`: `hidden` (tokens, hidden)
are the final-normed hidden states of this rank's micro-batch (or piece), `targets.labels`
their next-token labels (`labels.reshape(-1)` matches the rows; IGNORED: no loss),
`model.head_weight` the head (vocab-split over `model.tensor` under tensor parallelism, which
`LossConfig` refuses unless a loss's `unsupported_settings` say it handles it).
It returns the mean over the trained tokens, a differentiable scalar; the caller weights it
by its `weight` and the micro-batch's share of the trained tokens of the batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastllm.config import registry
from fastllm.config.model import (
    DistillationLossConfig,
    DPOLossConfig,
    LabelLossConfig,
    Loss,
    ZLossConfig,
)
from fastllm.model.gpt import GPTModel
from fastllm.parallel.vocab_parallel_losses import (
    vocab_parallel_distillation,
    vocab_parallel_dpo,
    vocab_parallel_label_losses,
    vocab_parallel_sequence_log_probs,
)
from fastllm_kernels.cross_entropy import linear_label_losses
from fastllm_kernels.distillation import linear_distillation
from fastllm_kernels.preference import dpo_metrics, linear_dpo, linear_sequence_log_probs

IGNORED = -100


@dataclass(frozen=True)
class Teacher:
    """What a reference model gives the losses for the same tokens: its final-normed hidden
    states and its head (distillation), or its span log-probabilities (DPO)."""

    hidden: Tensor | None = None
    head_weight: Tensor | None = None
    log_probs: Tensor | None = None


@dataclass(frozen=True)
class HeadTargets:
    labels: Tensor
    """Next-token labels (IGNORED: no loss)."""
    teachers: Mapping[str, Teacher] = field(default_factory=dict)
    """By reference model name."""
    spans: Tensor | None = None
    """Preference pairs: the span of each label (`engine.batch.Pairs.spans`)."""


def sequence_log_probs(
    model: GPTModel, hidden: Tensor, labels: Tensor, spans: Tensor, num_spans: int
) -> Tensor:
    """The summed label log-probabilities of each of the `num_spans` spans (2 a pair: chosen,
    rejected) of `hidden` under `model`'s head, without autograd (a reference model's); with
    sequence-data parallelism, over the chunks of every rank of the group."""
    log_probs = _chunk_log_probs(model, hidden.detach(), labels, spans, num_spans)
    return model.sequence_data.sum_chunks(log_probs)


def _chunk_log_probs(
    model: GPTModel, hidden: Tensor, labels: Tensor, spans: Tensor, num_spans: int
) -> Tensor:
    rows, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if model.tensor.split:
        return vocab_parallel_sequence_log_probs(
            rows, model.head_weight, labels, spans, num_spans, model.tensor
        )
    return linear_sequence_log_probs(rows, model.head_weight, labels, spans, num_spans)


def _dpo(
    model: GPTModel, rows: Tensor, labels: Tensor, spans: Tensor, reference: Tensor,
    loss: DPOLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """DPO's loss and metrics on `rows`; with sequence-data parallelism, those of the whole
    answers, split over the chunks of the group's ranks."""
    tensor, weight = model.tensor, model.head_weight
    sequence_data = model.sequence_data
    if sequence_data.split:
        # The fused head forms each answer's gradient once its log-probability is whole: it is
        # given those of the other chunks (an extra pass of the head over this chunk's answer
        # tokens, and one all-reduce) folded into the reference's, which only the margin reads.
        mine = _chunk_log_probs(model, rows.detach(), labels, spans, reference.shape[0])
        whole = sequence_data.sum_chunks(mine.clone())
        policy_reference = reference - (whole - mine)
    else:
        policy_reference = reference
    dpo = (loss.beta, loss.label_smoothing, loss.loss_type)
    if tensor.split:
        value, metrics = vocab_parallel_dpo(
            rows, weight, labels, spans, policy_reference, tensor, *dpo, recipe=model.head_recipe
        )
    else:
        value, metrics = linear_dpo(rows, weight, labels, spans, policy_reference, *dpo)
    if not sequence_data.split:
        return value, metrics
    # Every rank of the group holds the whole loss, weighted by 1/size of its pairs' share; its
    # gradient, which reaches this rank's chunk only, counts size times (the backward pass of
    # the all-reduce).
    size = sequence_data.size
    return size * value - (size - 1) * value.detach(), dpo_metrics(whole, reference, loss.beta)


def head_losses(
    model: GPTModel,
    hidden: Tensor,
    targets: HeadTargets,
    losses: Mapping[str, Loss],
    weights: Mapping[str, float],
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """The losses of `losses` on the final-normed `hidden` (batch, sequence, hidden): their sum,
    each times its `weights` entry, differentiable; each loss's value, detached; and the
    metrics of those that report some (DPO's, under TRL's names). The label losses and z-losses
    come from one pass over the logits."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    labels = targets.labels.reshape(-1)
    tensor, weight = model.tensor, model.head_weight
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    values: dict[str, Tensor] = {}
    metrics: dict[str, Tensor] = {}
    label = [name for name, loss in losses.items() if isinstance(loss, LabelLossConfig)]
    z = [name for name, loss in losses.items() if isinstance(loss, ZLossConfig)]
    if label or z:
        label_weights = {
            "label_weight": sum(weights[name] for name in label),
            "z_loss": sum(weights[name] for name in z),
        }
        if tensor.split:
            part, parts = vocab_parallel_label_losses(
                rows, weight, labels, tensor, recipe=model.head_recipe, **label_weights
            )
        else:
            part, parts = linear_label_losses(rows, weight, labels, **label_weights)
        total = total + part
        values |= dict.fromkeys(label, parts[0]) | dict.fromkeys(z, parts[1])
    for name, loss in losses.items():
        if isinstance(loss, LabelLossConfig | ZLossConfig):
            continue
        if isinstance(loss, DistillationLossConfig):
            teacher = targets.teachers[loss.reference_model]
            assert teacher.hidden is not None and teacher.head_weight is not None
            teacher_rows = teacher.hidden.reshape(-1, teacher.hidden.shape[-1])
            inputs = (rows, weight, teacher_rows, teacher.head_weight, labels != IGNORED)
            options = {"temperature": loss.temperature, "loss_type": loss.loss_type}
            if tensor.split:
                value = vocab_parallel_distillation(
                    *inputs, tensor, recipe=model.head_recipe, **options
                )
            else:
                value = linear_distillation(*inputs, **options)
        elif isinstance(loss, DPOLossConfig):
            reference = targets.teachers[loss.reference_model].log_probs
            assert targets.spans is not None and reference is not None
            value, metrics = _dpo(model, rows, labels, targets.spans, reference, loss)
        else:
            value = registry.implementation(loss)(loss, model, rows, targets)
        total = total + weights[name] * value
        values[name] = value.detach()
    return total, values, metrics
