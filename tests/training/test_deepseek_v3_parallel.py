"""A DeepSeek-V3-style model (latent attention, a dense first block, sigmoid routing limited to
groups, a shared expert, correction biases balanced by the loads) under torchrun against the
single-process run of the same global batch: on two tensor ranks with sequence parallelism,
and on two data ranks that split the experts (ZeRO-2), where the biases move by the loads
summed over both; on two pipeline
ranks; on two sequence-data ranks; in micro-sequences; with multi-token prediction on two data ranks and on two tensor ranks."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastllm.model.parameters import parameter_metas
from tests.training.conftest import Launched, Layout, compiled_graphs
from tests.training.test_data_parallel import final_weights
from tests.training.test_tensor_parallel import assert_close_weights, metric
from tests.training.test_training_options import trainer

STEPS = 4
RATE = 0.01
DEEPSEEK = (
    "model.base_model.transformer.normalization.type=rms_norm",
    "model.base_model.transformer.gated=true",
    "model.base_model.transformer.activation_type=silu",
    "model.base_model.transformer.add_linear_biases=false",
    "model.base_model.transformer.window_size=null",
    "model.base_model.transformer.head_groups=4",
    "model.base_model.transformer.mixer={type: latent_attention, q_lora_rank: 24, kv_lora_rank: 16, "
    "qk_head_dim: 12, qk_pos_emb_head_dim: 8, v_head_dim: 20}",
    "model.base_model.transformer.ffn_hidden_size=32",
    "model.base_model.transformer.dense_ffn_hidden_size=96",
    "model.base_model.transformer.first_dense_layers=1",
    "model.base_model.transformer.num_experts=8",
    "model.base_model.transformer.num_experts_per_token=3",
    "model.base_model.transformer.num_shared_experts=1",
    "model.base_model.transformer.expert_score_function=sigmoid",
    "model.base_model.transformer.expert_auxiliary_loss_coefficient=0",
    "model.base_model.transformer.expert_bias=true",
    f"model.base_model.transformer.expert_bias_update_rate={RATE}",
    "model.base_model.transformer.expert_groups=4",
    "model.base_model.transformer.expert_groups_per_token=2",
    "model.base_model.transformer.expert_routed_scaling_factor=2.5",
    "model.base_model.tie_word_embeddings=false",
    f"training.train_iters={STEPS}",
    f"training.export.interval={STEPS}",
    "training.export.format=distributed",
    "batch.batch_size=8",
    "model.multi_stage.debug_tensor_parallel=true",
)


PREDICTION = ("model.base_model.multi_token_prediction={depth: 1, loss_weight: 0.3}",)


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    return {
        "pp2": Layout(
            2,
            (
                *DEEPSEEK,
                "model.distributed.pipeline_parallel=2",
                "schedule.breadth_first_micro_batches=4",
            ),
        ),
        "micro-batch-splits": Layout(1, (*DEEPSEEK, "schedule.micro_batch_splits=2")),
        "sdp2-head-tail": Layout(
            2,
            (
                *DEEPSEEK,
                "model.distributed.sequence_data_parallel=2",
                "model.distributed.sequence_data_chunking=head_tail",
            ),
        ),
        "tp2-multi-token-prediction": Layout(
            2,
            (
                *DEEPSEEK,
                *PREDICTION,
                "model.distributed.tensor_parallel=2",
                "model.distributed.sequence_tensor_parallel=true",
            ),
        ),
        "dp2-multi-token-prediction": Layout(
            2, (*DEEPSEEK, *PREDICTION, "model.multi_stage.zero_stage=3")
        ),
        "tp2-sequence-parallel": Layout(
            2,
            (
                *DEEPSEEK,
                "model.distributed.tensor_parallel=2",
                "model.distributed.sequence_tensor_parallel=true",
            ),
        ),
        "dp2-ep2-zero2": Layout(
            2,
            (
                *DEEPSEEK,
                "model.distributed.expert_parallel=2",
                "model.multi_stage.zero_stage=2",
            ),
        ),
    }


@pytest.fixture(scope="module")
def reference(one_process: Callable[..., Path]) -> Path:
    return one_process(*DEEPSEEK)


def test_one_process_moves_each_bias_by_the_rate_per_step(reference: Path) -> None:
    biases = {
        name: tensor
        for name, tensor in final_weights(reference, STEPS).items()
        if name.endswith("expert_bias")
    }
    assert list(biases) == ["layers.1.mlp.expert_bias"]  # the first block is dense
    bias = biases["layers.1.mlp.expert_bias"]
    assert bias.abs().sum() > 0
    steps = bias / RATE  # a sum of STEPS moves of -1, 0 or +1
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    assert steps.abs().max() <= STEPS
    assert metric(reference, "expert_tokens_max")  # the loads are logged


@pytest.mark.parametrize(
    "layout",
    [
        "tp2-sequence-parallel",
        "dp2-ep2-zero2",
        # the dense block on the first rank, the mixture (and its bias) on the second
        "pp2",
        # each sequence in two pieces, the second's attention reading the first's keys and
        # values (micro-sequences)
        "micro-batch-splits",
        # each sequence shared by two ranks in head and tail chunks, the latents of the
        # earlier chunks gathered
        "sdp2-head-tail",
        "dp2-multi-token-prediction",
        # the modules' norms and projection replicated on the sequence chunks, their head
        # vocab-parallel
        "tp2-multi-token-prediction",
    ],
)
def test_deepseek_v3_style_model_matches_one_process(
    one_process: Callable[..., Path], launched: dict[str, Launched], layout: str
) -> None:
    """With multi-token prediction (its module a mixture too, its loss in the logged one):
    two data ranks with ZeRO-3."""
    prediction = layout.endswith("multi-token-prediction")
    reference = one_process(*DEEPSEEK, *(PREDICTION if prediction else ()))
    run = launched[layout].succeeded()
    for key in ("loss", "grad_norm", "expert_tokens_max", "expert_tokens_mean"):
        expected, got = metric(reference, key), metric(run, key)
        assert sorted(got) == list(range(1, STEPS + 1)), key
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-5), (key, step)
    assert_close_weights(final_weights(run, STEPS), final_weights(reference, STEPS))


def test_fp8_computes_latent_attention_and_the_dense_block_and_trains_close_to_bf16(
    dataset: Path, tmp_path: Path
) -> None:
    """FP8 (emulated on the CPU) marks latent attention's projections and the dense first
    block's MLP, not the mixtures' experts, and trains close to bf16."""
    options = (*DEEPSEEK, "training.train_iters=3", "model.distributed.training_dtype=bfloat16")
    steps = {}
    for name, recipe in (("bf16", ()), ("fp8", ("model.distributed.fp8_linear=rowwise",))):
        run = trainer(dataset, tmp_path / name, *options, *recipe)
        batches = itertools.islice(run.data_loader(), 3)
        steps[name] = [run.engine.train_step(batch)["loss"] for batch in batches]
    metas = parameter_metas(run.engine.model)
    marked = {name for name, meta in metas.items() if meta.recipe and meta.recipe.fp8}
    attention = ("query_down", "query_up", "key_value_down", "key_value_up", "dense")
    expected = {f"layers.{i}.attention.{p}.weight" for i in range(2) for p in attention}
    assert marked == expected | {"layers.0.mlp.layer_1.weight", "layers.0.mlp.layer_2.weight"}
    assert steps["fp8"] != steps["bf16"], "the linear layers computed in FP8"
    assert steps["fp8"] == pytest.approx(steps["bf16"], rel=2e-2)


def test_compiled_blocks_give_the_same_losses_and_gradients(dataset: Path, tmp_path: Path) -> None:
    """Latent attention and the routing inside compiled blocks (on the CPU: inductor's code of
    the torch references)."""
    options = (*DEEPSEEK, "training.train_iters=1", *PREDICTION)
    eager = trainer(dataset, tmp_path / "a", *options)
    compiled = trainer(dataset, tmp_path / "b", *options, "training.compile=true")
    with compiled_graphs() as compiled_since:
        for batch in next(iter(eager.data_loader())):
            ours = compiled.engine.forward_backward([batch])
            theirs = eager.engine.forward_backward([batch])
            assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
        assert compiled_since() > 0
    for ours, theirs in zip(
        compiled.engine.stages.dense.buffers.grads,
        eager.engine.stages.dense.buffers.grads,
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-5)
