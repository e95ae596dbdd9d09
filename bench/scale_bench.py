"""Data-parallel scaling of `fastllm train`: the Mistral-7B geometry (examples/mistral-7b.yaml,
seq 4096, bf16 with fp32 master weights, ZeRO-2) on G = 1, 2, 8 … GPUs of one host, each run
launched as a user would launch it:

    python -m torch.distributed.run --standalone --nproc-per-node G -m fastllm.cli train \\
        -c examples/mistral-7b.yaml model.multi_stage.zero_stage=2 ...

Every rank carries the same load at every G: the same micro-batch and the same per-GPU batch
(sequences per rank per optimizer step; gradient accumulation = per-GPU batch / micro-batch),
by default --global-batch / max(--gpus), so the largest run trains on exactly the global batch
(128 sequences) and a run on G GPUs on G × per-GPU batch. --strong instead keeps the global
batch at every G (per-GPU batch = global / G, accumulation adjusting). The JSON records what
each run used.

Each run logs every step to EXP/metrics.jsonl (rank 0; tokens_per_s is per GPU). The steady
state excludes the first --skip logged steps (compilation, autotuning, the loader's start);
tokens/s per GPU is the harmonic mean of the remaining steps (total tokens / total time), MFU
likewise; peak memory is the largest memory_gib logged (torch.cuda.max_memory_allocated of
rank 0 over each logging interval, so the peak of training, setup excluded). Scaling
efficiency = tokens/s per GPU at G / tokens/s per GPU at 1 GPU — or, when the 1-GPU run
failed (a 7B model with fp32 masters and Adam moments needs about 130 GB before activations),
at the fewest GPUs that ran; the JSON names that reference.

The dataset is uniformly random tokens (vocabulary 32000) written once per invocation under
--work as one document, so that every sample's attention is plain causal attention.

    python bench/scale_bench.py --gpus 1 2 8 --out bench/results/scale_h200 --commit HASH
    python bench/scale_bench.py --tiny --device cpu --gpus 1 2 --out /tmp/scale_smoke
    python bench/scale_bench.py --plot A/scale_bench.json B/scale_bench.json --out merged/
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import (
    EXAMPLES,
    ROOT,
    commit_info,
    fmt,
    harmonic_mean,
    log_tail,
    markdown_table,
    pyplot,
    read_json,
    replot_report,
    write_json,
    write_random_dataset,
)

DEFAULT_CONFIG = EXAMPLES / "mistral-7b.yaml"
T = "model.base_model.transformer."
TINY = (
    T + "num_layers=2",
    T + "hidden_size=64",
    T + "num_attention_heads=4",
    T + "head_groups=2",
    T + "ffn_hidden_size=128",
    T + "window_size=48",
    "model.base_model.vocab_size=512",
)
"""--tiny: the same config at a CPU-sized geometry (the window still shorter than a sample)."""
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


# ---------------------------------------------------------------- the runs


def batch_plan(gpus: int, args: argparse.Namespace) -> dict[str, int]:
    """Per-GPU batch, accumulation and global batch of the run on `gpus` GPUs."""
    if args.strong:
        per_gpu = args.global_batch // gpus
    else:
        per_gpu = args.per_gpu_batch or args.global_batch // max(args.gpus)
    if per_gpu < args.micro_batch or per_gpu % args.micro_batch:
        raise SystemExit(
            f"{gpus} GPU(s): a per-GPU batch of {per_gpu} is not a multiple of the "
            f"micro-batch {args.micro_batch}"
        )
    return {
        "micro_batch": args.micro_batch,
        "per_gpu_batch": per_gpu,
        "accumulation": per_gpu // args.micro_batch,
        "global_batch": per_gpu * gpus,
    }


def overrides(gpus: int, args: argparse.Namespace, experiment: Path, dataset: Path) -> list[str]:
    plan = batch_plan(gpus, args)
    return [
        *(TINY if args.tiny else ()),
        f"run.experiment_dir={experiment}",
        f"data.path=[{dataset}]",
        "model.distributed.training_dtype=bfloat16",
        f"model.multi_stage.zero_stage={args.zero_stage}",
        f"batch.sequence_length={args.seq}",
        f"batch.batch_size={plan['global_batch']}",
        f"batch.micro_batch_size={plan['micro_batch']}",
        f"training.train_iters={args.steps}",
        "training.logs.interval=1",
        "training.checkpoint.interval=null",
        "training.checkpoint.at_end=false",
        "training.export.interval=null",
        *args.set,
    ]


def trainer_config(config_file: Path, arguments: list[str]) -> Any:
    """The run's config, validated here before any launch (fastllm.config imports no torch)."""
    from fastllm.config import TrainerConfig, load_config

    return load_config(TrainerConfig, [config_file], arguments)


