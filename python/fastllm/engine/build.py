"""`build(config)`: the one seam where a config becomes an `Engine`. Every plug-in is applied
here, in this order, each by one call: the mesh, the model on the meta device, the frozen
parameters marked, its stages and their buffers, recomputation, activation offload, FP8,
compilation, the reference models, the step's program, the optimizer, and the initial or
pretrained weights."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from itertools import chain
from pathlib import Path

import torch

from fastllm.checkpoint import peft
from fastllm.checkpoint.compatibility import pretrained_tensors
from fastllm.checkpoint.formats import open_model
from fastllm.config import ConfigError, TrainerConfig
from fastllm.config.layout import RunLayout, StepShape, resolve
from fastllm.engine.activation_offload import apply_activation_offload
from fastllm.engine.batch import BatchPreparer
from fastllm.engine.checkpointing import TrainingState
from fastllm.engine.compile import apply_compile
from fastllm.engine.engine import Engine
from fastllm.engine.fp8 import apply_fp8
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.optimizer import AdamW
from fastllm.engine.precision import DTYPES, LossScaler
from fastllm.engine.recompute import apply_recompute
from fastllm.engine.reference import build_references
from fastllm.engine.schedule.runner import StepRunner
from fastllm.engine.weights_io import load_full_parameters, whole_shape
from fastllm.model import GPTModel
from fastllm.model.freeze import apply_freeze
from fastllm.model.init import initializers
from fastllm.parallel.mesh import build_mesh
from fastllm.parallel.process_group import Distributed, setup_distributed
from fastllm.parallel.tensor import DeferredWork
from fastllm_kernels.fp8.amax_history import AmaxHistories


def build(config: TrainerConfig, distributed: Distributed | None = None) -> Engine:
    """The engine of `config` on this process (`distributed`: default, from the launcher's
    environment)."""
    distributed = distributed or setup_distributed()
    device, dtype = distributed.device, DTYPES[config.model.distributed.training_dtype]
    multi_stage = config.model.multi_stage
    _seed_process(config, distributed)
    layout = resolve(config, distributed.world_size)
    # The weight gradients that tensor parallelism's backward collectives overlap: the stages'
    # gradient sinks queue them, the tensor dimension runs them.
    mesh = build_mesh(layout, distributed.rank).with_deferral(DeferredWork())
    with torch.device("meta"):
        model = GPTModel(config.model.base_model, mesh)
    apply_freeze(model, config.model.freeze, config.model.base_model.peft)
    whole = _whole_model_steps(layout)
    stages = ModelStages(
        model,
        compute_dtype=dtype,
        device=device,
        mesh=mesh,
        zero_stage=multi_stage.zero_stage,
        layers_per_stage=multi_stage.layers_per_stage,
        gather_in_forward=whole,
        offload_optimizer=multi_stage.offload_optimizer,
    )
    apply_recompute(model, multi_stage.recompute)
    offload = apply_activation_offload(model, multi_stage.offload_activations)
    fp8_histories = _apply_fp8(model, config, layout, device)
    if config.training.compile:
        apply_compile(model)
    # Those whose log-probabilities are precomputed run outside the step, when the data
    # loaders ask for them (training.reference_log_probs).
    in_step = set(config.reference_models) - config.model.base_model.head.precomputed_references
    references = build_references(
        config, in_step, mesh, device, None if whole else layout.num_stages
    )
    runner = StepRunner(
        model,
        stages,
        _step_shape(layout) if whole else layout.step,
        zero_stage=multi_stage.zero_stage,
        activation_shape=(
            layout.micro_batch_size,
            layout.piece_length,
            config.model.base_model.transformer.hidden_size,
        ),
        losses=config.model.base_model.head.active_losses(),
        references=references,
    )
    optimizer = AdamW(stages, config.optimizer)
    _initialize_weights(config, model, stages, device)
    return Engine(
        config=config,
        distributed=distributed,
        layout=layout,
        mesh=mesh,
        model=model,
        stages=stages,
        offload=offload,
        fp8_histories=fp8_histories,
        batches=BatchPreparer(
            data=mesh.data,
            sequence_data=mesh.sequence_data,
            splits=layout.micro_batch_splits,
            cross_document_attention=config.batch.cross_document_attention,
            device=device,
        ),
        runner=runner,
        optimizer=optimizer,
        scaler=LossScaler(dtype == torch.float16),
        state=TrainingState(),
        references=references,
    )


def _seed_process(config: TrainerConfig, distributed: Distributed) -> None:
    if distributed.device.type == "cpu":
        # Adam drives tiny values towards denormals, which slow x86 arithmetic tenfold.
        torch.set_flush_denormal(True)
    # torch seeds its global generators from OS entropy at start; nothing here draws from
    # them, but custom loops may, and checkpoints keep their state: the same in every run.
    torch.manual_seed(config.model.distributed.seed + distributed.rank)


def _whole_model_steps(layout: RunLayout) -> bool:
    """Each micro-batch runs through the whole model at once (no pipeline parallelism and no
    breadth-first micro-batches): the step's program has one stage."""
    return layout.pipeline == 1 and layout.breadth_first == 1


def _step_shape(layout: RunLayout) -> StepShape:
    """The step of one stage spanning the whole model."""
    return StepShape(
        num_stages=1,
        pipeline=1,
        breadth_first=1,
        depth_first=layout.depth_first,
        pieces=layout.micro_batch_splits,
    )


def _apply_fp8(
    model: GPTModel, config: TrainerConfig, layout: RunLayout, device: torch.device
) -> AmaxHistories | None:
    """FP8 linear layers, if configured; their amax histories under delayed scaling."""
    distributed = config.model.distributed
    if distributed.fp8_linear == "none":
        return None
    forwards = layout.depth_first * layout.breadth_first * config.schedule.micro_batch_splits
    return apply_fp8(
        model,
        distributed.fp8_linear,
        device,
        keep_copies=forwards > 1 or config.model.multi_stage.recompute == "full",
        delayed=distributed.fp8_scaling == "delayed",
        history_length=distributed.fp8_amax_history_length,
    )


@torch.no_grad()
def _initialize_weights(
    config: TrainerConfig, model: GPTModel, stages: ModelStages, device: torch.device
) -> None:
    # Every rank draws the same full fp32 model from the seed, one whole parameter at a time
    # (so a model only ZeRO-3 fits is never whole), and keeps its slice and shard: every
    # layout starts from the weights of the single-process run.
    generator = torch.Generator(device).manual_seed(config.model.distributed.seed)

    def drawn(names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, fill in initializers(model, generator):
            if names is not None and name not in names:
                continue
            tensor = torch.empty(whole_shape(stages, name), dtype=torch.float32, device=device)
            fill(tensor)
            yield name, tensor

    pretrained = config.pretrained
    if pretrained is None:
        load_full_parameters(stages, drawn())
        return
    source = open_model(pretrained.path, pretrained.format)
    base = config.model.base_model
    tensors, new_adapters = pretrained_tensors(source, base)
    if pretrained.adapter is not None:
        if not new_adapters:
            raise ConfigError("pretrained.adapter", f"{pretrained.path} holds adapters already")
        architecture = peft.architecture_for(base, source.hf_config)
        adapters = peft.adapter_tensors(Path(pretrained.adapter), base, architecture)
        load_full_parameters(stages, chain(tensors, adapters))
        return
    load_full_parameters(stages, chain(tensors, drawn(set(new_adapters))))
