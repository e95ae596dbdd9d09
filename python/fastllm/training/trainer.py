"""The training loop: an `Engine` built from the config, the data loaders from its data
position, logging, validation, checkpoint and export cadence, and signals.

Custom loops use the parts (`data_loader`, `engine.train_step`, `save_checkpoint`, `resume`);
`fit` is what `fastllm train` runs."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.checkpoint.saver import CheckpointSaver, remove_partials
from fastllm.config import ConfigError, MachineError, TrainerConfig
from fastllm.config.flops import flops_per_token
from fastllm.config.phases import data_phases
from fastllm.config.training import check_cadences
from fastllm.data import DataLoader, SampleStream
from fastllm.data.dataset import TokenDataset
from fastllm.data.errors import BuildStopped
from fastllm.data.fim import source_fim, tokenizer_fim
from fastllm.data.source import (
    BlendedSamples,
    SourceContext,
    SourceSamples,
    make_source,
    source_choices,
)
from fastllm.engine.build import build
from fastllm.engine.engine import Engine
from fastllm.engine.memory import buffer_memory
from fastllm.parallel.process_group import Distributed
from fastllm.training import state
from fastllm.training.energy import EnergyMeter
from fastllm.training.evaluators import Evaluation, evaluations
from fastllm.training.experiment_lock import ExperimentLock
from fastllm.training.metrics import PEAK_FLOPS, MetricsLogger
from fastllm.training.phases import PhasedLoader, describe_phase
from fastllm.training.profiling import StepProfiler
from fastllm.training.reference_log_probs import reference_log_probs


@dataclass(frozen=True)
class Stopped:
    """How `fit` ends when SIGINT or SIGTERM stopped it: after `step`, whose checkpoint is
    committed (none when it stopped before its first step)."""

    signal: signal.Signals
    step: int

    @property
    def exit_code(self) -> int:
        """The shell's code of a process the signal ended: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signal


