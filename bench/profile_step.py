"""Where a fastllm training step spends its GPU time: the step of bench/train_bench.py (the same
config, data and code path) under torch.profiler, its kernels grouped by what they do.

    python bench/profile_step.py --model 1b --out bench/results/profile_h200_1b
    python bench/profile_step.py --model 1b --tiny --device cpu --out /tmp/profile   # smoke
    python bench/profile_step.py --model mistral --lora --timeline --out /tmp/lora   # LoRA's step

Writes OUT/profile.json (per group and per kernel: calls, total ms per step, share of the step)
and OUT/profile.md; with --trace, a Chrome trace too (large). With --timeline, the wall time of
unprofiled steps and where the GPU sits idle (bench/step_timeline.py): once from a trace of
CUDA activity alone (the idle time without the profiler's host overhead), once with the host's
operators (which of them the GPU waited for), to OUT/timeline_cuda.md and timeline_host.md."""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench_common import commit_info, machine_info, markdown_table, write_json, write_random_dataset
from train_bench import LORA, MODELS, load_trainer_config, model_overrides, run_overrides

GROUPS = [
    ("attention", r"cudnn|fmha|flash|attention|sdpa"),
    ("nccl", r"nccl"),
    ("matmul", r"gemm|cutlass|sm90|sm100|nvjet|matmul|xmma|cublas"),
    # Our Triton kernels are named `_name_kernel`; torch's are `void at::native::..._kernel<...>`.
    ("fastllm triton", r"^_[a-z0-9_]+_kernel$|triton"),
    ("copy / cast", r"copy|memcpy|memset|convert|cast"),
    ("elementwise / reduce", r"elementwise|reduce|vectorized|unrolled|index|scatter|gather"),
]


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, lowered):
            return group
    return "other"


def profile(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from fastllm.training import Trainer

    work = Path(tempfile.mkdtemp(prefix="fastllm-profile-"))
    config = load_trainer_config(args.model, model_overrides(args.model, args))
    dataset = write_random_dataset(
        work / "dataset",
        vocab_size=config.model.base_model.vocab_size,
        tokens=(args.warmup + args.steps + 1) * 64 * args.accumulate * (args.seq + 1),
        document_length=None,
        seed=0,
    )
    timed_steps = args.steps
    if args.timeline:  # three more windows of `steps` steps: unprofiled, CUDA alone, host + CUDA
        args.steps *= 4
    overrides = [*run_overrides(args.model, args, work / "exp", Path(dataset["path"])), *args.set]
    if args.lora:
        overrides += LORA
    trainer = Trainer(load_trainer_config(args.model, overrides))
    args.steps = timed_steps
    cuda = trainer.distributed.device.type == "cuda"
    batches = iter(trainer.data_loader())
    for _ in range(args.warmup):
        trainer.engine.train_step(next(batches))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities, record_shapes=args.ops > 0) as prof:
        for _ in range(args.steps):
            trainer.engine.train_step(next(batches))
        if cuda:
            torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(str(args.out / "trace.json"))
    timing = timeline_windows(trainer, batches, args) if args.timeline and cuda else {}
    ops = _operators(prof, args, cuda) if args.ops else []
    return {
        "benchmark": "profile",
        **commit_info(args.commit),
        "machine": machine_info(),
        "model": args.model,
        "seq": args.seq,
        "micro_batch": trainer.config.batch.micro_batch_size,
        **kernel_summary(prof, args.steps, cuda, args.top),
        "operators": ops,
        **timing,
    }


def kernel_summary(
    prof: Any, steps: int, cuda: bool, top: int, launchers: int = 0
) -> dict[str, Any]:
    """A profile of `steps` steps by kernel (the `top` longest) and by group, per step; with
    `launchers`, that many host operators by the device time of the kernels they launched
    themselves (which operator a kernel such as a reduction comes from)."""
    events = prof.key_averages()
    kernels: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "ms": 0.0})
    for event in events:
        time_us = event.device_time_total if cuda else event.self_cpu_time_total
        if time_us <= 0 or (cuda and event.device_type.name != "CUDA"):
            continue
        kernels[event.key]["calls"] += event.count / steps
        kernels[event.key]["ms"] += time_us / 1e3 / steps
    total = sum(k["ms"] for k in kernels.values()) or 1.0
    groups: dict[str, float] = defaultdict(float)
    for name, stats in kernels.items():
        groups[group_of(name)] += stats["ms"]
    longest = sorted(kernels.items(), key=lambda item: -item[1]["ms"])[:top]
    launched = [
        {"op": event.key, "calls": event.count / steps,
         "ms": event.self_device_time_total / 1e3 / steps}
        for event in events
        if cuda and event.device_type.name == "CPU" and event.self_device_time_total > 0
    ]  # fmt: skip
    return {
        "timed": "device kernels" if cuda else "CPU operators (self time)",
        "ms_per_step": total,
        "groups": {g: {"ms": ms, "share": ms / total} for g, ms in sorted(groups.items())},
        "kernels": [
            {"name": name, "group": group_of(name), **stats, "share": stats["ms"] / total}
            for name, stats in longest
        ],
        "launchers": sorted(launched, key=lambda row: -row["ms"])[:launchers],
    }


