"""lm-eval-harness on one GPU: its own `hf` backend against `fastllm evaluate`'s model interface
(FastLLMLM), on the same random llama-1b (examples/llama3-1b.yaml's geometry, bf16) and the same
local tasks, each system in a fresh process; wall time of `simple_evaluate` including the model's
load (each system's modules imported before the clock starts, their time recorded apart as
import_seconds), and how often the two agree.

- mc: DOCS four-choice documents (default 2,000: 8,000 loglikelihood requests) of about 200
  tokens of context and a few words a choice; agreement: the same choice on each document.
- gen: GEN_DOCS prompts (default 200) of about 200 tokens, 64 greedy tokens each; agreement:
  the same generated text.
The text is random words of a made-up vocabulary, tokenized by a byte-level BPE that
`fastllm tokenizer train` learns from it (8,192 tokens; the model keeps Llama 3's 128,256).
Both read a context of 4,096 tokens from config.json (the run's sequence length).
The hf backend runs with batch_size=auto (its own search); fastllm with --mc-batch rows and
--gen-batch prompts a forward pass (the same work as `fastllm evaluate`: load, then
`simple_evaluate` on FastLLMLM; here with the samples logged, to compare them).

    python bench/lm_eval_bench.py --out bench/results/lm_eval_h200 --commit HASH
    python bench/lm_eval_bench.py --tiny --device cpu --out /tmp/lm_eval_smoke  # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import ROOT, commit_info, machine_info, write_json

TASKS = {"mc": "bench_multiple_choice", "gen": "bench_generation"}

LOADER = '''"""The bench tasks' documents: NAME.jsonl beside this file as the test split."""
from pathlib import Path

import datasets