def geometry(config: Any) -> dict[str, Any]:
    base = config.model.base_model
    t = base.transformer
    return {
        "layers": t.num_layers,
        "hidden": t.hidden_size,
        "heads": t.num_attention_heads,
        "kv_heads": t.head_groups,
        "ffn": t.ffn_hidden_size,
        "window": t.window_size,
        "vocab": base.vocab_size,
        "parameters": base.num_parameters(),
        "seq": config.batch.sequence_length,
        "zero_stage": config.model.multi_stage.zero_stage,
        "training_dtype": config.model.distributed.training_dtype,
        "recompute": config.model.multi_stage.recompute,
    }


def worker_pids(pid: int) -> list[int]:
    """The processes torchrun started (its children, from /proc)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children


def stop(process: subprocess.Popen) -> None:
    """End a launch: its workers first (torchrun puts each in its own session), then torchrun."""
    for pid in worker_pids(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def read_records(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return records


def launch(
    gpus: int, arguments: list[str], metrics: Path, args: argparse.Namespace, work: Path
) -> dict:
    """One `torchrun ... fastllm train` run; waits for it (or, with --kill-at-end, for the
    last step's metrics in `metrics`) and returns how it ended."""
    log = args.out / "logs" / f"gpus_{gpus}.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={gpus}", "-m", "fastllm.cli", "train", "-c", str(args.config), *arguments,
    ]  # fmt: skip
    caches = work / "caches" / f"gpus_{gpus}"  # no compiled kernels reused across runs
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        TRITON_CACHE_DIR=str(caches / "triton"),
    )
    if args.device == "cpu":
        # One thread per rank at every G: the same per-process load, and no OpenMP barriers
        # spinning against other processes on a small shared machine.
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    start = time.perf_counter()
    first_record = last_step = None
    ended = "exited"
    with log.open("w") as output:
        output.write(" ".join(command) + "\n\n")
        output.flush()
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
        while process.poll() is None:
            time.sleep(1.0)
            now = time.perf_counter() - start
            records = read_records(metrics)
            if records and first_record is None:
                first_record = now
            if last_step is None and any(r.get("step") == args.steps for r in records):
                last_step = now
                if args.kill_at_end:
                    stop(process)
                    ended = "killed after the last step's metrics (--kill-at-end)"
            if now > args.timeout:
                stop(process)
                ended = "timeout"
    wall = time.perf_counter() - start
    return {
        "command": command,
        "exit_code": process.returncode,
        "ended": ended,
        "wall_s": wall,
        "first_record_s": first_record,
        "after_last_step_s": None if last_step is None else wall - last_step,
        "records": read_records(metrics),
        "log": str(log),
    }


def steady_state(records: list[dict[str, Any]], skip: int, per_gpu_tokens: int) -> dict:
    """Tokens/s per GPU and MFU over the logged steps after the first `skip`."""
    steady = [r for r in records if r.get("step", 0) > skip and r.get("tokens_per_s")]
    if not steady:
        return {}
    tokens_per_s = harmonic_mean([r["tokens_per_s"] for r in steady])
    mfus = [r["mfu"] for r in steady if r.get("mfu")]
    memories = [r["memory_gib"] for r in records if r.get("memory_gib") is not None]
    return {
        "steady_steps": [r["step"] for r in steady],
        "tokens_per_s_per_gpu": tokens_per_s,
        "tflops_per_gpu": harmonic_mean([r["tflops"] for r in steady]),
        "mfu": harmonic_mean(mfus) if len(mfus) == len(steady) else None,
        "step_s": [per_gpu_tokens / r["tokens_per_s"] for r in steady],
        "peak_memory_gib": max(memories) if memories else None,
        "peak_reserved_gib": max(
            (r["memory_reserved_gib"] for r in records if r.get("memory_reserved_gib")),
            default=None,
        ),
        "losses": [r.get("loss") for r in records],
    }


