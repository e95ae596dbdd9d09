"""Supervised fine-tuning: fastllm against the pipelines it replaces, on the same batches and
the same cores.

The data: synthetic conversations (a system turn, one to three user/assistant exchanges of
random words, lengths varied) in a JSON-lines file, a byte-level BPE learned from them with
Llama 3's special tokens, and Llama 3's chat template with `{% generation %}` blocks, so that
`transformers` can report the assistant tokens too. Loss on the assistant turns only.

- train (one GPU): llama-1b (examples/llama3-1b.yaml's geometry, random weights) on the packed
  conversations `fastllm prepare` made:
  - fastllm:          `Trainer.train_step` on its own loader (bf16, fp32 masters, fused AdamW);
  - fastllm-isolated: the same with batch.cross_document_attention=false (attention and
                      positions kept within each conversation: varlen attention);
  - hf:               transformers' LlamaForCausalLM (sdpa, bf16, torch.compile, fused AdamW,
                      clipping) on the very micro-batches fastllm's loader yields: the same
                      tokens and the same -100 labels (`shift_labels=`), already on the GPU.
  tokens/s counts every position; trained tokens/s the labels that are not -100.
- prepare (CPU): `fastllm prepare` of the chat jsonl with C workers, against a
  `multiprocessing.Pool(C)` of workers running `apply_chat_template(..., tokenize=True,
  return_assistant_tokens_mask=True)` and writing .bin/.idx; each in a fresh process pinned to
  C cores. The pool's tokens and masks must equal fastllm's.

    python bench/sft_bench.py --parts train prepare --out bench/results/sft_h200 --commit HASH
    python bench/sft_bench.py --tiny --device cpu --cores 1 2 --out /tmp/sft_smoke  # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import train_bench
from bench_common import ROOT, commit_info, fmt, markdown_table, write_json
from prepare_bench import physical_cores_first

SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>",
]  # fmt: skip
# Llama 3's template, its assistant turns in transformers' {% generation %} blocks.
LLAMA3_GENERATION = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)
TRAIN_SYSTEMS = ("fastllm", "fastllm-isolated", "hf")
PREPARE_SYSTEMS = ("fastllm", "hf-pool")
CHUNK = 256
"""Conversations per task of the pool."""


# ---------------------------------------------------------------- the data


def write_conversations(path: Path, count: int, seed: int) -> dict[str, Any]:
    """`count` conversations of random lowercase words; turns of 10 to 400 words."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(3000)
    ]

    def text(low: int, high: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(low, high))).capitalize() + "."

    with path.open("w") as out:
        for _ in range(count):
            messages = [{"role": "system", "content": text(10, 60)}]
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": text(10, 200)})
                messages.append({"role": "assistant", "content": text(10, 400)})
            out.write(json.dumps({"messages": messages}) + "\n")
    return {"path": str(path), "conversations": count, "bytes": path.stat().st_size, "seed": seed}


