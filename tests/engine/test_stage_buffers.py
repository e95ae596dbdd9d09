"""The flat-buffer engine against plain PyTorch training of the same model."""

from __future__ import annotations

import copy

import pytest
import torch

from fastllm.config import TrainerConfig, load_config
from fastllm.config.training import LearningRateConfig
from fastllm.engine.learning_rate import learning_rate, phased_learning_rate
from fastllm.engine.model_stages import ModelStages
from fastllm.engine.optimizer import AdamW
from fastllm.engine.weights_io import load_full_parameters
from fastllm.model import GPTModel, initialize
from fastllm.model.parameters import parameter_metas
from fastllm_kernels import master_split
from tests.conftest import ROOT

TINY = [
    "model.base_model.transformer.num_layers=2",
    "model.base_model.transformer.hidden_size=32",
    "model.base_model.transformer.num_attention_heads=4",
    "model.base_model.transformer.ffn_hidden_size=48",
    "model.base_model.vocab_size=61",
    "optimizer.weight_decay=0.1",
    "optimizer.gradient_norm_clipping=0.05",
]


def tiny_config(*overrides: str) -> TrainerConfig:
    return load_config(TrainerConfig, [ROOT / "examples" / "tiny.yaml"], [*TINY, *overrides])


def model_stages(
    config: TrainerConfig, reference: GPTModel, dtype: torch.dtype
) -> tuple[GPTModel, ModelStages]:
    with torch.device("meta"):
        model = GPTModel(config.model.base_model)
    stages = ModelStages(model, compute_dtype=dtype, device=torch.device("cpu"))
    load_full_parameters(stages, reference.named_parameters())
    return model, stages


def test_parameters_are_views_of_the_flat_buffers() -> None:
    config = tiny_config()
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    model, stages = model_stages(config, reference, torch.float32)
    for (name, ours), (_, theirs) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert torch.equal(ours, theirs), name
        stage, offset, _numel = stages.dense.buffers.layout.parameter(name)
        assert ours.data_ptr() == stages.stages[stage].buffers[0].weights[offset:].data_ptr()
        assert offset % 128 == 0


def test_float32_steps_match_torch_adamw_with_clipping_and_decay_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The flat buffers, decay groups and clipping are tested: the ops run their torch
    # references (tests/kernels checks the kernels against them, AdamW's against torch's).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = tiny_config()
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    model, stages = model_stages(config, reference, torch.float32)
    reference = copy.deepcopy(reference)
    opt = config.optimizer
    metas = parameter_metas(reference)
    decay = [p for n, p in reference.named_parameters() if metas[n].weight_decay]
    no_decay = [p for n, p in reference.named_parameters() if not metas[n].weight_decay]
    torch_adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1.0, betas=(opt.beta_1, opt.beta_2), eps=opt.epsilon,
    )  # fmt: skip
    ours = AdamW(stages, opt)
    schedule = LearningRateConfig(base=1e-2, warmup_iterations=2, decay_style="cosine")
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, 61, (2, 2, 9), generator=generator)
        labels = torch.randint(0, 61, (2, 2, 9), generator=generator)
        lr = learning_rate(schedule, step, 4)
        for micro in range(2):  # two micro-batches accumulate
            (model.loss(ids[micro], labels[micro]) / 2).backward()
            stages.finish_backward()
            (reference.loss(ids[micro], labels[micro]) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), opt.gradient_norm_clipping)
        for group in torch_adamw.param_groups:
            group["lr"] = lr
        torch_adamw.step()
        torch_adamw.zero_grad()
        report = ours.step(lr)
        stages.zero_grad()
        assert report.grad_norm == pytest.approx(norm.item(), rel=1e-5)
        for (name, a), (_, b) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            # Our AdamW against torch's: round-off only (updates are ~1e-2 here); near-zero
            # gradients may differ in sign by round-off, hence the absolute tolerance.
            torch.testing.assert_close(
                a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_fp32_masters_and_writes_the_compute_weights(dtype) -> None:
    config = tiny_config()
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    model, stages = model_stages(config, reference, dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    ids = torch.randint(0, 61, (2, 9))
    model.loss(ids, ids).backward()
    stages.finish_backward()
    assert all(p.grad is None for p in model.parameters()), (
        "gradients belong in the flat fp32 buffer"
    )
    assert stages.dense.buffers.grads[1].abs().sum() > 0
    AdamW(stages, config.optimizer).step(1e-3)
    for shard in stages.dense.buffers.shards.values():
        # bf16: the weights are the masters' high halves, an int16 array the rest (16 bytes
        # per parameter in all, not 18); fp16 keeps fp32 masters apart.
        split = dtype == torch.bfloat16
        assert (shard.master is None) == split
        assert (shard.master_low is not None and shard.master_low.dtype == torch.int16) == split
        masters = shard.master_values()
        assert masters.dtype == torch.float32
        # The step writes the copy itself; Triton's interpreter truncates where the GPU
        # rounds to nearest, so allow one ulp.
        ulp = 2**-7 if split else 2**-10
        torch.testing.assert_close(shard.weight.float(), masters, rtol=ulp, atol=1e-4)
        if split:
            high = torch.empty_like(shard.weight)
            master_split.split_(masters, high, torch.empty_like(shard.master_low))
            assert torch.equal(high, shard.weight)


def test_a_new_step_overwrites_gradients_and_zeroes_those_not_computed() -> None:
    config = tiny_config()
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    model, stages = model_stages(config, reference, torch.float32)
    buffers = stages.dense.buffers
    ids = torch.randint(0, 61, (2, 9))
    model.loss(ids, ids).backward()
    stages.finish_backward()
    # A new step: with nothing to reduce, the buffers give their memory back until then.
    stages.zero_grad()
    assert not any(buffers.gradients.resident)
    assert all(grad.untyped_storage().nbytes() == 0 for grad in buffers.grads)
    model.embeddings(ids).sum().backward()  # only the embedding gets a gradient
    stages.finish_backward()
    assert all(buffers.gradients.resident)
    expected = torch.zeros(model.embeddings.weight.shape).index_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), model.embeddings.weight.shape[1])
    )
    embedding = buffers.names.index("embeddings.weight")
    torch.testing.assert_close(buffers.gradients.views[embedding], expected)
    for index, name in enumerate(buffers.names):
        if index != embedding:
            assert not buffers.gradients.views[index].any(), f"stale gradient: {name}"
    # The alignment gaps too: the gradient norm and the optimizer read whole shards.
    stage, offset, numel = buffers.layout.parameter(embedding)
    grads = [grad.clone() for grad in buffers.grads]
    grads[stage][offset : offset + numel] = 0
    assert not any(grad.any() for grad in grads)


