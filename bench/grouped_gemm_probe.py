"""The experts' grouped matmuls on one GPU: torch._grouped_mm (CUTLASS) against our Triton
kernels (fastllm_kernels.moe.grouped_matmul) at several tiles, on the fine-grained geometry
(8,192 tokens, 64 experts, top-8, hidden 2048, expert ffn 1024) and Mixtral's (top-2 of 8,
hidden 4096, ffn 14336), each projection's forward, input gradient and weight gradient.

The weight gradient is timed as training uses it: CUTLASS writes it in bf16 and a second
pass adds it to the fp32 gradient buffer (`copy_` on a step's first micro-batch, `accumulate_`
on the others), where our kernel writes or adds it there itself. Medians of CUDA-event
timings, in ms.

    python bench/grouped_gemm_probe.py --out bench/results/h200-HASH/grouped_gemm_probe.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench_common import machine_info, median_ms, write_json

GEOMETRIES = {"fine": (8192, 64, 8, 2048, 1024), "mixtral": (8192, 8, 2, 4096, 14336)}
"""tokens, experts, top-k, hidden, expert ffn."""
ROW_TILES = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4))
WEIGHT_TILES = (
    (64, 128, 128, 8, 3),
    (64, 256, 128, 8, 3),
    (32, 128, 128, 4, 4),
    (64, 128, 64, 4, 4),
)


def error(actual: Any, expected: Any) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def projection(ends: Any, rows: int, inputs: int, outputs: int, experts: int) -> dict[str, Any]:
    import torch

    from fastllm_kernels.accumulate import accumulate_
    from fastllm_kernels.moe.grouped_matmul import grouped_rows, grouped_weight_gradient_

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(rows, inputs, **bf16) / 8
    weight = torch.randn(experts, outputs, inputs, **bf16) / 32
    grad = torch.randn(rows, outputs, **bf16) / 8
    buffer = torch.zeros(experts, outputs, inputs, device="cuda")
    used = int(ends[-1])
    r: dict[str, Any] = {"flops": 2 * used * inputs * outputs}
    forward = torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    grad_x = torch._grouped_mm(grad, weight, offs=ends)
    grad_weight = torch._grouped_mm(grad.T, x, offs=ends)
    r["cutlass_forward"] = median_ms(
        lambda: torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    )
    r["cutlass_input_grad"] = median_ms(lambda: torch._grouped_mm(grad, weight, offs=ends))
    r["cutlass_weight_grad"] = median_ms(lambda: torch._grouped_mm(grad.T, x, offs=ends))
    r["cutlass_weight_grad_then_copy"] = median_ms(
        lambda: buffer.copy_(torch._grouped_mm(grad.T, x, offs=ends))
    )
    r["cutlass_weight_grad_then_accumulate"] = median_ms(
        lambda: accumulate_(buffer, torch._grouped_mm(grad.T, x, offs=ends))
    )
    for tile in ROW_TILES:
        name = "x".join(map(str, tile))
        ours = grouped_rows(x, weight, ends, True, tile)
        r[f"ours_forward_{name}"] = median_ms(lambda t=tile: grouped_rows(x, weight, ends, True, t))
        r[f"ours_forward_{name}_error"] = error(ours[:used], forward[:used])
        ours = grouped_rows(grad, weight, ends, False, tile)
        r[f"ours_input_grad_{name}"] = median_ms(
            lambda t=tile: grouped_rows(grad, weight, ends, False, t)
        )
        r[f"ours_input_grad_{name}_error"] = error(ours[:used], grad_x[:used])
    for tile in WEIGHT_TILES:
        name = "x".join(map(str, tile))
        try:
            grouped_weight_gradient_(buffer, grad, x, ends, False, tile)
            r[f"ours_weight_grad_{name}_error"] = error(buffer, grad_weight)
            for accumulate in (False, True):
                r[f"ours_weight_grad_{name}{'_accumulate' if accumulate else ''}"] = median_ms(
                    lambda t=tile, a=accumulate: grouped_weight_gradient_(
                        buffer, grad, x, ends, a, t
                    )
                )
        except Exception as failure:  # a tile that does not fit: recorded
            r[f"ours_weight_grad_{name}_failed"] = str(failure)[:200]
    return r


def geometry(name: str) -> dict[str, Any]:
    import torch

    from fastllm_kernels.moe.sparse_map import sparse_map

    tokens, experts, k, hidden, ffn = GEOMETRIES[name]
    generator = torch.Generator().manual_seed(0)
    chosen = torch.rand(tokens, experts, generator=generator).topk(k, dim=-1).indices
    sparse = sparse_map(chosen.cuda(), experts)
    return {
        "layer_1": projection(sparse.ends, sparse.num_rows, hidden, 2 * ffn, experts),
        "layer_2": projection(sparse.ends, sparse.num_rows, ffn, hidden, experts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=GEOMETRIES)
    args = parser.parse_args()
    report: dict[str, Any] = {"machine": machine_info()}
    for name in args.geometries:
        report[name] = geometry(name)
        write_json(args.out, report)
        for layer, timings in report[name].items():
            print(name, layer)
            for key, value in timings.items():
                print(
                    f"  {key:50s} {value:.4g}" if isinstance(value, float) else f"  {key} {value}"
                )


if __name__ == "__main__":
    main()