def write_tokenizer(directory: Path, conversations: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = (
        message["content"]
        for line in conversations.open()
        for message in json.loads(line)["messages"]
    )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_GENERATION,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return directory


def fastllm_prepare(
    conversations: Path, tokenizer: Path, output: Path, workers: int | None
) -> dict:
    from fastllm.config import load_config
    from fastllm.config.prepare import PrepareConfig
    from fastllm.data.prepare import prepare

    overrides = [
        f"input.path={conversations}", f"tokenizer.path={tokenizer}",
        f"output.path={output}", *([f"workers={workers}"] if workers else []),
    ]  # fmt: skip
    return prepare(load_config(PrepareConfig, [], overrides), progress=False)


# ---------------------------------------------------------------- training (child processes)


def sft_batches(config: Any) -> Any:
    """The steps fastllm's loader yields for `config` (no model built)."""
    from fastllm.data import DataLoader, SampleStream

    batch = config.batch
    stream = SampleStream(
        config.data.path, config.data, sequence_length=batch.sequence_length,
        num_samples=config.training.train_iters * batch.batch_size,
        seed=config.model.distributed.seed,
        cache_dir=Path(config.run.experiment_dir) / "cache" / "sampling",
    )  # fmt: skip
    loader = DataLoader(
        stream, batch_size=batch.batch_size, micro_batch_size=batch.micro_batch_size
    )
    return iter(loader)


def trained_tokens(micro_batches: list[Any]) -> int:
    return sum(int((batch.labels != -100).sum()) for batch in micro_batches)


def run_fastllm(spec: dict[str, Any]) -> dict[str, Any]:
    from fastllm.config.flops import flops_per_token

    config = train_bench.load_trainer_config(spec["model"], spec["overrides"])
    counts: list[int] = []

    def train_step(trainer: Any, micro_batches: list[Any]) -> dict[str, Any]:
        counts.append(trained_tokens(micro_batches))  # CPU tensors: no synchronization
        return trainer.engine.train_step(micro_batches)

    _, timing = train_bench.time_trainer(config, spec["warmup"], spec["steps"], train_step)
    return {
        "cross_document_attention": config.batch.cross_document_attention,
        "flops_per_token": flops_per_token(config.model.base_model, config.batch.sequence_length),
        "trained_tokens": sum(counts[spec["warmup"] :]),
        **timing,
    }


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    config = train_bench.load_trainer_config(spec["model"], spec["overrides"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = train_bench.build_hf_model(config, device)
    settings = config.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate.base, betas=(settings.beta_1, settings.beta_2),
        eps=settings.epsilon, weight_decay=settings.weight_decay, fused=True,
    )  # fmt: skip
    forward = torch.compile(model) if spec["compile"] else model
    loader = sft_batches(config)
    steps = [next(loader) for _ in range(spec["warmup"] + spec["steps"])]
    timed_trained = sum(trained_tokens(s) for s in steps[spec["warmup"] :])
    on_device = [
        [(b.input_ids.to(device), b.labels.to(device)) for b in micro_batches]
        for micro_batches in steps
    ]
    position = 0

    def step() -> Any:
        nonlocal position
        micro_batches = on_device[position]
        position += 1
        losses = []
        for input_ids, labels in micro_batches:
            # The labels are already shifted (label t is token t + 1), as fastllm trains them.
            loss = forward(input_ids=input_ids, labels=labels, shift_labels=labels).loss
            (loss / len(micro_batches)).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.gradient_norm_clipping or 1e9)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean()

    timing = train_bench.measure(step, spec["warmup"], spec["steps"], cuda)
    return {
        "device": str(device),
        "cross_document_attention": True,
        "flops_per_token": train_bench.hf_flops_per_token(model, config.batch.sequence_length),
        "compiled": spec["compile"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "trained_tokens": timed_trained,
        **timing,
    }


def train_part(args: argparse.Namespace, work: Path, dataset: Path) -> list[dict[str, Any]]:
    runs = []
    for system in args.train_systems:
        overrides = train_bench.run_overrides("1b", args, work / f"exp_{system}", dataset)
        overrides += ["batch.cross_document_attention=" + str(system != "fastllm-isolated").lower()]
        config = train_bench.load_trainer_config("1b", overrides)
        spec = {
            "model": "1b", "system": system, "overrides": overrides, "warmup": args.warmup,
            "steps": args.steps, "compile": args.compile,
            "result": str(args.out / "runs" / f"sft_1b_{system}.json"),
        }  # fmt: skip
        print(f"train 1b {system} ...", file=sys.stderr, flush=True)
        run = train_bench.spawn(spec, work, args.out / "logs", args, Path(__file__))
        tokens_per_step = config.batch.batch_size * config.batch.sequence_length
        run = train_bench.summarize(run, tokens_per_step, train_bench.PEAK_FLOPS)
        if run.get("status") == "ok":
            run["trained_tokens_per_s"] = run["trained_tokens"] / run["elapsed_s"]
        run.update(
            micro_batch=config.batch.micro_batch_size, accumulate=args.accumulate, seq=args.seq
        )
        print(
            f"  {run['status']}: {fmt(run.get('tokens_per_s'), ',.0f')} tokens/s", file=sys.stderr
        )
        runs.append(run)
    return runs


# ---------------------------------------------------------------- prepare (child processes)

_worker_tokenizer = None


def _start_worker(tokenizer: str) -> None:
    global _worker_tokenizer
    from transformers import AutoTokenizer

    _worker_tokenizer = AutoTokenizer.from_pretrained(tokenizer)


def _encode_chunk(lines: list[str]) -> tuple[Any, Any, Any]:
    import numpy as np

    ids, masks, lengths = [], [], []
    for line in lines:
        out = _worker_tokenizer.apply_chat_template(
            json.loads(line)["messages"], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        ids += out["input_ids"]
        masks += out["assistant_masks"]
        lengths.append(len(out["input_ids"]))
    return np.array(ids, np.uint16), np.array(masks, np.uint8), np.array(lengths, np.int32)


def _chunks(path: str):
    with open(path) as file:
        chunk = []
        for line in file:
            chunk.append(line)
            if len(chunk) == CHUNK:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def child_prepare(args: argparse.Namespace) -> None:
    import multiprocessing

    import numpy as np

    start = time.perf_counter()
    if args.child == "fastllm":
        report = fastllm_prepare(
            Path(args.input), Path(args.tokenizer), Path(args.output), args.child_cores
        )
        result = {"tokens": report["tokens"], "trained_tokens": report["trained_tokens"]}
    else:
        parts = []
        with multiprocessing.Pool(args.child_cores, _start_worker, (args.tokenizer,)) as pool:
            parts = list(pool.imap(_encode_chunk, _chunks(args.input)))
        ids, masks, lengths = (np.concatenate([p[k] for p in parts]) for k in range(3))
        output = Path(args.output)
        output.mkdir(parents=True)
        ids.tofile(output / "data.bin")
        masks.tofile(output / "mask.bin")
        lengths.tofile(output / "lengths.bin")
        result = {"tokens": len(ids), "trained_tokens": int(masks.sum())}
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result))


def run_prepare_child(kind: str, cores: list[int], paths: dict[str, Path], output: Path) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(len(cores)), TOKENIZERS_PARALLELISM="false")
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", kind,
        "--input", str(paths["conversations"]), "--tokenizer", str(paths["tokenizer"]),
        "--output", str(output), "--child-cores", str(len(cores)),
    ]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=ROOT,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )  # fmt: skip
    if result.returncode != 0:
        sys.exit(f"prepare {kind} on {len(cores)} core(s) failed:\n{result.stderr}")
    return {
        **json.loads(result.stdout.strip().splitlines()[-1]),
        "wall_s": time.perf_counter() - start,
    }


