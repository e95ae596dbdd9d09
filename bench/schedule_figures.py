"""The pipeline simulator's figures (`fastllm schedule`): predicted throughput of the
breadth-first, depth-first (looped) and depth-first (one stage per rank) schedules against the
micro-batches per pipeline, with ZeRO-1 and ZeRO-3, and the timelines of one setting. A CPU
script (no GPU): the cost model's defaults are the H200's compute rate and one 200 Gb/s link
per GPU (python/fastllm/engine/schedule/simulator.py).

    python bench/schedule_figures.py --out bench/results/schedule-sim
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from bench_common import pyplot

from fastllm.config import TrainerConfig, load_config
from fastllm.engine.schedule.simulator import VARIANTS, draw, predict

CONFIG = str(Path(__file__).parent.parent / "examples" / "llama3-8b.yaml")
WORLD = 32  # pipeline 4 × data 8
BASE = [
    "model.distributed.pipeline_parallel=4",
    "model.multi_stage.layers_per_stage=2",  # 16 stages: 4 per rank, looped
    "batch.micro_batch_size=1",
    "batch.sequence_length=4096",
]
MICRO_BATCHES = [4, 8, 16, 32]
"""Per pipeline (data-parallel replica): the batch per GPU, in sequences, with one stage of
each of the 4 pipeline ranks holding a quarter of the model."""


def config_for(zero: int, micro_batches: int) -> TrainerConfig:
    overrides = [
        *BASE,
        f"model.multi_stage.zero_stage={zero}",
        f"batch.batch_size={micro_batches * WORLD // 4}",
        f"schedule.breadth_first_micro_batches={micro_batches}",
    ]
    return load_config(TrainerConfig, [CONFIG], overrides)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    rows = []
    for zero in (1, 3):
        for micro_batches in MICRO_BATCHES:
            config = config_for(zero, micro_batches)
            tokens = micro_batches * config.batch.sequence_length / 4  # per GPU and step
            for p in predict(config, WORLD):
                rows.append({
                    "zero_stage": zero, "micro_batches": micro_batches, "schedule": p.name,
                    "step_s": p.step_time, "bubble": p.bubble, "exposed_s": p.exposed,
                    "tokens_per_s_per_gpu": tokens / p.step_time,
                })  # fmt: skip
            if micro_batches == 4:
                draw(
                    predict(config, WORLD),
                    args.out / f"timeline_zero{zero}_4.png",
                    f"llama-8b, {WORLD} GPUs (pipeline 4 × data 8), ZeRO-{zero}, 4 micro-batches "
                    "of 1 × 4096 per pipeline",
                )
    report = {"commit": commit, "config": "examples/llama3-8b.yaml", "world_size": WORLD, "overrides": BASE,
              "cost_model": "simulator defaults", "rows": rows}  # fmt: skip
    (args.out / "schedule_sim.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{'ZeRO':>4} {'micro':>5} {'schedule':34} {'tok/s/GPU':>10} {'bubble':>7} {'exposed':>8}"
    )
    for r in rows:
        print(
            f"{r['zero_stage']:>4} {r['micro_batches']:>5} {r['schedule']:34} "
            f"{r['tokens_per_s_per_gpu']:10,.0f} {r['bubble']:7.1%} {r['exposed_s']:7.2f}s"
        )
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, zero in zip(axes, (1, 3), strict=True):
        for name in VARIANTS:
            points = [r for r in rows if r["zero_stage"] == zero and r["schedule"] == name]
            axis.plot(
                [r["micro_batches"] for r in points],
                [r["tokens_per_s_per_gpu"] for r in points],
                marker="o",
                label=name,
            )
        axis.set_xscale("log", base=2)
        axis.set_xticks(MICRO_BATCHES, [str(m) for m in MICRO_BATCHES])
        axis.set_title(f"ZeRO-{zero}")
        axis.set_xlabel("micro-batches (sequences) per pipeline")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("predicted tokens/s per GPU")
    axes[0].legend(fontsize=8)
    figure.suptitle(
        f"llama-8b on {WORLD} GPUs, pipeline 4 × data 8, 200 Gb/s per GPU (simulated, {commit})",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(args.out / "schedule_sim.png", dpi=110)


if __name__ == "__main__":
    main()
