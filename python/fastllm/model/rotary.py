"""Rotary position embedding tables: the frequencies of each variant, as Hugging Face computes
them (so converted models match bit for bit in fp32), and the cos/sin of given positions."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastllm.config.model import (
    DefaultRotaryConfig,
    LinearRotaryConfig,
    Llama3RotaryConfig,
    NoRotaryConfig,
    RotaryConfig,
    YarnRotaryConfig,
)


def inverse_frequencies(config: RotaryConfig, head_size: int) -> tuple[Tensor, float]:
    """Per-pair angular frequencies (head_size // 2 of them) and the factor on cos/sin."""
    assert not isinstance(config, NoRotaryConfig)
    assert isinstance(config, DefaultRotaryConfig)
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    frequencies = 1.0 / (config.theta**exponents)
    if isinstance(config, Llama3RotaryConfig):
        return _llama3(frequencies, config), 1.0
    if isinstance(config, YarnRotaryConfig):
        assert config.attention_factor is not None
        return _yarn(config, head_size), config.attention_factor
    if isinstance(config, LinearRotaryConfig):
        return frequencies / config.scale_factor, 1.0
    return frequencies, 1.0


def _llama3(frequencies: Tensor, config: Llama3RotaryConfig) -> Tensor:
    low_wavelength = config.original_context_length / config.low_frequency_factor
    high_wavelength = config.original_context_length / config.high_frequency_factor
    wavelength = 2 * math.pi / frequencies
    scaled = torch.where(
        wavelength > low_wavelength, frequencies / config.scale_factor, frequencies
    )
    smooth = (config.original_context_length / wavelength - config.low_frequency_factor) / (
        config.high_frequency_factor - config.low_frequency_factor
    )
    smoothed = (1 - smooth) * scaled / config.scale_factor + smooth * scaled
    medium = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
    return torch.where(medium, smoothed, scaled)


def _yarn(config: YarnRotaryConfig, head_size: int) -> Tensor:
    def correction_dimension(rotations: float) -> float:
        context = config.original_context_length
        return (
            head_size * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(config.theta))
        )

    low = max(math.floor(correction_dimension(config.beta_fast)), 0)
    high = min(math.ceil(correction_dimension(config.beta_slow)), head_size - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    powers = config.theta ** (torch.arange(0, head_size, 2).float() / head_size)
    extrapolation, interpolation = 1.0 / powers, 1.0 / (config.scale_factor * powers)
    ramp = torch.clamp(
        (torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryTables(torch.nn.Module):
    """cos and sin, shape (..., head_size // 2) in fp32, for the positions asked for.

    The frequencies are kept in fp32 outside the module's buffers, so that casting the model
    (`.to(bfloat16)`) or building it on the meta device leaves them exact."""

    def __init__(self, config: RotaryConfig, head_size: int) -> None:
        super().__init__()
        self.config, self.head_size = config, head_size
        self._frequencies: dict[torch.device, Tensor] = {}

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        device = positions.device
        if device not in self._frequencies:
            with torch.device("cpu"):
                frequencies, self.scale = inverse_frequencies(self.config, self.head_size)
            self._frequencies[device] = frequencies.to(device)
        angles = positions[..., None].float() * self._frequencies[device]
        return angles.cos() * self.scale, angles.sin() * self.scale


def positions_in_documents(document_ids: Tensor) -> Tensor:
    """Position of each token within its document, for (batch, seq) document ids of packed
    samples: positions restart at 0 where the document id changes."""
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first
