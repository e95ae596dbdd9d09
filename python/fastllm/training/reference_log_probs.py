"""DPO's reference log-probabilities computed once per dataset (`reference_log_probs:
precomputed`, TRL's `precompute_ref_log_probs`).

Before the first step, the reference model runs over every pair of each preference dataset the
run reads, once: packed samples of the run's sequence length, each data rank its share of them,
under the run's layout (with pipeline parallelism, the reference's stages on their pipeline
ranks, as in the step). The (pairs, 2) log-probabilities of the chosen and the rejected
answers (NaN for pairs longer than the sequence, which no sample holds) are gathered over the
data ranks, and from the last pipeline stage's, by all-reduces and kept in
EXPERIMENT_DIR/cache/reference_log_probs, one file per dataset named by a digest of its key:
the fingerprints of the dataset's files and of the reference model's, the training dtype and
the sequence length. Any change gives another file, so a stale one is never read; each is
written whole under another name and renamed into place. A resumed run reads them back and
never loads the reference. The reference's weights are freed when the computation ends: they
are never held during training."""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from fastllm.checkpoint.fingerprint import file_fingerprint, fingerprint
from fastllm.config.data import DataConfig
from fastllm.data import DataLoader, SampleStream
from fastllm.data.dataset import TokenDataset
from fastllm.data.errors import BuildStopped
from fastllm.engine.reference import ReferenceModel

if TYPE_CHECKING:
    from fastllm.training.trainer import Trainer

VERSION = 1
"""Of the files' key: a change of what they hold or how it is computed raises it."""


def reference_log_probs(
    trainer: Trainer,
    name: str,
    paths: dict[str, str],
    agree: Callable[[], bool] | None = None,
) -> dict[str, Tensor]:
    """The (pairs, 2) log-probabilities under reference model `name` of the chosen and rejected
    answer of each pair of the preference datasets `paths` (each with its config key), by path,
    on the host: read from their files, or computed (every rank takes part) and written. Every
    rank calls it, with the same arguments. `agree` (a stop the ranks agree on) is asked first,
    before any collective (a rank stopped earlier on its own signal asks it where it stopped),
    and before each step of the computation: once true, `BuildStopped`, nothing written."""
    stopped = agree or (lambda: False)
    if stopped():
        raise BuildStopped(f"reference_models.{name}")
    directory = trainer.experiment_dir / "cache" / "reference_log_probs"
    keys = {path: _key(trainer, name, path) for path in paths}
    files = {path: directory / f"{_digest(key)}.npz" for path, key in keys.items()}
    tables = {path: _read(files[path], key) for path, key in keys.items()}
    main = trainer.distributed.is_main
    if _all_ranks_have(trainer, all(table is not None for table in tables.values())):
        if main:
            print(
                f"fastllm: reference_models.{name}: log-probabilities read from {directory}",
                flush=True,
            )
        return {path: table for path, table in tables.items() if table is not None}
    start = time.perf_counter()
    reference = trainer.engine.build_reference(name)
    try:
        computed = {
            path: _compute(trainer, reference, path, key, stopped) for path, key in paths.items()
        }
    finally:
        del reference
        _free_memory(trainer.distributed.device)
    if main:
        for path, table in computed.items():
            _write(files[path], keys[path], table)
        pairs = sum(len(table) for table in computed.values())
        print(
            f"fastllm: reference_models.{name}: log-probabilities of {pairs:,} pair(s) computed "
            f"in {time.perf_counter() - start:.1f} s, kept in {directory}",
            flush=True,
        )
    return computed


