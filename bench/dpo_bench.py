"""DPO on one GPU: TRL's DPOTrainer against `fastllm train -c examples/dpo-llama3-1b.yaml`, on
the same random llama-1b and the same preference pairs, in the same run (issue 35).

- model:    Llama-3.2-1B's geometry (examples/llama3-1b.yaml through fastllm's own conversion),
            random bf16 weights saved once as a Hugging Face directory; both systems load it as
            the trained model and as the reference (fastllm: `pretrained` and
            `reference_models.reference`; TRL: the model path, its reference made from it).
- pairs:    --pairs (8) a step, each a --prompt (512) token prompt with a chosen and a rejected
            answer of --answer (512) tokens, the end-of-document token last: random words of a
            word-level tokenizer made here (one word a token, Llama 3's 128,256), written as a
            preference jsonl. fastllm reads it through `fastllm prepare`; TRL tokenizes the
            same text with the same tokenizer, and its child checks that every pair it trains
            on holds the token ids fastllm prepared.
- fastllm:  the Trainer `fastllm train` builds from examples/dpo-llama3-1b.yaml (bf16 compute,
            fp32 master weights and Adam moments, clipping), each step `engine.train_step`:
            each row holds --pairs-per-row whole pairs (the prompt once, both answers attending
            to it: P + 2A + 1 positions a pair), --micro-batch rows a micro-batch.
- trl:      trl 1.16's DPOTrainer with its best settings here: `bf16=True` (autocast) on its
            default fp32 weights (fp32 masters and Adam moments, as fastllm; --trl-dtype
            bfloat16: bf16 weights and moments), `use_liger_kernel=True` (Liger's RMSNorm,
            RoPE and SwiGLU kernels; TRL 1.16 keeps its own fused LM head, which computes the
            answers' log-probabilities in tiles and refuses Liger's fused linear cross-entropy),
            fused AdamW, no gradient checkpointing (TRL's default is on: --trl-checkpointing),
            SDPA attention, --trl-micro-batch pairs a forward (each pair 2 sequences of P + A).
            Hub kernels (`use_kernels`) need the Hub, which the GPU machine cannot reach.

Two modes, each system in a fresh process per mode, with a time limit:
- reference:   the reference model's forward pass in every step;
- precomputed: the reference log-probabilities computed once before training (TRL's
               `precompute_ref_log_probs=True`; fastllm's DPO loss key
               `reference_log_probs: precomputed`; skipped, saying so, where the installed
               fastllm refuses that key). The pass is part of each system's set-up time.

Measured: warm-up steps excluded, then --steps steps between two synchronizations.
- tokens/s counted as TRL counts them, for both systems: pairs × 2 × (P + A) a step (both
  sequences of every pair, the prompt twice).
- peak memory allocated over the timed steps (after torch.cuda.reset_peak_memory_stats) and
  over the whole process.
- MFU over the FLOPs each system really computes (bench_common.forward_flops; 989.4 TFLOP/s):
  2 FLOPs per matmul weight per token through the blocks, 2 per head weight per row the fused
  head computes (both systems apply the head only to the tokens that predict an answer's
  token: 2A rows a pair), 4 × heads × head size per layer per (query, key) pair attention
  computes; the trained model 3 times that (forward and backward), the reference once (in the
  reference mode only). TRL: 2 sequences of P + A tokens a pair, causal: 2 × L(L + 1)/2 pairs
  with L = P + A. fastllm: P + 2A + 1 tokens a pair; the prompt part (P - 1 tokens) causal,
  each answer part (A + 1 tokens) attending to the prompt and causally to itself. Padding
  (fastllm rows longer than their pairs) counts in the blocks, not in attention; work done
  again (TRL's gradient checkpointing, fastllm's recomputation) is not counted. `mfu_whole`
  counts attention whole as torchtitan does (every key of each attention span: L² a
  sequence; fastllm (P - 1)² + 2 (A + 1)(P + A)).

    python bench/dpo_bench.py --out bench/results/dpo_h200 --commit HASH
    python bench/dpo_bench.py --tiny --device cpu --out /tmp/dpo_smoke      # CPU smoke test

--profile: fastllm's GPU kernels in two more steps, by group and the longest, and the host
operators that launched them, in OUT/profile_MODE_fastllm.md (bench/profile_step.py's table);
on a GPU, then the idle gaps of the step and the host's operators at them, in
OUT/timeline_MODE/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
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
    read_json,
    write_json,
    write_random_llama,
)
from profile_step import table as profile_table
from train_bench import (
    PEAK_FLOPS,
    add_run_arguments,
    memory,
    resolve_run_arguments,
    run_child,
    spawn,
    synchronize,
    time_trainer,
)

SYSTEMS = ("trl", "fastllm")
MODES = ("reference", "precomputed")
CONFIG = EXAMPLES / "dpo-llama3-1b.yaml"
EOS = "<|end_of_text|>"
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}
"""--tiny: llama-1b's config at a CPU-sized geometry."""
PRECOMPUTED = "model.base_model.head.losses.dpo.reference_log_probs=precomputed"
"""fastllm's precomputed mode: the reference's log-probabilities once per dataset."""