def run_gpus(gpus: int, args: argparse.Namespace, work: Path, dataset: Path) -> dict:
    experiment = work / f"exp_gpus_{gpus}"
    shutil.rmtree(experiment, ignore_errors=True)  # no resuming from an earlier invocation
    arguments = overrides(gpus, args, experiment, dataset)
    config = trainer_config(args.config, arguments)
    plan = batch_plan(gpus, args)
    print(f"{gpus} GPU(s): {plan} ...", file=sys.stderr, flush=True)
    metrics = experiment / "metrics.jsonl"
    outcome = launch(gpus, arguments, metrics, args, work)
    per_gpu_tokens = plan["per_gpu_batch"] * args.seq
    run = {
        "gpus": gpus,
        **plan,
        "global_batch_target": args.global_batch,
        "tokens_per_gpu_per_step": per_gpu_tokens,
        "overrides": arguments,
        **outcome,
        **steady_state(outcome["records"], args.skip, per_gpu_tokens),
    }
    logged_all = any(r.get("step") == args.steps for r in outcome["records"])
    text = Path(outcome["log"]).read_text(errors="replace")
    if logged_all and "tokens_per_s_per_gpu" in run:
        run["status"] = "ok"
    elif any(marker in text for marker in OOM_MARKERS):
        run["status"] = "oom"
    else:
        run["status"] = "timeout" if outcome["ended"] == "timeout" else "failed"
    if run["status"] != "ok":
        run["log_tail"] = log_tail(Path(outcome["log"]))
    if run["status"] == "ok" and outcome["exit_code"] not in (0, None) and not args.kill_at_end:
        run["warning"] = "every step was logged but the launch exited with an error"
    if metrics.is_file():
        shutil.copy2(metrics, args.out / "runs" / f"gpus_{gpus}.metrics.jsonl")
    if not args.keep_experiments:  # sampling caches and logs only: no checkpoint is written
        shutil.rmtree(experiment, ignore_errors=True)
    run["geometry"] = geometry(config)
    write_json(args.out / "runs" / f"gpus_{gpus}.json", run)
    print(
        f"  {run['status']}: {fmt(run.get('tokens_per_s_per_gpu'), ',.0f')} tokens/s/GPU, "
        f"MFU {fmt(run.get('mfu'), '.1%')}, "
        f"{fmt(run.get('peak_memory_gib'), '.1f')} GiB",
        file=sys.stderr,
        flush=True,
    )
    return run


# ---------------------------------------------------------------- the report


