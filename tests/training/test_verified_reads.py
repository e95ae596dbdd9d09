"""Every reader of a distributed export verifies its checksums: a damaged file is refused in
one line naming it, never loaded as weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fastllm
from fastllm.config import ConfigError
from tests.data.conftest import run_cli
from tests.training.conftest import train_arguments


def test_a_flipped_byte_in_an_export_fails_convert_generate_pretrained_and_load_model(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    result = run_cli(
        *train_arguments(
            dataset, experiment, "training.train_iters=1", "training.checkpoint.at_end=false",
            "training.export.interval=1", "training.export.format=distributed",
        )
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    export = experiment / "export" / "1"
    shard = export / "rank_00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of a weight: still a valid file, a slightly wrong model
    shard.write_bytes(bytes(raw))
    named = f"{shard}: checksum "
    convert = run_cli(
        "convert", "input.format=distributed", f"input.path={export}",
        "output.format=starcoder2", f"output.path={tmp_path / 'hf'}",
    )  # fmt: skip
    generate = run_cli("generate", str(export), "--prompt", "def", "--device", "cpu")
    pretrained = run_cli(
        *train_arguments(
            dataset, tmp_path / "next", "training.train_iters=1",
            "pretrained.format=distributed", f"pretrained.path={export}",
        )
    )  # fmt: skip
    for result in (convert, generate, pretrained):
        assert result.returncode == 2, result.stderr
        assert named in result.stderr and "(corrupt)" in result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "hf").exists()
    assert not (tmp_path / "next" / "checkpoint").exists()
    with pytest.raises(ConfigError, match=re.escape(named)):
        fastllm.load_model(export)
