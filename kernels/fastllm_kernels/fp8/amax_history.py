"""Delayed FP8 scaling state: the amaxes of the last steps of each FP8 layer's input, output
gradient and weight, from which their scales are taken (Transformer Engine's delayed recipe)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastllm_kernels.fp8.quantize import DelayedScale

INPUT, GRADIENT, WEIGHT = 0, 1, 2
"""The delayed-scaled tensors of a layer: its input, its output gradient and its weight."""
KINDS = 3
_KINDS_BEFORE_WEIGHT = 2
"""Checkpoints written before the weights were delayed-scaled hold INPUT and GRADIENT only."""


class AmaxHistories:
    """Delayed scaling state of `layers` linear layers: for each layer's input, output gradient
    and weight, the amaxes of the last `length` steps (newest first) and the amax so far of the
    step in progress. `roll` after each optimizer step. Until a kind's first roll its tensors
    scale currently (and record): there is no history yet. Part of a checkpoint (`state`)."""

    def __init__(self, layers: int, length: int, device: torch.device) -> None:
        if length < 1:
            raise ValueError(f"an amax history holds at least one step, got {length}")
        self.history = torch.zeros(layers, KINDS, length, device=device)
        self.current = torch.zeros(layers, KINDS, device=device)
        self.primed = [False] * KINDS
        """Per kind: whether its history holds a step."""

    def scale(self, layer: int, tensor: int, record: bool = True) -> DelayedScale:
        return DelayedScale(
            self.history[layer, tensor] if self.primed[tensor] else None,
            self.current[layer, tensor] if record else None,
        )

    @torch.no_grad()
    def roll(self) -> None:
        """The step's amaxes become the newest entries of the history. A weight that no pass of
        the step quantized (a skipped optimizer step left it unchanged, its copy kept) keeps
        its newest amax, still its amax."""
        weight = self.current[:, WEIGHT]
        weight.copy_(torch.where(weight > 0, weight, self.history[:, WEIGHT, 0]))
        self.history.copy_(torch.cat([self.current[..., None], self.history[..., :-1]], dim=-1))
        self.current.zero_()
        self.primed = [True] * KINDS

    def state(self) -> dict[str, Tensor]:
        return {"history": self.history, "current": self.current}

    @torch.no_grad()
    def load_state(self, state: dict[str, Tensor]) -> None:
        """Restore `state`; one without the weights' kind (an older checkpoint) leaves their
        histories empty: the weights scale currently until the next roll. A shape of other
        layers or another history length: ValueError naming the entry."""
        layers, _, length = self.history.shape
        history, current = state["history"], state["current"]
        kinds = history.shape[1] if history.dim() == 3 else 0
        expected = {"history": (layers, kinds, length), "current": (layers, kinds)}
        for key, shape in expected.items():
            if kinds not in (KINDS, _KINDS_BEFORE_WEIGHT) or tuple(state[key].shape) != shape:
                raise ValueError(
                    f"{key} has shape {tuple(state[key].shape)}; expected {layers} FP8 layers "
                    f"by {KINDS} kinds (or {_KINDS_BEFORE_WEIGHT}, before the weights')"
                    + (f" by {length} steps" if key == "history" else "")
                )
        self.history.zero_()
        self.current.zero_()
        self.history[:, :kinds].copy_(history)
        self.current[:, :kinds].copy_(current)
        self.primed = self.history.any(dim=2).any(dim=0).tolist()
