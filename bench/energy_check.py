"""What a run says it cost against the GPU's energy counter read by the benchmark itself: a
llama-1b run (`fastllm.training.Trainer.fit`, as `fastllm train` runs it) of --intervals
logging intervals of --interval steps, on random tokens. The benchmark reads NVML through
nvidia-ml-py (`bench_common.EnergyMeter`, not fastllm's reader) before the first step of each
logged window and after its last step, and compares its joules with each logged
`joules_per_step` × steps and its total with the last logged `energy_kwh`. Target: within 2%.

    python bench/energy_check.py --out bench/results/energy_check
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench_common import (
    EnergyMeter,
    commit_info,
    fmt,
    machine_info,
    markdown_table,
    write_json,
    write_random_dataset,
)
from train_bench import load_trainer_config

JOULES_PER_KWH = 3.6e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--interval", type=int, default=5, help="steps per logged window")
    parser.add_argument("--intervals", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from fastllm.engine.engine import Engine
    from fastllm.training import Trainer

    steps = args.interval * args.intervals
    work = Path(tempfile.mkdtemp(prefix="energy_check_"))
    probe = load_trainer_config(args.model, [])
    data = write_random_dataset(
        work / "data",
        vocab_size=probe.model.base_model.vocab_size,
        tokens=(steps + 1) * args.batch * args.seq + 1,
        document_length=None,
        seed=1,
    )
    config = load_trainer_config(
        args.model,
        [
            f"data.path=[{data['path']}]",
            f"run.experiment_dir={work / 'run'}",
            f"training.train_iters={steps}",
            f"training.logs.interval={args.interval}",
            f"batch.batch_size={args.batch}",
            f"batch.micro_batch_size={args.micro_batch}",
            f"batch.sequence_length={args.seq}",
            "training.checkpoint.at_end=false",
            "training.export.interval=null",
        ],
    )
    meter = EnergyMeter(torch.cuda.current_device())
    if meter.joules() is None:
        raise SystemExit("no NVML energy counter here (nvidia-ml-py and an NVIDIA GPU needed)")
    readings: list[float] = []  # before each window's first step, after its last
    train_step = Engine.train_step

    def read_around(engine: Engine, micro_batches: Any) -> dict[str, Any]:
        if engine.state.step % args.interval == 0:  # the first step of a window
            readings.append(meter.joules() or 0.0)
        metrics = train_step(engine, micro_batches)
        if engine.state.step % args.interval == 0:  # its last: the run reads the counter next
            torch.cuda.synchronize()
            readings.append(meter.joules() or 0.0)
        return metrics

    Engine.train_step = read_around  # type: ignore[method-assign]
    Trainer(config).fit()
    records = [
        json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    logged = [r for r in records if "joules_per_step" in r]
    windows = [end - start for start, end in zip(readings[::2], readings[1::2], strict=True)]
    rows = []
    for record, joules in zip(logged, windows, strict=True):
        ours = record["joules_per_step"] * args.interval
        rows.append(
            {
                "step": record["step"],
                "logged_joules": ours,
                "benchmark_joules": joules,
                "difference": ours / joules - 1,
                "tokens_per_kwh": record["tokens_per_kwh"],
            }
        )
    total = readings[-1] - readings[0]
    logged_total = logged[-1]["energy_kwh"] * JOULES_PER_KWH
    report = {
        "benchmark": "energy_check",
        **commit_info(args.commit),
        "machine": machine_info(),
        "model": args.model,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "interval": args.interval,
        "windows": rows,
        "benchmark_total_joules": total,
        "logged_total_joules": logged_total,
        "total_difference": logged_total / total - 1,
        "within_2_percent": all(abs(r["difference"]) <= 0.02 for r in rows)
        and abs(logged_total / total - 1) <= 0.02,
    }
    write_json(args.out / "energy_check.json", report)
    table = [
        [str(r["step"]), fmt(r["logged_joules"], ",.0f"), fmt(r["benchmark_joules"], ",.0f"),
         fmt(100 * r["difference"], "+.2f"), fmt(r["tokens_per_kwh"], ",.0f")]
        for r in rows
    ]  # fmt: skip
    table.append(
        ["total", fmt(logged_total, ",.0f"), fmt(total, ",.0f"),
         fmt(100 * report["total_difference"], "+.2f"), ""]
    )  # fmt: skip
    headers = ["window to step", "logged J", "NVML J (benchmark)", "difference %", "tokens/kWh"]
    text = markdown_table(headers, table)
    (args.out / "energy_check.md").write_text(text + "\n")
    print(text)
    print(f"within 2%: {report['within_2_percent']}")


if __name__ == "__main__":
    main()
