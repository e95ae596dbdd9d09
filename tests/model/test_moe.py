"""The dropless mixture of experts against the looped one (the reference): outputs, router
losses, gradients and training steps. `make test` runs them with TRITON_INTERPRET=1, so the
permutation kernels run (interpreted) rather than their references."""

from __future__ import annotations

import copy
from pathlib import Path

import msgspec
import pytest
import torch

from fastllm.config import TrainerConfig, load_config
from fastllm.config.model import TransformerConfig
from fastllm.model.mlp import MixtureOfExperts, take_expert_load
from fastllm.model.normalization import Normalization

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 24


def transformer(**fields: object) -> TransformerConfig:
    overrides = [
        f"model.base_model.transformer.hidden_size={HIDDEN}",
        "model.base_model.transformer.num_attention_heads=4",
        "model.base_model.transformer.ffn_hidden_size=20",
        "model.base_model.transformer.add_linear_biases=false",
        "model.base_model.transformer.expert_z_loss_coefficient=0.01",
        *(f"model.base_model.transformer.{key}={value}" for key, value in fields.items()),
    ]
    config = load_config(TrainerConfig, [ROOT / "examples" / "tiny.yaml"], overrides)
    return config.model.base_model.transformer


def pair(config: TransformerConfig, seed: int = 0) -> tuple[MixtureOfExperts, MixtureOfExperts]:
    """(dropless, looped) with the same random weights."""
    torch.manual_seed(seed)
    dropless = MixtureOfExperts(msgspec.structs.replace(config, dropless_moe=True))
    for parameter in dropless.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    looped = MixtureOfExperts(msgspec.structs.replace(config, dropless_moe=False))
    looped.load_state_dict(dropless.state_dict())
    return dropless, looped


def norm(config: TransformerConfig) -> Normalization:
    return Normalization(config.normalization, HIDDEN)


def skew(module: MixtureOfExperts, x: torch.Tensor) -> None:
    """Router logits ordered by expert along x's shared direction: the first experts get most
    tokens, the last ones none."""
    direction = x.mean(dim=(0, 1))
    scale = torch.linspace(3.0, -3.0, module.num_experts)[:, None]
    with torch.no_grad():
        module.router.weight.mul_(0.05).add_(scale * direction / direction.norm())


CASES = {
    "gated-silu-8-top2": {"num_experts": 8, "num_experts_per_token": 2, "gated": "true", "activation_type": "silu"},
    "plain-gelu-8-top1": {"num_experts": 8, "num_experts_per_token": 1, "gated": "false"},
    "plain-16-top8-softmax-shared": {"num_experts": 16, "num_experts_per_token": 8, "gated": "false",
                                     "expert_renormalize": "false", "num_shared_experts": 1,
                                     "shared_expert_gate": "true"},
    "plain-relu-128-top4": {"num_experts": 128, "num_experts_per_token": 4, "gated": "false",
                            "activation_type": "squared_relu"},
}  # fmt: skip


@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dropless_matches_looped_outputs_losses_and_gradients(case: str, skewed: bool) -> None:
    config = transformer(**CASES[case])
    dropless, looped = pair(config)
    layer_norm = norm(config)
    x = torch.randn(2, 7, HIDDEN) + 2.0 * torch.randn(HIDDEN)
    if skewed:
        skew(dropless, x)
        looped.load_state_dict(dropless.state_dict())
    grad = torch.randn_like(x)
    results = []
    for module in (dropless, looped):
        x_leaf = x.clone().requires_grad_()
        out, auxiliary = module(x_leaf, layer_norm)
        (out * grad).sum().add(auxiliary).backward()
        load = take_expert_load(module)
        results.append((out, auxiliary, x_leaf.grad, load, dict(module.named_parameters())))
    (out, auxiliary, d_x, load, parameters), (out_0, auxiliary_0, d_x_0, load_0, parameters_0) = (
        results
    )
    torch.testing.assert_close(out, out_0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(auxiliary, auxiliary_0)
    torch.testing.assert_close(d_x, d_x_0, rtol=1e-5, atol=1e-6)
    for name, parameter in parameters.items():
        torch.testing.assert_close(parameter.grad, parameters_0[name].grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(load, load_0) and int(load.sum()) == 14 * dropless.top_k
    if skewed:
        assert (load[0] == 0).any(), "some expert should receive no token"


def test_dropless_trains_like_looped_for_ten_steps() -> None:
    # Every token goes to every expert: no top-k choice can flip between the two as their
    # weights drift apart by rounding (Fast-LLM's layout tests do the same).
    config = transformer(num_experts=4, num_experts_per_token=4, gated="false")
    modules = pair(config, seed=1)
    norms = [norm(config), norm(config)]
    optimizers = [
        torch.optim.Adam([*m.parameters(), *n.parameters()], lr=1e-2)
        for m, n in zip(modules, norms, strict=True)
    ]
    generator = torch.Generator().manual_seed(2)
    losses: list[list[float]] = [[], []]
    for _ in range(10):
        x = torch.randn(3, 5, HIDDEN, generator=generator)
        target = torch.randn(3, 5, HIDDEN, generator=generator)
        for i in range(2):
            out, auxiliary = modules[i](x, norms[i])
            loss = (out - target).square().mean() + auxiliary
            optimizers[i].zero_grad()
            loss.backward()
            optimizers[i].step()
            losses[i].append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert losses[0][-1] < losses[0][0]
    for (name, ours), theirs in zip(
        modules[0].state_dict().items(), modules[1].state_dict().values(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=name)


def test_load_is_not_counted_again_when_the_backward_pass_recomputes() -> None:
    config = transformer(num_experts=4, num_experts_per_token=2)
    module, _ = pair(config)
    checkpointed = copy.deepcopy(module)
    layer_norm = norm(config)
    x = torch.randn(2, 3, HIDDEN, requires_grad=True)
    module(x, layer_norm)[0].sum().backward()
    out = torch.utils.checkpoint.checkpoint(checkpointed, x, layer_norm, use_reentrant=False)
    out[0].sum().backward()
    assert torch.equal(take_expert_load(module), take_expert_load(checkpointed))
    assert take_expert_load(module) is None
