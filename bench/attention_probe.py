"""Causal attention forward + backward at llama-1b's shape (32 query heads, 8 key/value heads,
head size 64) through SDPA's cuDNN backend, in the memory layouts and head groupings the model
could hand it, each under sustained load (the card at its power limit, as in training):

- bshd: (batch, seq, heads, head) tensors, as split_qkv_rotary writes them, transposed views
  to SDPA (what training runs);
- bhsd: (batch, heads, seq, head) contiguous tensors;
- *_mha: the key/value heads repeated to 32 heads, no GQA in the kernel.

Each variant runs back to back for --seconds, twice, in alternation; the table gives the median
of its iterations' CUDA-event times, the causal TFLOP/s and the joules per iteration.

    python bench/attention_probe.py --seq 16384 --out bench/results/attention_probe
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench_common import (
    EnergyMeter,
    commit_info,
    fmt,
    machine_info,
    markdown_table,
    write_json,
)

HEADS, KV_HEADS, HEAD = 32, 8, 64
VARIANTS = ("bshd", "bhsd", "bshd_mha", "bhsd_mha")


def tensors(variant: str, seq: int) -> tuple[Any, ...]:
    """q, k, v and the output gradient as SDPA sees them, (batch, heads, seq, head) shaped."""
    import torch

    def make(heads: int) -> torch.Tensor:
        if variant.startswith("bshd"):
            t = torch.randn(1, seq, heads, HEAD, device="cuda", dtype=torch.bfloat16)
            return t.transpose(1, 2)
        return torch.randn(1, heads, seq, HEAD, device="cuda", dtype=torch.bfloat16)

    q, k, v, grad = make(HEADS), make(KV_HEADS), make(KV_HEADS), make(HEADS)
    if variant.endswith("_mha"):  # repeated in the same layout
        k, v = (
            t.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=2).transpose(1, 2)
            if variant.startswith("bshd")
            else t.repeat_interleave(HEADS // KV_HEADS, dim=1)
            for t in (k, v)
        )
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def run(variant: str, seq: int, seconds: float, meter: EnergyMeter) -> dict[str, Any]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    q, k, v, grad = tensors(variant, seq)
    gqa = k.shape[1] != q.shape[1]

    def step() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        out.backward(grad)

    step()
    torch.cuda.synchronize()
    events, begin = [], time.perf_counter()
    joules = meter.joules()
    while time.perf_counter() - begin < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
        if len(events) % 8 == 0:
            torch.cuda.synchronize()  # keep the host within a few iterations of the GPU
    torch.cuda.synchronize()
    spent = None if joules is None else meter.joules() - joules
    times = sorted(a.elapsed_time(b) for a, b in events)
    ms = times[len(times) // 2]
    flops = 3.5 * 4 * HEADS * HEAD * seq * seq / 2  # causal: half the scores
    return {
        "variant": variant,
        "iterations": len(times),
        "ms": ms,
        "causal_tflops": flops / ms / 1e9,
        "joules_per_iteration": None if spent is None else spent / len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meter = EnergyMeter()
    rows = [
        {"round": r, **run(variant, args.seq, args.seconds, meter)}
        for r in range(args.rounds)
        for variant in args.variants
    ]
    report = {
        "benchmark": "attention_probe",
        **commit_info(args.commit),
        "machine": machine_info(),
        "seq": args.seq,
        "power_limit_w": meter.limit_w,
        "runs": rows,
    }
    write_json(args.out / "attention_probe.json", report)

    table = markdown_table(
        ["variant", "round", "iterations", "ms", "causal TFLOP/s", "J / iteration"],
        [
            [r["variant"], str(r["round"]), str(r["iterations"]), fmt(r["ms"], ".3f"),
             fmt(r["causal_tflops"], ".0f"), fmt(r["joules_per_iteration"], ".2f")]
            for r in rows
        ],
    )  # fmt: skip
    (args.out / "attention_probe.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