class Trainer:
    """The run of a `TrainerConfig` on this process: `fit` trains it as `fastllm train` does; a
    custom loop takes the parts (`engine`, `data_loader`, `save_checkpoint`, `resume`).
    Making one builds the engine (`engine.build.build`): under `torchrun` it joins the process
    group from the launcher's environment, unless `distributed` is given."""

    def __init__(self, config: TrainerConfig, distributed: Distributed | None = None) -> None:
        self.config = config
        self.engine: Engine = build(config, distributed)
        """The model on its flat buffers, its step program, AdamW, the loss scale and the
        training state."""
        self.distributed = self.engine.distributed
        self.checkpoints = CheckpointSaver(
            self.distributed.rank, self.distributed.world_size, self.distributed.device
        )
        self.evaluations: dict[str, Evaluation] = evaluations(self)
        """The run's evaluators by name (`training.evaluators`, and `training.validation` as
        validation)."""
        self.frozen_base: dict[str, Any] | None = None
        """Where the frozen weights come from, as checkpoints name it (`state.frozen_base`)."""
        self._reference_tables: dict[str, Tensor] | None = None
        """DPO's precomputed reference log-probabilities, by dataset path, once computed."""
        self.source_samples: SourceSamples | BlendedSamples | None = None
        """The samples of `data.source` (blended with `data.path`'s) that the last `data_loader`
        reads: its position goes into checkpoints."""

    @property
    def experiment_dir(self) -> Path:
        """`run.experiment_dir`; a `ConfigError` when it is not set."""
        if self.config.run.experiment_dir is None:
            raise ConfigError("run.experiment_dir", "is required to train")
        return Path(self.config.run.experiment_dir)

    # --- data ---------------------------------------------------------------------------------

    @property
    def sampling_cache(self) -> Path:
        """Where sampling indices are cached (`data.cache_dir`)."""
        cache = self.config.data.cache_dir
        return Path(cache) if cache else self.experiment_dir / "cache" / "sampling"

    def sample_stream(
        self,
        paths: list[str],
        num_samples: int,
        key: str,
        stop: Callable[[], bool] | None = None,
        *,
        weights: list[float] | None = None,
        seed: int | None = None,
    ) -> SampleStream:
        """The samples of `paths` blended by `weights` (default: by their token counts), drawn
        from `seed` (default `model.distributed.seed`); `stop` ends the building of its indices
        (`BuildStopped`)."""
        return SampleStream(
            paths,
            self.config.data,
            sequence_length=self.config.batch.sequence_length,
            num_samples=num_samples,
            seed=self.config.model.distributed.seed if seed is None else seed,
            cache_dir=self.sampling_cache,
            weights=weights,
            key=key,
            vocab_size=self.config.model.base_model.vocab_size,
            stop=stop,
        )

    def data_loader(
        self, stop: Callable[[], bool] | None = None, agree: Callable[[], bool] | None = None
    ) -> PhasedLoader:
        """Training batches (this rank's micro-batches of each step) from the current data
        position to the end of training, phase after phase (`training.phases`); `stop` ends the
        building of the sampling indices (`BuildStopped`), which are all built here, and
        `agree` (asked by every rank at the same points) the precomputation of DPO's reference
        log-probabilities, which runs here too."""
        batch_size, run = self.config.batch.batch_size, self.engine.state
        if self.config.data.source is not None:
            samples = self._source_samples(stop)
            return PhasedLoader([self.loader(samples, run.consumed_samples)])
        loaders = []
        for phase in data_phases(self.config):
            if phase.end_step <= run.step:
                continue
            stream = self.sample_stream(
                phase.path,
                (phase.end_step - phase.begin_step) * batch_size,
                phase.key,
                stop,
                weights=phase.weights,
                seed=phase.seed,
            )
            # The first phase reads from the data position (as a run without phases), the
            # others from their first sample, or where a resumed run stopped in them.
            position = (
                run.consumed_samples
                if phase.begin_step == 0
                else max(0, run.step - phase.begin_step) * batch_size
            )
            loaders.append(self.loader(stream, position, agree))
        return PhasedLoader(loaders)

    def _source_samples(self, stop: Callable[[], bool] | None) -> SourceSamples | BlendedSamples:
        """The samples of `data.source`, blended with those of `data.path` when it gives
        datasets, from the data position (phases are refused with a source)."""
        config, run = self.config, self.engine.state
        data, batch_size, seed = config.data, config.batch.batch_size, config.model.distributed.seed
        assert data.source is not None
        num_samples = config.training.train_iters * batch_size
        from_source = (
            source_choices(data.source.share, num_samples, seed)
            if data.path
            else np.ones(num_samples, dtype=bool)
        )
        before = np.concatenate([[0], np.cumsum(from_source)])
        vocab_size = config.model.base_model.vocab_size
        stream = None
        if data.path:
            prepared = int((~from_source).sum())
            stream = self.sample_stream(
                data.path, max(prepared, 1), "data.path", stop, weights=data.weights
            )
        fim = None
        if data.fim is not None:  # the prepared datasets' settings, else data.fim.tokenizer's
            settings = stream.fim if stream is not None else tokenizer_fim(data.fim, vocab_size)
            assert settings is not None
            fim = source_fim(settings, seed)
        context = SourceContext(seed=seed, vocab_size=vocab_size)
        samples = SourceSamples(
            make_source(data.source, context),
            sequence_length=config.batch.sequence_length,
            step_ends=before[batch_size::batch_size],
            vocab_size=vocab_size,
            truncate=data.sampling == "truncated",
            fim=fim,
            start=int(before[run.consumed_samples]),
            position=run.data_source,
        )
        self.source_samples = samples
        if stream is not None:
            self.source_samples = BlendedSamples(samples, stream, from_source)
        return self.source_samples

    def loader(
        self,
        stream: SampleStream | SourceSamples | BlendedSamples,
        consumed_samples: int = 0,
        agree: Callable[[], bool] | None = None,
    ) -> DataLoader:
        """This rank's share of each batch of `stream`, in micro-batches (whole sequences: the
        ranks of a sequence-data group share them, and the engine takes this rank's chunk);
        with DPO's reference log-probabilities precomputed, its pairs' (every rank calls it:
        the first call computes them, and `agree` stops that with `BuildStopped`)."""
        batch, data = self.config.batch, self.engine.mesh.sample_groups
        return DataLoader(
            stream,
            batch_size=batch.batch_size,
            micro_batch_size=self.engine.layout.micro_batch_size,
            rank=data.rank,
            world_size=data.size,
            consumed_samples=consumed_samples,
            prefetch=self.config.data.prefetch,
            reference_log_probs=self._reference_log_probs(stream, agree),
        )

    def _reference_log_probs(
        self,
        stream: SampleStream | SourceSamples | BlendedSamples,
        agree: Callable[[], bool] | None,
    ) -> Tensor | None:
        """The precomputed reference log-probabilities of the pairs of `stream`, by pair id;
        at the first call, those of every preference dataset the run reads."""
        names = self.config.model.base_model.head.precomputed_references
        if not names or not isinstance(stream, SampleStream) or not stream.is_preference:
            return None
        (name,) = names  # of the one dpo loss
        if self._reference_tables is None:
            paths = self._preference_paths()
            self._reference_tables = reference_log_probs(self, name, paths, agree)
        tables = self._reference_tables
        return torch.cat([tables[str(dataset.path)] for dataset in stream.datasets])

    def _preference_paths(self) -> dict[str, str]:
        """The preference datasets the run reads (training, in every phase, validation, named),
        by path, with their config keys."""
        data = self.config.data
        keyed = {
            **{phase.key: phase.path for phase in data_phases(self.config)},
            "data.validation_path": data.validation_path,
            **{f"data.datasets.{name}.path": d.path for name, d in data.datasets.items()},
        }
        found: dict[str, str] = {}
        for key, paths in keyed.items():
            for i, path in enumerate(paths):
                if TokenDataset(path).is_preference:
                    found.setdefault(str(Path(path)), f"{key}[{i}]")
        return found

    def evaluate(
        self, name: str, stop: Callable[[], bool] | None = None
    ) -> dict[str, float] | None:
        """Run the evaluator `name` of `evaluations` now: its metrics as the run logs them
        (NAME_METRIC, e.g. validation_loss). None when `stop` (asked by every rank at the same
        points) said to stop. Every rank calls it."""
        evaluation = self.evaluations[name]
        metrics = evaluation.run(stop or (lambda: False))
        if metrics is None:
            return None
        return {f"{name}_{metric}": value for metric, value in metrics.items()}

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, directory: Path | None = None) -> Path:
        """Write a checkpoint of the whole training state (in the background); returns its
        directory (default EXPERIMENT_DIR/checkpoint/STEP)."""
        return state.save_checkpoint(self, directory)

    def wait_for_checkpoints(self) -> None:
        """Block until every checkpoint in flight is written and committed."""
        self.checkpoints.wait()

    def load_checkpoint(self, directory: Path) -> None:
        """Restore the whole training state from the checkpoint in `directory`, whatever layout
        wrote it; a `ConfigError` when another architecture wrote it."""
        state.load_checkpoint(self, directory)

    def resume(self) -> Path | None:
        """Load the newest complete checkpoint of the experiment, if there is one."""
        return state.resume(self)

    # --- the loop -----------------------------------------------------------------------------

    def fit(self) -> Stopped | None:
        """Train to `training.train_iters`, resuming from the newest checkpoint, logging,
        validating, checkpointing and exporting at their intervals (an interval the run would
        never reach is a `ConfigError` before anything is written). SIGINT/SIGTERM (on any
        rank) end the current step or validation, write a checkpoint and return `Stopped`."""
        config, training = self.config, self.config.training
        check_cadences(training)
        experiment = self.experiment_dir
        try:
            experiment.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # `fastllm train` refused a file in the way (check_inputs)
            raise MachineError(f"cannot create {experiment}: {error.strerror}") from None
        lock = ExperimentLock.acquire(experiment)
        main = self.distributed.is_main
        if main:  # what a killed run was writing; no other run writes here while we hold the lock
            for root in ("checkpoint", "export"):
                remove_partials(experiment / root)
        resumed = self.resume()
        engine, run = self.engine, self.engine.state
        if main:
            setup = _memory_gib(self.distributed.device)
            memory = "" if setup is None else f", {setup:.1f} GiB after setup ({_held(engine)})"
            print(f"fastllm: {self.engine.describe()}{memory}", flush=True)
        _reset_memory_peak(self.distributed.device)
        if main and resumed is not None:
            print(f"fastllm: resumed from {resumed} (step {run.step})", flush=True)
        logger = MetricsLogger(
            experiment,
            total_steps=training.train_iters,
            start_step=run.step,
            enabled=main,
            tensorboard=training.logs.tensorboard,
            wandb_project=training.logs.wandb_project,
            config=msgspec.to_builtins(config),
        )
        stop = _StopSignal(self.distributed)
        tokens_per_step = config.batch.batch_size * config.batch.sequence_length
        flops = flops_per_token(
            config.model.base_model, config.batch.sequence_length, config.model.freeze
        )
        peak = PEAK_FLOPS.get(self.distributed.device.type)
        window: list[dict[str, Any]] = []  # the steps' metrics since the last log
        window_start = time.perf_counter()
        profiler = StepProfiler(
            training.profile, experiment / "profile", self.distributed.rank, self.distributed.device
        )
        first_step = run.step
        energy = EnergyMeter.of(self.distributed)
        phases = {phase.begin_step: i for i, phase in enumerate(training.phases)}
        try:
            # The sampling indices (minutes for a long run's) stop on this rank's signal; DPO's
            # reference precomputation, whose collectives every rank runs, where they agree.
            try:
                for evaluation in self.evaluations.values():
                    if evaluation.schedule.interval:  # its data is refused now, not at step N
                        evaluation.prepare(stop.asked)
                loader = (
                    self.data_loader(stop.asked, stop.agree)
                    if run.step < training.train_iters
                    else []
                )
            except BuildStopped:
                loader = []
            energy.start()
            for micro_batches in loader if not stop.agree() else []:
                if main and run.step in phases:
                    print(f"fastllm: {describe_phase(config, phases[run.step])}", flush=True)
                profiler.before(run.step + 1)
                metrics = engine.train_step(micro_batches)
                profiler.after(run.step)
                window.append(metrics)
                step, last = run.step, run.step >= training.train_iters
                stop.agree()
                due = [name for name, e in self.evaluations.items() if e.due(step)]
                began = phases.get(step - 1)  # the switch is logged with the phase's first step
                if step % training.logs.interval == 0 or last or stop.agreed or began is not None:
                    if self.distributed.device.type == "cuda":
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - window_start
                    tokens_per_s = (
                        len(window) * tokens_per_step / elapsed / self.distributed.world_size
                    )
                    record = {
                        # the loss, each head loss with several (NAME_loss), DPO's metrics
                        **{
                            key: sum(m[key] for m in window) / len(window)
                            for key in window[-1]
                            if key not in ("lr", "grad_norm", "skipped")
                        },
                        "lr": metrics["lr"],
                        "grad_norm": metrics["grad_norm"]
                        if math.isfinite(metrics["grad_norm"])
                        else None,
                        "tokens_per_s": tokens_per_s,
                        "tflops": tokens_per_s * flops / 1e12,
                        "mfu": tokens_per_s * flops / peak if peak else None,
                        "memory_gib": _memory_gib(self.distributed.device),
                        "memory_reserved_gib": _memory_gib(self.distributed.device, reserved=True),
                        "skipped_steps": run.skipped_steps,
                        "consumed_samples": run.consumed_samples,
                    }
                    record.update(engine.expert_load(len(window)))
                    record.update(energy.window(len(window), len(window) * tokens_per_step))
                    if began is not None:
                        record["phase"] = began + 1
                    record.update(self._evaluate_all(due, stop.agree))
                    logger.log(step, record)
                    _reset_memory_peak(self.distributed.device)
                    window, window_start = [], time.perf_counter()
                    energy.restart_window()
                elif evaluated := self._evaluate_all(due, stop.agree):
                    logger.log(step, evaluated)
                if training.export.interval and step % training.export.interval == 0:
                    directory = experiment / "export" / str(step)
                    if signum := state.export(self, directory, training.export.format, stop.got):
                        stop.agreed = signum  # the same on every rank: the exporter's
                checkpoint = training.checkpoint
                at_end = last and checkpoint.at_end
                if (
                    at_end
                    or stop.agreed
                    or (checkpoint.interval and step % checkpoint.interval == 0)
                ):
                    self.save_checkpoint()
                if last or stop.agreed:
                    break
        finally:
            profiler.close()
            try:
                self.checkpoints.wait()
            finally:
                logger.close()
                stop.restore()
                lock.release()
        total_kwh = energy.total_kwh()
        if main:
            print(
                f"fastllm: {_summary(run.step - first_step, total_kwh, energy.absent)}", flush=True
            )
        if stop.agreed is None or run.step >= training.train_iters:
            return None  # a signal during the last step came too late to stop anything
        if main:
            saved = "checkpoint written" if run.step > first_step else "nothing new to save"
            print(f"fastllm: stopped by {stop.agreed.name} at step {run.step}; {saved}", flush=True)
        return Stopped(stop.agreed, run.step)

    def _evaluate_all(self, names: list[str], stop: Callable[[], bool]) -> dict[str, float]:
        """The metrics of the evaluators `names`, as logged; after a stop, the ones before."""
        metrics: dict[str, float] = {}
        for name in names:
            if (evaluated := self.evaluate(name, stop)) is None:
                break
            metrics.update(evaluated)
        return metrics


