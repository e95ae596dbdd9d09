"""The energy one training step's matmuls and attention alone take on the GPU, at its power
limit: a floor under the step's joules, so under its time when the card runs at that limit.

For llama-1b's geometry at --seq tokens in one sequence (the long-context issue's 16k step):
- attention: cuDNN causal attention forward + backward of every block (SDPA, as the model
  calls it);
- matmuls: every product of the step with its real shapes and output dtypes (the blocks'
  projections forward, input and fp32 weight gradients; the head's fp32 logits, input and
  fp32 weight gradients in 2048-row chunks).
Each runs back to back for --seconds (the card settles at its power limit), read through the
GPU's energy counter (NVML). With --step-joules (a measured step's) the table adds what is
left for everything else.

    python bench/energy_floor.py --seq 16384 --out bench/results/energy_floor
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import EnergyMeter, commit_info, fmt, machine_info, markdown_table, write_json
from train_bench import geometry, load_trainer_config

CHUNK = 2048
"""Rows per chunk of the head (fastllm_kernels.cross_entropy's at a 128k vocabulary)."""


def attention_work(g: dict[str, Any], seq: int) -> tuple[Callable[[], None], float]:
    """One step's attention (forward + backward of every block) and its causal FLOPs."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def make(heads: int) -> torch.Tensor:
        t = torch.randn(1, seq, heads, g["head_size"], device="cuda", dtype=torch.bfloat16)
        return t.transpose(1, 2).requires_grad_()

    q, k, v = make(g["heads"]), make(g["kv_heads"]), make(g["kv_heads"])
    grad = torch.randn_like(q)

    def work() -> None:
        for _ in range(g["layers"]):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(grad)

    flops = g["layers"] * 3.5 * 4 * g["heads"] * g["head_size"] * seq * seq / 2
    return work, flops


def matmul_work(g: dict[str, Any], seq: int) -> tuple[Callable[[], None], float]:
    """One step's matmuls and their FLOPs."""
    import torch

    hidden, ffn, vocab = g["hidden"], g["ffn"], g["vocab"]
    q_size, kv_size = g["heads"] * g["head_size"], g["kv_heads"] * g["head_size"]
    linears = [(hidden, q_size + 2 * kv_size), (q_size, hidden), (hidden, 2 * ffn), (ffn, hidden)]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    blocks = []
    for fan_in, fan_out in linears:
        x, w, dy = rand(seq, fan_in), rand(fan_out, fan_in), rand(seq, fan_out)
        dw = torch.empty(fan_out, fan_in, device="cuda", dtype=torch.float32)
        blocks.append((x, w, dy, dw))
    head = rand(vocab, hidden)
    chunk_x, grad_logits = rand(CHUNK, hidden), rand(CHUNK, vocab)
    logits = torch.empty(CHUNK, vocab, device="cuda", dtype=torch.float32)
    head_grad = torch.empty(vocab, hidden, device="cuda", dtype=torch.float32)

    def work() -> None:
        for _ in range(g["layers"]):
            for x, w, dy, dw in blocks:
                x @ w.T  # forward
                dy @ w  # input gradient
                torch.mm(dy.T, x, out_dtype=torch.float32, out=dw)  # weight gradient, fp32
        for c in range(seq // CHUNK):
            torch.mm(chunk_x, head.T, out_dtype=torch.float32, out=logits)
            grad_logits @ head
            if c:
                torch.addmm(
                    head_grad, grad_logits.T, chunk_x, out_dtype=torch.float32, out=head_grad
                )
            else:
                torch.mm(grad_logits.T, chunk_x, out_dtype=torch.float32, out=head_grad)

    per_token = g["layers"] * sum(fan_in * fan_out for fan_in, fan_out in linears) + vocab * hidden
    return work, 6 * per_token * seq


def measure(work: Callable[[], None], seconds: float, meter: EnergyMeter) -> dict[str, Any]:
    import torch

    work()
    torch.cuda.synchronize()
    start, runs = time.perf_counter(), 0
    joules = meter.joules()
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    while time.perf_counter() - start < seconds:
        work()
        runs += 1
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    spent = meter.joules()
    return {
        "runs": runs,
        "ms": begin.elapsed_time(end) / runs,
        "joules": None if joules is None or spent is None else (spent - joules) / runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--step-joules", type=float, help="a measured step's joules, to compare")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    g = geometry(load_trainer_config(args.model, []))
    meter = EnergyMeter()
    rows = {}
    for name, make in (("attention", attention_work), ("matmuls", matmul_work)):
        work, flops = make(g, args.seq)
        rows[name] = {**measure(work, args.seconds, meter), "tflop": flops / 1e12}
        rows[name]["tflops"] = flops / rows[name]["ms"] / 1e9
    floor = sum(r["joules"] for r in rows.values()) if meter.limit_w else None
    report = {
        "benchmark": "energy_floor",
        **commit_info(args.commit),
        "machine": machine_info(),
        "model": args.model,
        "seq": args.seq,
        "power_limit_w": meter.limit_w,
        "parts": rows,
        "floor_joules": floor,
        "floor_ms_at_limit": None if floor is None else 1e3 * floor / meter.limit_w,
        "step_joules": args.step_joules,
    }
    write_json(args.out / "energy_floor.json", report)
    table = [
        [name, fmt(r["tflop"], ".1f"), fmt(r["ms"], ".1f"), fmt(r["tflops"], ".0f"),
         fmt(r["joules"], ".1f")]
        for name, r in rows.items()
    ]  # fmt: skip
    table.append(["both", "", "", "", fmt(floor, ".1f")])
    if args.step_joules and floor is not None:
        table.append(
            ["the rest of a measured step", "", "", "", fmt(args.step_joules - floor, ".1f")]
        )
    text = markdown_table(["part", "TFLOP", "ms", "TFLOP/s", "J"], table)
    (args.out / "energy_floor.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