# ---------------------------------------------------------------- the inputs (parent)


def word(token: int) -> str:
    return f"w{token}"


def write_tokenizer(directory: Path, vocab_size: int) -> int:
    """A word-level tokenizer of `vocab_size` ids, "w0" … and the end-of-document token last,
    with the files transformers and `fastllm prepare` read; returns the end token's id."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    eos = vocab_size - 1
    vocabulary = {word(i): i for i in range(eos)} | {EOS: eos}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": 1 << 20,
    }
    write_json(directory / "tokenizer_config.json", settings)
    return eos


def write_pairs(path: Path, count: int, args: argparse.Namespace, eos: int) -> None:
    """`count` records of random words: a prompt of P tokens, answers of A - 1 (the end token,
    added by both systems, makes A)."""
    generator = random.Random(args.seed)

    def text(length: int) -> str:
        return " ".join(word(generator.randrange(eos)) for _ in range(length))

    with path.open("w") as lines:
        for _ in range(count):
            record = {
                "prompt": text(args.prompt),
                "chosen": " " + text(args.answer - 1),
                "rejected": " " + text(args.answer - 1),
            }
            lines.write(json.dumps(record) + "\n")


def build(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """work/model (weights and tokenizer), work/pairs.jsonl and work/pairs (prepared)."""
    from fastllm.cli import main

    model = work / "model"
    start = time.perf_counter()
    device = "cpu" if args.device == "cpu" else "cuda"
    geometry = write_random_llama(
        model, "llama3-1b.yaml", shrink=TINY if args.tiny else None, seed=args.seed, device=device
    )
    eos = write_tokenizer(model, geometry["vocab"])
    pairs = args.pairs * (args.warmup + args.steps)
    write_pairs(work / "pairs.jsonl", pairs, args, eos)
    arguments = [f"input.path={work / 'pairs.jsonl'}", f"tokenizer.path={model}"]
    assert main(["prepare", *arguments, f"output.path={work / 'pairs'}"]) == 0
    return {
        "model": str(model),
        "geometry": geometry,
        "pairs": pairs,
        "jsonl": str(work / "pairs.jsonl"),
        "prepared": str(work / "pairs"),
        "build_s": time.perf_counter() - start,
    }


# ---------------------------------------------------------------- the configs


def fastllm_overrides(args: argparse.Namespace, mode: str, work: Path) -> list[str]:
    rows = args.pairs // args.pairs_per_row
    model = work / "model"
    return [
        f"run.experiment_dir={work / f'exp_{mode}'}",
        f"pretrained.path={model}",
        f"reference_models.reference.pretrained.path={model}",
        f"data.path=[{work / 'pairs'}]",
        f"batch.sequence_length={sequence_length(args)}",
        f"batch.batch_size={rows}",
        f"batch.micro_batch_size={args.micro_batch or rows}",
        f"training.train_iters={args.warmup + args.steps + 4 * PROFILED_STEPS * args.profile}",
        "training.checkpoint.interval=null",
        "training.export.interval=null",
        *([PRECOMPUTED] if mode == "precomputed" else []),
        *args.set,
    ]


def sequence_length(args: argparse.Namespace) -> int:
    return args.seq or args.pairs_per_row * pair_positions(args)


def pair_positions(args: argparse.Namespace) -> int:
    """The positions a pair takes in fastllm's rows: the prompt once, both answers, and the
    prompt's last token again to start the rejected answer."""
    return args.prompt + 2 * args.answer + 1


