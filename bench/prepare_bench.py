"""`fastllm prepare` against the Python pipelines it replaces, on the same input and cores.

The input is the Python standard library's own *.py files (about 32 MB) as one JSON-lines file
(field "text"), tokenized with a 4,096-token byte-level BPE that `fastllm tokenizer train`
learns from it. For each core count C, each pipeline runs in a fresh process pinned to C cores:

- fastllm:    `fastllm prepare ... workers=C` (the Rust pipeline: read, tokenize, write);
- python:     the straightforward Python pipeline: read and parse the jsonl, a
              `multiprocessing.Pool(C)` of workers each with a `tokenizers.Tokenizer` running
              `encode_batch` on ~1 MB chunks, then `np.concatenate` + `tofile` (.bin and .idx);
- tokenizers: `tokenizers`' own `encode_batch` on every document at once, RAYON_NUM_THREADS=C
              (the texts already in memory; no parsing, no writing).

Tokens/s count the tokens written (one end-of-text token per document included); times are the
median of --repeats runs of the work alone, after imports (the process's whole wall time is
recorded too). The Python pipeline's .bin must equal fastllm's byte for byte.

    python bench/prepare_bench.py --cores 1 2 --out bench/results/prepare_cpu2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
CHUNK_BYTES = 1 << 20


# ---------------------------------------------------------------- the input and the tokenizer


def physical_cores_first(cpus: set[int]) -> list[int]:
    """The CPUs ordered so that every physical core comes before a second hardware thread of
    any core: C cores then means C physical cores wherever the machine has them (Linux numbers
    SMT siblings either adjacently or half the machine apart)."""

    def sibling_rank(cpu: int) -> int:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            text = siblings.read_text().strip()
        except OSError:
            return 0
        members = sorted(
            n for part in text.split(",") for n in _cpu_range(part) if n in cpus or n == cpu
        )
        return members.index(cpu)

    return sorted(cpus, key=lambda cpu: (sibling_rank(cpu), cpu))


def _cpu_range(part: str) -> range:
    low, _, high = part.partition("-")
    return range(int(low), int(high or low) + 1)


def build_corpus(path: Path, copies: int = 1) -> dict:
    """Every *.py file of the standard library (site-packages excluded) that is UTF-8, one
    record per file, in sorted path order; `copies` times over."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f
        for f in stdlib.rglob("*.py")
        if not {"site-packages", "dist-packages", "__pycache__"} & set(f.relative_to(stdlib).parts)
    )
    lines, text_bytes = [], 0
    for file in files:
        try:
            text = file.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines.append(json.dumps({"text": text}) + "\n")
        text_bytes += len(text.encode("utf-8"))
    with path.open("w", encoding="utf-8") as out:
        for _ in range(copies):
            out.writelines(lines)
    return {
        "source": str(stdlib),
        "copies": copies,
        "documents": copies * len(lines),
        "text_bytes": copies * text_bytes,
        "jsonl_bytes": path.stat().st_size,
    }


def fastllm(*arguments: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "fastllm.cli", *arguments], capture_output=True, text=True, cwd=cwd
    )
    if result.returncode != 0:
        sys.exit(f"fastllm {' '.join(arguments)} failed:\n{result.stderr}")
    return result.stdout


# ---------------------------------------------------------------- the three pipelines (children)


def read_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line)["text"] for line in file]


def child_fastllm(args: argparse.Namespace) -> dict:
    from fastllm.config import load_config
    from fastllm.config.prepare import PrepareConfig
    from fastllm.data.prepare import prepare

    overrides = [
        f"input.path={args.input}",
        f"tokenizer.path={args.tokenizer}",
        f"output.path={args.output}",
        f"workers={args.cores}",
    ]
    config = load_config(PrepareConfig, [], overrides)
    start = time.perf_counter()
    report = prepare(config, progress=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": report["tokens"], "documents": report["documents"]}


_worker_tokenizer = None


def _start_worker(tokenizer: str) -> None:
    global _worker_tokenizer
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_file(tokenizer)


def _encode_chunk(texts: list[str]):
    import numpy as np

    eos = _worker_tokenizer.token_to_id(EOS)
    encodings = _worker_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids = [np.array([*encoding.ids, eos], dtype=np.uint16) for encoding in encodings]
    return np.concatenate(ids), np.array([len(i) for i in ids], dtype=np.int32)


def _chunks(path: str):
    """The jsonl's texts in chunks of about CHUNK_BYTES."""
    chunk, size = [], 0
    with open(path, encoding="utf-8") as file:
        for line in file:
            text = json.loads(line)["text"]
            chunk.append(text)
            size += len(text)
            if size >= CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def child_python(args: argparse.Namespace) -> dict:
    import multiprocessing

    import numpy as np

    start = time.perf_counter()
    tokens, lengths = [], []
    with multiprocessing.Pool(args.cores, _start_worker, (args.tokenizer,)) as pool:
        for chunk_tokens, chunk_lengths in pool.imap(_encode_chunk, _chunks(args.input)):
            tokens.append(chunk_tokens)
            lengths.append(chunk_lengths)
    tokens, lengths = np.concatenate(tokens), np.concatenate(lengths)
    output = Path(args.output)
    output.mkdir(parents=True)
    tokens.tofile(output / "data.bin")
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * tokens.itemsize, out=pointers[1:])
    with open(output / "data.idx", "wb") as index:
        index.write(b"MMIDIDX\x00\x00")
        index.write(np.array([1], "<u8").tobytes() + bytes([8]))  # version 1, uint16
        index.write(np.array([len(lengths), len(lengths) + 1], "<u8").tobytes())
        lengths.tofile(index)
        pointers.tofile(index)
        np.arange(len(lengths) + 1, dtype=np.int64).tofile(index)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": len(tokens), "documents": len(lengths)}


