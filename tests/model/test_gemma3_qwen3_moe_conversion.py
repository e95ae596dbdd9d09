"""Gemma 3 and Qwen-MoE conversion beyond the parity every architecture gets
(tests/model/test_parity.py): the config written back runs as the one read (Gemma 3's pattern
of sliding and global layers, their rotaries, its attention scale; Qwen-MoE's dense first
layers), an older Gemma 3 config.json reads as transformers 5's, and what they cannot express
is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import fastllm
from fastllm.checkpoint.convert import convert
from fastllm.config import ConfigError, build
from fastllm.config.convert import ConvertConfig
from tests.model.hf_models import save_hf_model
from tests.model.test_parity import all_tensors, relative_error

INPUT_IDS = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(4))


def convert_through_fastllm(architecture: str, directory: Path) -> None:
    """directory/hf converted to directory/ours (fastllm), then to directory/back."""
    steps = ((architecture, "hf", "fastllm", "ours"), ("fastllm", "ours", architecture, "back"))
    for source, source_path, target, target_path in steps:
        convert(
            build(
                ConvertConfig,
                {
                    "input": {"format": source, "path": str(directory / source_path)},
                    "output": {"type": target, "path": str(directory / target_path)},
                },
            )
        )


@pytest.mark.parametrize("architecture", ["gemma3_text", "qwen3_moe"])
def test_converted_back_through_fastllm_runs_as_the_original(
    architecture: str, tmp_path: Path
) -> None:
    theirs = save_hf_model(architecture, tmp_path / "hf")
    convert_through_fastllm(architecture, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert relative_error(back(INPUT_IDS).logits, theirs(INPUT_IDS).logits) <= 1e-6


@pytest.mark.parametrize(
    ("architecture", "dense"),
    [
        ("qwen3_moe", {"mlp_only_layers": [0]}),
        ("qwen3_moe", {"decoder_sparse_step": 2}),  # of 2 layers: the first dense
        ("qwen2_moe", {"mlp_only_layers": [0]}),
    ],
)
def test_qwen_moe_dense_first_layers_match_transformers_both_ways(
    architecture: str, dense: dict, tmp_path: Path
) -> None:
    theirs = save_hf_model(architecture, tmp_path / "hf", **dense)
    ours = fastllm.load_model(tmp_path / "hf")
    transformer = ours.config.transformer
    assert (transformer.first_dense_layers, transformer.dense_ffn_width) == (1, 80)
    assert relative_error(ours(INPUT_IDS), theirs(INPUT_IDS).logits) <= 1e-5
    convert_through_fastllm(architecture, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (back.config.mlp_only_layers, back.config.decoder_sparse_step) == ([0], 1)
    assert relative_error(back(INPUT_IDS).logits, theirs(INPUT_IDS).logits) <= 1e-6
    original, written = all_tensors(tmp_path / "hf"), all_tensors(tmp_path / "back")
    assert sorted(original) == sorted(written)
    for name, tensor in original.items():
        assert torch.equal(tensor, written[name]), name


def test_an_older_gemma3_config_json_reads_as_transformers_5(tmp_path: Path) -> None:
    """Before transformers 5: sliding_window_pattern, rope_local_base_freq and the global
    layers' rope_theta and rope_scaling, in place of layer_types and rope_parameters; and no
    tie_word_embeddings, Gemma 3's default being tied."""
    theirs = save_hf_model("gemma3_text", tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in ("layer_types", "rope_parameters", "tie_word_embeddings"):
        del config[key]
    config |= {
        "sliding_window_pattern": 2,
        "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0,
    }
    path.write_text(json.dumps(config))
    ours = fastllm.load_model(tmp_path)
    transformer = ours.config.transformer
    assert (transformer.global_attention_interval, transformer.window_size) == (2, 5)
    assert relative_error(ours(INPUT_IDS), theirs(INPUT_IDS).logits) <= 1e-5


@pytest.mark.parametrize(
    ("architecture", "overrides", "key"),
    [
        ("gemma3_text", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        (
            "gemma3_text",
            {
                "layer_types": ["sliding_attention", "full_attention", "full_attention"] * 1
                + ["sliding_attention"]
            },  # global layers not one every n
            "layer_types",
        ),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        # of 4 layers: layers 0 and 2 dense
        ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4}, "decoder_sparse_step"),
    ],
)
def test_what_fastllm_cannot_express_is_refused_naming_the_key(
    architecture: str, overrides: dict, key: str, tmp_path: Path
) -> None:
    save_hf_model(architecture, tmp_path, **overrides)
    with pytest.raises(ConfigError) as refused:
        fastllm.load_model(tmp_path)
    assert refused.value.path == f"config.json:{key}"
