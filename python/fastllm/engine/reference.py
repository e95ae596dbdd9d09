"""Reference models (`reference_models`): frozen models run beside the trained one, forward
passes only, what the head losses read of them handed over: a distillation teacher's final
hidden states, a DPO reference's log-probabilities of each answer. Each is a `GPTModel` of
its checkpoint's architecture on the trained model's mesh (tensor-parallel slices, ZeRO-3
shards), all of its parameters in weights-only buffers: no gradients, no optimizer state, no
autograd graph. When the trained model's steps run stage by stage (pipeline parallelism,
breadth-first micro-batches), a reference's blocks are spread over as many stages, each
pipeline rank holding its own, and each of its stages runs on a micro-batch just before the
trained model's same stage does, its output handed on with theirs (`engine.schedule.runner`).
With `schedule.micro_batch_splits`, it runs the trained model's pieces, reading the keys and
values of the earlier ones, as they do."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from fractions import Fraction
from itertools import chain
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor

from fastllm.checkpoint import peft
from fastllm.checkpoint.formats import ModelSource, open_model
from fastllm.config import ConfigError
from fastllm.config.model import HeadConfig
from fastllm.config.trainer import TrainerConfig
from fastllm.engine.batch import Pairs
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.precision import DTYPES
from fastllm.engine.stages import stages_read
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
    def run(
        self,
        stage: int | None,
        x: Tensor,
        input_ids: Tensor,
        document_ids: Tensor | None,
        pairs: Pairs | None,
        cache: Any = None,
    ) -> Tensor:
        """Its `stage` (None: the whole model) on `x`: the token ids at the first stage, else
        what the previous stage handed on; a stage gathers its ZeRO-3 weights first (the whole
        model: its stages' hooks do). `cache`: the keys and values of the earlier pieces of
        the micro-batch (`engine.micro_sequences`), its own. Returns the residual stream, or
        through the last stage its final-normed hidden states."""
        model = self.model
        first, last = 0, len(model.layers) + 1
        if stage is not None:
            first, last = self.stages.stages[stage].positions
            for needed in self._reads(stage):
                self.stages.wait_for_weights(needed)
        context = model.context(
            input_ids,
            document_ids=document_ids,
            cache=cache,
            position_ids=None if pairs is None else pairs.positions,
            branch_ids=None if pairs is None else pairs.parts,
        )
        return model.run_positions(first, last, x, context)[0]

    @torch.no_grad()
    def teacher(
        self, states: Tensor, labels: Tensor, pairs: Pairs | None, *, hidden: bool
    ) -> Teacher:
        """What the losses read of its final-normed hidden `states`: with `hidden`, them and
        its head; for preference `pairs`, each answer's log-probability."""
        model = self.model
        log_probs = None
        if pairs is not None:
            log_probs = sequence_log_probs(model, states, labels, pairs.spans, 2 * pairs.count)
        if not hidden:
            return Teacher(log_probs=log_probs)
        return Teacher(states, model.head_weight, log_probs)

    def release(self) -> None:
        """ZeRO-3: free its gathered weights (once the losses have read its head)."""
        self.stages.release_weights()

    def _reads(self, stage: int) -> set[int]:
        """The stages whose weights its `stage` reads (a head tied to the embedding on this
        rank: stage 0's too)."""
        frozen = self.stages.frozen
        tied_here = frozen is not None and frozen.buffers.tied and self.stages.frozen_tied is None
        return stages_read(stage, len(self.stages.stages), tied_here)


def build_references(
    config: TrainerConfig,
    names: Collection[str],
    mesh: ParallelMesh,
    device: torch.device,
    num_stages: int | None = None,
) -> dict[str, ReferenceModel]:
    """The reference models `names` of `config.reference_models` on this rank, under the
    trained model's layout, their weights loaded (every rank calls it). `num_stages`: the
    trained model's stages, when its steps run them one at a time (None: whole)."""
    multi_stage = config.model.multi_stage
    references = {}
    for name, reference in config.reference_models.items():
        if name not in names:
            continue
        pretrained = reference.pretrained
        references[name] = frozen_model(
            open_model(pretrained.path, pretrained.format),
            None if pretrained.adapter is None else Path(pretrained.adapter),
            mesh,
            compute_dtype=DTYPES[config.model.distributed.training_dtype],
            device=device,
            zero_stage=multi_stage.zero_stage,
            layers_per_stage=multi_stage.layers_per_stage,
            num_stages=num_stages,
            key=f"reference_models.{name}",
        )
    return references


def frozen_model(
    source: ModelSource,
    adapter: Path | None,
    mesh: ParallelMesh,
    *,
    compute_dtype: torch.dtype,
    device: torch.device,
    zero_stage: int,
    layers_per_stage: int,
    num_stages: int | None = None,
    key: str = "pretrained",
) -> ReferenceModel:
    """The model of `source` (with the PEFT adapter in directory `adapter`) on this rank of
    `mesh`, every parameter in weights-only buffers, its weights loaded. With `num_stages`
    (a trained model's, run one at a time), its blocks are spread over as many stages, each
    pipeline rank holding those of its own; else its stages are of `layers_per_stage` blocks,
    as the trained model's (units of the ZeRO-3 gathers). `key`: the config key an error
    names."""
    architecture = msgspec.structs.replace(source.config, head=HeadConfig())  # no losses of its own
    adapters: Iterator[tuple[str, Tensor]] = iter(())
    if adapter is not None:
        architecture, adapters = peft.with_adapter(architecture, source.hf_config, adapter)
    num_layers = architecture.transformer.num_layers
    if num_stages is not None:
        if num_layers < num_stages:
            raise ConfigError(
                key,
                f"its {num_layers} blocks are fewer than the trained model's {num_stages} "
                "stages, over which they are spread",
            )
        layers_per_stage = Fraction(num_layers, num_stages)
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
        gather_in_forward=num_stages is None,
    )
    load_full_parameters(stages, chain(source.tensors(), adapters))
    model.eval()
    return ReferenceModel(model, stages)
