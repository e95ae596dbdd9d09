"""metrics.jsonl holds whole lines of strict JSON, one record per step, across crashes and
resumes."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from fastllm.training.metrics import MetricsLogger


def logger(directory: Path, start_step: int) -> MetricsLogger:
    """The logger of a run resumed at `start_step` (0: a fresh one)."""
    return MetricsLogger(directory, total_steps=10, start_step=start_step, stream=io.StringIO())


def records(directory: Path) -> list[dict]:
    # parse_constant rejects the NaN/Infinity literals that strict JSON readers refuse.
    text = (directory / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line, parse_constant=_refuse) for line in text.splitlines()]


def _refuse(literal: str) -> None:
    raise ValueError(f"not strict JSON: {literal}")


def test_a_partial_last_line_is_cut_before_appending(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo')
    metrics = logger(tmp_path, start_step=2)
    metrics.log(3, {"loss": 2.0})
    metrics.close()
    assert records(tmp_path) == [{"step": 1, "loss": 2.5}, {"step": 3, "loss": 2.0}]


def test_records_past_the_resumed_step_are_dropped_so_replayed_steps_appear_once(
    tmp_path: Path,
) -> None:
    lines = [{"step": step, "loss": 1.0 / step} for step in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    stream = io.StringIO()
    metrics = MetricsLogger(tmp_path, total_steps=10, start_step=3, stream=stream)
    assert "2 record(s) after step 3 dropped, this run replays those steps" in stream.getvalue()
    for step in (4, 5):
        metrics.log(step, {"loss": 0.5})
    metrics.close()
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4, 5]
    assert records(tmp_path)[3] == {"step": 4, "loss": 0.5}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_non_finite_values_are_written_as_null_and_counted(tmp_path: Path) -> None:
    metrics = logger(tmp_path, start_step=0)
    metrics.log(1, {"loss": math.nan, "grad_norm": math.inf, "lr": 0.1})
    metrics.log(2, {"loss": 1.5, "lr": 0.1})
    metrics.close()
    assert records(tmp_path) == [
        {"step": 1, "loss": None, "grad_norm": None, "lr": 0.1, "non_finite": 2},
        {"step": 2, "loss": 1.5, "lr": 0.1},
    ]
