"""Long-context training on one GPU: llama-1b at 16k–128k tokens and llama-3b at 32k–64k in one
sequence (micro-batch 1), fastllm against HF + torch.compile of the same geometry, in one call;
and the attention kernels alone at those lengths (dense causal, and 2k-token documents packed
into 32k under the document mask).

The training runs are bench/train_bench.py's children (the same fastllm Trainer and HF system,
each in a fresh process); this script picks the geometries, the memory measure and the order.
Memory measure: each fastllm run tries the recomputation levels of its ladder, cheapest
first, and keeps the first that fits (an out-of-memory run is a result and moves to the next).
Runs are made in order of importance until --deadline seconds have passed; the rest are
recorded as skipped.

MFU two ways: torchtitan's formula (attention counted as if not causal: 12 × layers × heads ×
head size × seq per token) and causal-corrected (that term halved: each query sees on average
half the keys), both against 989.4 TFLOP/s. With packed documents a token attends within its
document: the attention term counts the document length instead of the sequence's.

    python bench/long_context_bench.py --out bench/results/long_context --commit HASH
    python bench/long_context_bench.py --tiny --device cpu --out /tmp/long_smoke   # CPU smoke
    python bench/long_context_bench.py --plot bench/results/long_context/long_context.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import train_bench
from bench_common import (
    ROOT,
    commit_info,
    fmt,
    log_tail,
    markdown_table,
    pyplot,
    read_json,
    replot_report,
    write_json,
    write_random_dataset,
)

PEAK_FLOPS = train_bench.PEAK_FLOPS
K = 1024
DOCUMENT_LENGTH = 2 * K


@dataclass(frozen=True)
class Run:
    model: str
    seq: int
    system: str
    """fastllm or hf (train_bench's systems)."""
    ladder: tuple[str, ...] = ("elementwise",)
    """Recomputation levels to try, cheapest first (fastllm only); LEVEL+offloadN also sends
    the first N blocks' stored activations to host memory."""
    documents: bool = False
    """2k-token documents packed into the sequence, attention kept within them."""
    warmup: int = 1
    steps: int = 2

    @property
    def label(self) -> str:
        """MODEL:SEQ:SYSTEM, with :documents for the packed-documents run (--only)."""
        return f"{self.model}:{self.seq}:{self.system}" + (":documents" if self.documents else "")


# In order of importance, so that a deadline drops the least needed. The ladders start where
# the activations could fit: llama-1b stores ~0.8 MiB per token at `elementwise` over 23 GiB of
# weights, gradients and Adam state (h200 issue-16 table: 36.0 GiB at 16k, 75.3 GiB at 64k),
# so 128k may just fit and `selective` (the MLP recomputed: ~0.3 MiB per token) surely does;
# llama-3b would need ~1.7 MiB per token over 48 GiB at `elementwise`, 155 GiB at 64k.
PLAN = (
    Run("1b", 128 * K, "fastllm", ("elementwise", "selective")),
    # llama-3b at 64k: ~3.75 GiB of activations per block at `elementwise`, 28 blocks, over
    # 36 GiB of state; a forward pass of ~2.4 s leaves time to send a third of them to host
    # memory, which spares `selective`'s second pass of every MLP.
    Run("3b", 64 * K, "fastllm", ("elementwise+offload8", "elementwise+offload14", "selective")),
    # The 16k and 32k pairs time several seconds each: at the power limit single steps vary
    # by up to 8% (h200-d5c7238: 354 to 384 ms at 16k).
    Run("1b", 16 * K, "hf", warmup=2, steps=6),
    # 16k fits every level; the memory target (≤ 0.7× HF's peak) takes the first two
    # blocks' activations off the device (h200-2cbd04a: 28.6 GiB without, 26.2 with three).
    Run("1b", 16 * K, "fastllm", ("elementwise+offload2",), warmup=2, steps=10),
    Run("1b", 32 * K, "fastllm", warmup=2, steps=4),
    Run("1b", 64 * K, "fastllm"),
    Run("3b", 32 * K, "fastllm", warmup=1, steps=3),
    Run("1b", 32 * K, "hf", warmup=2, steps=3),
    Run("1b", 32 * K, "fastllm", documents=True, warmup=2, steps=3),
)
TINY_SEQ = {16 * K: 64, 32 * K: 128, 64 * K: 256, 128 * K: 512}
"""--tiny: the CPU smoke test's lengths for each of the plan's."""


# ---------------------------------------------------------------- attention alone (child)


def attention_child(spec: dict[str, Any]) -> dict[str, Any]:
    """fastllm_kernels.attention forward + backward at llama-1b's attention shape: dense
    causal at each length, document-masked at 32k, and a later chunk's queries against the
    keys up to it (sequence-data parallelism, micro-sequences) checked against the whole."""
    import torch

    from fastllm_kernels.attention import attention

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    heads, kv_heads, head_size = spec["heads"], spec["kv_heads"], spec["head_size"]
    generator = torch.Generator(device).manual_seed(0)

    def tensors(seq: int) -> list[torch.Tensor]:
        shapes = [(1, seq, heads, head_size)] + [(1, seq, kv_heads, head_size)] * 2
        return [
            torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_()
            for shape in shapes
        ]

    def time_ms(seq: int, repeats: int, **options: Any) -> float:
        q, k, v = tensors(seq)
        grad = torch.randn_like(q)
        times = []
        for i in range(repeats + 1):  # the first compiles (flex) and sets up
            start = time.perf_counter()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                begin.record()
            attention(q, k, v, **options).backward(grad)
            if cuda:
                end.record()
                torch.cuda.synchronize()
                elapsed = begin.elapsed_time(end)
            else:
                elapsed = 1e3 * (time.perf_counter() - start)
            if i:
                times.append(elapsed)
        return statistics.median(times)

    def causal_tflops(seq: int, ms: float) -> float:
        # forward 2 matmuls of seq²/2 × heads × head size, backward 2.5 times that
        return 3.5 * 4 * heads * head_size * seq * seq / 2 / (ms * 1e-3) / 1e12

    results: dict[str, Any] = {"shape": {"heads": heads, "kv_heads": kv_heads, "head": head_size}}
    dense = []
    for seq in spec["lengths"]:
        ms = time_ms(seq, spec["repeats"], causal=True)
        dense.append({"seq": seq, "ms": ms, "causal_tflops": causal_tflops(seq, ms)})
    results["dense_causal"] = dense
    seq = spec["document_seq"]
    documents = torch.arange(seq, device=device)[None] // spec["document_length"]
    masked = time_ms(seq, spec["repeats"], causal=True, document_ids=documents)
    plain = next(row["ms"] for row in dense if row["seq"] == seq)
    results["documents"] = {
        "seq": seq,
        "document_length": spec["document_length"],
        "masked_ms": masked,
        "dense_causal_ms": plain,
        "speedup": plain / masked,
    }
    q, k, v = tensors(seq)
    with torch.no_grad():
        whole = attention(q, k, v)[:, -seq // 4 :].float()
        chunk = attention(q[:, -seq // 4 :], k, v).float()
    results["later_chunk_relative_error"] = float((chunk - whole).norm() / whole.norm())
    return results


# ---------------------------------------------------------------- the driver


def spawn(
    name: str, command: list[str], args: argparse.Namespace, work: Path, timeout: float, system: str
) -> tuple[int | str, float, Path]:
    """A child under `timeout`, its output in OUT/logs/NAME.log; compile caches shared by the
    runs of one system (each run's warm-up steps absorb what is still compiled)."""
    caches = work / "caches" / system
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        TRITON_CACHE_DIR=str(caches / "triton"),
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
    )
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", TORCHINDUCTOR_COMPILE_THREADS="1")
        env.setdefault("OMP_NUM_THREADS", "1")
    log = args.out / "logs" / f"{name}.log"
    start = time.perf_counter()
    try:
        with log.open("w") as output:
            code = subprocess.run(
                command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                timeout=max(timeout, 1),
            ).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        code = "timeout"
    return code, time.perf_counter() - start, log


def train_run(run: Run, level: str, args: argparse.Namespace, work: Path, datasets: dict) -> dict:
    seq = TINY_SEQ[run.seq] if args.tiny else run.seq
    options = argparse.Namespace(
        tiny=args.tiny, micro_batch=1, seq=seq, accumulate=1, warmup=run.warmup, steps=run.steps
    )
    probe = train_bench.load_trainer_config(
        run.model, train_bench.model_overrides(run.model, options)
    )
    vocab = probe.model.base_model.vocab_size
    dataset = datasets[(vocab, run.documents)]["path"]
    tag = f"{run.model}_{run.seq // K}k_{run.system}" + ("_documents" if run.documents else "")
    name = tag + (f"_{level}" if run.system != "hf" else "")
    overrides = train_bench.run_overrides(run.model, options, work / f"exp_{name}", Path(dataset))
    if run.system != "hf":
        # A level is a recomputation, optionally with +offloadN: the first N blocks' stored
        # activations sent to host memory (model.multi_stage.offload_activations).
        recompute, _, offload = level.partition("+offload")
        overrides.append(f"model.multi_stage.recompute={recompute}")
        if offload:
            overrides.append(f"model.multi_stage.offload_activations={offload}")
        if run.documents:
            overrides.append("batch.cross_document_attention=false")
    result = args.out / "runs" / f"{name}.json"
    spec = {
        "model": run.model, "system": run.system, "overrides": overrides,
        "warmup": run.warmup, "steps": run.steps, "compile": not args.tiny,
        "result": str(result),
    }  # fmt: skip
    spec_path = work / f"{name}.spec.json"
    write_json(spec_path, spec)
    command = [sys.executable, str(Path(train_bench.__file__).resolve()), "--child", str(spec_path)]
    remaining = args.deadline - (time.monotonic() - args.started)
    print(f"{name} (≤ {remaining:.0f} s) ...", file=sys.stderr, flush=True)
    code, wall, log = spawn(name, command, args, work, remaining, run.system)
    if code == 0 and result.is_file():
        outcome = read_json(result)
    else:
        status = "timeout" if code == "timeout" else "failed"
        outcome = {"status": status, "exit_code": code, "log_tail": log_tail(log)}
    config = train_bench.load_trainer_config(run.model, overrides)
    outcome = train_bench.summarize(
        {**outcome, "model": run.model, "system": run.system}, seq, PEAK_FLOPS
    )
    geometry = train_bench.geometry(config)
    outcome.update(seq=seq, geometry=geometry)
    if outcome.get("status") == "ok":
        span = document_length(args) if run.documents else seq
        outcome = with_attention_span(outcome, span)
    outcome.update(
        name=name, recompute=level if run.system != "hf" else None,
        documents=run.documents, wall_s=wall, overrides=overrides,
        log=str(log.relative_to(args.out)),
    )  # fmt: skip
    outcome.pop("machine", None)
    write_json(result, outcome)
    print(
        f"  {outcome['status']}: {fmt(outcome.get('tokens_per_s'), ',.0f')} tokens/s, "
        f"{fmt(_peak(outcome), '.1f')} GiB, {wall:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return outcome


def with_attention_span(run: dict[str, Any], span: int) -> dict[str, Any]:
    """The run's FLOPs per token and MFU with each token attending over `span` keys (the
    document length when attention stays within packed documents), torchtitan's way (as if
    not causal) and causal-corrected (the attention term halved)."""
    g, seq = run["geometry"], run["seq"]
    per_key = 12 * g["layers"] * g["heads"] * g["head_size"]
    flops = run["flops_per_token"] - per_key * run.get("attention_span", seq) + per_key * span
    causal = flops - per_key * span / 2
    return {
        **run,
        "attention_span": span,
        "flops_per_token": flops,
        "tflops": run["tokens_per_s"] * flops / 1e12,
        "mfu": run["tokens_per_s"] * flops / PEAK_FLOPS,
        "causal_flops_per_token": causal,
        "causal_mfu": run["tokens_per_s"] * causal / PEAK_FLOPS,
    }


def _peak(run: dict[str, Any]) -> float | None:
    memory = run.get("peak_memory") or {}
    return (memory.get("process") or memory).get("allocated_gib")


def write_datasets(args: argparse.Namespace, work: Path) -> dict[tuple[int, bool], dict]:
    needed: dict[tuple[int, bool], int] = {}
    for run in PLAN:
        options = argparse.Namespace(tiny=args.tiny)
        config = train_bench.load_trainer_config(
            run.model, train_bench.model_overrides(run.model, options)
        )
        seq = TINY_SEQ[run.seq] if args.tiny else run.seq
        key = (config.model.base_model.vocab_size, run.documents)
        needed[key] = max(needed.get(key, 0), (run.warmup + run.steps + 1) * (seq + 1))
    return {
        (vocab, documents): write_random_dataset(
            work / f"random_{vocab}{'_documents' if documents else ''}",
            vocab_size=vocab,
            tokens=tokens,
            document_length=document_length(args) if documents else None,
            seed=args.seed,
        )
        for (vocab, documents), tokens in needed.items()
    }


def document_length(args: argparse.Namespace) -> int:
    return 32 if args.tiny else DOCUMENT_LENGTH


def attention_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    lengths = [TINY_SEQ[s] if args.tiny else s for s in (16 * K, 32 * K, 64 * K, 128 * K)]
    spec = {
        "heads": 4 if args.tiny else 32, "kv_heads": 2 if args.tiny else 8,
        "head_size": 16 if args.tiny else 64, "lengths": lengths,
        "document_seq": lengths[1], "document_length": document_length(args),
        "repeats": 2 if args.tiny else 3,
    }  # fmt: skip
    spec_path, result = work / "attention.spec.json", args.out / "runs" / "attention.json"
    write_json(spec_path, {**spec, "result": str(result)})
    command = [sys.executable, str(Path(__file__).resolve()), "--attention-child", str(spec_path)]
    print("attention ...", file=sys.stderr, flush=True)
    code, wall, log = spawn("attention", command, args, work, 120, "attention")
    if code != 0 or not result.is_file():
        return {"status": "failed", "exit_code": code, "log_tail": log_tail(log)}
    return {**read_json(result), "status": "ok", "wall_s": wall}


def comparisons(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fastllm against HF at each (model, seq) where both ran, and the targets."""
    ok = {
        (r["model"], r["seq"], r["system"]): r
        for r in runs
        if r.get("status") == "ok" and not r.get("documents")
    }
    rows = []
    for (model, seq, system), ours in ok.items():
        theirs = ok.get((model, seq, "hf"))
        if system == "hf" or theirs is None:
            continue
        speed = ours["tokens_per_s"] / theirs["tokens_per_s"]
        ours_peak, theirs_peak = _peak(ours), _peak(theirs)
        memory = None if ours_peak is None or theirs_peak is None else ours_peak / theirs_peak
        rows.append(
            {
                "model": model,
                "seq": seq,
                "tokens_per_s_ratio": speed,
                "peak_allocated_ratio": memory,
                "target_met": memory is not None and speed >= 2 and memory <= 0.7,
            }
        )
    return rows


def table(report: dict[str, Any]) -> str:
    rows = []
    for run in report["runs"]:
        rows.append(
            [
                f"llama-{run['model']}",
                f"{run['seq']:,}",
                run["system"] + (" (packed documents)" if run.get("documents") else ""),
                run.get("recompute") or "—",
                fmt(run.get("tokens_per_s"), ",.0f"),
                fmt(run.get("mfu") and 100 * run["mfu"], ".1f"),
                fmt(run.get("causal_mfu") and 100 * run["causal_mfu"], ".1f"),
                fmt(_peak(run), ".1f"),
                fmt(run.get("joules_per_step"), ",.0f"),
                run["status"],
            ]
        )
    headers = [
        "model", "seq", "system", "recompute", "tokens/s", "MFU % (torchtitan)",
        "MFU % (causal)", "peak alloc GiB", "J / step", "status",
    ]  # fmt: skip
    text = markdown_table(headers, rows, text_columns=4)
    if report["comparisons"]:
        ratio_rows = [
            [
                f"llama-{row['model']}",
                f"{row['seq']:,}",
                f"{row['tokens_per_s_ratio']:.2f}x",
                fmt(row["peak_allocated_ratio"], ".2f"),
                "yes" if row["target_met"] else "no",
            ]
            for row in report["comparisons"]
        ]
        headers = ["model", "seq", "fastllm / HF tokens/s", "fastllm / HF peak", "≥2×, ≤0.7×"]
        text += "\n\n" + markdown_table(headers, ratio_rows, text_columns=2)
    attention = report.get("attention") or {}
    if attention.get("status") == "ok":
        dense = [
            [f"{row['seq']:,}", f"{row['ms']:.1f}", f"{row['causal_tflops']:.0f}"]
            for row in attention["dense_causal"]
        ]
        text += "\n\nattention alone, forward + backward, llama-1b shape (32 heads, 8 kv, 64)\n\n"
        text += markdown_table(["seq", "dense causal ms", "causal TFLOP/s"], dense)
        documents = attention["documents"]
        text += (
            f"\n\n{documents['document_length']:,}-token documents in {documents['seq']:,}: "
            f"{documents['masked_ms']:.1f} ms masked against {documents['dense_causal_ms']:.1f} "
            f"ms dense causal ({documents['speedup']:.2f}x); later chunk's queries against the "
            f"whole: relative error {attention['later_chunk_relative_error']:.1e}"
        )
    return text


def plot(report: dict[str, Any], path: Path) -> bool:
    """tokens/s and peak memory against sequence length, per model and system."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is missing: plot later with --plot RESULT.json", file=sys.stderr)
        return False
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[dict]] = {}
    for run in report["runs"]:
        if run.get("status") == "ok" and not run.get("documents"):
            series.setdefault(f"llama-{run['model']} {run['system']}", []).append(run)
    for label, runs in series.items():
        runs.sort(key=lambda r: r["seq"])
        seqs = [r["seq"] for r in runs]
        axes[0].plot(seqs, [r["tokens_per_s"] for r in runs], "o-", label=label)
        axes[1].plot(seqs, [_peak(r) for r in runs], "o-", label=label)
    for axis, title in ((axes[0], "tokens/s"), (axes[1], "peak allocated GiB")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("sequence length (one sequence per step)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[1].axhline(139, color="grey", linestyle=":", label="H200 memory")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"Long context on one GPU (commit {report['commit'][:10]})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return True


def report_of(args: argparse.Namespace, attention: dict, runs: list[dict]) -> dict[str, Any]:
    return {
        "benchmark": "long_context",
        **commit_info(args.commit),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"tiny": args.tiny, "deadline_s": args.deadline, "peak_flops": PEAK_FLOPS},
        "method": (
            "train_bench children, micro-batch 1, one sequence per step, warm-up steps "
            "excluded; each fastllm run keeps the first recomputation level of its ladder that "
            "fits; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for every run; compile "
            "caches shared by the runs of one system; MFU by torchtitan's formula and "
            "causal-corrected (attention term halved)"
        ),
        "plan": [run.__dict__ for run in PLAN],
        "attention": attention,
        "runs": runs,
        "comparisons": comparisons(runs),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit")
    parser.add_argument("--deadline", type=float, default=330, help="seconds for all runs")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized geometry (smoke test)")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--plot", type=Path, nargs="+", metavar="RESULT.json")
    parser.add_argument(
        "--only", nargs="+", metavar="RUN",
        help="only these runs of the plan (MODEL:SEQ:SYSTEM[:documents]) and, if listed, "
        "'attention'; e.g. 1b:32768:hf 1b:32768:fastllm",
    )  # fmt: skip
    parser.add_argument("--attention-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not (args.attention_child or args.plot) and args.out is None:
        parser.error("--out is required")
    labels = {run.label for run in PLAN} | {"attention"}
    if unknown := set(args.only or ()) - labels:
        parser.error(f"--only: no such run {sorted(unknown)}; the plan has {sorted(labels)}")
    return args


def main() -> None:
    args = parse_args()
    if args.attention_child:
        spec = read_json(args.attention_child)
        write_json(Path(spec["result"]), attention_child(spec))
        return
    if args.plot:
        report = read_json(args.plot[0])
        replot_report(report, args.out or args.plot[0].parent, "long_context", False, table, plot)
        return
    args.started = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="fastllm-long-bench-"))
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    datasets = write_datasets(args, work)
    result = args.out / "long_context.json"
    plan = [run for run in PLAN if not args.only or run.label in args.only]
    wanted = not args.only or "attention" in args.only
    attention = attention_part(args, work) if wanted else {"status": "not run (--only)"}
    runs: list[dict[str, Any]] = []
    for run in plan:
        for level in run.ladder if run.system != "hf" else ("—",):
            if time.monotonic() - args.started > args.deadline:
                runs.append({"model": run.model, "seq": run.seq, "system": run.system,
                             "documents": run.documents, "status": "skipped (deadline)"})  # fmt: skip
                break
            outcome = train_run(run, level, args, work, datasets)
            runs.append(outcome)
            write_json(result, report_of(args, attention, runs))
            if outcome["status"] != "oom":
                break
    report = report_of(args, attention, runs)
    write_json(result, report)
    text = table(report)
    (args.out / "long_context.md").write_text(text + "\n")
    print(f"\n{result}\n\n{text}")
    plot(report, args.out / "long_context.png")


if __name__ == "__main__":
    main()
