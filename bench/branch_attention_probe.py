"""Shared-prefix attention's two forms (kernels/fastllm_kernels/branch_attention.py) at llama-1b's
heads (32 query, 8 key/value, head size 64), bf16, forward and forward + backward, by layout:

- dpo: the DPO benchmark's rows, a 512-token prompt, a 512-token chosen answer and a 513-token
  rejected one (the prompt's last token again first), --rows rows;
- ragged: rows of --rows pairs of random prompt and answer lengths (prompts 64-768 tokens,
  answers 32-768), packed one pair a row and padded to the longest row.

Each form runs through fastllm_kernels.attention's own kernels (varlen: torch's varlen flash
attention; dense: SDPA, cuDNN first), whatever the plan would have chosen; the table gives each
form's median CUDA-event time, the TFLOP/s over the query-key pairs the mask really holds (the
same count for both forms: the dense form's extra work is not counted), and the ratio of the
dense form's padded work to the varlen form's (the plan takes dense up to DENSE_WORK).

    python bench/branch_attention_probe.py --out bench/results/branch_attention_probe
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import commit_info, fmt, machine_info, markdown_table, median_ms, write_json

HEADS, KV_HEADS, HEAD = 32, 8, 64


def layout(name: str, rows: int, seed: int) -> tuple[Any, Any]:
    """(document_ids, branch_ids) on CUDA; padding (branch -1) is a document of its own."""
    import torch

    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(rows):
        if name == "dpo":
            prompt, chosen, rejected = 512, 512, 513
        else:
            prompt, chosen, rejected = rng.integers(64, 769), *rng.integers(32, 769, size=2)
        parts.append([0] * prompt + [1] * chosen + [2] * rejected)
    seq = max(map(len, parts))
    branches = torch.full((rows, seq), -1, dtype=torch.int64)
    documents = torch.zeros(rows, seq, dtype=torch.int64)
    for row, ids in enumerate(parts):
        branches[row, : len(ids)] = torch.tensor(ids)
        documents[row, len(ids) :] = 1
    return documents.cuda(), branches.cuda()


def real_pairs(branches: Any) -> float:
    """Query-key pairs the mask holds for the pairs' tokens (causal, shared prefix)."""
    total = 0.0
    for ids in branches.tolist():
        prompt = ids.count(0)
        answers = [ids.count(b) for b in (1, 2)]
        total += prompt * (prompt + 1) / 2
        total += sum(a * prompt + a * (a + 1) / 2 for a in answers)
    return total


def run(name: str, rows: int, seed: int) -> list[dict[str, Any]]:
    import torch

    from fastllm_kernels import attention as attention_module
    from fastllm_kernels import branch_attention as branch

    documents, branches = layout(name, rows, seed)
    batch, seq = branches.shape
    q = torch.randn(batch, seq, HEADS, HEAD, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seq, KV_HEADS, HEAD, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))  # fmt: skip
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(q)
    flops = 4 * HEADS * HEAD * real_pairs(branches)
    saved = branch.DENSE_WORK
    out = []
    for form in ("varlen", "dense"):
        branch.DENSE_WORK = 0.0 if form == "varlen" else float("inf")
        plan = branch._build(documents.cpu().numpy(), branches.cpu().numpy(), q.device)
        branch.DENSE_WORK = saved
        runs, length = (plan.form.runs, plan.form.length) if form == "dense" else (None, None)

        def forward(plan=plan) -> Any:
            return branch.branch_attention(
                q, k, v, plan, None, branch.varlen_flash, attention_module._dense_causal
            )

        def both() -> None:
            forward().backward(grad)

        with torch.no_grad():
            forward_ms = median_ms(forward)
        both_ms = median_ms(both)
        out.append({
            "layout": name, "form": form, "rows": batch, "seq": seq, "runs": runs,
            "dense_length": length, "dense_over_varlen_work": plan.dense_over_varlen,
            "forward_ms": forward_ms, "forward_tflops": flops / forward_ms / 1e9,
            "forward_backward_ms": both_ms, "forward_backward_tflops": 3.5 * flops / both_ms / 1e9,
        })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [r for name in ("dpo", "ragged") for r in run(name, args.rows, args.seed)]
    write_json(
        args.out / "branch_attention_probe.json",
        {"benchmark": "branch_attention_probe", **commit_info(args.commit),
         "machine": machine_info(), "runs": rows},
    )  # fmt: skip
    table = markdown_table(
        ["layout", "form", "rows × seq", "dense / varlen work", "forward ms", "TFLOP/s",
         "fwd + bwd ms", "TFLOP/s"],
        [
            [r["layout"], r["form"], f"{r['rows']} × {r['seq']}",
             fmt(r["dense_over_varlen_work"], ".2f"), fmt(r["forward_ms"], ".3f"),
             fmt(r["forward_tflops"], ".0f"), fmt(r["forward_backward_ms"], ".3f"),
             fmt(r["forward_backward_tflops"], ".0f")]
            for r in rows
        ],
        text_columns=3,
    )  # fmt: skip
    (args.out / "branch_attention_probe.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
