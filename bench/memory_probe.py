"""What holds a fastllm training step's peak memory, and what moving activations to host memory
could take from it: three probes for the long-context budget (issue 16), on one GPU.

- peak: one step of bench/train_bench.py's run (same config, data, code path) under torch's
  allocator history; the allocations live at the step's peak, grouped by the first frame in
  fastllm's own code that made them (weights and optimizer state, made before recording,
  count as one "before the step" group).
- copies: device-to-host and host-to-device bandwidth of pinned copies on a side stream, alone
  and while bf16 matmuls run on the main stream (and the matmuls' slowdown).
- attention: SDPA forward + backward at llama-1b's attention shape by backend (cuDNN, flash,
  flex), to see whether any beats cuDNN at head size 64.

    python bench/memory_probe.py --seq 16384 --out bench/results/memory_probe
    python bench/memory_probe.py --tiny --device cpu --out /tmp/memory_probe   # CPU smoke
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench_common import GIB, commit_info, machine_info, median_ms, write_json, write_random_dataset
from train_bench import load_trainer_config, model_overrides, run_overrides

OWN_CODE = ("fastllm/", "fastllm_kernels/")


def origin(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in fastllm's code (file:line function), else the innermost."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OWN_CODE):
            short = name[name.rfind("fastllm") :]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    if frames:
        return f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}"
    return "unknown"


def peak_probe(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fastllm.training import Trainer

    work = Path(tempfile.mkdtemp(prefix="fastllm-memory-"))
    args.micro_batch, args.accumulate, args.warmup = 1, 1, 2
    config = load_trainer_config(args.model, model_overrides(args.model, args))
    dataset = write_random_dataset(
        work / "dataset",
        vocab_size=config.model.base_model.vocab_size,
        tokens=(args.warmup + args.steps + 2) * (args.seq + 1),
        document_length=None,
        seed=0,
    )
    overrides = [*run_overrides(args.model, args, work / "exp", Path(dataset["path"])), *args.set]
    trainer = Trainer(load_trainer_config(args.model, overrides))
    batches = iter(trainer.data_loader())
    for _ in range(args.warmup):
        trainer.engine.train_step(next(batches))
    if trainer.distributed.device.type != "cuda":
        return {"skipped": "no CUDA"}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    began = time.perf_counter()
    trainer.engine.train_step(next(batches))
    torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - began)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    # Replay the step's events: the live set at the largest total.
    live: dict[int, tuple[int, str]] = {}
    total, best, best_live, best_index = before, before, {}, -1
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    for index, event in enumerate(trace):
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = (size, origin(event.get("frames", [])))
            total += size
        elif action == "free_completed" and address in live:
            total -= live.pop(address)[0]
        if total > best:
            best, best_live, best_index = total, dict(live), index
    groups: dict[str, int] = defaultdict(int)
    for size, where in best_live.values():
        groups[where] += size
    rows = [
        {"origin": "before the step (weights, gradients, optimizer state)", "gib": before / GIB}
    ]
    rows += [
        {"origin": where, "gib": size / GIB}
        for where, size in sorted(groups.items(), key=lambda item: -item[1])
    ]
    at_peak = trace[best_index] if best_index >= 0 else {}
    return {
        "step_ms": step_ms,
        "max_allocated_gib": peak / GIB,
        "replayed_peak_gib": best / GIB,
        "peak_event": origin(at_peak.get("frames", [])),
        "events": len(trace),
        "groups": rows[: args.top],
    }


def copies_probe(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    chunk, chunks = 256 << 20, 8
    device = [torch.empty(chunk, dtype=torch.uint8, device="cuda") for _ in range(chunks)]
    host = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(chunks)]
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def copies(to_host: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(side):
            for d, h in zip(device, host, strict=True):
                (h.copy_(d, non_blocking=True) if to_host else d.copy_(h, non_blocking=True))
        side.synchronize()
        return chunk * chunks / (time.perf_counter() - start) / 1e9

    def matmuls(count: int) -> None:
        for _ in range(count):
            torch.mm(a, a)

    result: dict[str, Any] = {}
    for direction, to_host in (("device_to_host", True), ("host_to_device", False)):
        copies(to_host)
        result[f"{direction}_gb_s"] = copies(to_host)
    matmul_ms = median_ms(lambda: matmuls(20), repeats=5)
    result["matmul_tflops_alone"] = 20 * 2 * 8192**3 / matmul_ms / 1e9
    for direction, to_host in (("device_to_host", True), ("host_to_device", False)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(side):
            for d, h in zip(device, host, strict=True):
                (h.copy_(d, non_blocking=True) if to_host else d.copy_(h, non_blocking=True))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        matmuls(20)
        end.record()
        side.synchronize()
        copy_s = time.perf_counter() - start
        torch.cuda.synchronize()
        result[f"{direction}_under_matmuls_gb_s"] = chunk * chunks / copy_s / 1e9
        result[f"matmul_tflops_under_{direction}"] = (
            20 * 2 * 8192**3 / begin.elapsed_time(end) / 1e9
        )
    return result


def attention_probe(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    seq, heads, kv_heads, head = args.seq, 32, 8, 64
    generator = torch.Generator("cuda").manual_seed(0)

    def make(count: int) -> torch.Tensor:
        shape = (1, count, seq, head)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    q, k, v = make(heads).requires_grad_(), make(kv_heads), make(kv_heads)
    k.requires_grad_(), v.requires_grad_()
    grad = torch.randn_like(q)
    flops = 3.5 * 4 * heads * head * seq * seq / 2
    result: dict[str, Any] = {"seq": seq, "heads": heads, "kv_heads": kv_heads, "head": head}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):

        def step(backend: SDPBackend = backend) -> None:
            with sdpa_kernel([backend]):
                out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(grad)

        try:
            ms = median_ms(step, repeats=10)
            result[backend.name.lower()] = {"ms": ms, "causal_tflops": flops / ms / 1e9}
        except RuntimeError as error:
            result[backend.name.lower()] = {"error": str(error)[:200]}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, seq, seq, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)

        def flex_step() -> None:
            flex(q, k, v, block_mask=mask, enable_gqa=True).backward(grad)

        ms = median_ms(flex_step, repeats=10)
        result["flex"] = {"ms": ms, "causal_tflops": flops / ms / 1e9}
    except Exception as error:  # a probe records what failed
        result["flex"] = {"error": str(error)[:200]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--top", type=int, default=40, help="groups listed")
    parser.add_argument("--probes", nargs="+", default=["peak", "copies", "attention"])
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.tiny:
        args.seq = 64
    if args.device == "cpu":
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    args.out.mkdir(parents=True, exist_ok=True)
    probes = {"peak": peak_probe, "copies": copies_probe, "attention": attention_probe}
    report: dict[str, Any] = {
        "benchmark": "memory_probe",
        **commit_info(args.commit),
        "machine": machine_info(),
        "model": args.model,
        "seq": args.seq,
        "overrides": args.set,
    }
    for name in args.probes:
        report[name] = probes[name](args)
        write_json(args.out / "memory_probe.json", report)
        print(name, report[name])


if __name__ == "__main__":
    main()
