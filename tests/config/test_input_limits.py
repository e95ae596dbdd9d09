"""Input no config can hold is refused by `fastllm config validate` in one line with exit code
2: sizes past `fastllm.config.bounds`, YAML nested too deep or expanding through aliases, and
values too long to quote."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli import fastllm

TINY = ("-c", "examples/tiny.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "batch.batch_size=10000000000",  # aborted `train` in Rust before
            "batch.batch_size: batch_size × sequence_length = 2,560,000,000,000 tokens is more "
            "than 2**40",
        ),
        ("batch.sequence_length=100000000", "batch.sequence_length: 100,000,000 tokens"),
        (  # a step's program of ten million micro-batches ran the machine out of memory
            "batch.batch_size=10000000 batch.micro_batch_size=1",
            "batch.micro_batch_size: batch_size / micro_batch_size = 10,000,000 micro-batches",
        ),
        ("training.train_iters=1000000000000", "training.train_iters: train_iters × batch_size"),
        ("training.validation.iterations=10000000000", "training.validation.iterations:"),
        ("model.base_model.transformer.num_layers=100000000", "model.base_model: 69,107,201,"),
        ("model.base_model.vocab_size=9000000000000", "parameters is more than 2**42"),
    ],
)
def test_sizes_past_their_bounds_are_refused_with_the_bound(override: str, message: str) -> None:
    result = fastllm("config", "validate", *TINY, *override.split())
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("open_", "close"), [("{a: ", "}"), ("[", "]")])
def test_a_config_nested_800_deep_is_refused_in_one_line(
    tmp_path: Path, open_: str, close: str
) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(f"model: {open_ * 800}1{close * 800}\n")
    result = fastllm("config", "validate", "-c", str(path))
    assert result.returncode == 2
    assert f"{path}:1:" in result.stderr and "nested more than 64 levels deep" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_alias_bomb_under_a_valid_key_is_refused_at_once(tmp_path: Path) -> None:
    # Six levels of nine aliases each: 9**7 values, a 25 MB error message before.
    levels = '["x","x","x","x","x","x","x","x","x"]'
    for name in "abcdef":
        levels = f"[&{name} {levels}" + f",*{name}" * 8 + "]"
    path = tmp_path / "bomb.yaml"
    path.write_text(f"model:\n  base_model:\n    vocab_size: {levels}\n")
    result = fastllm("config", "validate", "-c", str(path))
    assert result.returncode == 2
    assert "more than 1,048,576 values (aliases expanded)" in result.stderr
    assert len(result.stderr) < 500 and "Traceback" not in result.stderr


def test_an_error_quotes_at_most_200_characters_of_a_value() -> None:
    result = fastllm("config", "validate", *TINY, f"model.base_model.vocab_size={'x' * 100_000}")
    assert result.returncode == 2
    assert "model.base_model.vocab_size: expected int, got str: 'xxx" in result.stderr
    assert "… (100,002 characters)" in result.stderr
    assert len(result.stderr) < 500


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{[1]: 2}\n", ":1:2: invalid YAML: a key must be a scalar"),
        ("model: {base_model: {transformer: {rotary: {type: [x]}}}}\n", "unknown type ['x']"),
        ("\x00\n", "invalid YAML: character #x0000 at offset 0 (special characters are not"),
    ],
)
def test_odd_yaml_is_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    result = fastllm("config", "validate", "-c", str(path))
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
