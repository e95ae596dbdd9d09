"""`fastllm prepare` of Hugging Face datasets (input.type: huggingface): a `save_to_disk`
directory and `load_dataset` specs give the bytes the same records give from JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastllm.data import huggingface_dataset
from tests.data.chat_fixtures import CONVERSATIONS, write_tokenizer
from tests.data.conftest import EDGE_CASES, TrainedTokenizer, prepare, run_cli, stdlib_files
from tests.data.megatron import read_dataset


@pytest.fixture(autouse=True)
def local_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_dataset converts files into its cache: the test's own, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """About 300 kB: several of the 1 MB-or-less tables a dataset is read in once the tests
    shrink them, and the edge cases."""
    sources = [f.read_text() for f in stdlib_files("json", "email/mime", "wsgiref")]
    return EDGE_CASES + sources + EDGE_CASES[::-1]


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def shards(output: Path) -> dict[str, bytes]:
    """The dataset's token files (metadata.json names its inputs, which differ)."""
    return {p.name: p.read_bytes() for p in sorted(output.iterdir()) if p.name.startswith("shard")}


def huggingface(path: Path | str, tokenizer: Path, output: Path, *overrides: str) -> Path:
    return prepare(path, tokenizer, output, "input.type=huggingface", *overrides)


def test_saved_datasets_and_load_dataset_give_the_bytes_of_the_same_jsonl(
    texts: list[str], tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    records = [{"id": i, "text": t} for i, t in enumerate(texts)]
    jsonl = write_records(tmp_path / "records.jsonl", records)
    reference = prepare(jsonl, tokenizer.path, tmp_path / "from_jsonl")
    assert read_dataset(reference) == tokenizer.encode(texts)
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "records.parquet", row_group_size=50)
    dataset = datasets.Dataset(table)
    dataset.save_to_disk(str(tmp_path / "saved"))
    split = datasets.DatasetDict({"train": dataset.select(range(3)), "test": dataset})
    split.save_to_disk(str(tmp_path / "saved_splits"))
    large = table.cast(pa.schema([("id", pa.int64()), ("text", pa.large_string())]))
    datasets.Dataset(large).save_to_disk(str(tmp_path / "saved_large"))
    runs = {
        "saved": (tmp_path / "saved", []),
        "saved_large_strings": (tmp_path / "saved_large", []),
        "saved_split": (tmp_path / "saved_splits", ["input.split=test"]),
        "json_streamed": ("json", [f"input.data_files=[{jsonl}]"]),
        "parquet_cached": (
            "parquet",
            [f"input.data_files=[{tmp_path / 'records.parquet'}]", "input.streaming=false"],
        ),
        "directory_streamed": (tmp_path, ["input.data_files=[records.parquet]"]),
        "arrow_streamed": ("arrow", [f"input.data_files=[{tmp_path / 'saved' / '*.arrow'}]"]),
    }
    for name, (path, overrides) in runs.items():
        output = huggingface(path, tokenizer.path, tmp_path / "out" / name, *overrides)
        assert shards(output) == shards(reference), name
        (source,) = json.loads((output / "metadata.json").read_text())["inputs"]
        assert source["documents"] == len(texts), name
    metadata = json.loads((tmp_path / "out" / "saved_split" / "metadata.json").read_text())
    assert metadata["inputs"][0]["path"] == str(tmp_path / "saved_splits" / "test")


def test_a_dataset_is_read_a_few_rows_at_a_time_in_order(
    texts: list[str], tokenizer: TrainedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [{"id": i, "text": t} for i, t in enumerate(texts)]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    jsonl = write_records(tmp_path / "records.jsonl", records)
    monkeypatch.setattr(huggingface_dataset, "FIRST_ROWS", 2)
    monkeypatch.setattr(huggingface_dataset, "TABLE_BYTES", 8192)
    monkeypatch.setattr(huggingface_dataset, "STREAMED_ROWS", 3)
    read: list[int] = []
    tables = huggingface_dataset.HuggingfaceDataset.tables

    def counted(self: huggingface_dataset.HuggingfaceDataset):  # type: ignore[no-untyped-def]
        for first, table, size in tables(self):
            assert first == sum(read) + 1
            read.append(table.num_rows)
            yield first, table, size

    monkeypatch.setattr(huggingface_dataset.HuggingfaceDataset, "tables", counted)
    reference = prepare(jsonl, tokenizer.path, tmp_path / "from_jsonl")
    for name, path, overrides in [
        ("saved", tmp_path / "saved", []),
        ("streamed", "json", [f"input.data_files=[{jsonl}]"]),
    ]:
        read.clear()
        output = huggingface(path, tokenizer.path, tmp_path / "out" / name, *overrides)
        assert shards(output) == shards(reference), name
        assert sum(read) == len(texts)
        # Never the whole dataset at once: many small tables (the streamed ones of 3 rows).
        assert len(read) > 10 and max(read) < len(texts) // 3, (name, read)
    assert max(read) == 3


def test_columns_and_split_are_named_by_key(tokenizer: TrainedTokenizer, tmp_path: Path) -> None:
    documents = ["first document", "second one", "third"]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"content": documents, "n": [1, 2, 3]}),
            "validation": datasets.Dataset.from_dict({"content": ["held out"], "n": [4]}),
        }
    ).save_to_disk(str(saved))
    output = huggingface(saved, tokenizer.path, tmp_path / "out", "input.field=content")
    assert read_dataset(output) == tokenizer.encode(documents)
    output = huggingface(
        saved, tokenizer.path, tmp_path / "val", "input.field=content", "input.split=validation"
    )
    assert read_dataset(output) == tokenizer.encode(["held out"])


