"""One linear layer's forward and backward on the GPU: bf16 against each FP8 recipe, on the
projections of llama-1b and 3b (micro-batches of 4 and 2 × 4096 tokens). Each runs through the
entry point the model uses (`norm_linear` for q/k/v and the MLP's up projection,
`gated_linear` for its down projection, `linear` for attention's output), so fused
quantization counts; the weight is quantized once per step as in a step of one micro-batch.
`--profile SHAPE` adds each recipe's CUDA kernels for that shape to the .md file. TFLOP/s count the three products
(6 × tokens × in × out) over the time of the whole forward and backward.

    python bench/fp8_bench.py --out bench/results/h200-HASH/fp8_bench.json --profile 1b-qkv
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_common import commit_info, machine_info, markdown_table, write_json

SHAPES = {  # name: (tokens, in, out, producer of the input: norm, gated or none)
    "1b-up": (16384, 2048, 16384, "norm"),
    "1b-down": (16384, 8192, 2048, "gated"),
    "1b-qkv": (16384, 2048, 3072, "norm"),
    "1b-out": (16384, 2048, 2048, "none"),
    "3b-up": (8192, 3072, 16384, "norm"),
    "3b-down": (8192, 8192, 3072, "gated"),
    "3b-qkv": (8192, 3072, 5120, "norm"),
    "3b-out": (8192, 3072, 3072, "none"),
}
RECIPES = ("none", "tensorwise", "rowwise")


def layer_step(tokens: int, inputs: int, outputs: int, producer: str, recipe: str):
    """One forward and backward of the layer, the weight requantized each time."""
    import torch

    from fastllm_kernels.fp8.weight import Fp8Weight
    from fastllm_kernels.gated_linear import gated_linear
    from fastllm_kernels.linear import linear
    from fastllm_kernels.norm_linear import norm_linear
    from fastllm_kernels.recipe import WeightRecipe

    device = torch.device("cuda")
    width = 2 * inputs if producer == "gated" else inputs
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(
        torch.randn(outputs, inputs, device=device, dtype=torch.bfloat16) / inputs**0.5
    )
    norm_weight = torch.ones(inputs, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight_recipe = WeightRecipe(fp8=None if recipe == "none" else Fp8Weight(recipe))
    grad = torch.randn(tokens, outputs, device=device, dtype=torch.bfloat16)

    def step() -> None:
        torch.autograd.graph.increment_version(weight)  # a new step: requantize
        if producer == "gated":
            out = gated_linear(x, weight, None, "silu", weight_recipe)
        elif producer == "norm":
            out = norm_linear(x, norm_weight, None, 1e-5, True, weight, None, weight_recipe)
        else:
            out = linear(x, weight, None, weight_recipe)
        out.backward(grad)
        x.grad = weight.grad = norm_weight.grad = None

    return step


def profile(name: str, recipe: str) -> str:
    """The CUDA kernels of a few steps of one shape, by total time."""
    import torch

    step = layer_step(*SHAPES[name], recipe)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="device_time_total", row_limit=14, max_name_column_width=70
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--profile", nargs="+", choices=sorted(SHAPES), default=[])
    args = parser.parse_args()
    import triton

    results = []
    for name in args.shapes:
        tokens, inputs, outputs, producer = SHAPES[name]
        for recipe in RECIPES:
            step = layer_step(tokens, inputs, outputs, producer, recipe)
            ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
            tflops = 6 * tokens * inputs * outputs / ms / 1e9
            results.append({"shape": name, "recipe": recipe, "ms": ms, "tflops": tflops})
            print(f"{name:20s} {recipe:10s} {ms:7.3f} ms {tflops:7.0f} TFLOP/s", flush=True)
    write_json(
        args.out, {"commit": commit_info(args.commit), "machine": machine_info(), "runs": results}
    )
    by = {(r["shape"], r["recipe"]): r for r in results}
    rows = [
        [name]
        + [f"{by[name, recipe]['tflops']:.0f}" for recipe in RECIPES]
        + [f"{by[name, 'none']['ms'] / by[name, recipe]['ms']:.2f}×" for recipe in RECIPES[1:]]
        for name in args.shapes
    ]
    headers = ["forward + backward", "bf16 TFLOP/s", "tensorwise", "rowwise", "tw speed-up", "rw"]
    table = markdown_table(headers, rows)
    profiles = [
        f"### {name}, {recipe}\n\n```\n{profile(name, recipe)}\n```"
        for name in args.profile
        for recipe in RECIPES
    ]
    args.out.with_suffix(".md").write_text("\n\n".join([table, *profiles]) + "\n")
    print(table)


if __name__ == "__main__":
    main()
