"""`fastllm convert` checks every tensor it reads against what the input's config implies, and
the output format against the model, before it writes anything: a disagreement is one line and
exit 2 naming the tensor, both shapes and the file (or the key), and no output is left."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from fastllm.checkpoint.compatibility import check_resume
from fastllm.checkpoint.distributed import SavedCheckpoint
from fastllm.config import ConfigError
from tests.checkpoint.fixtures.make_c14b8b5 import CHECKPOINT, CONVERTED, FIXTURE
from tests.data.conftest import CliResult, run_cli
from tests.model.hf_models import save_hf_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face llama: hidden 48, 6 heads of 8, 2 key/value heads, MLP 80, 97 tokens."""
    directory = tmp_path_factory.mktemp("llama") / "hf"
    save_hf_model("llama", directory)
    return directory


def convert(source: Path, output: Path, input_format: str, output_format: str) -> CliResult:
    return run_cli(
        "convert", f"input.format={input_format}", f"input.path={source}",
        f"output.format={output_format}", f"output.path={output}",
    )  # fmt: skip


def refused(result: CliResult, output: Path) -> str:
    """The one line of a refusal, after checking that nothing was written."""
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("fastllm: error: ")
    assert not output.exists()
    assert not list(output.parent.glob(f".{output.name}.partial-*"))
    return line


@pytest.mark.parametrize(
    ("key", "value", "tensor", "implied", "found"),
    [
        ("num_attention_heads", 12, "model.layers.0.self_attn.q_proj.weight", (96, 48), (48, 48)),
        ("hidden_size", 24, "model.embed_tokens.weight", (97, 24), (97, 48)),
        ("vocab_size", 90, "model.embed_tokens.weight", (90, 48), (97, 48)),
        ("intermediate_size", 40, "model.layers.0.mlp.gate_proj.weight", (40, 48), (80, 48)),
    ],
)
def test_a_config_json_that_disagrees_with_its_weights_is_refused(
    llama: Path, tmp_path: Path, key: str, value: int, tensor: str, implied: tuple, found: tuple
) -> None:
    source = tmp_path / "hf"
    shutil.copytree(llama, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {key: value}))
    line = refused(convert(source, tmp_path / "out", "llama", "fastllm"), tmp_path / "out")
    weights = source / "model.safetensors"
    assert f"{weights}: {tensor}: config.json implies {implied}, file has {found}" in line


def test_missing_unexpected_and_unlisted_tensors_are_refused(llama: Path, tmp_path: Path) -> None:
    source, output = tmp_path / "hf", tmp_path / "out"
    shutil.copytree(llama, source)
    weights = source / "model.safetensors"
    tensors = load_file(weights)
    dropped = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != dropped}, weights)
    line = refused(convert(source, output, "llama", "fastllm"), output)
    assert f"{source}: does not match config.json: missing tensors ['{dropped}']" in line
    extra = "model.layers.2.mlp.down_proj.weight"
    save_file(tensors | {extra: tensors[dropped].clone()}, weights)
    line = refused(convert(source, output, "llama", "fastllm"), output)
    assert f"unexpected tensors ['{extra}']" in line
    # An index that lists a tensor its file lacks.
    save_file({k: v for k, v in tensors.items() if k != dropped}, weights)
    index = {"weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    line = refused(convert(source, output, "llama", "fastllm"), output)
    assert f"{weights}: lacks {dropped}, which model.safetensors.index.json lists" in line


def test_an_export_or_fastllm_directory_that_disagrees_with_its_config_is_refused(
    tmp_path: Path,
) -> None:
    # A checkpoint of two data-parallel ranks (ZeRO-2) whose manifest's config was edited.
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(FIXTURE / "two_ranks" / CHECKPOINT, checkpoint)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["config"]["model"]["base_model"]["vocab_size"] = 256
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    output = tmp_path / "hf"
    line = refused(convert(checkpoint, output, "distributed", "starcoder2"), output)
    assert (
        f"{checkpoint / 'manifest.json'}: embeddings.weight: the manifest's config implies "
        "(256, 16), file has (512, 16)"
    ) in line
    ours = tmp_path / "fastllm"
    shutil.copytree(FIXTURE / "two_ranks" / "converted" / CONVERTED[0], ours)
    config = yaml.safe_load((ours / "config.yaml").read_text())
    config["model"]["base_model"]["transformer"]["ffn_hidden_size"] = 64
    (ours / "config.yaml").write_text(yaml.safe_dump(config))
    line = refused(convert(ours, output, "fastllm", "starcoder2"), output)
    assert (
        f"{ours / 'model.safetensors'}: layers.0.mlp.layer_1.weight: config.yaml implies "
        "(64, 16), file has (32, 16)"
    ) in line


def test_an_output_format_that_cannot_express_the_model_is_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    save_hf_model("mixtral", tmp_path / "hf")
    output = tmp_path / "llama"
    line = refused(convert(tmp_path / "hf", output, "mixtral", "llama"), output)
    assert (
        "output.format: llama cannot express the model: "
        "model.base_model.transformer.num_experts is 4 (llama has no experts)"
    ) in line


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_weights_that_are_not_floats_are_refused_naming_the_tensor_and_dtype(
    llama: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    # Integers would convert to floats silently; FP8 weights would lose their scales.
    source, output = tmp_path / "hf", tmp_path / "out"
    shutil.copytree(llama, source)
    weights = source / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.0.mlp.up_proj.weight"
    save_file(tensors | {name: tensors[name].to(dtype)}, weights)
    line = refused(convert(source, output, "llama", "fastllm"), output)
    stored = {torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3"}[dtype]
    assert f"{weights}: {name} holds {stored} values; weights are read from BF16, F16" in line


def test_a_checkpoint_whose_state_is_not_fp32_is_refused_before_any_read(tmp_path: Path) -> None:
    # The rank file's checksum is not what catches it: the check reads the dtype itself.
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(FIXTURE / "one_process" / CHECKPOINT, checkpoint)
    rank_file = checkpoint / "rank_00000.safetensors"
    tensors = load_file(rank_file)
    key = next(k for k in tensors if k.startswith("exp_avg_sq."))
    save_file(tensors | {key: tensors[key].half()}, rank_file)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    saved = SavedCheckpoint(checkpoint, manifest)
    with pytest.raises(ConfigError) as error:
        check_resume(saved, saved.model_config())
    assert f"{rank_file}: {key!r} holds F16 values; this format's state is F32" in str(error.value)
