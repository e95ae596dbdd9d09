"""Mixture of experts on one GPU: the dropless path against the looped reference, in the same
call, on two geometries; and one MoE layer's forward + backward against a dense MLP of the
same active FLOPs.

- train:  the Trainer `fastllm train` builds (bf16 compute, fp32 masters, ZeRO-1, fused AdamW,
          clipping), micro-batch 2 × 4096, --accumulate micro-batches per optimizer step (1:
          the optimizer's pass over the fp32 state is part of every micro-batch), random tokens:
          mixtral: examples/mixtral-8x7b.yaml cut to --mixtral-layers blocks (8 experts, top-2,
          hidden 4096, expert ffn 14336);
          fine:    64 experts, top-8, hidden 2048, expert ffn 1024, 16 heads, --fine-layers blocks.
          Each (geometry, path) runs in a fresh process (train_bench.spawn). MFU counts the
          active parameters only (fastllm.config.flops.flops_per_token).
- layer:  MixtureOfExperts (router, dispatch, grouped matmuls, combine) on 8192 tokens against
          the gated MLP of width top-k × expert ffn (the same matmul FLOPs, router aside), bf16,
          median of CUDA-event timings; and the GPU kernels of one dropless forward + backward.

    python bench/moe_bench.py --out bench/results/moe_h200 --commit HASH
    python bench/moe_bench.py --plot bench/results/moe_h200/moe_bench.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench_common import (
    EXAMPLES,
    commit_info,
    fmt,
    machine_info,
    markdown_table,
    pyplot,
    read_json,
    replot_report,
    write_json,
    write_random_dataset,
)
from train_bench import PEAK_FLOPS, measure, spawn, summarize

GEOMETRIES: dict[str, list[str]] = {
    "mixtral": [],
    "fine": [
        "model.base_model.transformer.hidden_size=2048",
        "model.base_model.transformer.num_attention_heads=16",
        "model.base_model.transformer.head_groups=16",
        "model.base_model.transformer.ffn_hidden_size=1024",
        "model.base_model.transformer.num_experts=64",
        "model.base_model.transformer.num_experts_per_token=8",
    ],
}
TOKENS = 8192


def train_overrides(spec: dict[str, Any]) -> list[str]:
    return [
        *GEOMETRIES[spec["geometry"]],
        f"model.base_model.transformer.num_layers={spec['layers']}",
        f"model.base_model.transformer.dropless_moe={spec['dropless']}",
        f"run.experiment_dir={spec['experiment']}",
        f"data.path=[{spec['dataset']}]",
        "model.distributed.training_dtype=bfloat16",
        "batch.sequence_length=4096",
        "batch.micro_batch_size=2",
        f"batch.batch_size={2 * spec['accumulate']}",
        f"training.train_iters={spec['warmup'] + spec['steps']}",
    ]


def run_train(spec: dict[str, Any]) -> dict[str, Any]:
    from fastllm.config import TrainerConfig, load_config
    from fastllm.config.flops import flops_per_token
    from fastllm.training import Trainer

    config = load_config(TrainerConfig, [EXAMPLES / "mixtral-8x7b.yaml"], train_overrides(spec))
    trainer = Trainer(config)
    batches = iter(trainer.data_loader())
    cuda = trainer.distributed.device.type == "cuda"
    timing = measure(
        lambda: trainer.engine.train_step(next(batches))["loss"],
        spec["warmup"],
        spec["steps"],
        cuda,
    )
    base = config.model.base_model
    return {
        "parameters": base.num_parameters(),
        "active_parameters": base.num_parameters(active=True),
        "flops_per_token": flops_per_token(base, config.batch.sequence_length),
        **timing,
    }


def run_layer(spec: dict[str, Any]) -> dict[str, Any]:
    """Forward + backward of one MoE layer and of the dense MLP of its active width."""
    import msgspec
    import torch

    from fastllm.config import TrainerConfig, load_config
    from fastllm.model.mlp import MLP, MixtureOfExperts
    from fastllm.model.normalization import Normalization

    overrides = [*GEOMETRIES[spec["geometry"]], "model.base_model.transformer.num_layers=1"]
    t = load_config(
        TrainerConfig, [EXAMPLES / "mixtral-8x7b.yaml"], overrides
    ).model.base_model.transformer
    assert t.ffn_hidden_size is not None
    dense = msgspec.structs.replace(
        t, num_experts=1, ffn_hidden_size=t.num_experts_per_token * t.ffn_hidden_size
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        norm = Normalization(t.normalization, t.hidden_size).bfloat16()
        modules = {
            "dropless": MixtureOfExperts(msgspec.structs.replace(t, dropless_moe=True)),
            "looped": MixtureOfExperts(msgspec.structs.replace(t, dropless_moe=False)),
            "dense": MLP(dense),
        }
    for module in modules.values():
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=t.hidden_size**-0.5)
        module.bfloat16()
    x = torch.randn(
        2, TOKENS // 2, t.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )
    grad = torch.randn_like(x)
    result: dict[str, Any] = {"tokens": TOKENS, "dense_ffn": dense.ffn_hidden_size}
    matmul_flops = 6 * TOKENS * t.hidden_size * (3 if t.gated else 2) * dense.ffn_hidden_size
    traces = Path(spec["trace"]) if spec.get("trace") else None
    for name, module in modules.items():
        seconds, host = fwd_bwd_seconds(module, norm, x, grad)
        trace = traces / f"{spec['geometry']}_trace.json" if traces and name == "dropless" else None
        result[name] = {
            "median_s": seconds,
            "host_s": host,
            "tflops": matmul_flops / seconds / 1e12,
            **kernel_profile(module, norm, x, grad, 25 if name == "dropless" else 8, trace),
        }
    result["dropless_over_dense"] = result["dropless"]["median_s"] / result["dense"]["median_s"]
    return result


def kernel_profile(
    module: Any, norm: Any, x: Any, grad: Any, rows: int, trace: Path | None = None
) -> dict[str, Any]:
    """One forward + backward under torch.profiler: its GPU kernels (count, summed time, the
    `rows` longest) and the host's synchronizing runtime calls; the Chrome trace to `trace`."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        out, auxiliary = module(x, norm)
        loss = (out * grad).sum()
        (loss if auxiliary is None else loss + auxiliary).backward()
        torch.cuda.synchronize()
    module.zero_grad(set_to_none=True)
    if trace:
        profiler.export_chrome_trace(str(trace))
    events = profiler.key_averages()
    kernels = [e for e in events if e.self_device_time_total > 0 and e.device_type.name != "CPU"]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    syncs = [e for e in events if "Synchronize" in e.key or "Memcpy" in e.key]
    return {
        "kernel_launches": sum(e.count for e in kernels),
        "kernel_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "kernels": [
            {"kernel": e.key[:120], "calls": e.count, "ms": e.self_device_time_total / 1e3}
            for e in kernels[:rows]
        ],
        "host_syncs": {e.key: e.count for e in syncs},
    }


