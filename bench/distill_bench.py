"""Distillation on one GPU: `fastllm train -c examples/distill-llama3-1b.yaml`, a llama-1b
student learning from a llama-8b teacher, MFU over both models' FLOPs (issue 35; target 50%).

- models:   random bf16 weights in Llama-3.2-1B's and Llama-3.1-8B's geometries
            (examples/llama3-1b.yaml and llama3-8b.yaml through fastllm's own conversion),
            saved as Hugging Face directories: the student's `pretrained` and the teacher's
            `reference_models.teacher` (read into bf16 weights-only buffers).
- run:      the Trainer `fastllm train` builds from the example (half the label loss, half the
            forward KL from the teacher at temperature 1; bf16 compute, fp32 master weights
            and Adam moments, clipping), each step `engine.train_step`: --batch sequences of
            --seq uniformly random tokens (one document: plain causal attention), --micro-batch
            a micro-batch, the teacher's forward pass on each micro-batch in the step.

Measured: warm-up steps excluded, then --steps steps between two synchronizations; tokens/s
(batch × seq a step), peak memory allocated (timed steps; whole process), and MFU over both
models' FLOPs (bench_common.forward_flops; 989.4 TFLOP/s): the student's forward and backward
(3 × a forward) and the teacher's forward, each 2 FLOPs per matmul weight per token (the head
over every token), plus attention: `mfu` counts it whole as torchtitan does and as fastllm's
logs do (12 × heads × head size × seq per token and layer for the student, a third of that for
the teacher), `mfu_causal` only the (query, key) pairs the causal mask keeps. Work done again
(fastllm's recomputation) is not counted. The time to write the two models is reported apart.

    python bench/distill_bench.py --out bench/results/distill_h200 --commit HASH
    python bench/distill_bench.py --tiny --device cpu --out /tmp/distill_smoke  # CPU smoke test
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import (
    EXAMPLES,
    commit_info,
    fmt,
    forward_flops,
    markdown_table,
    write_json,
    write_random_dataset,
    write_random_llama,
)
from train_bench import (
    PEAK_FLOPS,
    add_run_arguments,
    resolve_run_arguments,
    run_child,
    spawn,
    time_trainer,
)

CONFIG = EXAMPLES / "distill-llama3-1b.yaml"
MODELS = {"student": "llama3-1b.yaml", "teacher": "llama3-8b.yaml"}
TINY = {
    "student": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
    },
    "teacher": {
        "num_hidden_layers": 3,
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
    },
}
"""--tiny: both configs at CPU sizes, the teacher still the larger."""


def build(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """work/student and work/teacher (Hugging Face directories) and work/data (random tokens)."""
    device = "cpu" if args.device == "cpu" else "cuda"
    inputs: dict[str, Any] = {}
    for name, example in MODELS.items():
        start = time.perf_counter()
        inputs[name] = write_random_llama(
            work / name, example, shrink=TINY[name] if args.tiny else None,
            seed=args.seed, device=device,
        )  # fmt: skip
        inputs[f"{name}_write_s"] = time.perf_counter() - start
    vocab = inputs["student"]["vocab"]
    assert vocab == inputs["teacher"]["vocab"], "the student and its teacher share a vocabulary"
    samples = (args.warmup + args.steps) * args.batch
    inputs["dataset"] = write_random_dataset(
        work / "data", vocab_size=vocab, tokens=(samples + 1) * (args.seq + 1),
        document_length=None, seed=args.seed,
    )  # fmt: skip
    return inputs


def overrides(args: argparse.Namespace, work: Path) -> list[str]:
    return [
        f"run.experiment_dir={work / 'exp'}",
        f"pretrained.path={work / 'student'}",
        f"reference_models.teacher.pretrained.path={work / 'teacher'}",
        f"data.path=[{work / 'data'}]",
        f"batch.sequence_length={args.seq}",
        f"batch.batch_size={args.batch}",
        f"batch.micro_batch_size={args.micro_batch}",
        f"training.train_iters={args.warmup + args.steps}",
        "training.checkpoint.interval=null",
        "training.export.interval=null",
        *args.set,
    ]


def step_flops(args: argparse.Namespace, inputs: dict[str, Any]) -> dict[str, float]:
    """Both models' FLOPs in one step, attention whole and causal (module docstring)."""
    tokens, seq = args.batch * args.seq, args.seq

    def forward(model: str, attended_a_sequence: int) -> float:
        pairs = args.batch * attended_a_sequence
        return forward_flops(inputs[model], tokens=tokens, head_rows=tokens, attended_pairs=pairs)

    whole, causal = seq * seq, seq * (seq + 1) // 2
    student, teacher = 3 * forward("student", whole), forward("teacher", whole)
    return {
        "flops_per_step": student + teacher,
        "flops_per_step_causal": 3 * forward("student", causal) + forward("teacher", causal),
        "teacher_share": teacher / (student + teacher),
    }