def _summary(steps: int, kwh: float | None, absent: str | None) -> str:
    """The run's last line: its steps and what they cost."""
    energy = f"{kwh:.4g} kWh over every rank" if kwh is not None else f"energy absent ({absent})"
    return f"{steps} step(s) trained in this launch; {energy}"


class _StopSignal:
    """SIGINT/SIGTERM (preemption) request a checkpoint and a clean stop. The ranks of a job
    get a signal at different moments, so they stop where they `agree` on it: after the same
    step or at the same point of a validation, never one rank in a collective the others left."""

    def __init__(self, distributed: Distributed) -> None:
        self.requested: signal.Signals | None = None
        """The signal this rank got."""
        self.agreed: signal.Signals | None = None
        """The signal some rank got, as of the last `agree`: the same on every rank."""
        self._distributed = distributed
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def _handle(self, signum: int, _frame: object) -> None:
        self.requested = self.requested or signal.Signals(signum)

    def asked(self) -> bool:
        """Whether this rank got a signal (for work of this rank alone: no agreement)."""
        return self.requested is not None

    def got(self) -> signal.Signals | None:
        """The signal this rank got, if any (no agreement)."""
        return self.requested

    def agree(self) -> bool:
        """Whether any rank got a signal; every rank calls it at the same points. With several
        ranks this is a one-number all-reduce over the world (small beside a step)."""
        if self.agreed is not None:
            return True
        if self._distributed.world_size == 1:
            self.agreed = self.requested
        else:
            got = torch.tensor([self.requested or 0], device=self._distributed.device)
            dist.all_reduce(got, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
            self.agreed = signal.Signals(int(got.item())) if got.item() else None
        return self.agreed is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _held(engine: Engine) -> str:
    """What this rank's parameter buffers hold by kind, once the step has written the
    gradients (the rest of a step's peak is activations and workspace)."""
    memory = buffer_memory(engine.stages, engine.optimizer)
    optimizer = (
        f"{memory.optimizer / 2**30:.1f} of masters and Adam moments"
        if not memory.host_optimizer
        else f"{memory.optimizer / 2**30:.1f} of optimizer chunks in flight; "
        f"{memory.host_optimizer / 2**30:.1f} GiB of masters and Adam moments in host memory"
    )
    return (
        f"buffers: {memory.weights / 2**30:.1f} GiB of weights, {memory.gradients / 2**30:.1f} "
        f"of gradients, {optimizer}"
    )


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