def fwd_bwd_seconds(
    module: Any, norm: Any, x: Any, grad: Any, repeats: int = 10
) -> tuple[float, float]:
    """Medians over `repeats` (after 3 untimed) of one forward + backward: its GPU time (CUDA
    events) and the host's time to launch it (both about equal: the host is the bottleneck)."""
    import torch

    times, hosts = [], []
    for i in range(repeats + 3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        out, auxiliary = module(x, norm)
        loss = (out * grad).sum()
        (loss if auxiliary is None else loss + auxiliary).backward()
        end.record()
        launched = time.perf_counter() - began
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
            hosts.append(launched)
    module.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2], sorted(hosts)[len(hosts) // 2]


def child(spec_path: Path) -> None:
    spec = read_json(spec_path)
    start = time.perf_counter()
    runner = run_layer if spec["system"] == "layer" else run_train
    result = {**spec, **runner(spec), "status": "ok", "process_s": time.perf_counter() - start}
    result["machine"] = machine_info()
    write_json(Path(spec["result"]), result)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit")
    parser.add_argument("--mixtral-layers", type=int, default=2)
    parser.add_argument("--fine-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--accumulate", type=int, nargs="+", default=[1, 4], help="micro-batches per step"
    )
    parser.add_argument("--plot", type=Path, metavar="RESULT.json", help="only tabulate and plot")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per run")
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=GEOMETRIES)
    parser.add_argument("--layer-only", action="store_true", help="no training runs")
    parser.add_argument(
        "--paths", nargs="+", default=["dropless", "looped"], choices=["dropless", "looped"]
    )
    parser.add_argument("--traces", action="store_true", help="Chrome traces of the layers")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.plot:
        replot_report(read_json(args.plot), args.plot.parent, "moe_bench", False, table, plot)
        return
    args.device = "auto"
    out: Path = args.out
    work, logs = out / "work", out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    dataset = write_random_dataset(
        work / "dataset", vocab_size=32000, tokens=(args.warmup + args.steps + 2) * 8192 * max(args.accumulate),
        document_length=None, seed=1234,
    )  # fmt: skip
    layers = {"mixtral": args.mixtral_layers, "fine": args.fine_layers}
    runs = []
    for geometry in args.geometries:
        spec = {
            "model": geometry,
            "system": "layer",
            "geometry": geometry,
            "result": str(work / f"{geometry}_layer.json"),
            "trace": str(out) if args.traces else None,
        }
        runs.append(spawn(spec, work, logs, args, Path(__file__)))
        print(geometry, "layer", runs[-1].get("status"), runs[-1].get("dropless_over_dense"))
        for accumulate in [] if args.layer_only else args.accumulate:
            for path in args.paths:
                dropless = "true" if path == "dropless" else "false"
                name = f"{path}-x{accumulate}"
                spec = {
                    "model": geometry, "system": name, "geometry": geometry,
                    "layers": layers[geometry], "dropless": dropless, "accumulate": accumulate,
                    "warmup": args.warmup, "steps": args.steps, "dataset": dataset["path"],
                    "experiment": str(work / f"exp_{geometry}_{name}"),
                    "result": str(work / f"{geometry}_{name}.json"),
                }  # fmt: skip
                run = spawn(spec, work, logs, args, Path(__file__))
                run = summarize(run, 2 * 4096 * accumulate, PEAK_FLOPS)
                runs.append(run)
                print(geometry, name, run.get("status"), run.get("tokens_per_s"), run.get("mfu"))
    report = {"commit": commit_info(args.commit), "runs": runs}
    write_json(out / "moe_bench.json", report)
    (out / "moe_bench.md").write_text(table(report))
    print(table(report))
    plot(report, out / "moe_bench.png")