def load(file, **_):
    path = Path(__file__).with_name(file)
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(path))})
'''

TASK_FILES = {
    "bench_multiple_choice.yaml": """task: bench_multiple_choice
custom_dataset: !function documents.load
dataset_kwargs: {file: multiple_choice.jsonl}
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
""",
    "bench_generation.yaml": """task: bench_generation
custom_dataset: !function documents.load
dataset_kwargs: {file: generation.jsonl}
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs: {until: ["\\n\\n"], max_gen_toks: 64, do_sample: false}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]
""",
}


def words(count: int, rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(count)]


def build(work: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """work/model (the Hugging Face directory with the tokenizer) and work/tasks."""
    import msgspec
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastllm.checkpoint.hf_config import to_hf_config
    from fastllm.cli import main
    from fastllm.config import TrainerConfig, load_config

    rng = random.Random(0)
    vocabulary = words(3000, rng)
    corpus = work / "corpus.jsonl"
    with corpus.open("w") as lines:
        for _ in range(3000):
            lines.write(json.dumps({"text": " ".join(rng.choices(vocabulary, k=60))}) + "\n")
    tokenizer = work / "tokenizer"
    vocab_size = 1024 if args.tiny else 8192
    arguments = ["tokenizer", "train", f"input.path={corpus}", f"output={tokenizer}"]
    assert main([*arguments, f"vocab_size={vocab_size}"]) == 0
    encoder = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))

    def text_of(tokens: int) -> str:
        """Random words up to `tokens` tokens."""
        text = ""
        while len(encoder.encode(text).ids) < tokens:
            text += " " + " ".join(rng.choices(vocabulary, k=8))
        return " ".join(text.split())

    tasks = work / "tasks"
    tasks.mkdir()
    (tasks / "documents.py").write_text(LOADER)
    for name, text in TASK_FILES.items():
        (tasks / name).write_text(text)
    with (tasks / "multiple_choice.jsonl").open("w") as lines:
        for _ in range(args.docs):
            choices = [" ".join(rng.choices(vocabulary, k=rng.randint(2, 5))) for _ in range(4)]
            document = {"context": text_of(args.context), "choices": choices, "answer": 0}
            lines.write(json.dumps(document) + "\n")
    with (tasks / "generation.jsonl").open("w") as lines:
        for _ in range(args.gen_docs):
            lines.write(json.dumps({"prompt": text_of(args.context), "target": "x"}) + "\n")

    config = load_config(TrainerConfig, [ROOT / "examples/llama3-1b.yaml"])
    base = config.model.base_model
    if args.tiny:
        base = msgspec.structs.replace(base, vocab_size=vocab_size)
    hf_config = LlamaConfig.from_dict(to_hf_config(base, "llama"))
    if args.tiny:
        hf_config.num_hidden_layers, hf_config.hidden_size = 2, 64
        hf_config.intermediate_size, hf_config.num_attention_heads = 128, 4
        hf_config.num_key_value_heads, hf_config.head_dim = 2, 16
    hf_config.eos_token_id, hf_config.bos_token_id = encoder.token_to_id("<|endoftext|>"), None
    # The context both systems read (the run's sequence length): the hf backend sizes its
    # automatic batch search on it, which at Llama 3's 131,072 (262,144 scaled) would not fit.
    hf_config.max_position_embeddings = 4096 if not args.tiny else 256
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(hf_config, dtype=torch.bfloat16)
    model_directory = work / "model"
    model.save_pretrained(model_directory)
    for file in tokenizer.iterdir():
        shutil.copy(file, model_directory)
    return model_directory, tasks


def run(system: str, task: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One system on one task, in this (fresh) process: the wall time of the model's load
    and `simple_evaluate`, the metrics and every document's responses."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(work / "tasks"), include_defaults=False)
    # Each system's modules are imported before the clock starts (their time is recorded
    # apart): the clock reads the model's load and the evaluation.
    imported = time.perf_counter()
    if system == "hf":
        from lm_eval.models.huggingface import HFLM
    else:
        from transformers import AutoTokenizer

        import fastllm
        from fastllm.evaluation.lm_eval_model import FastLLMLM
        from fastllm.evaluation.model_files import context_length, generation_eos
    import_seconds = time.perf_counter() - imported
    torch.cuda.synchronize() if args.device == "cuda" else None
    profile = None
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities)
        profile.start()
    start = time.perf_counter()
    if system == "hf":
        lm = HFLM(
            pretrained=str(work / "model"), dtype="bfloat16", batch_size="auto",
            device=args.device,
        )  # fmt: skip
    else:
        directory = work / "model"
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        lm = FastLLMLM(
            fastllm.load_model(directory, args.device, torch.bfloat16),
            tokenizer,
            max_length=context_length(directory, tokenizer),
            batch_size=args.mc_batch if task == "mc" else args.gen_batch,
            eos_token_ids=generation_eos(directory),
        )
    loaded = time.perf_counter()
    results = simple_evaluate(model=lm, tasks=[TASKS[task]], task_manager=manager)
    seconds = time.perf_counter() - start
    if profile:
        profile.stop()
        averages = profile.key_averages()
        tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
        if args.device == "cuda":
            tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=40))
        (work.parent / f"profile_{system}_{task}.txt").write_text("\n\n".join(tables))
    assert results is not None
    samples = results["samples"][TASKS[task]]
    if task == "mc":
        answers = [
            max(range(4), key=lambda c: s["resps"][c][0][0])
            for s in sorted(samples, key=lambda s: s["doc_id"])
        ]
    else:
        answers = [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
    metrics = {k: v for k, v in results["results"][TASKS[task]].items() if "," in k}
    batch = getattr(lm, "batch_sizes", None) or getattr(lm, "batch_size", None)
    return {
        "seconds": seconds,
        "load_seconds": loaded - start,
        "import_seconds": import_seconds,
        "metrics": metrics,
        "answers": answers,
        "batch_size": str(batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tasks", nargs="+", default=["mc", "gen"], choices=sorted(TASKS))
    parser.add_argument("--systems", nargs="+", default=["hf", "fastllm"])
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--gen-docs", type=int, default=200)
    parser.add_argument("--context", type=int, default=200, help="tokens of context a document")
    parser.add_argument("--mc-batch", type=int, default=64)
    parser.add_argument("--gen-batch", type=int, default=200)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, for a smoke test")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler's op tables of each run (load and evaluation): OUT/profile_SYSTEM_TASK.txt",
    )
    parser.add_argument("--run", nargs=2, metavar=("SYSTEM", "TASK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.docs, args.gen_docs, args.context = min(args.docs, 8), min(args.gen_docs, 4), 40
    work = args.out / "work"
    if args.run:
        result = run(*args.run, work, args)
        write_json(work / f"{args.run[0]}_{args.run[1]}.json", result)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    build(work, args)
    report: dict[str, Any] = {**commit_info(args.commit), "machine": machine_info()}
    for task in args.tasks:
        report[task] = {}
        for system in args.systems:
            command = [sys.executable, __file__, *sys.argv[1:], "--run", system, task]
            subprocess.run(command, check=True, timeout=600)
            report[task][system] = json.loads((work / f"{system}_{task}.json").read_text())
        if {"hf", "fastllm"} <= set(args.systems):
            ours, theirs = report[task]["fastllm"], report[task]["hf"]
            same = sum(a == b for a, b in zip(ours["answers"], theirs["answers"], strict=True))
            report[task]["agreement"] = same / len(theirs["answers"])
            report[task]["speedup"] = theirs["seconds"] / ours["seconds"]
        for system in args.systems:
            entry = report[task][system]
            print(f"{task} {system}: {entry['seconds']:.1f} s (load {entry['load_seconds']:.1f}; "
                  f"imports before, {entry['import_seconds']:.1f}), batch {entry['batch_size']}, "
                  f"{entry['metrics']}")  # fmt: skip
        if "agreement" in report[task]:
            print(f"{task}: agreement {report[task]['agreement']:.4f}, "
                  f"speedup {report[task]['speedup']:.2f}x")  # fmt: skip
        for system in args.systems:
            del report[task][system]["answers"]
    write_json(args.out / "results.json", report)
    shutil.rmtree(work / "model", ignore_errors=True)


if __name__ == "__main__":
    main()
