"""Checkpoints, exports and resumption of a training run.

Saving stalls training only for the copy of this rank's state to pinned host memory; Rust
(`fastllm._native.CheckpointWriter`) serializes, checksums and fsyncs on background threads.
All ranks write into `checkpoint/.STEP.partial/`; once every rank's file is written, rank 0
commits: manifest.json (config, step, data position, layout, checksums), then an atomic rename
to `checkpoint/STEP/`. A partial or corrupt checkpoint is never loaded."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.distributed as dist
from safetensors import safe_open

from fastllm import _native
from fastllm.checkpoint.distributed import SavedLayout, ShardFiles, rank_file, stage_key
from fastllm.checkpoint.formats import ModelSource, copy_tokenizer_files, write_model
from fastllm.config import ConfigError
from fastllm.config.resume_changes import resume_warning
from fastllm.engine.data_parallel import gather_weights
from fastllm.engine.flat_model import ALIGNMENT

if TYPE_CHECKING:
    from fastllm.training.trainer import Trainer

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class _Pending:
    job: Any
    partial: Path
    final: Path
    manifest: dict[str, Any]
    keep: int | None
    buffers: list[Any] = field(default_factory=list)


_writer: Any = None
_pending: list[_Pending] = []
_world: tuple[int, int] = (0, 1)


def _layout_manifest(trainer: Trainer) -> dict[str, Any]:
    flat = trainer.flat
    return {
        "parameters": [list(spec) for spec in flat.specs],
        "shapes": {name: list(flat.shapes[name]) for name in flat.names},
        "alignment": ALIGNMENT,
        "world_size": flat.world_size,
        "config": msgspec.to_builtins(trainer.config),
    }


def _staged(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    copy.copy_(tensor, non_blocking=pin)
    return copy


def _submit(
    trainer: Trainer, directory: Path, kinds: tuple[str, ...], extra: dict[str, torch.Tensor]
) -> list[Any]:
    """Copy this rank's shards to host memory and hand them to the background writer."""
    global _writer, _world
    _world = (trainer.distributed.rank, trainer.distributed.world_size)
    if _writer is None:
        _writer = _native.CheckpointWriter()
    pin = trainer.distributed.device.type == "cuda"
    tensors = []
    for stage, shard in enumerate(trainer.flat.shards):
        for kind in kinds:
            tensors.append((stage_key(kind, stage), _staged(getattr(shard, kind), pin)))
    tensors += [(name, _staged(t, pin)) for name, t in extra.items()]
    if pin:
        torch.cuda.synchronize()
    arrays = [(name, t.numpy(), _dtype_name(t.dtype), list(t.shape)) for name, t in tensors]
    directory.mkdir(parents=True, exist_ok=True)
    job = _writer.submit(str(directory), [(rank_file(trainer.distributed.rank), arrays, {})])
    return [job, tensors]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.uint8: "U8", torch.int64: "I64"}[dtype]


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["rng.cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(trainer: Trainer, directory: Path | None = None) -> Path:
    """Start writing a checkpoint of the full training state; see the module doc."""
    wait_for_checkpoints()
    root = trainer.experiment_dir / "checkpoint"
    final = directory or root / str(trainer.step)
    partial = final.with_name(f".{final.name}.partial")
    if trainer.distributed.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        if final.exists():  # one this run did not resume from: corrupt, or of an abandoned branch
            warnings.warn(f"replacing the checkpoint {final}", stacklevel=2)
            shutil.rmtree(final)
    trainer.distributed.barrier()
    job, buffers = _submit(trainer, partial, STATE_KINDS, _rng_state(trainer.distributed.device))
    manifest = {
        "format": "distributed",
        "kind": "checkpoint",
        "step": trainer.step,
        "optimizer_steps": trainer.optimizer.step_count,
        "consumed_samples": trainer.consumed_samples,
        "skipped_steps": trainer.skipped_steps,
        "loss_scaler": trainer.scaler.state_dict(),
        **_layout_manifest(trainer),
    }
    keep = trainer.config.training.checkpoint.keep if directory is None else None
    _pending.append(_Pending(job, partial, final, manifest, keep, buffers))
    return final


def wait_for_checkpoints() -> None:
    """Finish every checkpoint in flight: wait for this rank's files, then rank 0 commits."""
    rank, world_size = _world
    while _pending:
        pending = _pending.pop(0)
        reports = pending.job.wait()
        if world_size > 1:
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, reports)
            reports = [report for rank_reports in gathered for report in rank_reports]
        if rank == 0:
            _native.commit_checkpoint(
                str(pending.partial), str(pending.final), json.dumps(pending.manifest), reports
            )
            if pending.keep is not None:
                _prune(pending.final.parent, pending.keep)
        if world_size > 1:
            dist.barrier()