# ---------------------------------------------------------------- the run (child process)


def run_fastllm(spec: dict[str, Any]) -> dict[str, Any]:
    from fastllm.config import TrainerConfig, build, load_raw
    from fastllm.training.setup import check_inputs, with_pretrained_architecture

    raw = load_raw([str(CONFIG)], spec["overrides"])
    config = build(TrainerConfig, with_pretrained_architecture(raw))
    check_inputs(config)
    named: dict[str, list[float]] = {}

    def train_step(trainer: Any, micro_batches: list[Any]) -> dict[str, Any]:
        metrics = trainer.engine.train_step(micro_batches)
        for key in ("label_loss", "distillation_loss"):
            named.setdefault(key, []).append(metrics[key])
        return metrics

    _, timing = time_trainer(config, spec["warmup"], spec["steps"], train_step)
    return {
        "named_losses": named,
        "precision": "bf16 compute; the student's fp32 master weights, gradients and Adam "
        "moments; the teacher in bf16 weights-only buffers",
        **timing,
    }


# ---------------------------------------------------------------- the driver


def summarize(run: dict[str, Any], args: argparse.Namespace, inputs: dict) -> dict[str, Any]:
    if run["status"] != "ok":
        return run
    per_s = len(run["step_s"]) / run["elapsed_s"]
    counts = step_flops(args, inputs)
    ordered = sorted(run["step_s"])
    return {
        **run,
        **counts,
        "tokens_per_step": args.batch * args.seq,
        "tokens_per_s": per_s * args.batch * args.seq,
        "tflops": per_s * counts["flops_per_step"] / 1e12,
        "mfu": per_s * counts["flops_per_step"] / PEAK_FLOPS,
        "mfu_causal": per_s * counts["flops_per_step_causal"] / PEAK_FLOPS,
        "median_step_s": ordered[len(ordered) // 2],
    }


def table(report: dict[str, Any]) -> str:
    rows = []
    for run in report["runs"]:
        memory = run.get("peak_memory") or {}
        rows.append(
            [
                run["system"],
                fmt(run.get("tokens_per_s"), ",.0f"),
                fmt(run.get("mfu") and 100 * run["mfu"], ".1f"),
                fmt(run.get("mfu_causal") and 100 * run["mfu_causal"], ".1f"),
                fmt(run.get("median_step_s") and 1e3 * run["median_step_s"], ",.0f"),
                fmt((memory.get("timed_steps") or {}).get("allocated_gib"), ".1f"),
                fmt((memory.get("process") or {}).get("allocated_gib"), ".1f"),
                fmt(run.get("setup_s"), ".1f"),
                run["status"],
            ]
        )
    headers = [
        "system",
        "tokens/s",
        "MFU % (both models)",
        "MFU % (causal)",
        "step ms (median)",
        "peak alloc GiB (steps)",
        "peak alloc GiB (process)",
        "set-up s",
        "status",
    ]
    return markdown_table(headers, rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, help="sequence length (default 4096; --tiny 64)")
    parser.add_argument("--batch", type=int, default=8, help="sequences a step")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences a micro-batch")
    add_run_arguments(
        parser, timeout=300, tiny="CPU-sized models", timeout_help="seconds for the run"
    )
    args = parser.parse_args()
    if args.child:
        return args
    resolve_run_arguments(parser, args)
    args.seq = args.seq or (64 if args.tiny else 4096)
    if args.batch % args.micro_batch:
        parser.error("--batch must be a multiple of --micro-batch")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        run_child(args.child, lambda spec: run_fastllm)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="fastllm-distill-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    print("writing the student, the teacher and the data ...", file=sys.stderr, flush=True)
    inputs = build(work, args)
    spec = {
        "model": "1b-from-8b",  # train_bench's spawn names a run by model and system
        "system": "fastllm",
        "overrides": overrides(args, work),
        "warmup": args.warmup,
        "steps": args.steps,
        "result": str(args.out / "runs" / "fastllm.json"),
    }
    print("fastllm ...", file=sys.stderr, flush=True)
    run = summarize(spawn(spec, work, args.out / "logs", args, Path(__file__)), args, inputs)
    write_json(Path(spec["result"]), run)
    report = {
        "benchmark": "distill",
        **commit_info(args.commit),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": run.pop("machine", None),
        "config": {
            "config_file": "examples/distill-llama3-1b.yaml",
            "seq": args.seq,
            "batch": args.batch,
            "micro_batch": args.micro_batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "tiny": args.tiny,
            "device": args.device,
            "extra_overrides": args.set,
            "peak_flops": PEAK_FLOPS,
        },
        "inputs": inputs,
        "method": __doc__.split("Measured:")[1].split("\n\n")[0].strip(),
        "runs": [run],
    }
    result = args.out / "distill_bench.json"
    write_json(result, report)
    text = table(report)
    (args.out / "distill_bench.md").write_text(text + "\n")
    print(f"\n{result}\n\n{text}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