def child_tokenizers(args: argparse.Namespace) -> dict:
    from tokenizers import Tokenizer

    texts = read_texts(args.input)
    tokenizer = Tokenizer.from_file(args.tokenizer)
    start = time.perf_counter()
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(encoding.ids) for encoding in encodings) + len(texts)
    return {"seconds": seconds, "tokens": tokens, "documents": len(texts)}


CHILDREN = {"fastllm": child_fastllm, "python": child_python, "tokenizers": child_tokenizers}


# ---------------------------------------------------------------- the driver


def run_child(
    kind: str, cores: list[int], work: Path, tokenizer: Path, corpus: Path, output: Path
) -> dict:
    """One run of a pipeline in a fresh process pinned to `cores`."""
    count = len(cores)
    env = dict(os.environ, RAYON_NUM_THREADS=str(count), RAYON_RS_NUM_CPUS=str(count))
    if kind == "python":  # one core per worker process, as the pool provides the parallelism
        env.update(RAYON_NUM_THREADS="1", RAYON_RS_NUM_CPUS="1", TOKENIZERS_PARALLELISM="false")
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        kind,
        "--input",
        str(corpus),
        "--tokenizer",
        str(tokenizer / "tokenizer.json"),
        "--output",
        str(output),
        "--child-cores",
        str(count),
    ]
    start = time.perf_counter()
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{kind} on {count} core(s) failed:\n{result.stderr}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["wall_s"] = wall
    return measured


CPU_REFERENCE_JOB = (
    "import hashlib, os, time\n"
    "block = os.urandom(1 << 24)\n"
    "start = time.perf_counter()\n"
    "digest = hashlib.sha256()\n"
    "for _ in range(24):\n"
    "    digest.update(block)\n"
    "print(time.perf_counter() - start)\n"
)
"""A fixed CPU-bound job (SHA-256 of 384 MiB, no shared data): one copy per core shows how
the machine itself scales with busy cores (clock boost, shared caches), apart from fastllm."""


