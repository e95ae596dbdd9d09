"""`training.profile`: torch.profiler around chosen optimizer steps of `fit`, written per rank
as a trace (Perfetto / chrome://tracing) and a table of time per operator and kernel."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fastllm.config.training import ProfileConfig


class StepProfiler:
    def __init__(self, config: ProfileConfig, directory: Path, rank: int, device: torch.device):
        self.config, self.directory, self.rank, self.device = config, directory, rank, device
        self._profile: profile | None = None

    def before(self, step: int) -> None:
        """`step`: the optimizer step about to run (1-based)."""
        if self.config.step is not None and step == self.config.step:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(activities=activities, record_shapes=True)
            self._profile.__enter__()

    def after(self, step: int) -> None:
        """After `step` ran: write the results once the last profiled step is done."""
        if self._profile is None or self.config.step is None:
            return
        if step < self.config.step + self.config.steps - 1:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._profile.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.directory / f"rank_{self.rank}.json"))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self._profile.key_averages().table(sort_by=sort, row_limit=60)
        (self.directory / f"rank_{self.rank}.txt").write_text(table + "\n")
        self._profile = None

    def close(self) -> None:
        """Stop a profile the run ended inside of, writing nothing."""
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None