def _key(trainer: Trainer, name: str, path: str) -> dict[str, Any]:
    """What the log-probabilities of dataset `path` under reference model `name` depend on."""
    config = trainer.config
    pretrained = config.reference_models[name].pretrained
    dataset = TokenDataset(path)
    return {
        "version": VERSION,
        "dataset": {str(file.name): file_fingerprint(file) for file in dataset.files},
        "reference": {
            "format": pretrained.format,
            "pretrained": fingerprint(Path(pretrained.path)),
            "adapter": None
            if pretrained.adapter is None
            else fingerprint(Path(pretrained.adapter)),
        },
        "dtype": config.model.distributed.training_dtype,
        "sequence_length": config.batch.sequence_length,
    }


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _read(file: Path, key: dict[str, Any]) -> Tensor | None:
    """The table `file` holds, if it is whole and of `key`; None otherwise."""
    try:
        with np.load(file) as saved:
            if json.loads(str(saved["key"])) != key:
                return None
            return torch.from_numpy(saved["log_probs"].copy())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # absent, damaged
        return None


def _write(file: Path, key: dict[str, Any], table: Tensor) -> None:
    """`table` into `file`, whole: written under another name, synced, then renamed."""
    file.parent.mkdir(parents=True, exist_ok=True)
    staging = file.with_name(f".{file.name}.{os.getpid()}")
    with staging.open("wb") as out:
        np.savez(out, key=np.array(json.dumps(key, sort_keys=True)), log_probs=table.numpy())
        out.flush()
        os.fsync(out.fileno())
    os.replace(staging, file)


def _all_ranks_have(trainer: Trainer, found: bool) -> bool:
    """Whether every rank found every file (one all-reduce): else all compute them."""
    distributed = trainer.distributed
    if distributed.world_size == 1:
        return found
    flag = torch.tensor([int(found)], device=distributed.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=dist.group.WORLD)
    return bool(flag.item())


@torch.no_grad()
def _compute(
    trainer: Trainer, reference: ReferenceModel, path: str, key: str, stopped: Callable[[], bool]
) -> Tensor:
    """The table of dataset `path`: the reference over packed samples that hold every pair
    that fits the sequence (at least once: one epoch, and the end of a sample of the next),
    each data rank (each sequence-data group, its chunks) a micro-batch of each step, through
    the reference's stages over the pipeline ranks; `stopped` is asked before each step."""
    config, engine = trainer.config, trainer.engine
    data, device = engine.mesh.data, trainer.distributed.device
    samples_of = engine.mesh.sample_groups  # a sequence-data group shares its samples
    micro_batch = engine.layout.micro_batch_size
    per_step = micro_batch * samples_of.size
    pairs = len(TokenDataset(path))
    # One pair at least per sample: as many samples as pairs hold an epoch, the rest of the
    # last step's beyond.
    stream = SampleStream(
        [path],
        DataConfig(sampling="packed"),
        sequence_length=config.batch.sequence_length,
        num_samples=pairs + per_step,
        seed=config.model.distributed.seed,
        cache_dir=trainer.sampling_cache,
        key=key,
        vocab_size=config.model.base_model.vocab_size,
    )
    fitting, samples = pairs - stream.skipped_pairs, 0
    while fitting > 0:  # the samples that hold the first epoch
        fitting -= len(stream.sample_pairs(samples))
        samples += 1
    loader = DataLoader(
        stream, batch_size=per_step, micro_batch_size=micro_batch, rank=samples_of.rank,
        world_size=samples_of.size, prefetch=config.data.prefetch,
    )  # fmt: skip
    table = torch.full((pairs, 2), -math.inf, dtype=torch.float32, device=device)
    steps = iter(loader)
    try:
        for _ in range(math.ceil(samples / per_step)):
            if stopped():
                raise BuildStopped(key)
            for micro in engine.batches.prepare(next(steps)):
                log_probs = engine.runner.reference_log_probs(reference, micro)
                if log_probs is not None:  # the last pipeline stage's rank
                    assert micro.pairs is not None and micro.pairs.ids is not None
                    table[micro.pairs.ids.to(device)] = log_probs.view(-1, 2)
    finally:
        steps.close()  # its reading thread
    for group in (data, engine.mesh.pipeline):
        if group.size > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group.group)
    return table.masked_fill_(table == -math.inf, math.nan).cpu()


def _free_memory(device: torch.device) -> None:
    """The dropped reference's buffers back to the device (its modules and hooks hold each
    other: a collection frees them now, not at some later one)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
