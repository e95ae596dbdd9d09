"""cuDNN's ragged attention (`torch.ops.aten._cudnn_attention_forward` with cumulative sequence
lengths, no padding) against torch's varlen flash attention, at llama-1b's heads (32 query, 8
key/value, head size 64), bf16, causal, 16 sequences: of 1,025 (the DPO rows' runs), of 1,088,
and of random lengths 100-1,500. Prints each one's errors against SDPA run on every sequence
apart (fp32), and forward and forward + backward times (median of 20, CUDA events).

On torch 2.11 / cuDNN 9.19 (H100, bench/results/h100-ac549d2/README.md) the forward matched,
took 60-73 ms a call, and the backward's gradients were wrong: shared-prefix attention does not
use it.

    python bench/cudnn_varlen_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_common import median_ms

HEADS, KV_HEADS, HEAD = 32, 8, 64


def probe(lengths: list[int]) -> None:
    starts = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    total, longest = sum(lengths), max(lengths)
    q = torch.randn(total, HEADS, HEAD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, KV_HEADS, HEAD, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))  # fmt: skip
    grad = torch.randn_like(q)
    aten = torch.ops.aten

    def cudnn():
        return aten._cudnn_attention_forward(
            q, k, v, None, starts, starts, longest, longest, True, 0.0, True, False
        )[0]

    def flash():
        return aten._flash_attention_forward(
            q, k, v, starts, starts, longest, longest, 0.0, True, False
        )[0]

    reference = []
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b].float().transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        reference.append(out[0].transpose(0, 1))
    expected = torch.cat(reference)
    wants = torch.autograd.grad(expected, (q, k, v), grad.float())
    flops = 4 * HEADS * HEAD * sum(n * (n + 1) / 2 for n in lengths)
    print(f"{len(lengths)} sequences, {total} tokens, longest {longest}")
    for name, fn in (("cudnn", cudnn), ("flash", flash)):
        out = fn()
        grads = torch.autograd.grad(out, (q, k, v), grad)
        errors = [(g.float() - w).abs().max().item() for g, w in zip(grads, wants, strict=True)]
        forward = median_ms(fn)
        both = median_ms(lambda fn=fn: fn().backward(grad))
        print(
            f"  {name}: forward error {(out.float() - expected).abs().max().item():.3g}, "
            f"gradient errors {', '.join(f'{e:.3g}' for e in errors)}; forward {forward:.3f} ms "
            f"({flops / forward / 1e9:.0f} TFLOP/s), forward + backward {both:.3f} ms "
            f"({3.5 * flops / both / 1e9:.0f})"
        )


def main() -> None:
    print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    torch.manual_seed(0)
    for lengths in ([1025] * 16, [1088] * 16, torch.randint(100, 1500, (16,)).tolist()):
        probe(lengths)


if __name__ == "__main__":
    main()
