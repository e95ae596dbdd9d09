"""The FP8 kernels' tile shapes on the GPU, at llama-3b's shapes, for each tile (rows × columns,
warps), in GB/s of bytes moved: `fp8.quantize._cast_kernel` under tensorwise delayed scaling
(one pass: read bf16, write the layouts asked for), and the fused MLP's gated backward
(`fp8.gated_mlp._gated_backward_quantize_kernel`: it computes about as much as it moves, so fewer
values a thread win; 32 × 64 tokens × columns with 4 warps the fastest of 25, h200-3ffe8e1).

    python bench/fp8_tiles.py --out bench/results/h200-HASH/fp8_tiles.json
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from bench_common import commit_info, machine_info, markdown_table, write_json

SHAPES = {  # name: (rows, cols, rows layout, columns layout, fp8 format)
    "grad up 8192x16384": (8192, 16384, True, True, "e5m2"),
    "grad qkv 8192x5120": (8192, 5120, True, True, "e5m2"),
    "grad out 8192x3072": (8192, 3072, True, True, "e5m2"),
    "weight up rows 16384x3072": (16384, 3072, True, False, "e4m3"),
    "weight up columns 16384x3072": (16384, 3072, False, True, "e4m3"),
    "weight down columns 3072x8192": (3072, 8192, False, True, "e4m3"),
    "input out rows 8192x3072": (8192, 3072, True, False, "e4m3"),
}
TILES = [(64, 128, 4), (64, 128, 8), (128, 128, 4), (128, 128, 8), (64, 256, 4), (64, 256, 8),
         (128, 64, 4), (32, 256, 4), (128, 256, 8), (256, 128, 8), (32, 64, 4), (32, 64, 2),
         (32, 128, 4), (16, 128, 4), (64, 64, 4), (32, 32, 2), (16, 64, 2)]  # fmt: skip
GATED_TILES = [(64, 128, 8), (64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8),
               (32, 128, 4), (64, 64, 4), (128, 32, 4), (256, 32, 8), (16, 128, 2), (16, 128, 4),
               (32, 64, 2), (32, 64, 4), (32, 128, 2), (16, 256, 4), (32, 256, 4), (32, 256, 8),
               (16, 64, 2), (64, 64, 2), (32, 32, 2), (32, 32, 4), (16, 64, 4), (64, 32, 4),
               (32, 64, 8), (64, 32, 2)]  # fmt: skip


def sweep() -> list[dict]:
    import torch
    import triton

    from fastllm_kernels.fp8.quantize import FP8_MAX, _cast_kernel

    formats = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}
    results = []
    for name, (n_rows, n_cols, rows, columns, fmt) in SHAPES.items():
        dtype = formats[fmt]
        x = torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16)
        history = torch.full((16,), 4.0, device="cuda")
        record = torch.zeros((), device="cuda")
        scale = torch.empty((), device="cuda")
        q = torch.empty(n_rows, n_cols, device="cuda", dtype=dtype) if rows else x
        qt = torch.empty(n_cols, n_rows, device="cuda", dtype=dtype) if columns else x
        moved = x.numel() * (2 + rows + columns)
        reference = None
        for bm, bk, warps in TILES:
            grid = (triton.cdiv(n_rows, bm), triton.cdiv(n_cols, bk))

            launch = functools.partial(
                _cast_kernel[grid],
                x, x.stride(0), n_rows, n_cols, history, history, 16, record, q, scale, qt, scale,
                ROWS=rows, COLS=columns, TENSOR=True, RECORD=True, AMAX_BLOCK=16,
                FP8_MAX=FP8_MAX[dtype], BM=bm, BK=bk, num_warps=warps,
            )  # fmt: skip
            launch()
            out = (
                q.float().sum().item() if rows else 0.0,
                qt.float().sum().item() if columns else 0.0,
            )
            reference = reference or out
            ms = triton.testing.do_bench(launch, warmup=10, rep=50)
            results.append({
                "shape": name, "tile": f"{bm}x{bk} w{warps}", "ms": ms,
                "gb_s": moved / ms / 1e6, "same_output": out == reference,
            })  # fmt: skip
            print(results[-1], flush=True)
    return results


def gated_sweep(n_rows: int = 8192, d: int = 8192) -> list[dict]:
    import torch
    import triton

    from fastllm_kernels.fp8.gated_mlp import _gated_backward_quantize_kernel
    from fastllm_kernels.fp8.quantize import FP8_MAX

    e5m2, e4m3 = torch.float8_e5m2, torch.float8_e4m3fn
    h = torch.randn(n_rows, 2 * d, device="cuda", dtype=torch.bfloat16)
    da = torch.randn(n_rows, d, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(n_rows, 2 * d, device="cuda", dtype=e5m2)
    dh_t = torch.empty(2 * d, n_rows, device="cuda", dtype=e5m2)
    a_t = torch.empty(d, n_rows, device="cuda", dtype=e4m3)
    history, scales = torch.full((16,), 4.0, device="cuda"), torch.empty(3, device="cuda")
    moved = n_rows * d * (2 * 2 + 2 + 2 * 2 + 1)
    results, reference = [], None
    for bm, bk, warps in GATED_TILES:
        launch = functools.partial(
            _gated_backward_quantize_kernel[(triton.cdiv(n_rows, bm), triton.cdiv(d, bk))],
            h, h.stride(0), da, da.stride(0), n_rows, d, dh, dh_t, scales[0], history, 16,
            scales[2], a_t, scales[1], history, 16, ACTIVATION="silu", RECORD=True,
            GRADIENT_AMAX_BLOCK=16, ACTIVATED_AMAX_BLOCK=16, GRADIENT_MAX=FP8_MAX[e5m2],
            ACTIVATED_MAX=FP8_MAX[e4m3], BM=bm, BK=bk, num_warps=warps,
        )  # fmt: skip
        for t in (dh, dh_t, a_t):
            t.zero_()
        launch()
        out = tuple(t.float().sum().item() for t in (dh, dh_t, a_t))
        reference = reference or out
        ms = triton.testing.do_bench(launch, warmup=10, rep=50)
        results.append({
            "shape": f"gated backward {n_rows}x{d}", "tile": f"{bm}x{bk} w{warps}",
            "ms": ms, "gb_s": moved / ms / 1e6, "same_output": out == reference,
        })  # fmt: skip
        print(results[-1], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit")
    parser.add_argument(
        "--kernels", nargs="+", choices=("gated", "cast"), default=["gated", "cast"]
    )
    args = parser.parse_args()
    results = (gated_sweep() if "gated" in args.kernels else []) + (
        sweep() if "cast" in args.kernels else []
    )
    report = {**commit_info(args.commit), "machine": machine_info(), "results": results}
    write_json(args.out, report)
    rows = [
        [r["shape"], r["tile"], f"{r['ms']:.3f}", f"{r['gb_s']:.0f}", str(r["same_output"])]
        for r in results
    ]
    table = markdown_table(["shape", "tile", "ms", "GB/s", "same output"], rows)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