def test_null_texts_are_bad_records_located_by_row(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["a b", None, "c d"]}).save_to_disk(str(saved))
    output = huggingface(saved, tokenizer.path, tmp_path / "out")
    assert read_dataset(output) == tokenizer.encode(["a b", "c d"])
    metadata = json.loads((output / "metadata.json").read_text())
    assert metadata["first_bad_records"] == [f"{saved}:2: null instead of a string"]


def test_bad_inputs_are_errors_naming_the_key_and_the_path(
    tokenizer: TrainedTokenizer, tmp_path: Path
) -> None:
    saved, splits = tmp_path / "saved", tmp_path / "splits"
    single = datasets.Dataset.from_dict({"text": ["a"], "n": [1]})
    single.save_to_disk(str(saved))
    datasets.DatasetDict({"train": single}).save_to_disk(str(splits))
    (tmp_path / "empty").mkdir()
    cases = [
        ([f"input.path={saved}", "input.field=body"], "input.field: ", "no column 'body'"),
        ([f"input.path={saved}", "input.field=n"], "input.field: ", "holds int64, not strings"),
        ([f"input.path={saved}", "input.format=chat"], "input.messages_field: ", "'messages'"),
        ([f"input.path={splits}", "input.split=test"], "input.split: ", "no split 'test'"),
        ([f"input.path={tmp_path / 'empty'}"], "input.path: ", str(tmp_path / "empty")),
        ([f"input.path={saved}", "input.data_files=[x.json]"], "input.data_files: ", "save_to"),
        (["input.path=json", "input.data_files=[missing.jsonl]"], "input.path: ", "missing"),
    ]
    for overrides, key, message in cases:
        result = run_cli(
            "prepare",
            "input.type=huggingface",
            *overrides,
            f"tokenizer.path={tokenizer.path}",
            f"output.path={tmp_path / 'out'}",
        )
        assert result.returncode == 2, (overrides, result.stderr)
        assert key in result.stderr and message in result.stderr, (overrides, result.stderr)
        assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"), "qwen2")


def test_conversations_pairs_and_masked_text_give_the_bytes_of_the_same_jsonl(
    chat_tokenizer: Path, tmp_path: Path
) -> None:
    pairs = [
        {"prompt": "What is 2 + 2?", "chosen": " 4, of course.", "rejected": " 5."},
        {"prompt": None, "chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"prompt": "Traduis « café »", "chosen": " coffee ☕", "rejected": " tea"},
    ]
    conversations = [{"messages": c} for c in CONVERSATIONS]
    masked = [
        {"text": "Question: why? Answer: because.", "spans": [[0, 15]]},
        {"text": "No mask here.", "spans": None},
    ]
    for name, records, overrides in [
        ("chat", conversations, []),
        ("chat_all", conversations, ["input.train_on=all"]),
        ("preference", pairs, []),
        ("text_masked", masked, ["input.loss_masking_spans=spans"]),
    ]:
        jsonl = write_records(tmp_path / f"{name}.jsonl", records)
        reference = prepare(jsonl, chat_tokenizer, tmp_path / f"{name}_jsonl", *overrides)
        saved = tmp_path / f"{name}_saved"
        datasets.Dataset.from_list(records).save_to_disk(str(saved))
        output = huggingface(saved, chat_tokenizer, tmp_path / f"{name}_hf", *overrides)
        assert len(shards(output)) == 3  # .bin, .idx and the spans
        assert shards(output) == shards(reference), name
        metadata = json.loads((output / "metadata.json").read_text())
        assert metadata["format"] == name.split("_")[0]