def timeline_windows(trainer: Any, batches: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Unprofiled steps' wall time, then the idle analysis of two profiled windows."""
    import torch
    from step_timeline import table as timeline_table
    from step_timeline import timeline
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(args.steps):
        trainer.engine.train_step(next(batches))
    torch.cuda.synchronize()
    result: dict[str, Any] = {"wall_ms_per_step": (time.perf_counter() - began) * 1e3 / args.steps}
    for name, activities in (
        ("cuda", [ProfilerActivity.CUDA]),
        ("host", [ProfilerActivity.CPU, ProfilerActivity.CUDA]),
    ):
        with torch_profile(activities=activities) as prof:
            for _ in range(args.steps):
                trainer.engine.train_step(next(batches))
            torch.cuda.synchronize()
        trace = Path(tempfile.mkdtemp(prefix="fastllm-trace-")) / "trace.json"
        prof.export_chrome_trace(str(trace))
        report = timeline(json.loads(trace.read_text()))
        trace.unlink()
        (args.out / f"timeline_{name}.md").write_text(timeline_table(report, args.steps) + "\n")
        result[f"timeline_{name}"] = report
    return result


# The operators whose device time the matmuls' shapes explain: (op, input shapes) rows.
_OPERATORS = re.compile(r"^aten::(mm|addmm|_scaled_mm|bmm)$")


def _operators(prof: Any, args: argparse.Namespace, cuda: bool) -> list[dict[str, Any]]:
    """The matmul operators by input shapes: calls and device ms per step (the kernels they
    launched), so each product's time can be set against its FLOPs."""
    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        if not _OPERATORS.match(event.key):
            continue
        time_us = event.device_time_total if cuda else event.cpu_time_total
        shapes = [list(s) for s in event.input_shapes if s]
        flops = _matmul_flops(event.key, shapes)
        ms = time_us / 1e3 / args.steps
        calls = event.count / args.steps
        rows.append({
            "op": event.key, "shapes": shapes, "calls": calls, "ms": ms,
            "tflops": flops * calls / ms / 1e9 if flops and ms > 0 else None,
        })  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms"])[: args.ops]


def _matmul_flops(op: str, shapes: list[list[int]]) -> float | None:
    """2·M·N·K of one call, from its operands' shapes."""
    mats = [s for s in shapes if len(s) == 2]
    if op == "aten::addmm" and len(mats) >= 3:
        (m, k), (_, n) = mats[1], mats[2]
    elif len(mats) >= 2:
        (m, k), (_, n) = mats[0], mats[1]
    else:
        return None
    return 2.0 * m * n * k


def table(report: dict[str, Any]) -> str:
    rows = [
        [group, f"{v['ms']:.2f}", f"{100 * v['share']:.1f}"]
        for group, v in sorted(report["groups"].items(), key=lambda item: -item[1]["ms"])
    ]
    rows += [
        [k["name"][:90], f"{k['ms']:.2f}", f"{100 * k['share']:.1f}"] for k in report["kernels"]
    ]
    text = markdown_table(["group / kernel", "ms per step", "% of step"], rows)
    if report.get("operators"):
        op_rows = [
            [o["op"], " ".join("x".join(map(str, s)) for s in o["shapes"]), f"{o['calls']:.0f}",
             f"{o['ms']:.2f}", "" if o["tflops"] is None else f"{o['tflops']:.0f}"]
            for o in report["operators"]
        ]  # fmt: skip
        text += "\n\n" + markdown_table(
            ["operator", "input shapes", "calls", "ms per step", "TFLOP/s"], op_rows
        )
    if report.get("launchers"):
        launcher_rows = [
            [o["op"], f"{o['calls']:.0f}", f"{o['ms']:.2f}"] for o in report["launchers"]
        ]
        text += "\n\n" + markdown_table(
            ["host operator", "calls", "ms per step of the kernels it launched"], launcher_rows
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches a step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=30, help="kernels listed")
    parser.add_argument("--ops", type=int, default=0, help="matmul operators listed by shape")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--timeline", action="store_true", help="wall time and GPU idle gaps")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides")
    parser.add_argument("--lora", action="store_true", help="train_bench's fastllm-lora adapters")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.tiny:
        args.seq = min(args.seq, 64)
    if args.device == "cpu":
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    args.out.mkdir(parents=True, exist_ok=True)
    report = profile(args)
    write_json(args.out / "profile.json", report)
    text = table(report)
    (args.out / "profile.md").write_text(text + "\n")
    print(f"{report['ms_per_step']:.1f} ms per step ({report['timed']})\n\n{text}")
    for name in ("cuda", "host"):
        if f"timeline_{name}" in report:
            print(
                f"\nwall {report['wall_ms_per_step']:.1f} ms per step unprofiled; timeline ({name}):"
            )
            print((args.out / f"timeline_{name}.md").read_text()[:6000])


if __name__ == "__main__":
    main()
