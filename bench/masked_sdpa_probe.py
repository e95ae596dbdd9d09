"""What torch SDPA with a boolean mask costs at evaluation's shapes, by backend (issue 36):
lm-eval's multiple-choice rows (ROWS rows of a context and four branches, a new length every
batch) and generation's decode steps (PROMPTS queries of one token over a cache one key longer
every step), llama-1b's heads (32 query, 8 key/value, head dim 64), bf16. Each backend's wall
time per call with the first call of each shape included (what a run of varying shapes pays),
and its time once warm.

    python bench/masked_sdpa_probe.py --out bench/results/masked_sdpa.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench_common import write_json
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

BACKENDS = {
    "default": None,
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}


def shapes(case: str, count: int, first: int) -> list[tuple[int, int, int]]:
    """(batch, queries, keys) of `count` calls, lengths from `first` on (each run its own:
    a backend's plans or kernels for a shape would serve the runs after it)."""
    if case == "mc":
        return [(64, 200 + first + i, 200 + first + i) for i in range(count)]
    return [(200, 1, 264 + first + i) for i in range(count)]


def run(case: str, backend: str, gqa: bool, count: int, first: int) -> dict[str, float | str]:
    heads, kv_heads, dim = 32, 8 if gqa else 32, 64
    times, warm = [], []
    for batch, queries, keys in shapes(case, count, first):
        q = torch.randn(batch, heads, queries, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, keys, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        i = torch.arange(keys - queries, keys, device="cuda")[:, None]
        mask = (torch.arange(keys, device="cuda")[None] <= i)[None, None].expand(batch, 1, -1, -1)
        context = sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] else torch.no_grad()
        try:
            with context:
                for attempt in range(3):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
                    torch.cuda.synchronize()
                    (times if attempt == 0 else warm).append(time.perf_counter() - start)
        except RuntimeError as error:
            return {"error": str(error).splitlines()[0][:200]}
    return {
        "first_call_ms": 1e3 * sum(times) / len(times),
        "warm_ms": 1e3 * sum(warm) / len(warm),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=8, help="shapes a case")
    args = parser.parse_args()
    results = {}
    for case in ("mc", "decode"):
        for gqa in (True, False):
            for backend in BACKENDS:
                key = f"{case} {'gqa' if gqa else 'expanded'} {backend}"
                results[key] = run(case, backend, gqa, args.count, len(results) * args.count)
                print(key, results[key], flush=True)
    write_json(args.out, {"torch": torch.__version__, "results": results})


if __name__ == "__main__":
    main()
