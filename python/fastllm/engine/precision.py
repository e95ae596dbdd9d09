"""Training dtypes and dynamic loss scaling for float16."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LossScaler:
    """float16's dynamic loss scale: halved on overflow, doubled after `interval` clean steps.
    For other dtypes the scale stays 1."""

    def __init__(self, enabled: bool, initial: float = 2.0**16, interval: int = 1000) -> None:
        self.enabled, self.interval = enabled, interval
        self.scale = initial if enabled else 1.0
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale, self.clean_steps = max(self.scale / 2, 1.0), 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.interval == 0:
                self.scale *= 2

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
