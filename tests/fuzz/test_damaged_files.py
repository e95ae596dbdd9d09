"""Property: a prepared dataset, a distributed export or a training checkpoint with bytes
flipped, cut off or appended is refused in one line naming the file, or read as it was (for `.bin`, which has no checksum:
read, its tokens as they now are) — never a panic, a traceback or a hang."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from fastllm.checkpoint.distributed import SavedCheckpoint
from fastllm.checkpoint.formats import open_model
from fastllm.config import ConfigError
from fastllm.data.dataset import TokenDataset
from tests.fuzz.conftest import examples, no_hang


@st.composite
def damaged(draw: st.DrawFn, original: bytes) -> bytes:
    """`original` with a few bytes flipped (often in the first 256: the headers), cut off, or
    with bytes appended."""
    data = bytearray(original)
    kind = draw(st.sampled_from(["flip", "cut", "append"]))
    if kind == "flip":
        anywhere = st.integers(0, len(data) - 1)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, min(len(data), 256) - 1) | anywhere)
            data[at] ^= draw(st.integers(1, 255))
    elif kind == "cut":
        del data[draw(st.integers(0, len(data) - 1)) :]
    else:
        data += draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("damaged")


def damaged_copy(original: Path, scratch: Path, file: str, content: bytes) -> Path:
    copy = scratch / uuid.uuid4().hex
    shutil.copytree(original, copy)
    (copy / file).write_bytes(content)
    return copy


def refused_in_one_line(error: Exception, directory: Path) -> None:
    message = str(error)
    assert "\n" not in message and str(directory) in message, message


def read_dataset(path: Path) -> list[np.ndarray]:
    dataset = TokenDataset(path)
    documents = [dataset[i] for i in range(len(dataset))]
    assert [len(d) for d in documents] == dataset.document_lengths().tolist()
    return documents


DATASET_FILES = ["shard_00000.idx", "shard_00000.bin", "metadata.json"]


@settings(max_examples=examples(1000))
@given(file=st.sampled_from(DATASET_FILES), data=st.data())
def test_a_damaged_dataset_is_refused_in_one_line_or_read(
    small_dataset: Path, scratch: Path, file: str, data: st.DataObject
) -> None:
    original = read_dataset(small_dataset)
    content = data.draw(damaged((small_dataset / file).read_bytes()), label="content")
    copy = damaged_copy(small_dataset, scratch, file, content)
    with no_hang():
        try:
            documents = read_dataset(copy)
        except (OSError, ValueError) as error:
            refused_in_one_line(error, copy)
            return
    if file.endswith(".bin"):
        assert [len(d) for d in documents] == [len(d) for d in original]
    else:
        assert all(np.array_equal(a, b) for a, b in zip(documents, original, strict=True))


def read_export(path: Path) -> dict[str, torch.Tensor]:
    return dict(open_model(path).tensors())


def recorded(copy: Path, file: str) -> None:
    """Lists `file` in the manifest with its present size and checksum, as a writer that
    damaged it before the checksum would have: the reader's own checks must catch it."""
    manifest = json.loads((copy / "manifest.json").read_bytes())
    content = (copy / file).read_bytes()
    manifest["files"][file] = {"bytes": len(content), "checksum": xxhash.xxh3_64_hexdigest(content)}
    (copy / "manifest.json").write_text(json.dumps(manifest))


EXPORT_FILES = ["manifest.json", "rank_00000.safetensors"]


@settings(max_examples=examples(450))
@given(file=st.sampled_from(EXPORT_FILES), record=st.booleans(), data=st.data())
def test_a_damaged_export_is_refused_in_one_line_or_read(
    small_export: Path, scratch: Path, file: str, record: bool, data: st.DataObject
) -> None:
    original = read_export(small_export)
    content = data.draw(damaged((small_export / file).read_bytes()), label="content")
    copy = damaged_copy(small_export, scratch, file, content)
    if record and file != "manifest.json":
        recorded(copy, file)
    with no_hang():
        try:
            tensors = read_export(copy)
        except ConfigError as error:
            refused_in_one_line(error, copy)
            return
    assert tensors.keys() == original.keys()
    for name, tensor in tensors.items():
        assert tensor.shape == original[name].shape, name
        if not record:
            assert torch.equal(tensor, original[name]), name


STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""What a resume reads of a checkpoint's parameters: weights and Adam's moments."""


def read_checkpoint(path: Path) -> tuple[dict[tuple[str, str], torch.Tensor], int]:
    """Every tensor a resume restores, whole, and the step it resumes at."""
    saved = SavedCheckpoint(path)
    tensors = {(kind, name): t for kind in STATE_KINDS for name, t in saved.full_tensors(kind)}
    return tensors, saved.counters["step"]


@settings(max_examples=examples(300))
@given(file=st.sampled_from(EXPORT_FILES), record=st.booleans(), data=st.data())
def test_a_damaged_checkpoint_is_refused_in_one_line_or_read(
    small_checkpoint: Path, scratch: Path, file: str, record: bool, data: st.DataObject
) -> None:
    original, step = read_checkpoint(small_checkpoint)
    content = data.draw(damaged((small_checkpoint / file).read_bytes()), label="content")
    copy = damaged_copy(small_checkpoint, scratch, file, content)
    if record and file != "manifest.json":
        recorded(copy, file)
    with no_hang():
        try:
            tensors, read_step = read_checkpoint(copy)
        except ConfigError as error:
            refused_in_one_line(error, copy)
            return
    assert tensors.keys() == original.keys()
    for key, tensor in tensors.items():
        assert tensor.shape == original[key].shape, key
        if not record:
            assert torch.equal(tensor, original[key]), key
    if not record and file != "manifest.json":
        assert read_step == step


def _manifest(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(copy: Path) -> None:
        manifest = json.loads((copy / "manifest.json").read_bytes())
        edit(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))

    return damage


def _rank_file(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def damage(copy: Path) -> None:
        file = copy / "rank_00000.safetensors"
        file.write_bytes(edit(file.read_bytes()))
        recorded(copy, file.name)

    return damage


# What the properties found (each a traceback before): damage the checksums do not see, as the
# manifest has none of its own and a writer may damage a file before hashing it.
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_manifest(lambda m: m.update(parameters=7)), "bad manifest: Expected `array`"),
        (_manifest(lambda m: m["parameters"][0].__setitem__(1, 10241)), "has 10241 elements"),
        (_manifest(lambda m: m.pop("shapes")), "missing required field `shapes`"),
        (_manifest(lambda m: m.update(world_size=2)), "world_size 2 disagree"),
        (_manifest(lambda m: m["config"].pop("model")), "no config.model.base_model"),
        (_manifest(lambda m: m["config"]["model"]["base_model"].update(vocab_size=0)), "vocab_size"),
        (_rank_file(lambda b: b""), "rank_00000.safetensors: cannot be read"),
        (_rank_file(lambda b: b.replace(b"master", b"masteR")), "has no tensor 'master.stage_00000'"),
        (_rank_file(lambda b: b.replace(b"[19712]", b"[10000]").replace(b"78848]", b"40000]")[:40000 - 78848]), "has shape [10000]"),
    ],
)  # fmt: skip
def test_an_export_whose_manifest_misdescribes_its_files_is_refused_naming_it(
    small_export: Path, scratch: Path, damage: Callable[[Path], None], message: str
) -> None:
    copy = scratch / uuid.uuid4().hex
    shutil.copytree(small_export, copy)
    damage(copy)
    with pytest.raises(ConfigError) as caught:
        read_export(copy)
    refused_in_one_line(caught.value, copy)
    assert message in str(caught.value)
