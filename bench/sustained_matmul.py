"""The bf16 matmul ceiling under sustained load: one training-sized matmul back to back for
--seconds, its TFLOP/s per window next to the GPU's SM clock and power draw (nvidia-smi).

A short burst (the usual microbenchmark) runs at the boost clock; a training run keeps the GPU
busy for hours, and once it reaches its power limit the clock drops. This script measures both,
so a training MFU can be set against the ceiling it actually had.

    python bench/sustained_matmul.py --out bench/results/sustained_matmul_h200.json
    python bench/sustained_matmul.py --seconds 2 --m 256 --n 256 --k 256 --out /tmp/s.json  # CPU

Writes OUT (JSON: windows with TFLOP/s, clock and power; burst and sustained summaries) and
OUT with .md (a table)."""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench_common import commit_info, machine_info, markdown_table, write_json

PEAK_FLOPS = 989.4e12
"""H100/H200 dense bf16 peak, the MFU denominator (torchtitan's)."""


def sampler(interval_ms: int) -> subprocess.Popen[str] | None:
    """nvidia-smi printing timestamped clock and power of GPU 0, or None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = "timestamp,clocks.sm,power.draw,temperature.gpu"
    return subprocess.Popen(
        [
            "nvidia-smi",
            "-i",
            "0",
            f"--query-gpu={query}",
            "--format=csv,noheader,nounits",
            "-lms",
            str(interval_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def samples(process: subprocess.Popen[str] | None) -> list[dict[str, float]]:
    """The sampler's rows (seconds since the epoch, MHz, W, °C), after stopping it."""
    if process is None:
        return []
    process.terminate()
    output, _ = process.communicate()
    rows = []
    for fields in csv.reader(io.StringIO(output)):
        if len(fields) != 4:
            continue
        try:
            # nvidia-smi's local time, like time.time() below once converted.
            stamp = datetime.strptime(fields[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            clock, power, temperature = (float(f) for f in fields[1:])
        except ValueError:
            continue
        rows.append(
            {
                "t": stamp,
                "clock_mhz": clock,
                "power_w": power,
                "temperature_c": temperature,
            }
        )
    return rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(args.m, args.k, device=device, dtype=dtype)
    b = torch.randn(args.k, args.n, device=device, dtype=dtype)
    out = torch.empty(args.m, args.n, device=device, dtype=dtype)
    flops = 2.0 * args.m * args.n * args.k

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):
        torch.mm(a, b, out=out)
    synchronize()
    # Matmuls per window: about --window seconds at the burst rate.
    start = time.perf_counter()
    for _ in range(10):
        torch.mm(a, b, out=out)
    synchronize()
    per_window = max(1, round(args.window / ((time.perf_counter() - start) / 10)))

    process = sampler(max(50, int(args.window * 500)))
    time.sleep(0.5)  # the sampler's first row, at idle
    windows = []
    begin = time.time()
    while time.time() - begin < args.seconds:
        window_start, wall = time.perf_counter(), time.time()
        for _ in range(per_window):
            torch.mm(a, b, out=out)
        synchronize()
        seconds = time.perf_counter() - window_start
        windows.append(
            {"t": wall - begin, "seconds": seconds, "tflops": per_window * flops / seconds / 1e12}
        )
    gpu = samples(process)
    for window in windows:
        inside = [
            s
            for s in gpu
            if begin + window["t"] <= s["t"] <= begin + window["t"] + window["seconds"]
        ]
        if inside:
            window["clock_mhz"] = sum(s["clock_mhz"] for s in inside) / len(inside)
            window["power_w"] = sum(s["power_w"] for s in inside) / len(inside)

    def summary(part: list[dict[str, Any]]) -> dict[str, Any]:
        tflops = sum(w["tflops"] for w in part) / len(part)
        clocks = [w["clock_mhz"] for w in part if "clock_mhz" in w]
        powers = [w["power_w"] for w in part if "power_w" in w]
        return {
            "windows": len(part),
            "tflops": tflops,
            "share_of_peak": tflops * 1e12 / PEAK_FLOPS,
            "clock_mhz": sum(clocks) / len(clocks) if clocks else None,
            "power_w": sum(powers) / len(powers) if powers else None,
        }

    settled = [w for w in windows if w["t"] >= args.seconds / 2]
    return {
        "benchmark": "sustained_matmul",
        **commit_info(args.commit),
        "machine": machine_info(),
        "shape": {"m": args.m, "n": args.n, "k": args.k, "dtype": str(dtype)},
        "matmuls_per_window": per_window,
        "burst": summary(windows[:1]),
        "sustained": summary(settled or windows[-1:]),
        "windows": windows,
        "gpu_samples": gpu,
    }


def table(report: dict[str, Any]) -> str:
    rows = []
    for name in ("burst", "sustained"):
        part = report[name]
        rows.append(
            [
                f"{name} ({part['windows']} window(s))",
                f"{part['tflops']:.0f}",
                f"{100 * part['share_of_peak']:.1f}",
                "—" if part["clock_mhz"] is None else f"{part['clock_mhz']:.0f}",
                "—" if part["power_w"] is None else f"{part['power_w']:.0f}",
            ]
        )
    shape = report["shape"]
    return (
        f"bf16 matmul {shape['m']}×{shape['k']} @ {shape['k']}×{shape['n']}, back to back\n\n"
        + markdown_table(["", "TFLOP/s", "% of 989.4", "SM clock MHz", "power W"], rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # Default: the llama-1b MLP's first projection at micro-batch 4 × 4096 tokens.
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--window", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = measure(args)
    write_json(args.out, report)
    text = table(report)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
