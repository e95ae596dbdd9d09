"""Kernel benchmark (H200): each fastllm kernel against torch eager and torch.compile of the
same computation, with the two ceilings measured in the same run (device copy bandwidth, bf16
matmul rate). Writes JSON to --out and prints a table.

    python bench/kernel_bench.py --out bench/results/kernels.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from fastllm_kernels.activation import gated_activation_fused
from fastllm_kernels.adam import adamw_step_
from fastllm_kernels.cross_entropy import linear_cross_entropy
from fastllm_kernels.norm import layer_norm, rms_norm
from fastllm_kernels.rotary import apply_rotary

DEVICE = "cuda"


def timed(fn: Callable[[], object]) -> float:
    """Median milliseconds (CUDA events, warm-up excluded)."""
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def ceilings() -> dict[str, float]:
    n = 1 << 30
    src, dst = torch.randn(n // 4, device=DEVICE), torch.empty(n // 4, device=DEVICE)
    copy_ms = timed(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    mm_ms = timed(lambda: a @ b)
    return {"copy_gb_s": 2 * n / copy_ms / 1e6, "matmul_tflop_s": 2 * 8192**3 / mm_ms / 1e9}


def compare(
    name: str, bytes_moved: int, ours: Callable, eager: Callable, compile_baseline: bool = True
) -> dict:
    """`eager` is the torch baseline; it is also timed under torch.compile when asked."""
    row = {"kernel": name, "bytes": bytes_moved}
    runs = [("fastllm", ours), ("eager", eager)]
    if compile_baseline:
        runs.append(("compile", torch.compile(eager)))
    for label, fn in runs:
        ms = timed(fn)
        row[f"{label}_ms"] = ms
        row[f"{label}_gb_s"] = bytes_moved / ms / 1e6
    return row


def bench_norms(rows: list[dict]) -> None:
    x = torch.randn(16384, 4096, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(4096, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(4096, device=DEVICE, dtype=torch.bfloat16)

    def rms_eager() -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)

    def layer_eager() -> torch.Tensor:
        return F.layer_norm(x.float(), (4096,), w.float(), b.float(), 1e-5).to(x.dtype)

    moved = 2 * x.numel() * 2
    rows.append(
        compare("rms_norm fwd 16384x4096 bf16", moved, lambda: rms_norm(x, w, 1e-5), rms_eager)
    )
    rows.append(
        compare(
            "layer_norm fwd 16384x4096 bf16", moved, lambda: layer_norm(x, w, b, 1e-5), layer_eager
        )
    )


def bench_rotary(rows: list[dict]) -> None:
    x = torch.randn(4, 4096, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    angles = torch.randn(4096, 64, device=DEVICE)
    cos, sin = angles.cos(), angles.sin()

    def eager() -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    rows.append(
        compare(
            "rotary fwd 4x4096x32x128 bf16",
            2 * x.numel() * 2,
            lambda: apply_rotary(x, cos, sin),
            eager,
        )
    )


def bench_swiglu(rows: list[dict]) -> None:
    x = torch.randn(16384, 2 * 14336, device=DEVICE, dtype=torch.bfloat16)

    def eager() -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    rows.append(
        compare(
            "swiglu fwd 16384x14336 bf16",
            x.numel() * 2 * 3 // 2,
            lambda: gated_activation_fused(x, "silu"),
            eager,
        )
    )


def bench_adamw(rows: list[dict]) -> None:
    n = 256 * 2**20
    p, g, m, v = (torch.randn(n, device=DEVICE) for _ in range(4))
    v.abs_()
    copy = torch.empty(n, device=DEVICE, dtype=torch.bfloat16)

    def ours() -> None:
        adamw_step_(
            p,
            g,
            m,
            v,
            lr=1e-4,
            beta_1=0.9,
            beta_2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            step=10,
            compute_copy=copy,
        )

    params = [p]
    p.grad = g
    fused = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    fused.step()
    # read p, g, m, v; write p, m, v, bf16 copy
    # Baseline: torch's fused AdamW (reads p, g, m, v; writes p, m, v; no bf16 copy to write).
    rows.append(
        compare(
            "adamw 256M fp32 (+bf16 copy)",
            n * (4 * 4 + 3 * 4 + 2),
            ours,
            fused.step,
            compile_baseline=False,
        )
    )


def bench_cross_entropy(rows: list[dict]) -> None:
    n, h, vocab = 8192, 4096, 128256
    hidden = torch.randn(n, h, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, h, device=DEVICE, dtype=torch.bfloat16) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device=DEVICE)

    def ours() -> None:
        linear_cross_entropy(hidden, weight, labels).backward()

    def eager_loss() -> torch.Tensor:
        return F.cross_entropy((hidden @ weight.T).float(), labels)

    compiled = torch.compile(eager_loss)
    row: dict = {"kernel": f"linear cross-entropy fwd+bwd N={n} H={h} V={vocab} bf16"}
    for label, fn in (
        ("fastllm", ours),
        ("eager", lambda: eager_loss().backward()),
        ("compile", lambda: compiled().backward()),
    ):
        fn()
        torch.cuda.synchronize()
        hidden.grad = weight.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = timed(fn)
        row[f"{label}_ms"] = ms
        row[f"{label}_tflop_s"] = 6 * n * h * vocab / ms / 1e9
        row[f"{label}_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        hidden.grad = weight.grad = None
    rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    for bench in (bench_norms, bench_rotary, bench_swiglu, bench_adamw, bench_cross_entropy):
        bench(rows)
    commit = (
        subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        or None
    )
    result = {
        "commit": commit,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ceilings": ceilings(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ceilings: {result['ceilings']}")
    for row in rows:
        cells = [row["kernel"]] + [
            f"{k}={v:.3g}" for k, v in row.items() if k not in ("kernel", "bytes")
        ]
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
