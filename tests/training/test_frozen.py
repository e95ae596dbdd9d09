"""Frozen parameters (`model.freeze`): weights only (no gradient, master or moments), never
updated, never reduced; the other parameters train as they would with them held fixed; data
parallelism at ZeRO-1 and ZeRO-3 matches one process; resumes read the frozen weights again."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastllm.config import ConfigError, TrainerConfig, load_config
from fastllm.config.flops import flops_per_token
from tests.data.conftest import run_cli
from tests.training.conftest import Launched, Layout, train_arguments
from tests.training.test_train_cli import assert_same_losses, losses
from tests.training.test_training_options import trainer

# The tiny model has 2 blocks here and a tied head: the embedding (and so the head) and the
# first block are frozen.
FROZEN = (
    "model.freeze.embeddings=true",
    "model.freeze.head=true",
    "model.freeze.blocks=[0,1]",
)
FOUR_STEPS = (
    "training.train_iters=4",
    "training.export.interval=4",
    "training.export.format=starcoder2",
)


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """Two data ranks at ZeRO-1 and ZeRO-3, two tensor ranks with sequence-tensor parallelism,
    two pipeline ranks (trained for the fixture `launched`)."""
    return {
        **{
            f"zero{stage}": Layout(
                2, (*FROZEN, *FOUR_STEPS, f"model.multi_stage.zero_stage={stage}")
            )
            for stage in (1, 3)
        },
        "tensor": Layout(2, (*FROZEN, *FOUR_STEPS, *TENSOR)),
        # The first stage (the embedding and block 0) is frozen whole: no backward pass there.
        "pipeline": Layout(2, (*FROZEN, *FOUR_STEPS, "model.distributed.pipeline_parallel=2")),
    }


TENSOR = ("model.distributed.tensor_parallel=2", "model.distributed.sequence_tensor_parallel=true")


@pytest.mark.parametrize("layout", ["zero1", "zero3", "tensor", "pipeline"])
def test_two_ranks_with_frozen_parameters_match_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path], layout: str
) -> None:
    # ZeRO-3 gathers the frozen weights' shards like the trained ones'; tensor ranks hold
    # slices of them; the export holds every weight, frozen ones included.
    single, double = one_process(*FROZEN, *FOUR_STEPS), launched[layout].succeeded()
    assert_same_run(single, double)


def assert_same_run(single: Path, double: Path) -> None:
    """The two runs of `FOUR_STEPS` logged the same losses and exported the same weights."""
    assert_same_losses(single, double, 4, rel=1e-5)
    ours, theirs = (
        load_file(run / "export" / "4" / "model.safetensors") for run in (double, single)
    )
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def test_frozen_parameters_hold_only_weights_and_the_others_train_as_with_them_held_fixed(
    dataset: Path, tmp_path: Path
) -> None:
    # Without clipping (the norm of fewer gradients would scale them otherwise), the first
    # step updates the trained parameters exactly as the run that trains everything does.
    overrides = ("training.train_iters=3", "optimizer.gradient_norm_clipping=null")
    plain = trainer(dataset, tmp_path / "plain", *overrides)
    frozen = trainer(dataset, tmp_path / "frozen", *overrides, *FROZEN)
    stages = frozen.engine.stages
    assert stages.frozen is not None
    frozen_names = set(stages.frozen.buffers.names)
    assert frozen_names == {"embeddings.weight"} | {
        name for name, _ in frozen.engine.model.named_parameters() if name.startswith("layers.0.")
    }
    trained = {name for group in stages.groups for name in group.buffers.names}
    assert not trained & frozen_names
    assert all(
        not p.requires_grad for n, p in frozen.engine.model.named_parameters() if n in frozen_names
    )
    # The optimizer's state and the gradients hold the trained parameters' elements only.
    layout = stages.dense.buffers.layout
    elements = sum(layout.stage_size(s) for s in stages.dense.buffers.owned)
    shards = stages.dense.buffers.shards.values()
    assert sum(s.exp_avg.numel() for s in shards) == elements
    assert stages.dense.buffers.gradients.held_bytes == 4 * elements
    numel = {n: p.numel() for n, p in frozen.engine.model.named_parameters()}
    assert elements < sum(numel[n] for n in trained) + 128 * len(trained)
    assert not hasattr(stages.frozen.buffers, "gradients") and not stages.frozen.buffers.shards

    before = {n: p.detach().clone() for n, p in plain.engine.model.named_parameters()}
    batches = list(itertools.islice(plain.data_loader(), 3))
    plain.engine.train_step(batches[0])
    frozen.engine.train_step(batches[0])
    for name, parameter in frozen.engine.model.named_parameters():
        reference = before[name] if name in frozen_names else plain.engine.model.get_parameter(name)
        assert torch.equal(parameter.detach(), reference.detach()), name
    for micro_batches in batches[1:]:
        frozen.engine.train_step(micro_batches)
    for name in frozen_names:
        assert torch.equal(frozen.engine.model.get_parameter(name).detach(), before[name]), name


def test_a_resume_reads_the_frozen_weights_again_and_continues_exactly(
    dataset: Path, tmp_path: Path, one_process: Callable[..., Path]
) -> None:
    experiment = tmp_path / "run"
    for steps in (2, 4):
        arguments = train_arguments(dataset, experiment, *FROZEN, *FOUR_STEPS)
        # The first run stops at step 2, before FOUR_STEPS's export.
        exports = f"training.export.interval={4 if steps == 4 else 'null'}"
        result = run_cli(*arguments, f"training.train_iters={steps}", exports)
        assert result.returncode == 0, result.stderr
    expected = losses(one_process(*FROZEN, *FOUR_STEPS))
    got = losses(experiment)
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-6), step
    # The checkpoint holds the trained parameters only.
    shard = load_file(experiment / "checkpoint" / "4" / "rank_00000.safetensors")
    assert shard and all("embeddings" not in key for key in shard)


def test_a_resume_with_other_frozen_parameters_is_refused_naming_the_key(
    dataset: Path, tmp_path: Path
) -> None:
    experiment = tmp_path / "run"
    result = run_cli(*train_arguments(dataset, experiment, *FROZEN, "training.train_iters=2"))
    assert result.returncode == 0, result.stderr
    changed = [*FROZEN[:2], "training.train_iters=4"]
    result = run_cli(*train_arguments(dataset, experiment, *changed))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("fastllm: error: model.freeze.blocks: checkpoint [0, 1], config null")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("training.export.interval=2", "training.export.format=distributed"),
            "model.freeze: not supported yet with training.export.format=distributed with an "
            "interval (a distributed export holds the trained shards only",
        ),
        (("model.freeze.head=false",), "model.freeze.head: is false but freeze.embeddings is true"),
        (("model.freeze.blocks=[1,3]",), "model.freeze.blocks: must be [first, end) with 0 <="),
    ],
)
def test_what_frozen_parameters_do_not_work_with_is_refused_naming_the_keys(
    overrides: tuple[str, ...], message: str
) -> None:
    arguments = [*FROZEN, "model.base_model.transformer.num_layers=2", *overrides]
    with pytest.raises(ConfigError) as refused:
        load_config(TrainerConfig, ["examples/tiny.yaml"], arguments)
    assert str(refused.value).startswith(message), refused.value


def test_frozen_parameters_cost_no_weight_gradient_and_a_frozen_prefix_no_backward_pass() -> None:
    config = load_config(
        TrainerConfig, ["examples/tiny.yaml"], [*FROZEN, "training.export.format=starcoder2"]
    )
    base, sequence = config.model.base_model, 256
    t, counts = base.transformer, base.parameter_counts()
    attention = 12 * t.num_attention_heads * t.kv_channels * sequence
    head = base.vocab_size * t.hidden_size
    blocks = t.num_layers
    whole = blocks * (6 * counts.block + attention) + 6 * counts.final_norm + 6 * head
    assert flops_per_token(base, sequence) == whole
    # Block 0 comes before anything trained: its forward pass only. The head's input gradient
    # is still needed (the blocks after the first train).
    frozen = (
        2 * counts.block + attention / 3
        + (blocks - 1) * (6 * counts.block + attention)
        + 6 * counts.final_norm
        + 4 * head
    )  # fmt: skip
    assert flops_per_token(base, sequence, config.model.freeze) == frozen
    assert config.model.num_frozen_parameters() == counts.embedding + counts.block


def test_frozen_norms_stay_while_the_projections_they_feed_train(
    dataset: Path, tmp_path: Path
) -> None:
    # The norms are fused into the projections after them: only their weights' gradients go.
    run = trainer(dataset, tmp_path / "run", "training.train_iters=2", "model.freeze.norms=true")
    model = run.engine.model
    norms = {name for name, _ in model.named_parameters() if "norm" in name}
    assert norms and set(run.engine.stages.frozen.buffers.names) == norms
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for micro_batches in run.data_loader():
        run.engine.train_step(micro_batches)
    for name, parameter in model.named_parameters():
        unchanged = torch.equal(parameter.detach(), before[name])
        assert unchanged == (name in norms), name
