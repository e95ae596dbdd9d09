"""Running out of accelerator memory ends a run in one line (exit 1): what was asked for, what
this rank's parameter buffers hold by kind (the rest of the peak is activations and
workspace), and the settings that would use less (LoRA among them, for a run that trains
everything), offered only where they compose with the rest of the config."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import torch

from fastllm.config import ConfigError, MachineError, TrainerConfig
from fastllm.config.layout import check_compatible
from fastllm.config.model import LoRAConfig, NoPeftConfig
from fastllm.engine.engine import Engine
from fastllm.engine.memory import buffer_memory

_RECOMPUTE = ("none", "elementwise", "selective", "full")


def out_of_memory(
    config: TrainerConfig, error: torch.OutOfMemoryError, engine: Engine | None
) -> MachineError:
    """The one-line error for `error`; `engine` is None when it came while the engine was
    being built."""
    text = " ".join(str(error).split())
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    free = re.search(r"capacity of ([\d.]+ [KMGT]?i?B) of which ([\d.]+ [KMGT]?i?B) is free", text)
    parts = ["out of accelerator memory" + (f" allocating {asked[1]}" if asked else "")]
    if free:
        parts[0] += f" ({free[2]} free of {free[1]})"
    if engine is None:
        parts.append("while the model's buffers were being made")
    else:
        memory = buffer_memory(engine.stages, engine.optimizer)
        optimizer = (
            f"{_gib(memory.optimizer)} of masters and Adam moments"
            if not memory.host_optimizer
            else f"{_gib(memory.optimizer)} of optimizer chunks in flight (the masters and Adam "
            f"moments, {_gib(memory.host_optimizer)}, are in host memory)"
        )
        held = (
            f"this rank's buffers hold {_gib(memory.weights)} of weights, "
            f"{_gib(memory.gradients)} of gradients and {optimizer}"
        )
        device = engine.distributed.device
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            held += f"; activations and workspace take the rest of the {_gib(peak)} allocated"
        parts.append(held)
    data_ranks = None if engine is None else engine.mesh.data.size
    if ways := ways_to_use_less(config, data_ranks):
        parts.append("to use less: " + ", ".join(ways))
    return MachineError("; ".join(parts))


def ways_to_use_less(config: TrainerConfig, data_ranks: int | None) -> list[str]:
    """Settings that lower the memory a rank needs, each as `key=value (now …)`, among those
    that compose with the rest of `config`."""
    multi_stage, batch = config.model.multi_stage, config.batch
    candidates: list[tuple[str, Any, str]] = []  # key, value, how it reads
    level = _RECOMPUTE.index(multi_stage.recompute)
    if level + 1 < len(_RECOMPUTE):
        recompute = _RECOMPUTE[level + 1]
        candidates.append(
            ("model.multi_stage.recompute", recompute, f"{recompute} (now {multi_stage.recompute})")
        )
    micro = batch.micro_batch_size
    if micro is not None and micro > 1:
        fewer = micro // 2 if batch.batch_size % (micro // 2) == 0 else 1
        candidates.append(("batch.micro_batch_size", fewer, f"{fewer} (now {micro})"))
    if multi_stage.zero_stage < 3:
        more = "" if data_ranks is not None and data_ranks > 1 else " with more data ranks"
        shown = f"3 (now {multi_stage.zero_stage}){more}"
        candidates.append(("model.multi_stage.zero_stage", 3, shown))
    if multi_stage.offload_activations == 0:
        shown = "N (now 0: the first N blocks' stored activations in host memory)"
        candidates.append(("model.multi_stage.offload_activations", 1, shown))
    if not multi_stage.offload_optimizer and _trains(config):
        shown = "true (now false: the masters and Adam moments in host memory)"
        candidates.append(("model.multi_stage.offload_optimizer", True, shown))
    if isinstance(config.model.base_model.peft, NoPeftConfig):
        shown = "{type: lora} (now none: adapters train, every other parameter is frozen)"
        candidates.append(("model.base_model.peft", LoRAConfig(), shown))
    return [f"{key}={shown}" for key, value, shown in candidates if _composes(config, key, value)]


def _trains(config: TrainerConfig) -> bool:
    """Some parameter trains (and so has optimizer state)."""
    base = config.model.base_model
    return config.model.num_frozen_parameters() < base.num_parameters()


def _composes(config: TrainerConfig, key: str, value: Any) -> bool:
    try:
        check_compatible(_replaced(config, key.split("."), value))
    except ConfigError:
        return False
    return True


def _replaced(section: Any, path: list[str], value: Any) -> Any:
    """`section` with the field at `path` set to `value` (its sections copied, not changed)."""
    head, *rest = path
    inner = value if not rest else _replaced(getattr(section, head), rest, value)
    return msgspec.structs.replace(section, **{head: inner})


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
