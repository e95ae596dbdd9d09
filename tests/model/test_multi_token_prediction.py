"""Multi-token prediction (DeepSeek-V3's modules) against a plain-torch reference of the same
weights: the loss and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm.config import BaseModelConfig, ConfigError, TrainerConfig, build
from fastllm.config.flops import flops_per_token
from fastllm.config.layout import check_compatible
from fastllm.model import GPTModel
from fastllm.model.init import initialize


def config(depth: int = 2, **transformer: object) -> BaseModelConfig:
    raw = {
        "transformer": {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "head_groups": 2,
            "ffn_hidden_size": 48,
            "gated": True,
            "add_linear_biases": False,
            **transformer,
        },
        "vocab_size": 61,
        "tie_word_embeddings": False,
        "multi_token_prediction": {"depth": depth, "loss_weight": 0.3},
    }
    return build(BaseModelConfig, raw)


def rms(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon) * weight


def reference_loss(model: GPTModel, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Label cross-entropy + 0.3 / D × Σ_k the cross-entropy of module k on token i + k + 1,
    spelled out in torch; the blocks are the model's (their parity is tested elsewhere)."""
    epsilon = model.config.transformer.normalization.epsilon
    context = model.context(input_ids)
    h = F.embedding(input_ids, model.embeddings.weight)
    for block in model.layers:
        h, _ = block(h, context.rotary)
    head = model.head_weight
    logits = F.linear(rms(h, model.final_norm.weight, epsilon), head)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    depth, length = len(model.prediction_modules), input_ids.shape[1]
    for k, module in enumerate(model.prediction_modules, start=1):
        # position i < length - k reads token i + k and predicts label i + k (token i + k + 1)
        e = F.embedding(input_ids[:, k:], model.embeddings.weight)
        joined = torch.cat(
            [rms(e, module.embedding_norm.weight, epsilon),
             rms(h[:, : length - k], module.hidden_norm.weight, epsilon)],
            dim=-1,
        )  # fmt: skip
        x = F.linear(joined, module.projection.weight)
        rotary = tuple(t[: length - k] for t in context.rotary)
        h, _ = module.block(x, rotary)
        logits = F.linear(rms(h, module.output_norm.weight, epsilon), head)
        targets = labels[:, k:]
        mtp = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss = loss + 0.3 / depth * mtp
    return loss


@pytest.mark.parametrize("depth", [1, 2])
def test_loss_and_gradients_match_a_plain_torch_reference(depth: int) -> None:
    model = GPTModel(config(depth))
    initialize(model, torch.Generator().manual_seed(0))
    with torch.no_grad():  # norms away from one, so that each is exercised
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.1)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 61, (2, 13), generator=generator)
    labels = torch.randint(0, 61, (2, 13), generator=generator)
    labels[0, :4] = -100
    ours = model.loss(input_ids, labels)
    ours.backward()
    our_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    theirs = reference_loss(model, input_ids, labels)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(our_grads[name], parameter.grad, rtol=1e-4, atol=1e-6)
    assert all(p.grad.abs().sum() > 0 for p in model.prediction_modules.parameters())


def test_logits_do_not_depend_on_the_prediction_modules() -> None:
    model = GPTModel(config(1))
    initialize(model, torch.Generator().manual_seed(0))
    input_ids = torch.randint(0, 61, (1, 9))
    before = model(input_ids)
    with torch.no_grad():
        for parameter in model.prediction_modules.parameters():
            parameter.mul_(3.0)
    assert torch.equal(model(input_ids), before)


def test_parameters_and_flops_count_the_modules() -> None:
    with_modules, without = config(2), config(2)
    without.multi_token_prediction = None
    with torch.device("meta"):
        model = GPTModel(with_modules)
    assert with_modules.num_parameters() == sum(p.numel() for p in model.parameters())
    module = sum(p.numel() for p in model.prediction_modules[0].parameters())
    assert with_modules.num_parameters() - without.num_parameters() == 2 * module
    attention = 12 * 4 * 8 * 64  # per module, as a block's
    extra = flops_per_token(with_modules, 64) - flops_per_token(without, 64)
    assert extra == 2 * (6 * (module + 61 * 32) + attention)


def test_pipeline_parallelism_is_refused_naming_both_keys() -> None:
    raw = {
        "model": {
            "base_model": {"multi_token_prediction": {"depth": 1}},
            "distributed": {"pipeline_parallel": 2},
        },
        "data": {"path": ["x"]},
    }
    with pytest.raises(ConfigError, match=r"multi_token_prediction.*pipeline_parallel"):
        check_compatible(build(TrainerConfig, raw))
