"""LoRA adapters: one layer against plain torch, a tiny model against PEFT on the same
`transformers` model (loss and the adapters' gradients; a mixture's experts against PEFT's
`target_parameters`), and merged weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import peft
import pytest
import torch
import torch.nn.functional as F

from fastllm.checkpoint.formats import open_model
from fastllm.checkpoint.peft import PREFIX, adapter_rules, merged
from fastllm.config import BaseModelConfig, ConfigError, TrainerConfig, build
from fastllm.config.model import LoRAConfig
from fastllm.model import GPTModel
from fastllm.model.lora import LoRA
from fastllm.parallel.tensor import TensorDimension
from tests.model.hf_models import save_hf_model
from tests.model.test_parity import relative_error

EVERY_LINEAR = ["query", "key", "value", "dense", "mlp_1", "mlp_2"]
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_LAYERS = ["query", "experts_1", "experts_2"]
"""A mixture's adapters: its routed experts, and queries beside them."""
PEFT_EXPERTS = {
    "target_modules": ["q_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
# Qwen2-MoE's shared experts are a dense MLP: mlp_1 and mlp_2, gate_proj, up_proj, down_proj.
SHARED_LAYERS = [*EXPERT_LAYERS, "mlp_1", "mlp_2"]
PEFT_SHARED = {
    "target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"],
    "target_parameters": PEFT_EXPERTS["target_parameters"],
}
MIXTURES = {  # our layers, PEFT's targets, PEFT's adapted modules per block
    "mixtral": (EXPERT_LAYERS, PEFT_EXPERTS, 3),
    "qwen2_moe": (SHARED_LAYERS, PEFT_SHARED, 6),
}


@pytest.mark.parametrize("path", ["one op", "composed"])
def test_a_lora_layer_adds_each_segments_update_as_plain_torch_does(path: str) -> None:
    # A q/k/v-like projection of three segments, the first and the last adapted, its base
    # weight and bias trained too (to check their gradients); "composed" is the form FP8
    # recipes and torch.compile take.
    config = LoRAConfig(rank=3, alpha=6.0, layers=["query", "value"])
    lora = LoRA(config, 10, (8, 4, 4), (0, 2), TensorDimension(), row_parallel=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in lora.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    x = torch.randn(2, 5, 10, generator=generator, requires_grad=True)
    weight = torch.randn(16, 10, generator=generator, requires_grad=True)
    bias = torch.randn(16, generator=generator, requires_grad=True)
    if path == "one op":
        out = lora.project(x, weight, bias, None)
    else:
        out = lora._add_to(F.linear(x, weight, bias), x)

    a_q, a_v = lora.a.detach()[:3].clone(), lora.a.detach()[3:].clone()
    b_q, b_v = lora.b.detach()[:8].clone(), lora.b.detach()[8:].clone()
    x_ref, weight_ref, bias_ref = (t.detach().clone() for t in (x, weight, bias))
    for tensor in (a_q, a_v, b_q, b_v, x_ref, weight_ref, bias_ref):
        tensor.requires_grad_(True)
    q, k, v = F.linear(x_ref, weight_ref, bias_ref).split([8, 4, 4], dim=-1)
    reference = torch.cat(
        [q + 2.0 * (x_ref @ a_q.T) @ b_q.T, k, v + 2.0 * (x_ref @ a_v.T) @ b_v.T], dim=-1
    )
    torch.testing.assert_close(out, reference)

    grad = torch.randn(out.shape, generator=generator)
    out.backward(grad)
    reference.backward(grad)
    for ours, theirs in ((x, x_ref), (weight, weight_ref), (bias, bias_ref)):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert lora.a.grad is not None and lora.b.grad is not None
    torch.testing.assert_close(lora.a.grad, torch.cat([a_q.grad, a_v.grad]))
    torch.testing.assert_close(lora.b.grad, torch.cat([b_q.grad, b_v.grad]))


def lora_config(source_config: BaseModelConfig, **lora: object) -> BaseModelConfig:
    raw = msgspec.to_builtins(source_config)
    return build(BaseModelConfig, {**raw, "peft": {"type": "lora", **lora}})


def peft_model(
    directory: Path, rank: int, alpha: float, targets: dict[str, list[str]] | None = None
) -> peft.PeftModel:
    """PEFT's LoRA on every linear of the saved model (or on `targets`, LoraConfig's keyword
    arguments), its B matrices random (PEFT starts them at zero, which would leave A without
    a gradient)."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    base.config._attn_implementation = "eager"
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, **(targets or {"target_modules": PEFT_MODULES})
    )
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


def ours_with_their_adapters(
    directory: Path, theirs: peft.PeftModel, architecture: str, **lora: object
) -> GPTModel:
    source = open_model(directory)
    config = lora_config(source.config, **lora)
    model = GPTModel(config)
    state = dict(source.tensors())
    adapters = peft.get_peft_model_state_dict(theirs)
    for rule in adapter_rules(config, architecture):
        state[rule.ours] = rule.join([adapters[PREFIX + name] for name in rule.theirs])
    model.load_state_dict(state, strict=True)
    return model


def test_a_tiny_llama_with_lora_matches_peft_loss_and_adapter_gradients(tmp_path: Path) -> None:
    save_hf_model("llama", tmp_path)
    theirs = peft_model(tmp_path, rank=4, alpha=8.0)
    ours = ours_with_their_adapters(
        tmp_path, theirs, "llama", rank=4, alpha=8.0, layers=EVERY_LINEAR
    )
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (2, 13), generator=generator)
    labels = torch.randint(0, 97, (2, 13), generator=generator)

    their_grads = assert_same_loss_and_adapter_gradients(
        ours, theirs, "llama", ours.loss(input_ids, labels), input_ids, labels
    )
    assert len(their_grads) == 2 * 7 * 2  # every adapter of PEFT's, 7 in each of the 2 blocks


def assert_same_loss_and_adapter_gradients(
    ours: GPTModel,
    theirs: Any,
    architecture: str,
    our_loss: torch.Tensor,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Our loss against PEFT's cross-entropy of the same batch, then each of our adapters'
    gradients against PEFT's (every one of PEFT's covered); PEFT's gradients by name."""
    their_logits = theirs(input_ids=input_ids).logits
    their_loss = F.cross_entropy(their_logits.flatten(0, 1), labels.flatten())
    assert our_loss.item() == pytest.approx(their_loss.item(), rel=1e-5)
    our_loss.backward()
    their_loss.backward()
    their_grads = {
        name.replace(".default", ""): p.grad
        for name, p in theirs.named_parameters()
        if p.requires_grad
    }
    our_params = dict(ours.named_parameters())
    rules = list(adapter_rules(ours.config, architecture))
    for rule in rules:
        expected = rule.join([their_grads[PREFIX + name] for name in rule.theirs])
        assert relative_error(our_params[rule.ours].grad, expected) <= 1e-5, rule.ours
    assert {PREFIX + name for rule in rules for name in rule.theirs} == set(their_grads)
    return their_grads


@pytest.mark.parametrize(
    ("architecture", "dropless"), [("mixtral", True), ("mixtral", False), ("qwen2_moe", True)]
)
def test_a_tiny_mixture_with_expert_lora_matches_peft_target_parameters(
    tmp_path: Path, architecture: str, dropless: bool
) -> None:
    # Each expert's own adapters of gate_up_proj and down_proj (PEFT's ParamWrapper), on the
    # grouped matmuls (dropless) and on the looped reference; Qwen2-MoE's shared experts too.
    layers, targets, per_block = MIXTURES[architecture]
    save_hf_model(architecture, tmp_path)
    theirs = peft_model(tmp_path, rank=4, alpha=8.0, targets=targets)
    ours = ours_with_their_adapters(
        tmp_path, theirs, architecture, rank=4, alpha=8.0, layers=layers
    )
    if not dropless:
        state = ours.state_dict()
        t = msgspec.structs.replace(ours.config.transformer, dropless_moe=False)
        ours = GPTModel(msgspec.structs.replace(ours.config, transformer=t))
        ours.load_state_dict(state, strict=True)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (2, 13), generator=generator)
    labels = torch.randint(0, 97, (2, 13), generator=generator)

    # From the logits: our loss would add the router's auxiliary loss, which PEFT's leaves out.
    our_loss = F.cross_entropy(ours(input_ids).flatten(0, 1), labels.flatten())
    their_grads = assert_same_loss_and_adapter_gradients(
        ours, theirs, architecture, our_loss, input_ids, labels
    )
    our_params = dict(ours.named_parameters())
    assert len(their_grads) == 2 * per_block * 2  # A and B of each, in 2 blocks
    assert our_params["layers.0.mlp.layer_1_lora.a"].shape == (4, 4, 48)  # experts, rank, in
    adapters = sum(p.numel() for name, p in our_params.items() if "_lora." in name)
    assert ours.config.adapter_parameters() == adapters
    assert ours.config.num_parameters() == sum(p.numel() for p in our_params.values())


@pytest.mark.parametrize(
    ("architecture", "layers", "targets"),
    [("llama", EVERY_LINEAR, None), ("qwen2_moe", SHARED_LAYERS, PEFT_SHARED)],
)
def test_merged_weights_compute_what_the_base_and_its_adapters_compute(
    tmp_path: Path, architecture: str, layers: list[str], targets: dict[str, list[str]] | None
) -> None:
    save_hf_model(architecture, tmp_path)
    theirs = peft_model(tmp_path, rank=4, alpha=16.0, targets=targets)
    ours = ours_with_their_adapters(
        tmp_path, theirs, architecture, rank=4, alpha=16.0, layers=layers
    )
    state = {name: t.detach() for name, t in ours.state_dict().items()}
    plain = GPTModel(msgspec.structs.replace(ours.config, peft=build(BaseModelConfig, {}).peft))
    plain.load_state_dict(dict(merged(ours.config, iter(state.items()))), strict=True)
    input_ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs.merge_and_unload()(input_ids=input_ids).logits
        assert relative_error(ours(input_ids), expected) <= 1e-5
        assert relative_error(plain(input_ids), expected) <= 1e-5


def test_lora_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"peft\.rank"):
        build(BaseModelConfig, {"peft": {"type": "lora", "rank": 0}})
    with pytest.raises(ConfigError, match=r"peft\.dropout"):
        build(BaseModelConfig, {"peft": {"type": "lora", "dropout": 1.0}})
    with pytest.raises(ConfigError, match="names a projection twice"):
        build(BaseModelConfig, {"peft": {"type": "lora", "layers": ["key", "key_value"]}})
    moe = {"transformer": {"num_experts": 4, "add_linear_biases": False}}
    with pytest.raises(ConfigError, match="no dense MLP") as caught:
        build(BaseModelConfig, {**moe, "peft": {"type": "lora", "layers": ["query", "mlp_1"]}})
    assert caught.value.path == "peft.layers"
    with pytest.raises(ConfigError, match="no mixture of experts") as caught:
        build(BaseModelConfig, {"peft": {"type": "lora", "layers": ["experts_2"]}})
    assert caught.value.path == "peft.layers"
    experts = {"type": "lora", "layers": ["experts_1"], "dropout": 0.1}
    trainer = {"model": {"base_model": {**moe, "peft": experts}}}
    build(TrainerConfig, trainer)  # dropout on the experts' adapters trains
    with pytest.raises(ConfigError, match=r"target_parameters\) has no dropout") as caught:
        build(TrainerConfig, {**trainer, "training": {"export": {"format": "peft"}}})
    assert caught.value.path == "training.export.format"
