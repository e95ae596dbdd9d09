"""Prepare-time record transforms (input.transform): a user function makes each record a text,
a conversation or a preference pair, for every input type; what it makes tokenizes as the same
documents written out as JSON lines do."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastllm.data import huggingface_dataset, record_files
from tests.conftest import ROOT
from tests.data.chat_fixtures import write_tokenizer
from tests.data.conftest import TrainedTokenizer, prepare, run_cli
from tests.data.megatron import read_dataset
from tests.data.record_transforms import good_and_bad, question_and_answer
from tests.data.test_prepare import interruptible_children, leftovers

TRANSFORMS = "tests.data.record_transforms"

ARTICLES = [
    {"id": i, "title": f"Title {i}", "body": "Body of the article. " * (i % 5 + 1)}
    for i in range(40)
]
QUESTIONS = [
    {"question": "What is 2 + 2?", "answer": "4.", "good": " 4, of course.", "bad": " 5."},
    {"question": "Traduis « café »", "answer": "coffee", "good": " coffee ☕", "bad": " tea"},
    {"question": "Colour of the sky?", "answer": "Blue.", "good": " Blue.", "bad": " Red."},
]


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def shards(output: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(output.iterdir()) if p.name.startswith("shard")}


def test_a_text_transform_applies_to_jsonl_parquet_and_datasets(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    texts = [f"{r['title']}\n\n{r['body']}" for r in ARTICLES]
    jsonl = write_records(tmp_path / "articles.jsonl", ARTICLES)
    gzipped = tmp_path / "articles.jsonl.gz"
    gzipped.write_bytes(gzip.compress(jsonl.read_bytes()))
    parquet = tmp_path / "articles.parquet"
    pq.write_table(pa.Table.from_pylist(ARTICLES), parquet, row_group_size=7)
    datasets.Dataset.from_list(ARTICLES).save_to_disk(str(tmp_path / "saved"))
    transform = f"input.transform={TRANSFORMS}:title_and_body"
    for name, path, overrides in [
        ("jsonl", jsonl, []),
        ("gzip", gzipped, []),
        ("parquet", parquet, []),
        ("saved", tmp_path / "saved", ["input.type=huggingface"]),
    ]:
        output = prepare(path, tokenizer.path, tmp_path / "out" / name, transform, *overrides)
        assert read_dataset(output) == tokenizer.encode(texts), name
        metadata = json.loads((output / "metadata.json").read_text())
        assert metadata["format"] == "text"
        assert metadata["inputs"][0]["documents"] == len(ARTICLES)


def test_records_a_transform_cannot_receive_are_bad_records_located_by_line(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    jsonl = tmp_path / "articles.jsonl"
    lines = [json.dumps(r) for r in ARTICLES[:3]]
    jsonl.write_text("\n".join([lines[0], "{broken", "", "[1, 2]", lines[1], lines[2]]) + "\n")
    output = prepare(
        jsonl, tokenizer.path, tmp_path / "out", f"input.transform={TRANSFORMS}:title_and_body"
    )
    texts = [f"{r['title']}\n\n{r['body']}" for r in ARTICLES[:3]]
    assert read_dataset(output) == tokenizer.encode(texts)
    metadata = json.loads((output / "metadata.json").read_text())
    assert metadata["bad_records"] == 2
    assert metadata["first_bad_records"][0].startswith(f"{jsonl}:2: invalid JSON")
    assert metadata["first_bad_records"][1] == f"{jsonl}:4: not a JSON object"


def test_a_transform_of_text_files_receives_their_text_and_path(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("print('a')\n")
    (tree / "b.py").write_text("x = 1\n")
    (tree / "c.bin").write_bytes(b"\x00\xff binary")
    output = prepare(
        tree, tokenizer.path, tmp_path / "out", f"input.transform={TRANSFORMS}:file_with_its_name"
    )
    expected = ["# a.py\nprint('a')\n", "# b.py\nx = 1\n"]
    assert read_dataset(output) == tokenizer.encode(expected)
    assert json.loads((output / "metadata.json").read_text())["skipped_files"] == 1


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"), "qwen2")


def test_chat_and_preference_transforms_give_the_bytes_of_the_same_jsonl(
    chat_tokenizer: Path, tmp_path: Path
) -> None:
    source = write_records(tmp_path / "questions.jsonl", QUESTIONS)
    datasets.Dataset.from_list(QUESTIONS).save_to_disk(str(tmp_path / "saved"))
    for name, function, written in [
        ("chat", "question_and_answer", [{"messages": question_and_answer(r)} for r in QUESTIONS]),
        ("preference", "good_and_bad", [good_and_bad(r) for r in QUESTIONS]),
    ]:
        jsonl = write_records(tmp_path / f"{name}.jsonl", written)
        reference = prepare(jsonl, chat_tokenizer, tmp_path / f"{name}_reference")
        transform = f"input.transform={TRANSFORMS}:{function}"
        for path, overrides in [(source, []), (tmp_path / "saved", ["input.type=huggingface"])]:
            output = prepare(
                path, chat_tokenizer, tmp_path / f"{name}_{path.name}", transform, *overrides
            )
            assert shards(output) == shards(reference), (name, path)
            assert json.loads((output / "metadata.json").read_text())["format"] == name


def test_transform_errors_name_the_record_and_the_key(
    tokenizer: TrainedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A record a batch: the third record fails once the job runs, which then leaves nothing.
    monkeypatch.setattr(huggingface_dataset, "FIRST_ROWS", 1)
    monkeypatch.setattr(huggingface_dataset, "TABLE_BYTES", 1)
    monkeypatch.setattr(record_files, "TABLE_BYTES", 1)
    records = [{"id": i, "text": f"record {i}"} for i in range(4)]
    jsonl = write_records(tmp_path / "records.jsonl", records)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    cases = [
        ("fails_on_the_third", jsonl, f"{jsonl}:3: KeyError: 'summary'"),
        ("fails_on_the_third", tmp_path / "saved", f"{tmp_path / 'saved'}:3: KeyError"),
        ("text_then_a_conversation", jsonl, f"{jsonl}:2: returned a conversation"),
        ("a_number", jsonl, f"{jsonl}:1: returned int"),
        ("NOT_CALLABLE", jsonl, "is not callable"),
        ("no_such_function", jsonl, f"{TRANSFORMS} has no no_such_function"),
    ]
    for function, path, message in cases:
        overrides = ["input.type=huggingface"] if path.is_dir() else []
        result = run_cli(
            "prepare",
            f"input.path={path}",
            *overrides,
            f"input.transform={TRANSFORMS}:{function}",
            f"tokenizer.path={tokenizer.path}",
            f"output.path={tmp_path / 'out'}",
        )
        assert result.returncode == 2, (function, result.stderr)
        assert "input.transform: " in result.stderr, result.stderr
        assert message in result.stderr, (function, result.stderr)
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    result = run_cli(
        "prepare",
        f"input.path={jsonl}",
        "input.transform=no_such_module.anywhere:f",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={tmp_path / 'out'}",
    )
    assert result.returncode == 2
    assert "input.transform: cannot import no_such_module.anywhere" in result.stderr


def test_keys_a_transform_makes_unused_are_refused_at_config_time(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    for override, key in [
        ("input.field=body", "input.field"),
        ("input.messages_field=turns", "input.messages_field"),
        ("input.chosen_text=good", "input.chosen_text"),
    ]:
        result = run_cli(
            "prepare",
            f"input.path={tmp_path / 'records.jsonl'}",
            f"input.transform={TRANSFORMS}:title_and_body",
            override,
            f"tokenizer.path={tokenizer.path}",
            f"output.path={tmp_path / 'out'}",
        )
        assert result.returncode == 2
        assert f"{key}: is not read with a transform" in result.stderr, result.stderr
    result = run_cli(
        "prepare",
        f"input.path={tmp_path}",
        "input.transform=not a path",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={tmp_path / 'out'}",
    )
    assert result.returncode == 2
    assert "input.transform: expected an import path package.module:function" in result.stderr


def test_an_interrupted_transform_leaves_no_output_nor_partial(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    records = [{"id": i, "text": f"record {i} " * 100} for i in range(2000)]
    jsonl = write_records(tmp_path / "records.jsonl", records)
    output = tmp_path / "out"
    arguments = [
        f"input.path={jsonl}",
        f"input.transform={TRANSFORMS}:stalls_past_the_first_megabyte",
        f"tokenizer.path={tokenizer.path}",
        f"output.path={output}",
    ]
    with interruptible_children():
        process = subprocess.Popen(
            [sys.executable, "-m", "fastllm.cli", "prepare", *arguments],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    deadline = time.monotonic() + 60
    try:
        while not leftovers(output):  # the job started: its staging folder is there
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert stderr.endswith("fastllm: interrupted\n"), stderr
    assert not output.exists()
    assert leftovers(output) == []
