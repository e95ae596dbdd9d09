"""`data`: the token datasets a run trains on."""

from __future__ import annotations

import math

import msgspec

from fastllm.config.section import ConfigError, Section


class DataConfig(Section):
    path: list[str] = msgspec.field(default_factory=list)
    """Prepared datasets (directories written by `fastllm prepare`)."""
    weights: list[float] | None = None
    """Share of each dataset in the blend; default proportional to their token counts."""

    def validate(self) -> None:
        if self.weights is None:
            return
        if len(self.weights) != len(self.path):
            raise ConfigError(
                "weights", f"has {len(self.weights)} entries but path has {len(self.path)}"
            )
        for i, weight in enumerate(self.weights):
            if not (math.isfinite(weight) and weight >= 0):
                raise ConfigError(f"weights[{i}]", f"must be finite and non-negative, got {weight}")
        if self.path and sum(self.weights) <= 0:
            raise ConfigError("weights", "must not all be zero")