def cpu_reference(cores: list[int]) -> float:
    """Seconds of the slowest of one CPU_REFERENCE_JOB per core, all run at once."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", CPU_REFERENCE_JOB],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=lambda core=core: os.sched_setaffinity(0, [core]),
        )
        for core in cores
    ]
    return max(float(process.communicate()[0]) for process in processes)


def measure(
    kind: str, cores: list[int], repeats: int, work: Path, tokenizer: Path, corpus: Path
) -> dict:
    runs = []
    for repeat in range(repeats):
        output = work / f"{kind}_{len(cores)}_{repeat}"
        runs.append(run_child(kind, cores, work, tokenizer, corpus, output))
        if kind == "python":
            reference = work / f"fastllm_{len(cores)}_0" / "shard_00000.bin"
            runs[-1]["bin_identical_to_fastllm"] = (
                output / "data.bin"
            ).read_bytes() == reference.read_bytes()
        if repeat > 0 or kind == "python":
            shutil.rmtree(output, ignore_errors=True)
    seconds = statistics.median(run["seconds"] for run in runs)
    tokens = runs[0]["tokens"]
    return {
        "tokens": tokens,
        "documents": runs[0]["documents"],
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "wall_s": statistics.median(run["wall_s"] for run in runs),
        "runs_s": [round(run["seconds"], 4) for run in runs],
        **(
            {"bin_identical_to_fastllm": all(run["bin_identical_to_fastllm"] for run in runs)}
            if kind == "python"
            else {}
        ),
    }


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict:
    import tokenizers

    import fastllm

    return {"fastllm": fastllm.__version__, "tokenizers": tokenizers.__version__}


def commit() -> dict:
    """HEAD, and whether the working tree differs from it (then HEAD is not what ran)."""

    def git(*arguments: str) -> str | None:
        try:
            result = subprocess.run(["git", *arguments], capture_output=True, text=True, cwd=ROOT)
        except OSError:  # no git
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(status)}


def load_average() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def table(results: list[dict]) -> str:
    def cell(measured: dict | None) -> str:
        if measured is None:
            return "—"
        return f"{measured['tokens_per_s'] / 1e6:.2f} M ({measured['seconds']:.2f} s)"

    def ratio(value: float | None) -> str:
        return "—" if value is None else f"{value:.1f}x"

    lines = [
        "| cores | fastllm prepare | fastllm vs 1 core | machine (SHA-256 per core) vs 1 core "
        "| Python Pool pipeline "
        "| tokenizers encode_batch alone | fastllm vs pipeline | fastllm vs encode_batch "
        "| fastllm process wall |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| {row['cores']} | {cell(row['fastllm'])} | {ratio(row.get('fastllm_vs_1_core'))} "
            f"| {ratio(row.get('cpu_reference_vs_1_core'))} "
            f"| {cell(row.get('python'))} | {cell(row.get('tokenizers'))} "
            f"| {ratio(row.get('fastllm_vs_python'))} | {ratio(row.get('fastllm_vs_tokenizers'))} "
            f"| {row['fastllm']['wall_s']:.2f} s |"
        )
    return "\n".join(lines) + "\n\ntokens/s (median seconds of the work alone)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cores", type=int, nargs="+", help="core counts (default: 1 and all)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--copies", type=int, default=1, help="repeat the corpus (a longer run for many cores)"
    )
    parser.add_argument(
        "--baselines-up-to",
        type=int,
        default=None,
        help="run the Python pipelines only at core counts up to this (a large --copies input "
        "takes them minutes); fastllm runs at every count",
    )
    parser.add_argument("--label", default=None, help="names the result file (default: hostname)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON (default: bench/results/prepare_LABEL.json)",
    )
    # Internal: one measured run, in a child process.
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--child-cores", dest="child_cores", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.cores = args.child_cores
        print(json.dumps(CHILDREN[args.child](args)))
        return

    usable = physical_cores_first(os.sched_getaffinity(0))
    core_counts = args.cores or sorted({1, len(usable)})
    if max(core_counts) > len(usable):
        parser.error(f"only {len(usable)} usable cores")
    out = (
        args.out
        or ROOT / "bench" / "results" / f"prepare_{args.label or socket.gethostname()}.json"
    )

    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="fastllm-prepare-bench-") as temp:
        work = Path(temp)
        corpus = work / "stdlib.jsonl"
        print(f"building {corpus} ...", file=sys.stderr)
        corpus_info = build_corpus(corpus, args.copies)
        print(
            f"  {corpus_info['documents']} files, {corpus_info['text_bytes'] / 1e6:.1f} MB of text",
            file=sys.stderr,
        )
        tokenizer = work / "tokenizer"
        start = time.perf_counter()
        fastllm(
            "tokenizer",
            "train",
            f"input.path={corpus}",
            f"output={tokenizer}",
            f"vocab_size={args.vocab_size}",
            # One copy's worth: the same tokenizer whatever --copies is.
            f"max_documents={corpus_info['documents'] // args.copies}",
            cwd=work,
        )
        training_s = time.perf_counter() - start
        print(f"  trained a {args.vocab_size}-token BPE in {training_s:.1f}s", file=sys.stderr)

        results = []
        for count in core_counts:
            cores = usable[:count]
            row: dict = {"cores": count}
            baselines = args.baselines_up_to is None or count <= args.baselines_up_to
            for kind in ("fastllm", "python", "tokenizers") if baselines else ("fastllm",):
                print(f"{count} core(s): {kind} ...", file=sys.stderr)
                row[kind] = measure(kind, cores, args.repeats, work, tokenizer, corpus)
            row["cpu_reference_s"] = cpu_reference(cores)
            first = results[0] if results else row
            one_core = first["cores"] == 1
            row["fastllm_vs_1_core"] = (
                row["fastllm"]["tokens_per_s"] / first["fastllm"]["tokens_per_s"]
                if one_core
                else None
            )
            # What the machine itself gives with `count` busy cores: count × (1-core time / time).
            row["cpu_reference_vs_1_core"] = (
                count * first["cpu_reference_s"] / row["cpu_reference_s"] if one_core else None
            )
            if baselines:
                assert (
                    row["python"]["tokens"]
                    == row["fastllm"]["tokens"]
                    == row["tokenizers"]["tokens"]
                ), row
                row["fastllm_vs_python"] = (
                    row["fastllm"]["tokens_per_s"] / row["python"]["tokens_per_s"]
                )
                row["fastllm_vs_tokenizers"] = (
                    row["fastllm"]["tokens_per_s"] / row["tokenizers"]["tokens_per_s"]
                )
            results.append(row)

    report = {
        "benchmark": "prepare",
        **commit(),
        "machine": {
            **machine(),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
        "versions": versions(),
        "input": {**corpus_info, "vocab_size": args.vocab_size, "tokenizer_training_s": training_s},
        "method": "median of the work alone (after imports) over the repeats; each run a fresh process pinned to the cores, one hardware thread per physical core before any second one",
        "cpus_used": {
            str(count): physical_cores_first(os.sched_getaffinity(0))[:count]
            for count in core_counts
        },
        "repeats": args.repeats,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{out}\n")
    print(table(results))


if __name__ == "__main__":
    main()
