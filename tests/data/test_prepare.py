"""`fastllm prepare` end to end: what it writes must be, read by an independent Megatron reader,
exactly what the `tokenizers` library makes of each input document, in input order."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fastllm.data import TokenDataset
from tests.conftest import ROOT
from tests.data.conftest import (
    EDGE_CASES,
    STDLIB,
    CliResult,
    TrainedTokenizer,
    prepare,
    run_cli,
    stdlib_files,
    write_jsonl,
)
from tests.data.megatron import read_dataset
from tests.test_cli import fastllm


def leftovers(output: Path) -> list[str]:
    """Hidden siblings a run may have left next to its output (partial or old directories)."""
    return sorted(p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}."))


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    """About 1.4 MB of stdlib sources (more than one of the pipeline's 1 MB batches) with the
    edge cases at the start, in the middle and at the end."""
    texts = [f.read_text() for f in stdlib_files("email", "asyncio", "http", "json", "logging")]
    texts += [(STDLIB / name).read_text() for name in ("shlex.py", "re/_casefix.py")]
    middle = len(texts) // 2
    return EDGE_CASES + texts[:middle] + EDGE_CASES[::-1] + texts[middle:] + EDGE_CASES


@pytest.fixture(scope="module")
def expected(corpus: list[str], tokenizer: TrainedTokenizer) -> list[list[int]]:
    return tokenizer.encode(corpus)


def test_source_tree_gives_the_tokenizers_ids_of_each_file_in_sorted_order(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(STDLIB / "email", tree, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / ".hidden.py").write_text("skipped: hidden\n")
    (tree / "blob.py").write_bytes(b"binary\x00\xff\xfe")  # skipped: not text
    (tree / "mime" / "notes.txt").write_text("skipped: not .py\n")
    output = tmp_path / "out"
    result = fastllm(
        "prepare",
        f"input.path={tree}",
        "input.extensions=[.py]",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={output}",
    )
    assert result.returncode == 0, result.stderr
    files = stdlib_files("email")
    names = [f.relative_to(STDLIB / "email") for f in files]
    # A subdirectory is visited at its name's place: message.py, mime/..., parser.py.
    assert names.index(Path("mime/__init__.py")) == names.index(Path("message.py")) + 1
    assert read_dataset(output) == tokenizer.encode([f.read_text() for f in files])
    metadata = json.loads((output / "metadata.json").read_text())
    assert metadata["skipped_files"] == 1
    assert metadata["eos_token"] == {"text": "<|endoftext|>", "id": tokenizer.eos}
    assert "1 file(s) skipped" in result.stdout


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.jsonl.gz"])
def test_jsonl_gives_the_tokenizers_ids_of_each_record_in_order_across_shards(
    name: str,
    corpus: list[str],
    expected: list[list[int]],
    tokenizer: TrainedTokenizer,
    tmp_path: Path,
) -> None:
    inputs = write_jsonl(tmp_path / name, corpus, ensure_ascii=name.endswith(".gz"))
    output = prepare(
        inputs, tokenizer.path, tmp_path / "out", "workers=2", "output.shard_size_tokens=100000"
    )
    documents = read_dataset(output)
    assert len(documents) == len(corpus)
    for i, (document, reference) in enumerate(zip(documents, expected, strict=True)):
        assert document == reference, f"document {i}: {corpus[i][:60]!r}"
    metadata = json.loads((output / "metadata.json").read_text())
    assert len(metadata["shards"]) > 3
    assert all(shard["tokens"] >= 100000 for shard in metadata["shards"][:-1])
    assert metadata["bad_records"] == 0
    # Our own reader agrees with the independent one.
    dataset = TokenDataset(output)
    assert len(dataset) == len(documents)
    for i in (0, 1, 5, len(dataset) // 2, len(dataset) - 1):
        assert dataset[i].tolist() == documents[i]
    assert np.array_equal(dataset.document_lengths(), [len(d) for d in documents])


def test_output_is_byte_identical_whatever_the_worker_count_and_run(
    corpus: list[str], tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    inputs = write_jsonl(tmp_path / "corpus.jsonl", corpus * 2)
    runs = [
        prepare(
            inputs,
            tokenizer.path,
            tmp_path / name,
            f"workers={workers}",
            "output.shard_size_tokens=300000",
        )
        for name, workers in [("one", 1), ("two", 2), ("two_again", 2)]
    ]
    names = sorted(p.name for p in runs[0].iterdir())
    assert len(names) > 3  # several shards and metadata.json
    for run in runs[1:]:
        assert sorted(p.name for p in run.iterdir()) == names
        for name in names:
            assert (run / name).read_bytes() == (runs[0] / name).read_bytes(), name


def test_inputs_are_read_in_the_order_given_with_globs_sorted(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    texts = {name: f"document {name}\n" for name in ("a", "b", "c", "d")}
    for name in "bca":
        write_jsonl(tmp_path / f"part_{name}.jsonl", [texts[name], texts[name] * 2])
    (tmp_path / "whole.txt").write_text(texts["d"])  # a text file is one document
    output = prepare(
        f"[{tmp_path / 'whole.txt'}, {tmp_path / 'part_*.jsonl'}, {tmp_path / 'part_b.jsonl'}]",
        tokenizer.path,
        tmp_path / "out",
    )
    order = ["d", "a", "a", "b", "b", "c", "c", "b", "b"]
    repeat = [1, 1, 2, 1, 2, 1, 2, 1, 2]
    assert read_dataset(output) == tokenizer.encode(
        [texts[name] * n for name, n in zip(order, repeat, strict=True)]
    )


def bad_records_file(path: Path, good: list[str]) -> Path:
    """Good records, then (from line len(good) + 1 on) an invalid JSON line, a record without
    the field, a blank line (ignored), a non-string field, invalid UTF-8, then good ones."""
    lines = [json.dumps({"text": text}).encode() for text in good]
    lines += [
        b'{"text": "unterminated',
        b'{"content": "no text field"}',
        b"   ",
        b'{"text": 42}',
        b'{"text": "\xff\xfe"}',
    ]
    lines += [json.dumps({"text": text}).encode() for text in good[:3]]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_records_are_counted_located_and_skipped(
    corpus: list[str], tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    good = corpus[:40]
    inputs = bad_records_file(tmp_path / "bad.jsonl", good)
    n = len(good)
    output = tmp_path / "out"
    result = fastllm(
        "prepare",
        f"input.path={inputs}",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={output}",
    )
    assert result.returncode == 0, result.stderr
    assert "4 bad record(s) skipped" in result.stdout
    for line in (n + 1, n + 2, n + 4, n + 5):
        assert f"{inputs}:{line}: " in result.stdout
    assert read_dataset(output) == tokenizer.encode(good + good[:3])
    metadata = json.loads((output / "metadata.json").read_text())
    assert metadata["bad_records"] == 4
    assert [record.split(": ")[0] for record in metadata["first_bad_records"]] == [
        f"{inputs}:{line}" for line in (n + 1, n + 2, n + 4, n + 5)
    ]
    assert 'no field "text"' in metadata["first_bad_records"][1]
    assert metadata["inputs"][0]["bad_records"] == 4
    assert metadata["inputs"][0]["documents"] == n + 3


def test_strict_mode_exits_2_at_the_first_bad_record_leaving_nothing(
    corpus: list[str], tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    # The good records before the first bad one fill more than one batch, so shards were already
    # being written when the run fails.
    inputs = bad_records_file(tmp_path / "bad.jsonl", corpus)
    output = tmp_path / "out"
    result = fastllm(
        "prepare",
        f"input.path={inputs}",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={output}",
        "--strict",
    )
    assert result.returncode == 2
    assert f"{inputs}:{len(corpus) + 1}: invalid JSON" in result.stderr
    assert "Traceback" not in result.stderr
    assert not output.exists()
    assert leftovers(output) == []


def test_existing_output_is_refused_unless_overwrite(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    first = write_jsonl(tmp_path / "first.jsonl", ["first dataset"])
    second = write_jsonl(tmp_path / "second.jsonl", ["second", "dataset"])
    output = tmp_path / "out"

    def run(inputs: Path, *flags: str) -> CliResult:
        return run_cli(
            "prepare",
            f"input.path={inputs}",
            f"tokenizer.path={tokenizer.path}",
            f"output.path={output}",
            *flags,
        )

    assert run(first).returncode == 0
    refused = run(second)
    assert refused.returncode == 2
    assert f"{output} already exists" in refused.stderr
    assert read_dataset(output) == tokenizer.encode(["first dataset"])
    replaced = run(second, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert read_dataset(output) == tokenizer.encode(["second", "dataset"])
    assert leftovers(output) == []
    # A replacement that fails keeps the dataset it was to replace.
    failed = run(second, "--overwrite", f"tokenizer.path={tmp_path / 'missing'}")
    assert failed.returncode == 2
    assert str(tmp_path / "missing") in failed.stderr
    assert read_dataset(output) == tokenizer.encode(["second", "dataset"])
    failed = run(bad_records_file(tmp_path / "bad.jsonl", ["good"]), "--overwrite", "--strict")
    assert failed.returncode == 2
    assert read_dataset(output) == tokenizer.encode(["second", "dataset"])
    assert leftovers(output) == []

    # --overwrite replaces datasets only, not a directory named by mistake.
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    output = precious
    refused = run(first, "--overwrite")
    assert refused.returncode == 2
    assert str(precious) in refused.stderr
    assert (precious / "notes.txt").read_text() == "keep me"


def test_failed_run_leaves_no_output_and_no_partial_directory(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", ["some text"])
    output = tmp_path / "out"
    missing = tmp_path / "no_such_tokenizer"
    result = fastllm(
        "prepare", f"input.path={inputs}", f"tokenizer.path={missing}", f"output.path={output}"
    )
    assert result.returncode == 2
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr
    assert not output.exists()
    assert leftovers(output) == []
    result = run_cli(
        "prepare",
        f"input.path={tmp_path / 'nope.jsonl'}",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={output}",
    )
    assert result.returncode == 2
    assert "nope.jsonl" in result.stderr
    assert not output.exists()
    assert leftovers(output) == []


@contextlib.contextmanager
def interruptible_children() -> Iterator[None]:
    """Children started inside get SIGINT's default action, as a terminal's foreground job
    has. A suite started in the background of a non-interactive shell (`make test &`, CI
    scripts) ignores SIGINT, as POSIX has such jobs do; children inherit that, Python leaves
    an ignored SIGINT ignored, and a Ctrl-C sent to `prepare` then does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # reset at exec
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_interrupted_run_exits_130_without_a_traceback_leaving_no_output_nor_partial(
    corpus: list[str], tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    # The input is a pipe fed by the test, so the run is surely under way (and cannot reach the
    # end of its input) when Ctrl-C arrives.
    lines = "".join(json.dumps({"text": text}) + "\n" for text in corpus).encode()
    inputs = tmp_path / "stream.jsonl"
    os.mkfifo(inputs)
    output = tmp_path / "out"
    arguments = [
        f"input.path={inputs}",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={output}",
    ]
    with interruptible_children():
        process = subprocess.Popen(
            [sys.executable, "-m", "fastllm.cli", "prepare", *arguments, "workers=1"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    deadline = time.monotonic() + 60
    try:
        while True:  # open the pipe once prepare opened its end
            try:
                pipe = os.open(inputs, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert process.poll() is None, process.communicate()[1]
                assert time.monotonic() < deadline
                time.sleep(0.01)
        os.set_blocking(pipe, True)
        os.write(pipe, lines)  # returns once prepare has read all but a pipe buffer of it
        while not leftovers(output):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(BrokenPipeError):  # prepare closes its end when it stops
            while process.poll() is None:
                assert time.monotonic() < deadline
                os.write(pipe, lines[: 1 << 16])
        os.close(pipe)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert stderr.endswith("fastllm: interrupted\n"), stderr
    assert "Traceback" not in stderr
    assert not output.exists()
    assert leftovers(output) == [], stderr


def make_small_dataset(tokenizer: TrainedTokenizer, directory: Path) -> Path:
    return prepare(STDLIB / "json", tokenizer.path, directory / "data", "input.extensions=[.py]")


@pytest.mark.parametrize(
    ("damage", "file"),
    [
        ("truncate", "shard_00000.bin"),
        ("extend", "shard_00000.bin"),
        ("truncate", "shard_00000.idx"),
        ("magic", "shard_00000.idx"),
        ("remove", "shard_00000.bin"),
    ],
)
def test_damaged_shards_are_refused_naming_the_file(
    damage: str, file: str, tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    dataset = make_small_dataset(tokenizer, tmp_path)
    TokenDataset(dataset)  # intact: opens
    target = dataset / file
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[:-2])
    elif damage == "extend":
        target.write_bytes(data + b"\x00\x00")
    elif damage == "magic":
        target.write_bytes(b"MMIDIDY" + data[7:])
    else:
        target.unlink()
    with pytest.raises((OSError, ValueError)) as raised:
        TokenDataset(dataset)
    assert str(target) in str(raised.value)


def test_an_input_without_a_valid_record_exits_2_writing_nothing(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    inputs = tmp_path / "bad.jsonl"
    inputs.write_text('{"title": "no text"}\nnot json\n')
    output = tmp_path / "out"
    result = fastllm(
        "prepare",
        f"input.path={inputs}",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={output}",
    )
    assert result.returncode == 2
    assert (
        f"{inputs}: no valid record, nothing to write (2 bad record(s); the first: "
        in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not output.exists()
    assert leftovers(output) == []


def owner_record(pid: int, **other: str) -> str:
    """The record a staging directory holds: this machine's and pid namespace's, unless
    `other` says otherwise."""
    owner = {
        "host": Path("/proc/sys/kernel/hostname").read_text().strip(),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "pid_namespace": os.readlink("/proc/self/ns/pid"),
        "pid": pid,
    }
    return json.dumps(owner | other)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc says who runs")
def test_staging_directories_of_dead_local_runs_are_removed_those_of_other_hosts_kept_and_reported(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    output = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    alive = os.getppid()  # pytest's parent still runs
    staged = {
        "dead": (tmp_path / f".out.partial-{dead.pid}-0", owner_record(dead.pid)),
        "alive": (tmp_path / f".out.partial-{alive}-3", owner_record(alive)),
        # The same pid, dead here, but another node's (shared storage) or container's.
        "other host": (
            tmp_path / f".out.partial-{dead.pid}-1",
            owner_record(dead.pid, host="node-17", boot_id="0d1e"),
        ),
        "other namespace": (
            tmp_path / f".out.partial-{dead.pid}-2",
            owner_record(dead.pid, pid_namespace="pid:[1]"),
        ),
        "no record": (tmp_path / f".out.partial-{dead.pid}-4", None),
        "other output": (tmp_path / f".outer.partial-{dead.pid}-0", owner_record(dead.pid)),
    }
    for directory, record in staged.values():
        directory.mkdir()
        (directory / "shard_00000.bin").write_bytes(b"\0" * 1024)
        if record is not None:
            (directory / ".staging-owner.json").write_text(record)
    result = run_cli(
        "prepare", f"input.path={STDLIB / 'json'}", "input.extensions=[.py]",
        f"tokenizer.path={tokenizer.path}", f"output.path={output}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not staged["dead"][0].exists()
    for name in ("alive", "other host", "other namespace", "no record", "other output"):
        assert staged[name][0].is_dir(), name
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 3, result.stderr
    assert f"fastllm: warning: {staged['other host'][0]}: staging directory kept: written by " \
        f"process {dead.pid} on node-17" in result.stderr  # fmt: skip
    assert f"{staged['other namespace'][0]}: staging directory kept" in result.stderr
    assert (
        f"{staged['no record'][0]}: staging directory kept: it records no writer" in result.stderr
    )
    assert read_dataset(output)
    assert not (output / ".staging-owner.json").exists()


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail (EFBIG, "File too large") as on a full disk."""
    import resource

    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the write kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, handler)


def test_prepare_exits_1_when_the_machine_cannot_write_the_output(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    inputs = write_jsonl(tmp_path / "in.jsonl", [f.read_text() for f in stdlib_files("json")])
    output = tmp_path / "out"
    with file_size_limit(4096):
        result = run_cli(
            "prepare", f"input.path={inputs}", f"tokenizer.path={tokenizer.path}",
            f"output.path={output}",
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("fastllm: error: ") and "File too large" in result.stderr
    assert "Traceback" not in result.stderr
    assert not output.exists() and leftovers(output) == []
