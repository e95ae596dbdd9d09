"""A training run: the model on flat buffers, AdamW, the loss scale and the data position.

Custom loops use the parts (`data_loader`, `train_step` or `forward_backward` +
`optimizer_step`, `save_checkpoint`, `load_checkpoint`); `fit` is what `fastllm train` runs."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from fastllm.checkpoint.formats import open_model
from fastllm.checkpoint.saver import CheckpointSaver, remove_partials
from fastllm.config import ConfigError, TrainerConfig
from fastllm.config.flops import flops_per_token
from fastllm.config.layout import resolve
from fastllm.data import Batch, DataLoader, SampleStream
from fastllm.engine.activation_offload import apply_activation_offload
from fastllm.engine.compile import apply_compile
from fastllm.engine.data_parallel import gather_weights
from fastllm.engine.fp8 import apply_fp8
from fastllm.engine.learning_rate import learning_rate
from fastllm.engine.micro_sequences import KeyValueMemory, PieceCache, cut_into_pieces
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.optimizer import AdamW
from fastllm.engine.pipeline.runner import MicroBatch, PipelineRunner
from fastllm.engine.precision import DTYPES, LossScaler
from fastllm.engine.recompute import apply_recompute
from fastllm.engine.replicated_check import check_replicated
from fastllm.engine.weights_io import load_full_parameters, whole_shape
from fastllm.model import GPTModel
from fastllm.model.init import initializers
from fastllm.model.mlp import take_expert_load
from fastllm.parallel.mesh import build_mesh
from fastllm.parallel.process_group import Distributed, setup_distributed
from fastllm.parallel.tensor import DeferredWork
from fastllm.training import state
from fastllm.training.experiment_lock import ExperimentLock
from fastllm.training.metrics import PEAK_FLOPS, MetricsLogger
from fastllm.training.profiling import StepProfiler
from fastllm_kernels.fp8.amax_history import AmaxHistories


class Trainer:
    def __init__(self, config: TrainerConfig, distributed: Distributed | None = None) -> None:
        self.config = config
        self.distributed = distributed or setup_distributed()
        device, dtype = self.distributed.device, DTYPES[config.model.distributed.training_dtype]
        if device.type == "cpu":
            # Adam drives tiny values towards denormals, which slow x86 arithmetic tenfold.
            torch.set_flush_denormal(True)
        # torch seeds its global generators from OS entropy at start; nothing here draws from
        # them, but custom loops may, and checkpoints keep their state: the same in every run.
        torch.manual_seed(config.model.distributed.seed + self.distributed.rank)
        self.layout = resolve(config, self.distributed.world_size)
        """Every size of the run: the mesh's, the step's micro-batches and stages."""
        # The weight gradients that tensor parallelism's backward collectives overlap: the flat
        # model's gradient sinks queue them, the tensor dimension runs them.
        self.deferred = DeferredWork()
        self.mesh = build_mesh(self.layout, self.distributed.rank).with_deferral(self.deferred)
        with torch.device("meta"):
            self.model = GPTModel(config.model.base_model, self.mesh)
        multi_stage = config.model.multi_stage
        pipelined = self.layout.pipeline > 1 or self.layout.breadth_first > 1
        self.stages = ModelStages(
            self.model,
            compute_dtype=dtype,
            device=device,
            mesh=self.mesh,
            zero_stage=multi_stage.zero_stage,
            layers_per_stage=multi_stage.layers_per_stage,
            gather_in_forward=not pipelined,
        )
        apply_recompute(self.model, multi_stage.recompute)
        self.offload = apply_activation_offload(self.model, multi_stage.offload_activations)
        self.fp8_histories = self._apply_fp8(device)
        if config.training.compile:
            apply_compile(self.model)
        self.pipeline: PipelineRunner | None = None
        """Runs the steps stage by stage (pipeline parallelism or breadth-first micro-batches);
        None: each micro-batch's forward and backward pass whole, in turn."""
        if pipelined:
            self.pipeline = PipelineRunner(
                self.model,
                self.stages,
                self.layout.step,
                zero_stage=multi_stage.zero_stage,
                activation_shape=(
                    self.layout.micro_batch_size,
                    self.layout.piece_length,
                    config.model.base_model.transformer.hidden_size,
                ),
            )
        self.optimizer = AdamW(self.stages, config.optimizer)
        self.scaler = LossScaler(dtype == torch.float16)
        self.step = 0
        """Optimizer steps completed (skipped ones included)."""
        self.consumed_samples = 0
        self.skipped_steps = 0
        self.checkpoints = CheckpointSaver(
            self.distributed.rank, self.distributed.world_size, device
        )
        self._initialize_weights()

    def _apply_fp8(self, device: torch.device) -> AmaxHistories | None:
        """FP8 linear layers, if configured; their amax histories under delayed scaling."""
        config = self.config
        distributed = config.model.distributed
        if distributed.fp8_linear == "none":
            return None
        forwards = self.layout.depth_first * self.layout.breadth_first
        forwards *= config.schedule.micro_batch_splits
        return apply_fp8(
            self.model,
            distributed.fp8_linear,
            device,
            keep_copies=forwards > 1 or config.model.multi_stage.recompute == "full",
            delayed=distributed.fp8_scaling == "delayed",
            history_length=distributed.fp8_amax_history_length,
        )

    @property
    def experiment_dir(self) -> Path:
        if self.config.run.experiment_dir is None:
            raise ConfigError("run.experiment_dir", "is required to train")
        return Path(self.config.run.experiment_dir)

    @torch.no_grad()
    def _initialize_weights(self) -> None:
        pretrained = self.config.pretrained
        if pretrained is not None:
            source = open_model(pretrained.path, pretrained.format)
            load_full_parameters(self.stages, source.tensors())
            return
        # Every rank draws the same full fp32 model from the seed, one whole parameter at a time
        # (so a model only ZeRO-3 fits is never whole), and keeps its slice and shard: every
        # layout starts from the weights of the single-process run.
        device = self.distributed.device
        generator = torch.Generator(device).manual_seed(self.config.model.distributed.seed)

        def drawn() -> Iterator[tuple[str, torch.Tensor]]:
            for name, fill in initializers(self.model, generator):
                shape = whole_shape(self.stages, name)
                tensor = torch.empty(shape, dtype=torch.float32, device=device)
                fill(tensor)
                yield name, tensor

        load_full_parameters(self.stages, drawn())

    # --- data ---------------------------------------------------------------------------------

    def sample_stream(self, paths: list[str], num_samples: int, key: str) -> SampleStream:
        data = self.config.data
        cache = data.cache_dir or str(self.experiment_dir / "cache" / "sampling")
        return SampleStream(
            paths,
            data,
            sequence_length=self.config.batch.sequence_length,
            num_samples=num_samples,
            seed=self.config.model.distributed.seed,
            cache_dir=cache,
            weights=data.weights if key == "data.path" else None,
            key=key,
            vocab_size=self.config.model.base_model.vocab_size,
        )

    def data_loader(self) -> DataLoader:
        """Training batches from the current data position to the end of training."""
        stream = self.sample_stream(
            self.config.data.path,
            self.config.training.train_iters * self.config.batch.batch_size,
            "data.path",
        )
        return self._loader(stream, self.consumed_samples)

    def _loader(self, stream: SampleStream, consumed_samples: int = 0) -> DataLoader:
        """This rank's share of each batch of `stream`, in micro-batches (whole sequences: the
        ranks of a sequence-data group share them, and `_loss` takes this rank's chunk)."""
        batch, data = self.config.batch, self.mesh.sample_groups
        return DataLoader(
            stream,
            batch_size=batch.batch_size,
            micro_batch_size=self.layout.micro_batch_size,
            rank=data.rank,
            world_size=data.size,
            consumed_samples=consumed_samples,
            prefetch=self.config.data.prefetch,
        )

    def _loss(self, batch: Batch) -> torch.Tensor:
        """Mean loss over the micro-batch's trained tokens (this rank's chunk of them); with
        `schedule.micro_batch_splits`, the pieces' mean losses weighted by their tokens."""
        input_ids, labels, documents = self._on_device(batch)
        splits = self.config.schedule.micro_batch_splits
        if splits == 1:
            return self.model.loss(input_ids, labels, document_ids=documents)
        memory = KeyValueMemory()
        total = torch.zeros((), device=input_ids.device)
        for ids, piece_labels, piece_documents in cut_into_pieces(
            input_ids, labels, documents, splits
        ):
            loss = self.model.loss(ids, piece_labels, document_ids=piece_documents, cache=memory)
            total = total + loss * (piece_labels != -100).sum()
        return total / (labels != -100).sum().clamp(min=1)

    def _on_device(self, batch: Batch) -> MicroBatch:
        device = self.distributed.device
        return (
            self.mesh.sequence_data.chunk(batch.input_ids).to(device, non_blocking=True),
            self.mesh.sequence_data.chunk(batch.labels).to(device, non_blocking=True),
            self._attention_documents(batch),
        )

    def _pieces(self, batch: Batch) -> list[MicroBatch]:
        """The micro-batch on the device, in its `schedule.micro_batch_splits` pieces."""
        return cut_into_pieces(*self._on_device(batch), self.config.schedule.micro_batch_splits)

    def _piece_shares(self, micro_batches: list[Batch], shares: list[float]) -> list[list[float]]:
        """Each piece's share of the batch's trained tokens: its micro-batch's, split by the
        pieces' trained tokens."""
        splits, result = self.config.schedule.micro_batch_splits, []
        if splits == 1:
            return [[share] for share in shares]
        for batch, share in zip(micro_batches, shares, strict=True):
            trained = (self.mesh.sequence_data.chunk(batch.labels) != -100).reshape(
                batch.labels.shape[0], splits, -1
            )
            counts = trained.sum(dim=(0, 2)).tolist()
            total = sum(counts)
            result.append([share * count / total if total else 0.0 for count in counts])
        return result

    def _context(self, micro_batch: MicroBatch, cache: PieceCache | None):
        input_ids, _, documents = micro_batch
        return self.model.context(input_ids, document_ids=documents, cache=cache)

    def _attention_documents(self, batch: Batch) -> torch.Tensor | None:
        """The document ids attention must keep within, on the device; None when it may cross
        documents (`batch.cross_document_attention`) or each sequence is a single document,
        where plain causal attention (the fastest kernels) is the same. With sequence-data
        parallelism, those of the sequences up to the end of this rank's chunk."""
        ids = batch.document_ids
        if self.config.batch.cross_document_attention or bool((ids == ids[:, :1]).all()):
            return None
        return self.mesh.sequence_data.prefix(ids).to(self.distributed.device, non_blocking=True)

    # --- steps --------------------------------------------------------------------------------

    def forward_backward(
        self, batch: Batch, weight: float = 1.0, last: bool = False
    ) -> torch.Tensor:
        """Loss of one micro-batch; its gradient, times `weight`, is added to the flat buffer
        and summed over data-parallel ranks (the weights of a step's micro-batches on all
        ranks should sum to 1: `token_shares`).
        `last`: the step's last micro-batch, whose backward pass then also sums the gradients
        over data-parallel ranks (ZeRO-1), overlapping it; otherwise `optimizer_step` does.
        Not with pipeline parallelism or breadth-first micro-batches: `train_step` runs the
        whole step's schedule then."""
        if self.pipeline is not None:
            raise RuntimeError(
                "forward_backward runs one micro-batch whole: with model.distributed."
                "pipeline_parallel > 1 or schedule.breadth_first_micro_batches > 1, use "
                "train_step, which runs the step's schedule"
            )
        loss = self._loss(batch)
        self.stages.start_backward(last)
        (loss * (weight * self.scaler.scale)).backward()
        self.stages.finish_backward()
        return loss.detach()

    def optimizer_step(self) -> dict[str, Any]:
        """Clip, update (unless the gradient is not finite) and advance the schedule."""
        lr = learning_rate(
            self.config.optimizer.learning_rate, self.step, self.config.training.train_iters
        )
        # The step sums the gradients over data ranks first (ModelStages.reduce_gradients); the
        # micro-batches' weights already normalize that sum (train_step).
        report = self.optimizer.step(lr, self.scaler.scale)
        if self.fp8_histories is not None:
            self.fp8_histories.roll()
        if not report.skipped:
            gather_weights(self.stages, wait=False)  # each stage's forward pass waits for its own
            if self.config.model.multi_stage.debug_tensor_parallel:
                check_replicated(self.stages.dense.buffers)
        self.scaler.update(report.skipped)
        self.step += 1
        self.skipped_steps += report.skipped
        self.stages.zero_grad()
        return {"lr": lr, "grad_norm": report.grad_norm, "skipped": report.skipped}

    def train_step(self, micro_batches: list[Batch]) -> dict[str, Any]:
        """One optimizer step over the micro-batches of this rank's share of a batch. Its loss
        is the mean over the trained tokens of the whole global batch, whatever the
        micro-batching and the data-parallel split: each micro-batch's mean loss is weighted
        by its share of the batch's trained tokens."""
        shares = self.token_shares(micro_batches)
        if self.pipeline is not None:
            inputs = [self._pieces(batch) for batch in micro_batches]
            weights = self._piece_shares(micro_batches, shares)
            weighted = self.pipeline.run(inputs, weights, self.scaler.scale, self._context)
            loss = self._data_sum(self._pipeline_sum(weighted))
        else:
            losses = [
                self.forward_backward(batch, share, last=i == len(micro_batches) - 1)
                for i, (batch, share) in enumerate(zip(micro_batches, shares, strict=True))
            ]
            weighted = sum(share * loss for share, loss in zip(shares, losses, strict=True))
            loss = self._data_sum(weighted)
        metrics = self.optimizer_step()
        self.consumed_samples += self.config.batch.batch_size
        return {"loss": loss.item(), **metrics}

    def token_shares(self, micro_batches: list[Batch]) -> list[float]:
        """Each micro-batch's trained tokens (in this rank's chunk of its sequences) over those
        of the global batch (over every data rank); zeros when the batch trains no token."""
        sdp = self.mesh.sequence_data
        counts = [int((sdp.chunk(batch.labels) != -100).sum()) for batch in micro_batches]
        total = float(sum(counts))
        if self.mesh.data.size > 1:
            total = self._data_sum(torch.tensor(total, device=self.distributed.device)).item()
        return [count / total if total else 0.0 for count in counts]

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """Mean loss over the trained tokens of `training.validation.iterations` batches of the
        validation data."""
        data, batch = self.config.data, self.config.batch
        if not data.validation_path:
            return None
        iterations = self.config.training.validation.iterations
        stream = self.sample_stream(
            data.validation_path, iterations * batch.batch_size, "data.validation_path"
        )
        micro_batches = [b for step in self._loader(stream) for b in step]
        shares = self.token_shares(micro_batches)
        self.model.eval()
        try:
            if self.pipeline is not None:
                inputs = [self._pieces(batch) for batch in micro_batches]
                weights = self._piece_shares(micro_batches, shares)
                total = self._pipeline_sum(self.pipeline.evaluate(inputs, weights, self._context))
            else:
                pairs = zip(micro_batches, shares, strict=True)
                total = torch.stack([share * self._loss(b) for b, share in pairs]).sum()
        finally:
            self.model.train()
        return self._data_sum(total).item()

    def _pipeline_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the pipeline ranks (each holds its stages' part of the loss)."""
        pipeline = self.mesh.pipeline
        if pipeline.size > 1:
            dist.all_reduce(value, group=pipeline.group)
        return value

    def _expert_load(self, steps: int) -> dict[str, float]:
        """Tokens routed per expert and step since the last call, over every data rank: the
        most any expert of any layer got, and the mean (what a balanced router gives each)."""
        load = take_expert_load(self.model)
        if load is None or not steps:
            return {}
        load = self._data_sum(load).double() / steps
        most = load.max()
        total = torch.stack(
            [load.sum(), torch.tensor(load.numel(), dtype=load.dtype, device=load.device)]
        )
        pipeline = self.mesh.pipeline
        if pipeline.size > 1:  # each pipeline rank counted the layers of its stages
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=pipeline.group)
            dist.all_reduce(total, group=pipeline.group)
        return {
            "expert_tokens_max": most.item(),
            "expert_tokens_mean": (total[0] / total[1]).item(),
        }

    def _data_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the data-parallel ranks (tensor ranks agree on it)."""
        data = self.mesh.data
        if data.size > 1:
            dist.all_reduce(value, group=data.group)
        return value

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, directory: Path | None = None) -> Path:
        """Write a checkpoint of the whole training state (in the background); returns its
        directory (default EXPERIMENT_DIR/checkpoint/STEP)."""
        return state.save_checkpoint(self, directory)

    def wait_for_checkpoints(self) -> None:
        """Block until every checkpoint in flight is written and committed."""
        self.checkpoints.wait()

    def load_checkpoint(self, directory: Path) -> None:
        state.load_checkpoint(self, directory)

    def resume(self) -> Path | None:
        """Load the newest complete checkpoint of the experiment, if there is one."""
        return state.resume(self)

    def _describe(self) -> str:
        """One line: the model, where and how it trains."""
        config, distributed, mesh = self.config, self.distributed, self.mesh
        batch, stages, layout = config.batch, config.model.multi_stage, self.layout
        micro = layout.micro_batch_size
        accumulated = (
            f"{layout.depth_first} accumulated"
            if layout.breadth_first == 1
            else f"{layout.depth_first} × {layout.breadth_first} breadth-first"
        )
        base = config.model.base_model
        total, active = base.num_parameters(), base.num_parameters(active=True)
        parts = [
            f"{total:,} parameters" + (f" ({active:,} active per token)" if active < total else ""),
            f"{distributed.world_size} × {distributed.device.type}",
            f"{config.model.distributed.training_dtype}"
            + (" (fp32 masters)" if self.stages.mixed_precision else ""),
            f"batch {batch.batch_size} × {batch.sequence_length} tokens"
            f" ({micro} per micro-batch, {accumulated})",
        ]
        if config.model.distributed.fp8_linear != "none":
            delayed = " (delayed scaling)" if self.fp8_histories is not None else ""
            parts.append(f"{config.model.distributed.fp8_linear}{delayed} FP8 linear layers")
        if mesh.tensor.size > 1:
            sequence = " with sequence parallelism" if mesh.tensor.sequence_tensor_parallel else ""
            parts.append(f"tensor parallel {mesh.tensor.size}{sequence}")
        if mesh.pipeline.size > 1:
            parts.append(
                f"pipeline parallel {mesh.pipeline.size} ({layout.num_stages} stages, "
                f"{config.schedule.order.replace('_', '-')})"
            )
        if mesh.data.size > 1:
            parts.append(
                f"data parallel {mesh.data.size}, ZeRO-{stages.zero_stage}, "
                f"{stages.layers_per_stage} layer(s)/stage"
            )
        if mesh.sequence_data.size > 1:
            chunks = config.model.distributed.sequence_data_chunking.replace("_", "-")
            parts.append(f"sequence-data parallel {mesh.sequence_data.size} ({chunks} chunks)")
        if mesh.expert.size > 1:
            parts.append(f"expert parallel {mesh.expert.size}")
        if config.schedule.micro_batch_splits > 1:
            parts.append(f"sequences in {config.schedule.micro_batch_splits} pieces")
        parts.append(f"{stages.recompute} recomputation")
        if config.training.compile:
            parts.append("compiled blocks")
        return ", ".join(parts)

    # --- the loop -----------------------------------------------------------------------------

    def fit(self) -> None:
        """Train to `training.train_iters`, resuming from the newest checkpoint, logging,
        validating, checkpointing and exporting at their intervals. SIGINT/SIGTERM write a
        checkpoint and stop cleanly."""
        config, training = self.config, self.config.training
        experiment = self.experiment_dir
        experiment.mkdir(parents=True, exist_ok=True)
        lock = ExperimentLock.acquire(experiment)
        main = self.distributed.is_main
        if main:  # what a killed run was writing; no other run writes here while we hold the lock
            for root in ("checkpoint", "export"):
                remove_partials(experiment / root)
        resumed = self.resume()
        if main:
            setup = _memory_gib(self.distributed.device)
            memory = "" if setup is None else f", {setup:.1f} GiB after setup"
            print(f"fastllm: {self._describe()}{memory}", flush=True)
        _reset_memory_peak(self.distributed.device)
        if main and resumed is not None:
            print(f"fastllm: resumed from {resumed} (step {self.step})", flush=True)
        logger = MetricsLogger(
            experiment,
            total_steps=training.train_iters,
            start_step=self.step,
            enabled=main,
            tensorboard=training.logs.tensorboard,
            wandb_project=training.logs.wandb_project,
            config=msgspec.to_builtins(config),
        )
        stop = _StopSignal()
        tokens_per_step = config.batch.batch_size * config.batch.sequence_length
        flops = flops_per_token(config.model.base_model, config.batch.sequence_length)
        peak = PEAK_FLOPS.get(self.distributed.device.type)
        window: list[float] = []
        window_start = time.perf_counter()
        profiler = StepProfiler(
            training.profile, experiment / "profile", self.distributed.rank, self.distributed.device
        )
        try:
            for micro_batches in self.data_loader() if self.step < training.train_iters else []:
                profiler.before(self.step + 1)
                metrics = self.train_step(micro_batches)
                profiler.after(self.step)
                window.append(metrics["loss"])
                step, last = self.step, self.step >= training.train_iters
                if step % training.logs.interval == 0 or last or stop.requested:
                    if self.distributed.device.type == "cuda":
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - window_start
                    tokens_per_s = (
                        len(window) * tokens_per_step / elapsed / self.distributed.world_size
                    )
                    record = {
                        "loss": sum(window) / len(window),
                        "lr": metrics["lr"],
                        "grad_norm": metrics["grad_norm"]
                        if math.isfinite(metrics["grad_norm"])
                        else None,
                        "tokens_per_s": tokens_per_s,
                        "tflops": tokens_per_s * flops / 1e12,
                        "mfu": tokens_per_s * flops / peak if peak else None,
                        "memory_gib": _memory_gib(self.distributed.device),
                        "memory_reserved_gib": _memory_gib(self.distributed.device, reserved=True),
                        "skipped_steps": self.skipped_steps,
                        "consumed_samples": self.consumed_samples,
                    }
                    record.update(self._expert_load(len(window)))
                    if training.validation.interval and step % training.validation.interval == 0:
                        record["validation_loss"] = self.validation_loss()
                    logger.log(step, record)
                    _reset_memory_peak(self.distributed.device)
                    window, window_start = [], time.perf_counter()
                elif training.validation.interval and step % training.validation.interval == 0:
                    logger.log(step, {"validation_loss": self.validation_loss()})
                if training.export.interval and step % training.export.interval == 0:
                    state.export(self, experiment / "export" / str(step), training.export.format)
                checkpoint = training.checkpoint
                at_end = last and checkpoint.at_end
                if (
                    at_end
                    or stop.requested
                    or (checkpoint.interval and step % checkpoint.interval == 0)
                ):
                    self.save_checkpoint()
                if last or stop.requested:
                    break
        finally:
            profiler.close()
            try:
                self.checkpoints.wait()
            finally:
                logger.close()
                stop.restore()
                lock.release()
        if stop.requested and main:
            print(
                f"fastllm: stopped by {stop.requested} at step {self.step}; checkpoint written",
                flush=True,
            )


class _StopSignal:
    """SIGINT/SIGTERM (preemption) request a checkpoint and a clean stop after the current step."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def _handle(self, signum: int, _frame: object) -> None:
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _memory_gib(device: torch.device, reserved: bool = False) -> float | None:
    """Peak memory since the last reset (the last log, or the end of setup): allocated by
    tensors, or reserved by the caching allocator."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated
    return peak(device) / 2**30


def _reset_memory_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