def plot(report: dict[str, Any], path: Path) -> bool:
    """Tokens/s of each training run, dropless beside looped, per geometry and accumulation."""
    plt = pyplot()
    if plt is None:
        return False
    runs = [r for r in report["runs"] if r["system"] != "layer" and r.get("status") == "ok"]
    figure, axis = plt.subplots(figsize=(8, 4))
    labels = [f"{r['model']} {r['system']}" for r in runs]
    colors = ["tab:blue" if r["system"].startswith("dropless") else "tab:gray" for r in runs]
    axis.barh(labels, [r["tokens_per_s"] for r in runs], color=colors)
    for i, r in enumerate(runs):
        axis.text(r["tokens_per_s"], i, f" {r['mfu']:.0%} MFU", va="center", fontsize=8)
    axis.set_xlabel("tokens/s (one H200; MFU on active parameters)")
    axis.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def layer_cell(timing: dict[str, Any]) -> str:
    """GPU time, and where profiled the host's launch time and the kernels launched."""
    cell = f"{timing['median_s'] * 1e3:.2f} ms"
    if "host_s" in timing:
        cell += f" (host {timing['host_s'] * 1e3:.2f} ms, {timing['kernel_launches']} kernels)"
    return cell


def table(report: dict[str, Any]) -> str:
    runs, rows = report["runs"], []
    train = {(r["model"], r["system"]): r for r in runs if r["system"] != "layer"}
    for r in runs:
        if r.get("status") != "ok":
            rows.append([r["model"], r["system"], r.get("status", "?"), "", "", ""])
        elif r["system"] == "layer":
            rows.append([
                r["model"], "layer fwd+bwd",
                ", ".join(f"{name} {layer_cell(r[name])}" for name in ("dropless", "looped"))
                + f", dense MLP (ffn {r['dense_ffn']}) {layer_cell(r['dense'])}",
                f"{r['dropless_over_dense']:.2f}× dense", "", "",
            ])  # fmt: skip
        else:
            looped = train.get((r["model"], r["system"].replace("dropless", "looped")), {})
            speedup = (
                r["tokens_per_s"] / looped["tokens_per_s"] if looped.get("status") == "ok" else None
            )
            rows.append([
                r["model"], r["system"], f"{r['tokens_per_s']:,.0f} tok/s", f"{r['mfu']:.1%} MFU (active)",
                "" if speedup is None else f"{speedup:.2f}× looped",
                fmt(r["peak_memory"]["process"]["allocated_gib"], ".1f") + " GiB",
            ])  # fmt: skip
    return (
        markdown_table(["geometry", "path", "speed", "MFU", "vs looped", "peak memory"], rows)
        + "\n"
    )


if __name__ == "__main__":
    main()
