"""What the dropless MoE layer's kernels cost on the fine-grained geometry (8,192 tokens, 64
experts, top-8, hidden 2048, expert ffn 1024), to choose the next fusions: each grouped matmul
forward + backward with the experts' weights stored (experts, out, in) as now or (experts, in,
out), against the dense matmul of the same FLOPs; and the permutation kernels at 4 and 8 warps
against a plain copy of the same bytes. Medians of CUDA-event timings, in ms.

    python bench/moe_kernel_probe.py --out bench/results/h200-HASH/moe/kernel_probe.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench_common import machine_info, median_ms, write_json

TOKENS, EXPERTS, K, HIDDEN, FFN = 8192, 64, 8, 2048, 1024


def matmuls(sparse: Any, inputs: int, outputs: int) -> dict[str, float]:
    import torch

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    rows = torch.randn(sparse.num_rows, inputs, **bf16).requires_grad_()
    grad = torch.randn(sparse.num_rows, outputs, **bf16)
    timings = {}
    for layout, shape in (
        ("out_in", (EXPERTS, outputs, inputs)),
        ("in_out", (EXPERTS, inputs, outputs)),
    ):
        weight = (torch.randn(*shape, **bf16) / 32).requires_grad_()
        view = weight.transpose(1, 2) if layout == "out_in" else weight
        timings[f"grouped_{layout}"] = median_ms(
            lambda view=view, weight=weight: torch.autograd.grad(
                torch._grouped_mm(rows, view, offs=sparse.ends), (rows, weight), grad
            )
        )
    dense_in = torch.randn(TOKENS * K, inputs, **bf16).requires_grad_()
    dense_weight = (torch.randn(outputs, inputs, **bf16) / 32).requires_grad_()
    dense_grad = torch.randn(TOKENS * K, outputs, **bf16)
    timings["dense_same_flops"] = median_ms(
        lambda: torch.autograd.grad(dense_in @ dense_weight.T, (dense_in, dense_weight), dense_grad)
    )
    return timings


def permutations(sparse: Any) -> dict[str, float]:
    import torch
    import triton

    from fastllm_kernels.moe import sparse_copy

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    tokens = torch.randn(TOKENS, HIDDEN, **bf16)
    y = torch.randn(sparse.num_rows, HIDDEN, **bf16)
    weights = torch.rand(TOKENS, K, **bf16)
    gathered = torch.empty(TOKENS, HIDDEN, **bf16)
    scattered = torch.empty_like(y)
    k_block, block = sparse_copy._gather_settings(HIDDEN, K)
    block_r, block_h = sparse_copy._row_settings(HIDDEN)
    timings = {}
    for block, warps in ((512, 4), (512, 8), (1024, 4), (1024, 8), (2048, 8), (256, 4)):
        timings[f"combine_gather_{block}_columns_{warps}_warps"] = median_ms(
            lambda block=block, warps=warps: sparse_copy._gather_kernel[(TOKENS, triton.cdiv(HIDDEN, block))](
                y, sparse.rows, weights, gathered, HIDDEN, K=K, K_BLOCK=k_block, BLOCK=block,
                SCALE=True, num_warps=warps,
            )
        )  # fmt: skip
    for block_r, block_h, warps in (
        (4, 1024, 4),
        (4, 1024, 8),
        (8, 512, 4),
        (16, 256, 4),
        (2, 2048, 8),
        (8, 1024, 8),
    ):
        grid = (triton.cdiv(sparse.num_rows, block_r), triton.cdiv(HIDDEN, block_h))
        timings[f"dispatch_rows_{block_r}x{block_h}_{warps}_warps"] = median_ms(
            lambda warps=warps, grid=grid, block_r=block_r, block_h=block_h: sparse_copy._rows_kernel[grid](
                tokens, sparse.entries, tokens, scattered, tokens, tokens, sparse.num_rows,
                HIDDEN, K=K, BLOCK_R=block_r, BLOCK_H=block_h, SCALE=False, DOT=False,
                num_warps=warps,
            )
        )  # fmt: skip
    timings["copy_of_the_sparse_rows"] = median_ms(lambda: scattered.copy_(y))
    return timings


def host_microseconds(sparse: Any) -> dict[str, float]:
    """The host's time to launch each piece (median of 50 calls, the GPU keeping up)."""
    import time

    import torch

    from fastllm_kernels.moe.routing import route
    from fastllm_kernels.moe.sparse_copy import dispatch
    from fastllm_kernels.moe.sparse_map import sparse_map

    logits = torch.randn(TOKENS, EXPERTS, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    experts = torch.randint(0, EXPERTS, (TOKENS, K), device="cuda")
    pieces = {
        "torch_empty": lambda: torch.empty(TOKENS, K, device="cuda"),
        "torch_add": lambda: logits + 1,
        "route": lambda: route(logits, K, True, torch.bfloat16, 0.01, 0.001),
        "sparse_map": lambda: sparse_map(experts, EXPERTS),
        "dispatch": lambda: dispatch(x, sparse),
    }
    result = {}
    for name, piece in pieces.items():
        times = []
        for _ in range(60):
            torch.cuda.synchronize()
            start = time.perf_counter()
            piece()
            times.append(time.perf_counter() - start)
        result[name] = sorted(times[10:])[25] * 1e6
    return result


def main() -> None:
    import torch

    from fastllm_kernels.moe.sparse_map import sparse_map

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    experts = torch.rand(TOKENS, EXPERTS, device="cuda").topk(K, dim=-1).indices
    sparse = sparse_map(experts, EXPERTS)
    result = {
        "layer_1_ms": matmuls(sparse, HIDDEN, 2 * FFN),
        "layer_2_ms": matmuls(sparse, FFN, HIDDEN),
        "permutations_ms": permutations(sparse),
        "host_us": host_microseconds(sparse),
        "machine": machine_info(),
    }
    print({key: value for key, value in result.items() if key != "machine"})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
