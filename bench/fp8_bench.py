"""One linear layer's forward and backward on the GPU: bf16 against each FP8 recipe, the issue's
MLP shapes. The FP8 rows run the same entry points the model does (`norm_linear` for the up
projection, `gated_linear` for the down projection, so their fused quantization counts), with
the weight quantized once as in a step of one micro-batch. TFLOP/s count the three products
(6 × tokens × in × out) over the time of the whole forward and backward.

    python bench/fp8_bench.py --out bench/results/h200-HASH/fp8_bench.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_common import commit_info, machine_info, markdown_table, write_json

SHAPES = {  # name: (tokens, in, out, producer of the input)
    "llama-1b MLP up": (16384, 2048, 16384, "norm"),
    "llama-1b MLP down": (16384, 8192, 2048, "gated"),
    "llama-3b MLP up": (8192, 3072, 16384, "norm"),
    "llama-3b MLP down": (8192, 8192, 3072, "gated"),
    "llama-1b q/k/v": (16384, 2048, 3072, "norm"),
}
RECIPES = ("none", "tensorwise", "rowwise")


def measure(tokens: int, inputs: int, outputs: int, producer: str, recipe: str) -> float:
    """Milliseconds of one forward and backward, the weight requantized each time."""
    import torch
    import triton

    from fastllm_kernels.activation import gated_linear
    from fastllm_kernels.fp8_linear import Fp8Weight
    from fastllm_kernels.norm_linear import norm_linear

    device = torch.device("cuda")
    width = 2 * inputs if producer == "gated" else inputs
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(
        torch.randn(outputs, inputs, device=device, dtype=torch.bfloat16) / inputs**0.5
    )
    norm_weight = torch.ones(inputs, device=device, dtype=torch.bfloat16, requires_grad=True)
    if recipe != "none":
        weight.fp8 = Fp8Weight(recipe)
    grad = torch.randn(tokens, outputs, device=device, dtype=torch.bfloat16)

    def step() -> None:
        torch.autograd.graph.increment_version(weight)  # a new step: requantize
        if producer == "gated":
            out = gated_linear(x, weight, None, "silu")
        else:
            out = norm_linear(x, norm_weight, None, 1e-5, True, weight)
        out.backward(grad)
        x.grad = weight.grad = norm_weight.grad = None

    return triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    for name, (tokens, inputs, outputs, producer) in SHAPES.items():
        for recipe in RECIPES:
            ms = measure(tokens, inputs, outputs, producer, recipe)
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
        for name in SHAPES
    ]
    headers = ["forward + backward", "bf16 TFLOP/s", "tensorwise", "rowwise", "tw speed-up", "rw"]
    table = markdown_table(headers, rows)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
