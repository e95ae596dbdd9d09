"""What a run reports: a line every `training.logs.interval` steps, a progress bar with ETA,
`metrics.jsonl` (one strict JSON object per logged step, see `metrics_file`), and TensorBoard /
W&B when configured."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from fastllm.training.metrics_file import MetricsFile

PEAK_FLOPS = {"cuda": 989.4e12}
"""Dense bf16 peak per GPU for MFU (H100/H200, as torchtitan counts it)."""


class MetricsLogger:
    def __init__(
        self,
        directory: Path | None,
        *,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        config: dict[str, Any] | None = None,
        stream: TextIO = sys.stderr,
    ) -> None:
        self.enabled, self.total_steps, self.stream = enabled, total_steps, stream
        self.file = None
        self._start, self._first_step = time.perf_counter(), start_step
        self._tensorboard = self._wandb = None
        if not enabled or directory is None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.file = MetricsFile(directory, start_step)
        if self.file.dropped:
            stream.write(
                f"fastllm: {self.file.path}: {self.file.dropped} record(s) after step "
                f"{start_step} dropped, this run replays those steps\n"
            )
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(directory / "tensorboard"))
        if wandb_project:
            import wandb

            self._wandb = wandb.init(
                project=wandb_project, dir=str(directory), config=config, resume="allow"
            )

    def log(self, step: int, metrics: dict[str, float | int | None]) -> None:
        """Record the metrics of `step` (1-based, steps completed)."""
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        if self.file is not None:
            self.file.write(record)
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float):
                    self._tensorboard.add_scalar(f"train/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        self.stream.write(self._line(step, metrics) + "\n")
        self.stream.flush()

    def _line(self, step: int, metrics: dict[str, Any]) -> str:
        done = step - self._first_step
        elapsed = time.perf_counter() - self._start
        remaining = (self.total_steps - step) * elapsed / max(done, 1)
        width = 20
        filled = int(width * step / max(self.total_steps, 1))
        bar = "█" * filled + "·" * (width - filled)
        parts = [f"[{bar}] step {step}/{self.total_steps}", f"ETA {_duration(remaining)}"]
        if metrics.get("loss") is not None:
            parts.append(f"loss {metrics['loss']:.4f}")
        for key, value in metrics.items():  # the loss evaluators' (NAME_loss)
            if key.endswith("_loss") and value is not None:
                parts.append(f"{key.removesuffix('_loss')} {value:.4f}")
        for key, fmt in (
            ("lr", "lr {:.2e}"),
            ("grad_norm", "grad {:.3f}"),
            ("tokens_per_s", "{:,.0f} tok/s"),
            ("tflops", "{:.1f} TFLOP/s"),
            ("mfu", "MFU {:.1%}"),
            ("joules_per_step", "{:,.0f} J/step"),
            ("energy_kwh", "{:.3g} kWh"),
            ("memory_gib", "mem {:.1f} GiB"),
            ("expert_tokens_max", "experts max {:,.0f}"),
            ("skipped_steps", "skipped {}"),
        ):
            if metrics.get(key) is not None:
                parts.append(fmt.format(metrics[key]))
        return " | ".join(parts)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