def _prune(root: Path, keep: int) -> None:
    steps = sorted((int(p.name), p) for p in root.iterdir() if p.is_dir() and p.name.isdigit())
    for _, directory in steps[:-keep]:
        shutil.rmtree(directory, ignore_errors=True)


def resume(trainer: Trainer) -> Path | None:
    root = trainer.experiment_dir / "checkpoint"
    if not root.is_dir():
        return None
    found = _native.latest_checkpoint(str(root))
    if found is None:
        return None
    _, directory, manifest, problems = found
    manifest = json.loads(manifest)
    if trainer.distributed.is_main:
        for problem in problems:
            warnings.warn(f"skipping a bad checkpoint: {problem}", stacklevel=2)
        if changed := resume_warning(manifest["config"], msgspec.to_builtins(trainer.config)):
            warnings.warn(changed, stacklevel=2)
    load_checkpoint(trainer, Path(directory), manifest)
    return Path(directory)


@torch.no_grad()
def load_checkpoint(
    trainer: Trainer, directory: Path, manifest: dict[str, Any] | None = None
) -> None:
    """Restore the full training state, resharding when the checkpoint was written by another
    number of ranks. `manifest` is given when the checkpoint was just verified."""
    if manifest is None:
        manifest = json.loads(_native.verify_checkpoint(str(directory)))
    _load_shards(trainer, directory, manifest, STATE_KINDS)
    trainer.flat.sync_weights_from_master()
    gather_weights(trainer.flat)  # the other ranks' shards of the compute weights
    trainer.step = manifest["step"]
    trainer.optimizer.step_count = manifest["optimizer_steps"]
    trainer.consumed_samples = manifest["consumed_samples"]
    trainer.skipped_steps = manifest["skipped_steps"]
    trainer.scaler.load_state_dict(manifest["loss_scaler"])
    if manifest["world_size"] == trainer.distributed.world_size:  # RNG streams are per rank
        with safe_open(directory / rank_file(trainer.distributed.rank), "pt") as handle:
            torch.set_rng_state(handle.get_tensor("rng.cpu"))
            if trainer.distributed.device.type == "cuda" and "rng.cuda" in handle.keys():  # noqa: SIM118
                torch.cuda.set_rng_state(handle.get_tensor("rng.cuda"), trainer.distributed.device)


def _load_shards(
    trainer: Trainer, directory: Path, manifest: dict[str, Any], kinds: tuple[str, ...]
) -> None:
    saved, files, flat = SavedLayout(manifest), ShardFiles(directory), trainer.flat
    if set(saved.index) != set(flat.names):
        raise ConfigError(str(directory), "holds the parameters of another model")
    for stage, shard in enumerate(flat.shards):
        for index, p0, p1, s0, _ in flat.layout.shard_parameters(stage, flat.rank):
            name = flat.names[index]
            for rank, saved_stage, q0, q1, t0, _ in saved.pieces(name):
                start, end = max(p0, q0), min(p1, q1)
                if start >= end:
                    continue
                for kind in kinds:
                    values = files.piece(rank, kind, saved_stage, t0 + start - q0, t0 + end - q0)
                    getattr(shard, kind)[s0 + start - p0 : s0 + end - p0].copy_(values)


def export(trainer: Trainer, directory: Path, output_format: str) -> None:
    """Write the model weights: `distributed` (fp32 shards, every rank), else rank 0 writes the
    whole model in that format (fastllm or a Hugging Face architecture)."""
    if directory.exists():
        return
    if output_format == "distributed":
        wait_for_checkpoints()
        partial = directory.with_name(f".{directory.name}.partial")
        if trainer.distributed.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        trainer.distributed.barrier()
        job, buffers = _submit(trainer, partial, ("master",), {})
        if trainer.distributed.is_main:
            copy_tokenizer_files(Path(trainer.config.data.path[0]), partial)
        manifest = {
            "format": "distributed",
            "kind": "export",
            "step": trainer.step,
            **_layout_manifest(trainer),
        }
        _pending.append(_Pending(job, partial, directory, manifest, None, buffers))
        wait_for_checkpoints()
        return
    # Every rank takes part (ZeRO-3 gathers each stage); rank 0 keeps the copies.
    tensors = {
        name: t.detach().to("cpu", copy=True)
        for name, t in trainer.flat.full_parameters()
        if trainer.distributed.is_main
    }
    if trainer.distributed.is_main:
        # The dataset's directory as the source's: write_model copies its tokenizer files.
        dataset = Path(trainer.config.data.path[0])
        source = ModelSource(dataset, "fastllm", trainer.config.model.base_model, loaded=tensors)
        partial = directory.with_name(f".{directory.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        write_model(source, partial, output_format)
        partial.rename(directory)
    trainer.distributed.barrier()
