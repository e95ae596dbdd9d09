"""Our model against `transformers` on the same weights: logits, gradients, round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import fastllm
from fastllm.checkpoint.convert import convert
from fastllm.checkpoint.formats import open_model
from fastllm.checkpoint.hf_weights import rules
from fastllm.config import build
from fastllm.config.convert import ConvertConfig
from fastllm.config.model import YarnRotaryConfig
from tests.model.hf_models import CONFIGS, save_hf_model

ARCHITECTURES = sorted(CONFIGS)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def on_disk_names(tensors: dict[str, torch.Tensor], architecture: str) -> dict[str, torch.Tensor]:
    """transformers 5 fuses the experts in memory; its checkpoints keep one tensor per expert
    (Mixtral: w1 gate, w3 up, w2 down under block_sparse_moe; Qwen2-MoE: gate_proj, up_proj,
    down_proj), which is what our mappings read."""
    moe, gate, up, down = {
        "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
        "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
        "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
        "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
    }.get(architecture, ("", "", "", ""))
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        layer, _, rest = name.partition(".mlp.")
        if not moe:
            renamed[name] = tensor
        elif rest == "gate.weight":
            renamed[f"{layer}.{moe}.gate.weight"] = tensor
        elif rest == "experts.gate_up_proj":
            for e, (w1, w3) in enumerate(t.chunk(2) for t in tensor.unbind(0)):
                renamed[f"{layer}.{moe}.experts.{e}.{gate}.weight"] = w1
                renamed[f"{layer}.{moe}.experts.{e}.{up}.weight"] = w3
        elif rest == "experts.down_proj":
            for e, w2 in enumerate(tensor.unbind(0)):
                renamed[f"{layer}.{moe}.experts.{e}.{down}.weight"] = w2
        else:
            renamed[name] = tensor
    return renamed


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_and_gradients_match_transformers(architecture: str, tmp_path: Path) -> None:
    theirs = save_hf_model(architecture, tmp_path)
    ours = fastllm.load_model(tmp_path)
    ours.train()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (2, 13), generator=generator)
    labels = torch.randint(0, 97, (2, 13), generator=generator)

    our_logits = ours(input_ids)
    their_logits = theirs(input_ids).logits
    assert relative_error(our_logits, their_logits) <= 1e-5

    F.cross_entropy(our_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(their_logits.flatten(0, 1), labels.flatten()).backward()
    their_grads = on_disk_names(
        {name: p.grad for name, p in theirs.named_parameters()}, architecture
    )
    if theirs.config.tie_word_embeddings:
        their_grads.pop("lm_head.weight", None)
    source = open_model(tmp_path)
    our_params = dict(ours.named_parameters())
    for rule in rules(source.config, architecture):
        if rule.ours.endswith("expert_bias"):  # a buffer of theirs, no gradient of ours
            assert our_params[rule.ours].grad is None
            continue
        expected = rule.join([their_grads[name] for name in rule.theirs])
        assert relative_error(our_params[rule.ours].grad, expected) <= 1e-5, rule.ours


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fused_loss_equals_cross_entropy_of_logits(architecture: str, tmp_path: Path) -> None:
    save_hf_model(architecture, tmp_path)
    model = fastllm.load_model(tmp_path)
    model.config.transformer.expert_auxiliary_loss_coefficient = 0.0
    for layer in model.layers:
        if hasattr(layer.mlp, "auxiliary_coefficient"):
            layer.mlp.auxiliary_coefficient = 0.0
    input_ids = torch.randint(0, 97, (2, 11))
    labels = torch.randint(0, 97, (2, 11))
    labels[0, :3] = -100
    fused = model.loss(input_ids, labels)
    reference = F.cross_entropy(model(input_ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert relative_error(fused, reference) <= 1e-5


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_hf_to_fastllm_to_hf_reproduces_every_tensor(architecture: str, tmp_path: Path) -> None:
    save_hf_model(architecture, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    first = ConvertConfig
    convert(
        build(
            first,
            {
                "input": {"format": architecture, "path": str(tmp_path / "hf")},
                "output": {"format": "fastllm", "path": str(tmp_path / "ours")},
            },
        )
    )
    convert(
        build(
            ConvertConfig,
            {
                "input": {"format": "fastllm", "path": str(tmp_path / "ours")},
                "output": {"type": architecture, "path": str(tmp_path / "back")},
            },
        )
    )
    original, back = all_tensors(tmp_path / "hf"), all_tensors(tmp_path / "back")
    if json.loads((tmp_path / "hf" / "config.json").read_text()).get("tie_word_embeddings"):
        original.pop("lm_head.weight", None)
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert torch.equal(tensor, back[name]), name
    assert (tmp_path / "back" / "tokenizer.json").read_text() == "{}"
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert reloaded.config.model_type == architecture


@pytest.mark.parametrize(
    "architecture", ["llama", "starcoder2", "mixtral", "qwen3", "olmo2", "gemma3_text"]
)
def test_generate_matches_transformers_greedy_decoding(architecture: str, tmp_path: Path) -> None:
    from fastllm.hf import FastLLMForCausalLM

    theirs = save_hf_model(architecture, tmp_path)
    ours = FastLLMForCausalLM.wrap(fastllm.load_model(tmp_path))
    prompt = torch.tensor([[5, 17, 33, 8, 60, 2, 41]])
    settings = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    expected = theirs.generate(prompt, **settings)
    assert torch.equal(ours.generate(prompt, **settings), expected)


def test_generate_matches_transformers_on_a_left_padded_batch(tmp_path: Path) -> None:
    from fastllm.hf import FastLLMForCausalLM

    theirs = save_hf_model("llama", tmp_path)
    ours = FastLLMForCausalLM.wrap(fastllm.load_model(tmp_path))
    prompts = torch.tensor(
        [[0, 0, 0, 5, 17, 33, 8], [0, 9, 41, 3, 60, 2, 41], [7, 1, 88, 5, 17, 4, 8]]
    )
    mask = (torch.arange(7) >= torch.tensor([[3], [1], [0]])).long()
    settings = {"max_new_tokens": 10, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    expected = theirs.generate(prompts, attention_mask=mask, **settings)
    assert torch.equal(ours.generate(prompts, attention_mask=mask, **settings), expected)
    # Each row as the prompt alone gives it: padding changes nothing.
    alone = ours.generate(prompts[:1, 3:], **settings)
    assert torch.equal(alone[0], expected[0, 3:])
    with pytest.raises(ValueError, match="only left padding"):
        ours(prompts, attention_mask=mask.flip(1))


def test_generate_forms_the_logits_of_the_last_position_only(tmp_path: Path) -> None:
    from fastllm.hf import FastLLMForCausalLM

    save_hf_model("llama", tmp_path)
    ours = FastLLMForCausalLM.wrap(fastllm.load_model(tmp_path))
    prompt = torch.tensor([[5, 17, 33, 8, 60, 2, 41]])
    whole = ours(prompt).logits
    # (another matmul shape: equal to rounding)
    torch.testing.assert_close(ours(prompt, logits_to_keep=2).logits, whole[:, -2:])
    shapes: list[torch.Size] = []
    ours.register_forward_hook(lambda _, __, output: shapes.append(output.logits.shape))
    ours.generate(prompt, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert [shape[1] for shape in shapes] == [1, 1, 1]  # the prompt's last position, then one
    with pytest.raises(ValueError, match="logits_to_keep"):
        ours(prompt, labels=prompt, logits_to_keep=1)


@pytest.mark.parametrize(
    "yarn",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
    ],
)
def test_yarn_rotary_matches_transformers_past_the_original_context(
    yarn: dict, tmp_path: Path
) -> None:
    theirs = save_hf_model("qwen2", tmp_path, rope_scaling=yarn)
    ours = fastllm.load_model(tmp_path)
    assert isinstance(ours.config.transformer.rotary, YarnRotaryConfig)
    input_ids = torch.randint(0, 97, (1, 160), generator=torch.Generator().manual_seed(2))
    assert relative_error(ours(input_ids), theirs(input_ids).logits) <= 1e-5


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
@pytest.mark.parametrize(("max_window_layers", "window"), [(0, 5), (2, None)])
def test_qwen_sliding_windows_match_transformers_both_ways(
    architecture: str, max_window_layers: int, window: int | None, tmp_path: Path
) -> None:
    """The layers from max_window_layers on slide (transformers' layer_types): all of the two
    or none, read and written back."""
    windows = {"use_sliding_window": True, "sliding_window": 5}
    theirs = save_hf_model(
        architecture, tmp_path / "hf", **windows, max_window_layers=max_window_layers
    )
    ours = fastllm.load_model(tmp_path / "hf")
    assert ours.config.transformer.window_size == window
    input_ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    assert relative_error(ours(input_ids), theirs(input_ids).logits) <= 1e-5
    convert(
        build(
            ConvertConfig,
            {
                "input": {"format": architecture, "path": str(tmp_path / "hf")},
                "output": {"type": architecture, "path": str(tmp_path / "back")},
            },
        )
    )
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert relative_error(back(input_ids).logits, theirs(input_ids).logits) <= 1e-6


def test_sliding_windows_in_some_qwen_layers_only_are_refused(tmp_path: Path) -> None:
    from fastllm.config import ConfigError

    windows = {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}
    save_hf_model("qwen3", tmp_path, **windows)
    with pytest.raises(ConfigError, match="layer_types: sliding windows in some layers only"):
        fastllm.load_model(tmp_path)


@pytest.mark.parametrize(
    ("architecture", "overrides", "key"),
    [
        ("mixtral", {"num_shared_experts": 1}, "num_shared_experts"),
        ("mixtral", {"expert_renormalize": False}, "expert_renormalize"),
        ("qwen2_moe", {"num_shared_experts": 1}, "shared_expert_gate"),
    ],
)
def test_moe_exports_refuse_what_the_architecture_cannot_express(
    architecture: str, overrides: dict, key: str
) -> None:
    from fastllm.checkpoint.hf_config import to_hf_config
    from fastllm.config import BaseModelConfig, ConfigError

    transformer = {"num_experts": 4, "num_experts_per_token": 2, "gated": True}
    transformer |= {"add_linear_biases": False, **overrides}
    config = build(BaseModelConfig, {"transformer": transformer})
    with pytest.raises(ConfigError, match=key):
        to_hf_config(config, architecture)