def same_as_fastllm(pool_output: Path, fastllm_output: Path) -> bool:
    """The pool's tokens and assistant masks equal the dataset fastllm wrote."""
    import numpy as np

    from fastllm.data import TokenDataset

    dataset = TokenDataset(fastllm_output)
    lengths = np.fromfile(pool_output / "lengths.bin", np.int32)
    if lengths.tolist() != dataset.document_lengths().tolist():
        return False
    ids, masks = (
        np.fromfile(pool_output / "data.bin", np.uint16),
        np.fromfile(pool_output / "mask.bin", np.uint8),
    )
    ours = np.concatenate([dataset[i] for i in range(len(dataset))])
    trained = np.ones(len(ours), np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(len(dataset)):
        for begin, end in dataset.loss_spans(i):
            trained[starts[i] + begin : starts[i] + end] = 0
    return bool((ours == ids).all() and (trained == masks).all())


def prepare_part(
    args: argparse.Namespace, work: Path, paths: dict[str, Path]
) -> list[dict[str, Any]]:
    available = physical_cores_first(os.sched_getaffinity(0))
    rows = []
    for count in args.cores:
        if count > len(available):
            print(f"skipping {count} cores: only {len(available)} usable", file=sys.stderr)
            continue
        cores = available[:count]
        row: dict[str, Any] = {"cores": count}
        for kind in PREPARE_SYSTEMS:
            runs = []
            for repeat in range(args.repeats):
                output = work / f"prepare_{kind}_{count}_{repeat}"
                runs.append(run_prepare_child(kind, cores, paths, output))
                if kind == "hf-pool":
                    reference = work / f"prepare_fastllm_{count}_0"
                    runs[-1]["identical_to_fastllm"] = same_as_fastllm(output, reference)
            seconds = statistics.median(run["seconds"] for run in runs)
            row[kind] = {
                "tokens": runs[0]["tokens"], "trained_tokens": runs[0]["trained_tokens"],
                "seconds": seconds, "tokens_per_s": runs[0]["tokens"] / seconds,
                "runs_s": [round(run["seconds"], 4) for run in runs],
                **({"identical_to_fastllm": all(r["identical_to_fastllm"] for r in runs)} if kind == "hf-pool" else {}),
            }  # fmt: skip
        row["speedup"] = row["fastllm"]["tokens_per_s"] / row["hf-pool"]["tokens_per_s"]
        print(f"prepare on {count} core(s): {row['speedup']:.1f}x", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the driver


def table(report: dict[str, Any]) -> str:
    text = ""
    if report.get("train"):
        rows = [
            [
                run["system"], fmt(run.get("tokens_per_s"), ",.0f"),
                fmt(run.get("trained_tokens_per_s"), ",.0f"),
                fmt(run.get("mfu") and 100 * run["mfu"], ".1f"), run["status"],
            ]
            for run in report["train"]
        ]  # fmt: skip
        headers = ["system", "tokens/s", "trained tokens/s", "MFU %", "status"]
        text += markdown_table(headers, rows)
        ok = {run["system"]: run for run in report["train"] if run.get("status") == "ok"}
        if "hf" in ok:
            for system in ("fastllm", "fastllm-isolated"):
                if system in ok:
                    ratio = ok[system]["tokens_per_s"] / ok["hf"]["tokens_per_s"]
                    text += f"\n\n{system} / hf: {ratio:.2f}x"
    if report.get("prepare"):
        rows = [
            [
                str(row["cores"]), fmt(row["fastllm"]["tokens_per_s"], ",.0f"),
                fmt(row["hf-pool"]["tokens_per_s"], ",.0f"), f"{row['speedup']:.1f}x",
                "yes" if row["hf-pool"]["identical_to_fastllm"] else "NO",
            ]
            for row in report["prepare"]
        ]  # fmt: skip
        headers = [
            "cores",
            "fastllm tok/s",
            "apply_chat_template pool tok/s",
            "speedup",
            "same tokens and masks",
        ]
        text += ("\n\n" if text else "") + markdown_table(headers, rows)
    return text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts", nargs="+", choices=["train", "prepare"], default=["train", "prepare"]
    )
    parser.add_argument(
        "--train-systems", nargs="+", choices=TRAIN_SYSTEMS, default=list(TRAIN_SYSTEMS)
    )
    parser.add_argument("--conversations", type=int, help="default 5000; --tiny 300")
    parser.add_argument(
        "--vocab-size", type=int, help="of the learned tokenizer (default 8192; --tiny 512)"
    )
    parser.add_argument("--cores", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, help="timed steps (default 10; --tiny 3)")
    parser.add_argument("--warmup", type=int, help="untimed first steps (default 3; --tiny 1)")
    parser.add_argument("--seq", type=int, help="sequence length (default 4096; --tiny 128)")
    parser.add_argument("--micro-batch", type=int, help="default the model's (1b: 4; --tiny 2)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model and data (smoke test)")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="baseline eager")
    parser.add_argument("--commit", help="commit being measured (default: git rev-parse HEAD)")
    parser.add_argument("--out", type=Path, help="result directory")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per training run")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    for name in ("--input", "--tokenizer", "--output"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--child-cores", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child and args.out is None:
        parser.error("--out is required")
    args.steps = args.steps or (3 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.seq = args.seq or (128 if args.tiny else 4096)
    args.conversations = args.conversations or (300 if args.tiny else 5000)
    args.vocab_size = args.vocab_size or (512 if args.tiny else 8192)
    return args


def main() -> None:
    args = parse_args()
    if args.child in PREPARE_SYSTEMS:
        child_prepare(args)
        return
    if args.child:
        train_bench.run_child(
            Path(args.child), lambda spec: run_hf if spec["system"] == "hf" else run_fastllm
        )
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="fastllm-sft-bench-"))
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    conversations = work / "conversations.jsonl"
    paths = {"conversations": conversations, "tokenizer": work / "tokenizer"}
    data = write_conversations(conversations, args.conversations, args.seed)
    write_tokenizer(paths["tokenizer"], conversations, args.vocab_size)
    report: dict[str, Any] = {
        "benchmark": "sft",
        **commit_info(args.commit),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            key: value
            for key, value in vars(args).items()
            if isinstance(value, int | float | str | list | bool)
            and key not in ("child", "input", "tokenizer", "output", "child_cores")
        },
        "data": {
            **data,
            "vocab_size": args.vocab_size,
            "chat_template": "Llama 3 with {% generation %} blocks",
        },
    }
    result = args.out / "sft_bench.json"
    if "prepare" in args.parts:
        report["prepare"] = prepare_part(args, work, paths)
        write_json(result, report)
    if "train" in args.parts:
        dataset = work / "dataset"
        prepared = fastllm_prepare(conversations, paths["tokenizer"], dataset, None)
        report["data"]["prepared"] = {
            k: prepared[k] for k in ("documents", "tokens", "trained_tokens")
        }
        report["train"] = train_part(args, work, dataset)
        write_json(result, report)
    text = table(report)
    (args.out / "sft_bench.md").write_text(text + "\n")
    print(f"\n{result}\n\n{text}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
