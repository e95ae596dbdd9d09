"""Reference models (`reference_models`): frozen models run beside the trained one, forward
passes only, what the head losses read of them handed over: a distillation teacher's final
hidden states, a DPO reference's log-probabilities of each answer. Each is a `GPTModel` of its checkpoint's architecture on the trained
model's mesh (tensor-parallel slices, ZeRO-3 shards), all of its parameters in weights-only
buffers: no gradients, no optimizer state, no autograd graph."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import msgspec
import torch
from torch import Tensor

from fastllm.checkpoint import peft
from fastllm.checkpoint.formats import open_model
from fastllm.config.model import HeadConfig
from fastllm.config.trainer import ReferenceModelConfig, TrainerConfig
from fastllm.engine.batch import Pairs
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.precision import DTYPES
from fastllm.engine.weights_io import load_full_parameters
from fastllm.model.gpt import GPTModel
from fastllm.model.head_losses import Teacher, sequence_log_probs
from fastllm.model.parameters import freeze
from fastllm.parallel.mesh import ParallelMesh


@dataclass
class ReferenceModel:
    model: GPTModel
    stages: ModelStages

    @torch.no_grad()
    def teacher(
        self,
        input_ids: Tensor,
        labels: Tensor,
        document_ids: Tensor | None,
        pairs: Pairs | None,
        *,
        hidden: bool,
    ) -> Teacher:
        """What the losses read of it for these tokens: with `hidden`, its final-normed hidden
        states and its head; for preference `pairs`, each answer's log-probability."""
        model = self.model
        context = model.context(
            input_ids,
            document_ids=document_ids,
            position_ids=None if pairs is None else pairs.positions,
            branch_ids=None if pairs is None else pairs.parts,
        )
        states, _ = model.run_positions(0, len(model.layers) + 1, input_ids, context)
        log_probs = None
        if pairs is not None:
            log_probs = sequence_log_probs(model, states, labels, pairs.spans, 2 * pairs.count)
        if not hidden:
            return Teacher(log_probs=log_probs)
        return Teacher(states, model.head_weight, log_probs)

    def release(self) -> None:
        """ZeRO-3: free its gathered weights (once the losses have read its head)."""
        self.stages.release_weights()


def build_references(
    config: TrainerConfig, names: Collection[str], mesh: ParallelMesh, device: torch.device
) -> dict[str, ReferenceModel]:
    """The reference models `names` of `config.reference_models` on this rank, under the
    trained model's layout, their weights loaded (every rank calls it)."""
    multi_stage = config.model.multi_stage
    return {
        name: build_reference(
            reference,
            mesh,
            compute_dtype=DTYPES[config.model.distributed.training_dtype],
            device=device,
            zero_stage=multi_stage.zero_stage,
            layers_per_stage=multi_stage.layers_per_stage,
        )
        for name, reference in config.reference_models.items()
        if name in names
    }


def build_reference(
    config: ReferenceModelConfig,
    mesh: ParallelMesh,
    *,
    compute_dtype: torch.dtype,
    device: torch.device,
    zero_stage: int,
    layers_per_stage: int,
) -> ReferenceModel:
    """The reference model of `config` on this rank, its weights loaded."""
    pretrained = config.pretrained
    source = open_model(pretrained.path, pretrained.format)
    architecture = msgspec.structs.replace(source.config, head=HeadConfig())  # no losses of its own
    adapters: Iterator[tuple[str, Tensor]] = iter(())
    if pretrained.adapter is not None:
        architecture, adapters = peft.with_adapter(
            architecture, source.hf_config, Path(pretrained.adapter)
        )
    with torch.device("meta"):
        model = GPTModel(architecture, mesh)
    freeze(model)
    stages = ModelStages(
        model,
        compute_dtype=compute_dtype,
        device=device,
        mesh=mesh,
        zero_stage=zero_stage,
        layers_per_stage=layers_per_stage,
        gather_in_forward=True,
    )
    load_full_parameters(stages, chain(source.tensors(), adapters))
    model.eval()
    return ReferenceModel(model, stages)