def fastllm_config(overrides: list[str]) -> Any:
    """The config `fastllm train -c examples/dpo-llama3-1b.yaml OVERRIDES` runs."""
    from fastllm.config import TrainerConfig, build, load_raw
    from fastllm.training.setup import with_pretrained_architecture

    return build(TrainerConfig, with_pretrained_architecture(load_raw([str(CONFIG)], overrides)))


def refusal(overrides: list[str]) -> str | None:
    """Why the installed fastllm refuses this run's config, or None (the precomputed mode's
    key is newer than some fastllm this script runs against)."""
    from fastllm.config import ConfigError

    try:
        fastllm_config(overrides)
    except (ConfigError, ValueError, TypeError) as error:  # msgspec's errors are ValueErrors
        return f"{type(error).__name__}: {error}"
    return None


# ---------------------------------------------------------------- FLOPs and tokens


def step_counts(system: str, mode: str, args: argparse.Namespace, geometry: dict) -> dict:
    """The tokens TRL counts and the FLOPs `system` computes in one step (module docstring)."""
    p, a, pairs = args.prompt, args.answer, args.pairs
    if system == "trl":
        length = p + a
        tokens, causal, whole = 2 * length, length * (length + 1), 2 * length * length
    else:
        rows = pairs // args.pairs_per_row
        tokens = rows * sequence_length(args) / pairs  # a pair's share, padding included
        causal = (p - 1) * p // 2 + 2 * ((a + 1) * (p - 1) + (a + 1) * (a + 2) // 2)
        whole = (p - 1) ** 2 + 2 * (a + 1) * (p + a)
    passes = 3 + (mode == "reference")  # trained forward + backward, the reference forward
    flops = {
        name: pairs * passes * forward_flops(
            geometry, tokens=tokens, head_rows=2 * a, attended_pairs=attended
        )
        for name, attended in (("causal", causal), ("whole", whole))
    }  # fmt: skip
    return {
        "trl_tokens_per_step": pairs * 2 * (p + a),
        "computed_tokens_per_step": pairs * tokens,
        "flops_per_step": flops["causal"],
        "flops_per_step_whole_attention": flops["whole"],
    }


# ---------------------------------------------------------------- the runs (child processes)


def run_fastllm(spec: dict[str, Any]) -> dict[str, Any]:
    from fastllm.training.setup import check_inputs

    config = fastllm_config(spec["overrides"])
    check_inputs(config)
    seen: dict[str, int] = {}

    def train_step(trainer: Any, micro_batches: list[Any]) -> dict[str, Any]:
        if not seen:  # the first (warm-up) step: what a step holds
            seen.update(batch_contents(micro_batches))
        return trainer.engine.train_step(micro_batches)

    trainer, timing = time_trainer(config, spec["warmup"], spec["steps"], train_step)
    return {
        "step_contents": seen,
        "precision": "bf16 compute, fp32 master weights, gradients and Adam moments; the "
        "reference in bf16 weights-only buffers",
        **timing,
        **(
            {"profile": profile_steps(trainer, Path(spec["profile"]))}
            if spec.get("profile")
            else {}
        ),
    }


PROFILED_STEPS = 2
"""--profile: steps under torch.profiler after the timed ones; on a GPU, three more windows of
as many for the timeline (unprofiled, CUDA alone, host and CUDA)."""


def profile_steps(trainer: Any, out: Path) -> dict[str, Any]:
    """The GPU kernels of PROFILED_STEPS more steps, by group and the longest, then where the
    GPU sits idle and what the host was doing then, in OUT/timeline_*.md (profile_step.py)."""
    import torch
    from profile_step import kernel_summary, timeline_windows
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.distributed.device.type == "cuda"
    batches = iter(trainer.data_loader())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            trainer.engine.train_step(next(batches))
        if cuda:
            torch.cuda.synchronize()
    summary = kernel_summary(prof, PROFILED_STEPS, cuda, top=40, launchers=30)
    if not cuda:
        return summary
    out.mkdir(parents=True, exist_ok=True)
    timing = timeline_windows(trainer, batches, argparse.Namespace(steps=PROFILED_STEPS, out=out))
    return {**summary, "wall_ms_per_step": timing["wall_ms_per_step"]}