def test_a_step_with_non_finite_gradients_is_skipped() -> None:
    config = tiny_config()
    reference = GPTModel(config.model.base_model)
    initialize(reference, torch.Generator().manual_seed(0))
    _model, stages = model_stages(config, reference, torch.float32)
    weights = [stage.weights for stage in stages.dense.buffers.stages]
    before = [w.clone() for w in weights]
    stages.reduce_gradients()  # the buffers held (zero: no backward pass ran)
    stages.dense.buffers.grads[1][3] = float("nan")
    report = AdamW(stages, config.optimizer).step(1e-3)
    assert report.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, weights, strict=True))


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "wsd"])
def test_schedules_warm_up_then_reach_their_minimum(style: str) -> None:
    config = LearningRateConfig(base=1.0, warmup_iterations=4, decay_style=style, minimum=0.1)
    rates = [learning_rate(config, step, 20) for step in range(20)]
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert max(rates) == pytest.approx(1.0)
    assert rates[-1] == pytest.approx(1.0 if style == "constant" else 0.1)
    if style == "wsd":
        assert rates[4:16] == pytest.approx([1.0] * 12)


def test_phases_switch_schedules_going_on_from_the_last_rate_unless_given_a_base() -> None:
    config = load_config(
        TrainerConfig,
        overrides=[
            "training.train_iters=12",
            "optimizer.learning_rate={base: 1.0, warmup_iterations: 2, decay_style: linear,"
            " decay_iterations: 8, minimum: 0.2}",
            "training.phases=[{begin_step: 6, learning_rate: {decay_style: linear}},"
            " {begin_step: 8, data: {path: [d]}}, {begin_step: 10, learning_rate: {base: 0.5}}]",
        ],
    )
    training = config.training
    rates = [
        phased_learning_rate(config.optimizer.learning_rate, training.phases, step, 12)
        for step in range(12)
    ]
    first = [learning_rate(config.optimizer.learning_rate, step, 12) for step in range(6)]
    assert rates[:6] == first  # the phases before the first switch: the run's schedule
    # From the rate of step 6 (the last before the phase) down to 0 over the phase's 4 steps,
    # through the phase that only switches data, then 0.5 as the last phase declares.
    assert rates[6:] == pytest.approx(
        [0.75 * first[5], 0.5 * first[5], 0.25 * first[5], 0, 0.5, 0.5]
    )
