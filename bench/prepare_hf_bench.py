"""`fastllm prepare` of a Hugging Face dataset against the same records in Parquet (issue 37:
within 20%), on the CPU.

The records are synthetic text (words of a fixed vocabulary, 20 to 400 words each), written
once as a Parquet file (row groups of 10,000 rows) and as a `save_to_disk` dataset, and tokenized with a 4,096-token
byte-level BPE that `fastllm tokenizer train` learns from the first records. Each source is
prepared once untimed, then --repeats times in this process, the sources in turn (the first
`load_dataset` of a process spends seconds importing, a one-time cost of the command, not of
tokenizing). Times are of the whole `prepare` call (reading, tokenizing, writing), as wall time and as
CPU time of every thread (the second holds up better when other work shares the cores), each
as the median and the best of the runs, and relative to Parquet's. The sources: Parquet (the Rust reader), the saved dataset
(memory-mapped, rows fed to the Rust tokenizer), and `load_dataset("parquet", streaming=True)`
of the same Parquet file. Every output's shards must equal the Parquet run's byte for byte.

    python bench/prepare_hf_bench.py --records 200000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Row groups of 10,000 rows (about 13 MB here), as Parquet files of datasets have them (`datasets`
# writes 1,000-row groups); pyarrow's default would make the whole file one group, which
# `load_dataset` streams as one batch of every row.
ROW_GROUP_ROWS = 10_000
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import commit_info  # noqa: E402


def synthetic_texts(records: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(20_000)]
    texts = []
    for _ in range(records):
        sentence = rng.choices(words, k=rng.randint(20, 400))
        texts.append(" ".join(sentence).capitalize() + ".")
    return texts


def train_tokenizer(texts: list[str], directory: Path) -> Path:
    corpus = directory / "tokenizer_corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    output = directory / "tokenizer"
    command = [sys.executable, "-m", "fastllm.cli", "tokenizer", "train"]
    subprocess.run(
        [*command, f"input.path={corpus}", f"output={output}", "vocab_size=4096"],
        check=True,
        capture_output=True,
    )
    return output


def run_prepare(overrides: list[str], tokenizer: Path, output: Path) -> tuple[float, dict]:
    from fastllm.config.loading import load_config
    from fastllm.config.prepare import PrepareConfig
    from fastllm.data.prepare import prepare

    config = load_config(
        PrepareConfig,
        overrides=[*overrides, f"tokenizer.path={tokenizer}", f"output.path={output}"],
    )
    start = time.perf_counter()
    report = prepare(config, overwrite=True, progress=False)
    return time.perf_counter() - start, report


def _cpu_seconds() -> float:
    """CPU time of this process, every thread (the Rust pipeline's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def shards(output: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(output.glob("shard_*"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        texts = synthetic_texts(args.records, args.seed)
        tokenizer = train_tokenizer(texts[:5000], directory)
        table = pa.table({"id": list(range(len(texts))), "text": texts})
        pq.write_table(table, directory / "records.parquet", row_group_size=ROW_GROUP_ROWS)
        datasets.Dataset(table).save_to_disk(str(directory / "saved"))
        text_bytes = sum(len(t.encode()) for t in texts)
        del texts, table
        sources = {
            "parquet": [f"input.path=[{directory / 'records.parquet'}]"],
            "hf_save_to_disk": ["input.type=huggingface", f"input.path={directory / 'saved'}"],
            "hf_load_dataset_streaming": [
                "input.type=huggingface",
                "input.path=parquet",
                f"input.data_files=[{directory / 'records.parquet'}]",
            ],
        }
        results: dict[str, dict] = {name: {"seconds": [], "cpu_seconds": []} for name in sources}
        reference: dict[str, bytes] | None = None
        # The first run of each source is not timed: the first load_dataset of a process
        # spends seconds importing what it needs (paid once by `fastllm prepare`).
        for name, overrides in sources.items():
            results[name]["untimed_first_run_seconds"], report = run_prepare(
                overrides, tokenizer, directory / name
            )
            written = shards(directory / name)
            reference = reference or written
            assert written == reference, f"{name}: the shards differ from Parquet's"
            results[name]["tokens"] = report["tokens"]
            results[name]["documents"] = report["documents"]
        # Round robin, so that a busy spell of the machine weighs on every source alike.
        for _ in range(args.repeats):
            for name, overrides in sources.items():
                cpu = _cpu_seconds()
                elapsed, _ = run_prepare(overrides, tokenizer, directory / name)
                results[name]["seconds"].append(elapsed)
                results[name]["cpu_seconds"].append(_cpu_seconds() - cpu)
        # Medians, and the best runs: work sharing the cores only ever adds time.
        for result in results.values():
            for statistic, pick in (("median", statistics.median), ("best", min)):
                seconds, cpu = pick(result["seconds"]), pick(result["cpu_seconds"])
                result[f"{statistic}_seconds"] = seconds
                result[f"{statistic}_cpu_seconds"] = cpu
                result[f"{statistic}_tokens_per_s"] = result["tokens"] / seconds
                result[f"{statistic}_tokens_per_cpu_s"] = result["tokens"] / cpu
        base = results["parquet"]
        for name, result in results.items():
            line = []
            for statistic in ("median", "best"):
                for unit in ("s", "cpu_s"):
                    key = f"{statistic}_tokens_per_{unit}"
                    relative = result[key] / base[key]
                    result[f"{statistic}_{unit}_relative_to_parquet"] = relative
                    label = "tokens/s" if unit == "s" else "tokens/CPU s"
                    line.append(f"{statistic} {result[key] / 1e6:.1f}M {label} ({relative:.3f}x)")
            print(f"{name:26s} " + ", ".join(line))
    summary = {
        **commit_info(None),
        "records": args.records,
        "parquet_row_group_rows": ROW_GROUP_ROWS,
        "text_bytes": text_bytes,
        "cpu_count": os.cpu_count(),
        "datasets": datasets.__version__,
        "pyarrow": pa.__version__,
        "repeats": args.repeats,
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