def with_efficiency(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Scaling efficiency of each run against 1 GPU, or the fewest GPUs that ran."""
    ok = sorted((run for run in runs if run["status"] == "ok"), key=lambda run: run["gpus"])
    reference = ok[0] if ok else None
    for run in runs:
        run["scaling_efficiency"] = (
            run["tokens_per_s_per_gpu"] / reference["tokens_per_s_per_gpu"]
            if reference and run["status"] == "ok"
            else None
        )
        run["tokens_per_s_total"] = (
            run["tokens_per_s_per_gpu"] * run["gpus"] if run["status"] == "ok" else None
        )
    return {
        "reference_gpus": reference["gpus"] if reference else None,
        "reference_note": None
        if not reference or reference["gpus"] == 1
        else f"no 1-GPU run completed; efficiency is relative to {reference['gpus']} GPUs",
    }


def report_of(args: argparse.Namespace, dataset: dict, runs: list[dict]) -> dict[str, Any]:
    runs = sorted(runs, key=lambda run: run["gpus"])
    return {
        "benchmark": "scale",
        **commit_info(args.commit),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(args.device),
        "config": {
            "config_file": str(args.config.resolve().relative_to(ROOT)),
            "gpus": args.gpus,
            "steps": args.steps,
            "skip": args.skip,
            "seq": args.seq,
            "global_batch": args.global_batch,
            "micro_batch": args.micro_batch,
            "per_gpu_batch": args.per_gpu_batch,
            "mode": "strong (global batch fixed)" if args.strong else "same per-GPU batch",
            "zero_stage": args.zero_stage,
            "extra_overrides": args.set,
            "tiny": args.tiny,
            "device": args.device,
            "kill_at_end": args.kill_at_end,
        },
        "method": (
            "one torchrun launch of `fastllm train` per GPU count; metrics.jsonl logged every "
            "step by rank 0; steady state = logged steps after the first `skip`; tokens/s per "
            "GPU and MFU = harmonic means over those steps; peak memory = max memory_gib "
            "(max_memory_allocated of rank 0 per logging interval: training, not setup)"
        ),
        "dataset": dataset,
        **with_efficiency(runs),
        "runs": runs,
    }


def gpu_count() -> int | None:
    """GPUs visible to nvidia-smi (None without it: the launches will tell)."""
    if not shutil.which("nvidia-smi"):
        return None
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in result.stdout.splitlines())


def machine(device: str) -> dict[str, Any]:
    """Host and accelerators, without importing torch into this process."""
    import platform
    import socket

    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform()}
    if device != "cpu" and shutil.which("nvidia-smi"):
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        info["gpus"] = result.stdout.strip().splitlines()
    info["cpu_count"] = os.cpu_count()
    return info


def table(report: dict[str, Any]) -> str:
    rows = [
        [
            str(run["gpus"]),
            f"{run['micro_batch']} / {run['per_gpu_batch']} / {run['accumulation']}",
            str(run["global_batch"]),
            fmt(run.get("tokens_per_s_per_gpu"), ",.0f"),
            fmt(run.get("tokens_per_s_total"), ",.0f"),
            fmt(run.get("mfu") and 100 * run["mfu"], ".1f"),
            fmt(run.get("peak_memory_gib"), ".1f"),
            fmt(run.get("scaling_efficiency") and 100 * run["scaling_efficiency"], ".1f"),
            run["status"],
        ]
        for run in report["runs"]
    ]
    headers = [
        "GPUs",
        "micro / per-GPU batch / accum.",
        "global batch",
        "tokens/s/GPU",
        "tokens/s total",
        "MFU %",
        "peak GiB",
        f"efficiency % (vs {report.get('reference_gpus')} GPU)",
        "status",
    ]
    return markdown_table(headers, rows, text_columns=2)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Total tokens/s against GPUs with the ideal line, and per-GPU efficiency with MFU."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is missing: plot later with --plot RESULT.json", file=sys.stderr)
        return False
    ok = [run for run in report["runs"] if run["status"] == "ok"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if ok:
        reference = next(run for run in ok if run["gpus"] == report["reference_gpus"])
        gpus = [run["gpus"] for run in ok]
        per_gpu = reference["tokens_per_s_per_gpu"]
        left.plot(gpus, [per_gpu * g for g in gpus], "--", color="gray", label="linear")
        left.plot(gpus, [run["tokens_per_s_total"] for run in ok], "o-", label="fastllm")
        left.set_xscale("log", base=2)
        left.set_xticks(gpus, [str(g) for g in gpus])
        left.legend(fontsize=8)
        bars = right.bar([str(g) for g in gpus], [100 * run["scaling_efficiency"] for run in ok])
        for bar, run in zip(bars, ok, strict=True):
            right.annotate(
                f"{100 * run['scaling_efficiency']:.1f}%\nMFU {fmt(run.get('mfu'), '.1%')}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center", va="bottom", fontsize=8,
            )  # fmt: skip
        right.set_ylim(0, 115)
    failed = [f"{run['gpus']}: {run['status']}" for run in report["runs"] if run["status"] != "ok"]
    if failed:
        right.text(0.02, 0.02, "not measured — " + ", ".join(failed), transform=right.transAxes)
    left.set(xlabel="GPUs", ylabel="tokens/s (all GPUs)", title="throughput")
    right.set(
        xlabel="GPUs",
        ylabel="%",
        title=f"per-GPU tokens/s vs {report.get('reference_gpus')} GPU",
    )
    for axis in (left, right):
        axis.grid(alpha=0.3)
    config, device = report["config"], (report["machine"].get("gpus") or ["CPU"])[0]
    figure.suptitle(
        f"fastllm data-parallel scaling{' (tiny smoke geometry)' if config.get('tiny') else ''}, "
        f"{Path(config['config_file']).stem}, seq {config['seq']}, ZeRO-{config['zero_stage']}, {device} "
        f"(commit {report['commit'][:10]}{'+' if report.get('dirty') else ''})",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return True


def replot(results: list[Path], out: Path | None) -> None:
    """Table and plot of saved results; several (e.g. a 2-GPU and an 8-GPU machine's) are
    merged by GPU count, later files winning."""
    reports = [read_json(path) for path in results]
    runs = {run["gpus"]: run for report in reports for run in report["runs"]}
    merged = {**reports[0], "runs": sorted(runs.values(), key=lambda run: run["gpus"])}
    merged.update(with_efficiency(merged["runs"]))
    stem = results[0].stem
    if len(results) > 1:
        stem = "scale_bench_merged"
        merged["merged_from"] = [
            {"file": str(path), "commit": report["commit"], "machine": report["machine"]}
            for path, report in zip(results, reports, strict=True)
        ]
    replot_report(merged, out or results[0].parent, stem, len(results) > 1, table, plot)


# ---------------------------------------------------------------- the driver


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 8; --tiny 3)")
    parser.add_argument("--skip", type=int, help="first logged steps excluded (default 2; tiny 1)")
    parser.add_argument("--seq", type=int, help="sequence length (default 4096; --tiny 64)")
    parser.add_argument("--global-batch", type=int, help="sequences (default 128; --tiny 8)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--per-gpu-batch", type=int, help="default: global batch / max(--gpus)")
    parser.add_argument("--strong", action="store_true", help="keep the global batch at every G")
    parser.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=2)
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="example config (default mistral-7b)"
    )
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="more config overrides"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU-sized geometry (smoke test)")
    parser.add_argument(
        "--device", choices=["auto", "cpu"], default="auto", help="cpu: Gloo CPU processes"
    )
    parser.add_argument(
        "--kill-at-end",
        action="store_true",
        help="end each launch once its last step is logged, skipping its teardown",
    )
    parser.add_argument("--keep-experiments", action="store_true", help="keep EXP directories")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per launch")
    parser.add_argument("--commit", help="commit being measured (default: git rev-parse HEAD)")
    parser.add_argument("--out", type=Path, help="result directory")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--plot", type=Path, nargs="+", metavar="RESULT.json", help="only tabulate and plot"
    )
    args = parser.parse_args()
    if not args.plot and args.out is None:
        parser.error("--out is required")
    args.steps = args.steps or (3 if args.tiny else 8)
    args.skip = args.skip if args.skip is not None else (1 if args.tiny else 2)
    args.seq = args.seq or (64 if args.tiny else 4096)
    args.global_batch = args.global_batch or (8 if args.tiny else 128)
    if not args.plot and args.steps <= args.skip:
        parser.error("--steps must exceed --skip")
    return args


def main() -> None:
    args = parse_args()
    if args.plot:
        replot(args.plot, args.out)
        return
    for gpus in args.gpus:  # every plan is valid before any GPU time is spent
        batch_plan(gpus, args)
    available = gpu_count() if args.device != "cpu" else None
    if available is not None and max(args.gpus) > available:
        raise SystemExit(f"--gpus {max(args.gpus)}: this machine has {available} GPU(s)")
    work = args.work or Path(tempfile.mkdtemp(prefix="fastllm-scale-bench-"))
    for sub in ("logs", "runs"):
        (args.out / sub).mkdir(parents=True, exist_ok=True)
    vocab = trainer_config(args.config, list(TINY if args.tiny else ())).model.base_model.vocab_size
    samples = max(batch_plan(g, args)["global_batch"] for g in args.gpus) * args.steps
    dataset = write_random_dataset(
        work / "dataset",
        vocab_size=vocab,
        tokens=(samples + 1) * (args.seq + 1),
        document_length=None,
        seed=args.seed,
    )
    result = args.out / "scale_bench.json"
    runs: list[dict[str, Any]] = []
    for gpus in args.gpus:
        runs.append(run_gpus(gpus, args, work, Path(dataset["path"])))
        write_json(result, report_of(args, dataset, runs))  # kept if a later run is cut short
    report = read_json(result)
    text = table(report)
    (args.out / "scale_bench.md").write_text(text + "\n")
    print(f"\n{result}\n\n{text}")
    if report.get("reference_note"):
        print(f"\n{report['reference_note']}")
    if plot(report, args.out / "scale_bench.png"):
        print(f"\n{args.out / 'scale_bench.png'}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
