"""What a run costs: the GPU driver's energy counter (NVML's total energy consumption, in
millijoules since the driver loaded) read on every rank and summed over the ranks at each
logged step. Where a rank has no counter (a CPU, another vendor's GPU, a MIG instance, NVML
missing or failing) the run reports energy as absent, never an estimate."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastllm.parallel.process_group import Distributed

JOULES_PER_KWH = 3.6e6

EnergyReader = Callable[[], float]
"""This rank's device's energy counter, in joules (only differences mean anything)."""


def nvml_energy_reader(device: torch.device) -> tuple[EnergyReader | None, str]:
    """The energy counter of `device` through the NVIDIA driver's library (libnvidia-ml.so.1,
    through ctypes: no dependency), or None and why there is none."""
    if device.type != "cuda":
        return None, f"no energy counter on {device.type}"
    if torch.version.hip is not None:
        return None, "no energy counter read on ROCm"
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, "the NVIDIA driver's libnvidia-ml.so.1 is not found"
    # The device by its UUID: CUDA's indices are renumbered by CUDA_VISIBLE_DEVICES, NVML's not.
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    handle, energy = ctypes.c_void_p(), ctypes.c_ulonglong()
    for call, arguments in (
        ("nvmlInit_v2", ()),
        ("nvmlDeviceGetHandleByUUID", (ctypes.c_char_p(uuid.encode()), ctypes.byref(handle))),
        ("nvmlDeviceGetTotalEnergyConsumption", (handle, ctypes.byref(energy))),
    ):
        if code := getattr(nvml, call)(*arguments):
            return None, f"NVML's {call} failed (error {code}): no energy counter"

    def read() -> float:
        if code := nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(energy)):
            raise RuntimeError(f"NVML's nvmlDeviceGetTotalEnergyConsumption failed (error {code})")
        return energy.value / 1e3

    return read, ""


class EnergyMeter:
    """The run's energy over its ranks. `start` at the first step; each logged step, `window`
    gives the figures of the steps since `restart_window` (or `start`) and the run's total so
    far. Every rank calls them at the same points: with a counter on every rank each is one
    all-reduce of two numbers; without one on every rank, `absent` says why and they do
    nothing."""

    def __init__(self, distributed: Distributed, read: EnergyReader | None, absent: str) -> None:
        self._distributed, self._read = distributed, read
        if distributed.world_size > 1 and distributed.device.type == "cuda":
            everywhere = torch.tensor([read is not None], device=distributed.device)
            dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=dist.group.WORLD)
            if read is not None and not everywhere.item():
                self._read, absent = None, "no energy counter on some rank"
        self.absent: str | None = absent if self._read is None else None
        """Why the run reports no energy; None when it does."""
        self._run_start = self._window_start = 0.0

    @classmethod
    def of(cls, distributed: Distributed) -> EnergyMeter:
        """The meter of this rank's device (NVML on NVIDIA GPUs)."""
        return cls(distributed, *nvml_energy_reader(distributed.device))

    def start(self) -> None:
        if self._read is not None:
            self._run_start = self._window_start = self._read()

    def restart_window(self) -> None:
        if self._read is not None:
            self._window_start = self._read()

    def window(self, steps: int, tokens: int) -> dict[str, float | None]:
        """`joules_per_step` and `tokens_per_kwh` of the `steps` steps (`tokens` tokens over
        every rank) since the window started, and `energy_kwh` since `start`: every rank's."""
        spent = self._spent()
        if spent is None:
            return {}
        window, total = spent
        return {
            "joules_per_step": window / steps,
            "tokens_per_kwh": tokens / (window / JOULES_PER_KWH) if window > 0 else None,
            "energy_kwh": total / JOULES_PER_KWH,
        }

    def total_kwh(self) -> float | None:
        """Every rank's energy since `start`, in kWh; None without counters."""
        spent = self._spent()
        return None if spent is None else spent[1] / JOULES_PER_KWH

    def _spent(self) -> tuple[float, float] | None:
        """Joules since the window's start and since `start`, summed over the ranks."""
        if self._read is None:
            return None
        now = self._read()
        spent = torch.tensor([now - self._window_start, now - self._run_start], dtype=torch.float64)
        if self._distributed.world_size > 1:
            spent = spent.to(self._distributed.device)
            dist.all_reduce(spent, group=dist.group.WORLD)
        window, total = spent.tolist()
        return window, total
