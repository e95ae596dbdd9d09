"""`fastllm convert` and `fastllm generate` through the command line, on real files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import fastllm as library
from fastllm.config import ConfigError
from tests.data.conftest import run_cli
from tests.model.hf_models import save_hf_model
from tests.test_cli import fastllm


def test_convert_hf_to_fastllm_and_back_through_the_cli(tmp_path: Path) -> None:
    save_hf_model("mistral", tmp_path / "hf")
    result = fastllm(
        "convert", "gpt", "input.format=mistral", f"input.path={tmp_path / 'hf'}",
        "output.format=fastllm", f"output.path={tmp_path / 'ours'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert {"config.yaml", "metadata.json", "model.safetensors"} <= {
        p.name for p in (tmp_path / "ours").iterdir()
    }
    result = fastllm(
        "convert", f"input.path={tmp_path / 'ours'}", "output.type=mistral",
        f"output.path={tmp_path / 'back'}", "shard_size_gb=0.00002",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "a small shard size must split the model"
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    ids = torch.randint(0, 97, (1, 9))
    assert torch.equal(original(ids).logits, back(ids).logits)


def test_convert_refuses_an_existing_output_and_impossible_targets(tmp_path: Path) -> None:
    save_hf_model("starcoder2", tmp_path / "hf")
    (tmp_path / "taken").mkdir()
    result = fastllm(
        "convert",
        "input.format=starcoder2",
        f"input.path={tmp_path / 'hf'}",
        f"output.path={tmp_path / 'taken'}",
    )
    assert result.returncode == 2
    assert "output.path" in result.stderr and "already exists" in result.stderr
    result = fastllm(
        "convert",
        "input.format=starcoder2",
        f"input.path={tmp_path / 'hf'}",
        "output.format=llama",
        f"output.path={tmp_path / 'llama'}",
    )
    assert result.returncode == 2
    assert "model.base_model.transformer.normalization.type" in result.stderr
    assert not (tmp_path / "llama").exists()
    assert not list(tmp_path.glob(".llama.partial-*")), "no partial output may be left"
    result = fastllm(
        "convert",
        "input.format=llama",
        f"input.path={tmp_path / 'hf'}",
        f"output.path={tmp_path / 'x'}",
    )
    assert result.returncode == 2
    assert "holds a starcoder2 model, not llama" in result.stderr


def save_model_and_tokenizer(directory: Path) -> tuple[transformers.PreTrainedModel, Tokenizer]:
    """A small Llama in Hugging Face's format with a byte-level BPE beside it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    tokenizer.decoder = __import__("tokenizers").decoders.ByteLevel()
    model = save_hf_model("llama", directory, vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(directory / "tokenizer.json"))
    return model, tokenizer


def test_generate_prints_the_same_completion_as_transformers(tmp_path: Path) -> None:
    model, tokenizer = save_model_and_tokenizer(tmp_path / "hf")
    result = fastllm(
        "generate",
        str(tmp_path / "hf"),
        "--prompt",
        "def add(",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
    )
    assert result.returncode == 0, result.stderr
    prompt = tokenizer.encode("def add(").ids
    expected = model.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert result.stdout.rstrip("\n") == tokenizer.decode(
        expected[0].tolist(), skip_special_tokens=False
    )


def test_a_broken_hugging_face_directory_is_one_line_naming_the_file(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    save_hf_model("llama", hf)
    weights, config = hf / "model.safetensors", hf / "config.json"
    raw, settings = weights.read_bytes(), config.read_text()

    def refused(message: str) -> None:
        convert = run_cli(
            "convert", "input.format=llama", f"input.path={hf}",
            "output.format=fastllm", f"output.path={tmp_path / 'out'}",
        )  # fmt: skip
        generate = run_cli("generate", str(hf), "--prompt", "a", "--device", "cpu")
        for result in (convert, generate):
            assert result.returncode == 2
            (line,) = result.stderr.strip().splitlines()
            assert message in line
        with pytest.raises(ConfigError, match=re.escape(message)):
            library.load_model(hf)
        assert not (tmp_path / "out").exists()

    tokenizer = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    tokenizer.save(str(hf / "tokenizer.json"))  # generate gets as far as the weights
    weights.write_bytes(raw[: len(raw) // 2])
    refused(f"{weights}: truncated or not safetensors")
    weights.unlink()
    refused(f"{hf}: has neither model.safetensors nor model.safetensors.index.json")
    weights.write_bytes(raw)
    config.write_text(settings[:-10])
    refused(f"{config}: is not valid JSON")
    config.write_text(settings)
    (hf / "tokenizer.json").write_text("{")
    result = run_cli("generate", str(hf), "--prompt", "a", "--device", "cpu")
    assert result.returncode == 2
    assert f"{hf / 'tokenizer.json'}: is not a valid tokenizer" in result.stderr
    (hf / "tokenizer.json").unlink()
    result = run_cli("generate", str(hf), "--prompt", "a", "--device", "cpu")
    assert result.returncode == 2
    assert f"{hf}: has no tokenizer.json" in result.stderr


def test_generate_on_the_meta_device_is_one_line(tmp_path: Path) -> None:
    save_model_and_tokenizer(tmp_path / "hf")
    result = run_cli("generate", str(tmp_path / "hf"), "--prompt", "def", "--device", "meta")
    assert result.returncode == 2
    assert "--device: meta: fastllm generates on cpu or cuda" in result.stderr
    assert "Traceback" not in result.stderr