def batch_contents(micro_batches: list[Any]) -> dict[str, int]:
    """Pairs, answer labels and positions of a step's micro-batches."""
    pairs = labels = positions = 0
    for batch in micro_batches:
        positions += batch.input_ids.numel()
        labels += int((batch.labels != -100).sum())
        for row in range(batch.input_ids.shape[0]):
            pairs += len(set(batch.document_ids[row][batch.parts[row] == 1].tolist()))
    return {"pairs": pairs, "answer_labels": labels, "positions": positions}


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    warmup, steps = spec["warmup"], spec["steps"]
    micro = spec["trl_micro_batch"]
    arguments = DPOConfig(
        output_dir=spec["work"] + "/trl_" + spec["model"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=spec["pairs"] // micro,
        max_steps=warmup + steps,
        learning_rate=5e-7,  # the example's
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.1,
        bf16=True,
        use_cpu=not cuda,  # the CPU smoke test
        optim="adamw_torch_fused",
        use_liger_kernel=spec["liger"] and cuda,
        gradient_checkpointing=spec["trl_checkpointing"],
        max_length=None,  # the pairs' length: nothing truncated
        precompute_ref_log_probs=spec["model"] == "precomputed",
        precompute_ref_batch_size=micro,
        logging_steps=warmup + steps,  # once, at the end: no loss read in between
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
        model_init_kwargs={"dtype": spec["trl_dtype"]},
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    dataset = Dataset.from_json(spec["jsonl"])

    class Clock(TrainerCallback):
        """Each step's end, synchronized; the peak memory over the steps after the warm-up."""

        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self.marks:
                synchronize(cuda)
                self.marks.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup:
                self.before = memory(cuda)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            # TRL reads its metrics (.item()) in every step: one more wait costs nothing.
            synchronize(cuda)
            self.marks.append(time.perf_counter())

    clock = Clock()
    start = time.perf_counter()
    trainer = DPOTrainer(
        model=spec["model_dir"], args=arguments, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[clock],
    )  # fmt: skip
    synchronize(cuda)
    setup_s = time.perf_counter() - start
    same_tokens = check_tokens(trainer.train_dataset, spec["prepared"])
    trainer.train()
    durations = [b - a for a, b in itertools.pairwise(clock.marks)]
    steady = memory(cuda)
    process = {k: v if v is None else max(v, clock.before[k] or 0.0) for k, v in steady.items()}
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "device": str(trainer.accelerator.device),
        "setup_s": setup_s,
        "same_tokens_as_fastllm": same_tokens,
        "elapsed_s": sum(durations[warmup:]),
        "step_s": durations[warmup:],
        "warmup_step_s": durations[:warmup],
        "mean_loss": logged[-1]["loss"] if logged else None,
        "logged": logged[-1] if logged else None,
        "peak_memory": {"process": process, "timed_steps": steady},
        "precision": f"{spec['trl_dtype']} weights, gradients and Adam moments under bf16 "
        f"autocast; the reference in {spec['trl_dtype']} under bf16 autocast",
        "liger": arguments.use_liger_kernel,
        # What the trained model runs (Liger patches it when training starts, the reference's
        # blocks only through the rotary function it replaces in transformers' Llama module).
        "kernels": {
            "norm": trainer.model.model.norm.forward.__qualname__,
            "mlp": trainer.model.model.layers[0].mlp.forward.__qualname__,
        },
        "gradient_checkpointing": arguments.gradient_checkpointing,
        "attention": trainer.model.config._attn_implementation,
    }


def check_tokens(dataset: Any, prepared: str) -> bool:
    """Whether every pair TRL tokenized is one fastllm prepared (prompt, chosen, rejected),
    token for token; raises where one is not."""
    from fastllm.data.dataset import TokenDataset

    ours = TokenDataset(prepared)
    documents = {tuple(ours[i].tolist()) for i in range(len(ours))}
    for example in dataset:
        pair = (*example["prompt_ids"], *example["chosen_ids"], *example["rejected_ids"])
        if tuple(pair) not in documents:
            raise AssertionError("TRL tokenized a pair into other token ids than fastllm prepare")
    return True


# ---------------------------------------------------------------- the driver


def run_one(
    system: str, mode: str, args: argparse.Namespace, work: Path, inputs: dict
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": mode,  # train_bench's spawn names a run by model and system
        "system": system,
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
        "work": str(work),
        "result": str(args.out / "runs" / f"{mode}_{system}.json"),
    }
    if system == "fastllm":
        spec["overrides"] = fastllm_overrides(args, mode, work)
        spec["profile"] = str(args.out / f"timeline_{mode}") if args.profile else None
        refused = refusal(spec["overrides"]) if mode == "precomputed" else None
        if refused is not None:
            print(f"{mode} {system}: skipped, the installed fastllm refuses it: {refused}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return {"mode": mode, "system": system, "status": "skipped", "reason": refused}
    else:
        spec.update(
            model_dir=inputs["model"],
            jsonl=inputs["jsonl"],
            prepared=inputs["prepared"],
            pairs=args.pairs,
            trl_micro_batch=args.trl_micro_batch or args.pairs,
            trl_checkpointing=args.trl_checkpointing,
            trl_dtype=args.trl_dtype,
            liger=args.liger,
        )
    print(f"{mode} {system} ...", file=sys.stderr, flush=True)
    run = spawn(spec, work, args.out / "logs", args, Path(__file__))
    run["mode"] = run.pop("model", mode)
    if run["status"] == "ok":
        run.update(summarize(run, step_counts(system, mode, args, inputs["geometry"])))
    if run.get("profile"):
        (args.out / f"profile_{mode}_{system}.md").write_text(profile_table(run["profile"]) + "\n")
    write_json(Path(spec["result"]), run)
    print(
        f"  {run['status']}: {fmt(run.get('tokens_per_s'), ',.0f')} tokens/s, "
        f"MFU {fmt(run.get('mfu'), '.1%')}, "
        f"{fmt(peak(run), '.1f')} GiB",
        file=sys.stderr,
        flush=True,
    )
    return run


def summarize(run: dict[str, Any], counts: dict[str, Any]) -> dict[str, Any]:
    steps = len(run["step_s"])
    per_s = steps / run["elapsed_s"]
    ordered = sorted(run["step_s"])
    return {
        **counts,
        "tokens_per_s": per_s * counts["trl_tokens_per_step"],
        "tflops": per_s * counts["flops_per_step"] / 1e12,
        "mfu": per_s * counts["flops_per_step"] / PEAK_FLOPS,
        "mfu_whole": per_s * counts["flops_per_step_whole_attention"] / PEAK_FLOPS,
        "median_step_s": ordered[len(ordered) // 2],
    }


def peak(run: dict[str, Any]) -> float | None:
    return ((run.get("peak_memory") or {}).get("timed_steps") or {}).get("allocated_gib")


def comparisons(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fastllm against TRL per mode, where both ran: the issue's targets are a tokens/s ratio
    of at least 1.3 within TRL's memory, and an MFU of at least 55%."""
    by_key = {(run["mode"], run["system"]): run for run in runs}
    rows = []
    for mode in MODES:
        ours, theirs = by_key.get((mode, "fastllm")), by_key.get((mode, "trl"))
        if ours and theirs and ours["status"] == theirs["status"] == "ok":
            ours_memory, theirs_memory = peak(ours), peak(theirs)
            rows.append(
                {
                    "mode": mode,
                    "tokens_per_s_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                    "peak_allocated_ratio": ours_memory / theirs_memory
                    if ours_memory and theirs_memory
                    else None,
                    "mfu": ours["mfu"],
                    "mfu_trl": theirs["mfu"],
                }
            )
    return rows


def table(report: dict[str, Any]) -> str:
    rows = [
        [
            run["mode"],
            run["system"],
            fmt(run.get("tokens_per_s"), ",.0f"),
            fmt(run.get("mfu") and 100 * run["mfu"], ".1f"),
            fmt(run.get("mfu_whole") and 100 * run["mfu_whole"], ".1f"),
            fmt(run.get("median_step_s") and 1e3 * run["median_step_s"], ",.0f"),
            fmt(peak(run), ".1f"),
            fmt(((run.get("peak_memory") or {}).get("process") or {}).get("allocated_gib"), ".1f"),
            fmt(run.get("setup_s"), ".1f"),
            run["status"],
        ]
        for run in report["runs"]
    ]
    headers = [
        "mode",
        "system",
        "tokens/s (TRL's count)",
        "MFU %",
        "MFU % (attention whole)",
        "step ms (median)",
        "peak alloc GiB (steps)",
        "peak alloc GiB (process)",
        "set-up s",
        "status",
    ]
    text = markdown_table(headers, rows, text_columns=2)
    if report["comparisons"]:
        ratio_rows = [
            [
                row["mode"],
                f"{row['tokens_per_s_ratio']:.2f}x",
                fmt(row["peak_allocated_ratio"], ".2f"),
                f"{100 * row['mfu']:.1f} / {100 * row['mfu_trl']:.1f}",
            ]
            for row in report["comparisons"]
        ]
        headers = ["mode", "tokens/s fastllm / TRL", "peak alloc ratio", "MFU % fastllm / TRL"]
        text += "\n\n" + markdown_table(headers, ratio_rows)
    return text


def report_of(args: argparse.Namespace, inputs: dict, runs: list[dict]) -> dict[str, Any]:
    machine = next((run["machine"] for run in runs if run.get("machine")), None)
    return {
        "benchmark": "dpo",
        **commit_info(args.commit),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "config": {
            "pairs_per_step": args.pairs,
            "prompt_tokens": args.prompt,
            "answer_tokens": args.answer,
            "pairs_per_row": args.pairs_per_row,
            "sequence_length": sequence_length(args),
            "micro_batch_rows": args.micro_batch or args.pairs // args.pairs_per_row,
            "trl_micro_batch_pairs": args.trl_micro_batch or args.pairs,
            "trl_gradient_checkpointing": args.trl_checkpointing,
            "trl_dtype": args.trl_dtype,
            "liger": args.liger,
            "steps": args.steps,
            "warmup": args.warmup,
            "tiny": args.tiny,
            "device": args.device,
            "extra_overrides": args.set,
            "peak_flops": PEAK_FLOPS,
        },
        "inputs": inputs,
        "method": __doc__.split("Measured:")[1].split("\n\n")[0].strip(),
        "runs": [{k: v for k, v in run.items() if k != "machine"} for run in runs],
        "comparisons": comparisons(runs),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--pairs", type=int, default=8, help="pairs a step")
    parser.add_argument("--prompt", type=int, help="prompt tokens (default 512; --tiny 24)")
    parser.add_argument("--answer", type=int, help="tokens an answer (default 512; --tiny 24)")
    parser.add_argument("--pairs-per-row", type=int, default=1, help="fastllm: pairs a row")
    parser.add_argument("--seq", type=int, help="fastllm's row length (default: its pairs')")
    parser.add_argument("--micro-batch", type=int, help="fastllm: rows a micro-batch (all)")
    parser.add_argument("--trl-micro-batch", type=int, help="TRL: pairs a forward (all)")
    parser.add_argument(
        "--trl-checkpointing", action="store_true", help="TRL with gradient checkpointing"
    )
    parser.add_argument(
        "--trl-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="TRL's weights (its default float32: fp32 masters under bf16 autocast, as fastllm)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="fastllm: its kernels in 2 more steps (profile_*.md)"
    )
    parser.add_argument("--no-liger", dest="liger", action="store_false", help="TRL without Liger")
    add_run_arguments(
        parser, timeout=170, tiny="CPU-sized model and pairs", timeout_help="seconds per run"
    )
    args = parser.parse_args()
    if args.child:
        return args
    resolve_run_arguments(parser, args)
    args.prompt = args.prompt or (24 if args.tiny else 512)
    args.answer = args.answer or (24 if args.tiny else 512)
    if args.pairs % args.pairs_per_row:
        parser.error("--pairs must be a multiple of --pairs-per-row")
    if args.seq and args.seq < args.pairs_per_row * pair_positions(args):
        parser.error(f"--seq must hold {args.pairs_per_row} pair(s) of {pair_positions(args)}")
    if args.trl_micro_batch and args.pairs % args.trl_micro_batch:
        parser.error("--pairs must be a multiple of --trl-micro-batch")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        run_child(args.child, lambda spec: run_trl if spec["system"] == "trl" else run_fastllm)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="fastllm-dpo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    # TRL's datasets cache (tokenized pairs, precomputed log-probabilities) of this run alone:
    # one left by an earlier run would skip TRL's reference pass. Nothing from the Hub.
    os.environ.update(HF_HOME=str(work / "hf"), HF_HUB_OFFLINE="1")
    print("building the model and the pairs ...", file=sys.stderr, flush=True)
    inputs = build(work, args)
    result = args.out / "dpo_bench.json"
    runs: list[dict[str, Any]] = []
    for mode in args.modes:
        for system in args.systems:
            runs.append(run_one(system, mode, args, work, inputs))
            # After every run, so that a run cut short by a time limit keeps what it measured.
            write_json(result, report_of(args, inputs, runs))
    text = table(read_json(result))
    (args.out / "dpo_bench.md").write_text(text + "\n")
    print(f"\n{result}\n\n{text}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
