"""Micro-sequences (`schedule.micro_batch_splits`) against whole sequences: the same losses and
accumulated gradients (1e-5 relative), with and without document-masked attention, in one
process, each piece a unit of the runner's program (breadth-first micro-batches, both orders) and on two
tensor ranks with sequence-tensor parallelism. (With pipeline parallelism:
tests/training/test_pipeline_parallel.py.)"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastllm.config import ConfigError
from tests.training.conftest import Launched, Script
from tests.training.test_tensor_parallel import GEMMA3
from tests.training.test_training_options import trainer

SPLITS_4 = "schedule.micro_batch_splits=4"
DOCUMENTS = "batch.cross_document_attention=false"


@pytest.mark.parametrize(
    ("documents", "model"),
    [(False, ()), (True, ()), (True, GEMMA3)],
    ids=["across-documents", "within", "gemma3-style-within"],
)
def test_four_pieces_give_the_whole_sequences_loss_and_gradients(
    dataset: Path, tmp_path: Path, documents: bool, model: tuple[str, ...]
) -> None:
    # The tiny model's sliding window (32; Gemma 3-style: 16 in every other block, with an
    # attention scale of its own) reaches back over more than one piece (12 tokens).
    options = (*model, DOCUMENTS) if documents else model
    whole = trainer(dataset, tmp_path / "whole", *options)
    pieces = trainer(dataset, tmp_path / "pieces", *options, SPLITS_4)
    masked = False
    for micro_batches in itertools.islice(whole.data_loader(), 10):  # until a packed sample
        for batch in micro_batches:
            masked |= whole.engine.batches._attention_documents(batch) is not None
            expected = whole.engine.forward_backward([batch])
            got = pieces.engine.forward_backward([batch])
            assert got.item() == pytest.approx(expected.item(), rel=1e-5)
        assert_same_gradients(
            pieces.engine.stages.dense.buffers.grads, whole.engine.stages.dense.buffers.grads
        )
        whole.engine.stages.zero_grad()
        pieces.engine.stages.zero_grad()
        if masked or not documents:
            break
    assert masked == documents


def assert_same_gradients(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for mine, reference in zip(ours, theirs, strict=True):
        error = torch.linalg.vector_norm(mine - reference)
        assert error <= 1e-5 * torch.linalg.vector_norm(reference) + 1e-7, float(error)


@pytest.mark.parametrize("order", ["breadth_first", "depth_first"])
def test_pieces_as_units_of_the_pipeline_schedule_give_the_whole_sequences_gradients(
    dataset: Path, tmp_path: Path, order: str
) -> None:
    """Two breadth-first micro-batches of four pieces, each piece a unit of the runner's
    schedule, its backward pass its own, against the micro-batches run whole in turn."""
    whole = trainer(dataset, tmp_path / "whole", DOCUMENTS)
    pieces = trainer(
        dataset,
        tmp_path / "pieces",
        DOCUMENTS,
        SPLITS_4,
        "schedule.breadth_first_micro_batches=2",
        f"schedule.order={order}",
    )
    assert not pieces.engine.runner.whole and pieces.engine.layout.micro_batch_splits == 4
    masked = False
    for micro_batches in itertools.islice(whole.data_loader(), 10):  # until a packed sample
        masked = any(
            whole.engine.batches._attention_documents(batch) is not None for batch in micro_batches
        )
        if masked:
            break
    assert masked
    expected = whole.engine.forward_backward(micro_batches)  # each micro-batch whole, in turn
    got = pieces.engine.forward_backward(micro_batches)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert_same_gradients(
        pieces.engine.stages.dense.buffers.grads, whole.engine.stages.dense.buffers.grads
    )


TENSOR_SCRIPT = """
import itertools
from pathlib import Path
import torch
import torch.distributed as dist
from tests.training.test_training_options import trainer

options = ("batch.cross_document_attention=false", "model.distributed.tensor_parallel=2",
           "model.distributed.sequence_tensor_parallel=true")
dataset, experiments = Path(DATASET), Path(EXPERIMENTS)
whole = trainer(dataset, experiments / "whole", *options)
pieces = trainer(dataset, experiments / "pieces", *options, "schedule.micro_batch_splits=4")
masked = False
for micro_batches in itertools.islice(whole.data_loader(), 10):  # until a packed sample
    whole.engine.stages.zero_grad()
    pieces.engine.stages.zero_grad()
    documents = whole.engine.batches._attention_documents
    masked = any(documents(batch) is not None for batch in micro_batches)
    expected = whole.engine.forward_backward(micro_batches)
    got = pieces.engine.forward_backward(micro_batches)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    if masked:
        break
assert masked
for run in (whole, pieces):  # ZeRO-1 sums over the tensor ranks, if no backward pass did
    run.engine.stages.reduce_gradients()
ours_buffers, their_buffers = pieces.engine.stages.dense.buffers, whole.engine.stages.dense.buffers
for index, name in enumerate(their_buffers.names):  # this rank's slices
    ours = ours_buffers.gradients.views[index].clone()
    theirs = their_buffers.gradients.views[index].clone()
    # (The partial sums over each rank's tokens of the tensor-replicated parameters were
    # summed over the tensor ranks by the step's reduction, in its last backward pass.)
    error = torch.linalg.vector_norm(ours - theirs)
    assert error <= 1e-5 * torch.linalg.vector_norm(theirs) + 1e-7, (name, float(error))
dist.barrier()
dist.destroy_process_group()
"""


DATA_SCRIPT = """
import itertools
from pathlib import Path
import torch
import torch.distributed as dist
from tests.training.test_training_options import trainer

dataset, experiments = Path(DATASET), Path(EXPERIMENTS)
for zero in (1, 2, 3):
    # Two micro-batches a step per data rank: ZeRO-1 sums in the second one's backward pass,
    # ZeRO-2/3 in both.
    options = ("batch.cross_document_attention=false", "batch.batch_size=8",
               f"model.multi_stage.zero_stage={zero}")
    whole = trainer(dataset, experiments / f"whole{zero}", *options)
    pieces = trainer(dataset, experiments / f"pieces{zero}", *options,
                     "schedule.micro_batch_splits=4")
    assert pieces.engine.runner.whole and pieces.engine.mesh.data.size == 2
    micro_batches = next(iter(whole.data_loader()))
    assert len(micro_batches) == 2
    expected = whole.engine.forward_backward(micro_batches)
    got = pieces.engine.forward_backward(micro_batches)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    if zero == 1:  # summed in the last backward pass, overlapping it; not at the optimizer step
        assert pieces.engine.stages.dense.reducer.reduced
    for run in (whole, pieces):
        run.engine.stages.reduce_gradients()
    ours, theirs = pieces.engine.stages.dense.buffers, whole.engine.stages.dense.buffers
    for stage, shard in theirs.shards.items():  # this rank's share of the summed gradients
        mine, reference = ours.shards[stage].grad, shard.grad
        error = torch.linalg.vector_norm(mine - reference)
        assert error <= 1e-5 * torch.linalg.vector_norm(reference) + 1e-7, (zero, stage, float(error))
dist.barrier()
dist.destroy_process_group()
"""


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Script]:
    """TENSOR_SCRIPT and DATA_SCRIPT (run for the fixture `launched`, see conftest.py)."""
    scripts = {"tensor": TENSOR_SCRIPT, "data": DATA_SCRIPT}
    return {
        name: Script(
            2,
            script.replace("DATASET", repr(str(dataset))).replace(
                "EXPERIMENTS", repr(str(root / name))
            ),
        )
        for name, script in scripts.items()
    }


def test_micro_sequences_with_tensor_and_sequence_parallelism_give_the_same_gradients(
    launched: dict[str, Launched],
) -> None:
    """On two tensor ranks, whose sequence-parallel chunks of a piece are 6 tokens."""
    result = launched["tensor"].result
    assert result.returncode == 0, result.stderr


def test_micro_sequences_on_two_data_ranks_sum_the_same_gradients_with_each_zero_stage(
    launched: dict[str, Launched],
) -> None:
    """Two data ranks, two micro-batches of four pieces each: the gradients summed into each
    rank's shard equal the whole sequences' (ZeRO-1 sums them in the step's last backward pass,
    ZeRO-2/3 in each, while it runs)."""
    result = launched["data"].result
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (("schedule.micro_batch_splits=5",), "batch.sequence_length", "micro_batch_splits"),
        ((SPLITS_4, "model.multi_stage.recompute=full"), "schedule.micro_batch_splits", "full"),
    ],
    ids=["pieces-divide-the-sequence", "not-with-full-recomputation"],
)
def test_micro_sequences_config_errors_name_the_keys(
    dataset: Path, tmp_path: Path, overrides: tuple[str, ...], key: str, words: str
) -> None:
    with pytest.raises(ConfigError) as error:
        trainer(dataset, tmp_path / "bad", *overrides)
    assert error.value.path == key
    assert words in error.value.message


def reference_losses(loss: str, root: Path, one_process: Callable[..., Path]) -> tuple[str, ...]:
    """A DPO (its reference's log-probabilities in the step or precomputed) or a distillation
    run of the tiny model against its 4-step export."""
    from tests.training.test_distillation import TEACHER_RUN, distilling
    from tests.training.test_dpo import PRECOMPUTED, dpo_run, preference_dataset

    reference = one_process(*TEACHER_RUN) / "export" / "4"
    if loss == "distillation":
        return distilling(reference)
    dpo = dpo_run(preference_dataset(root), reference)
    return (*dpo, PRECOMPUTED) if loss == "dpo_precomputed" else dpo


@pytest.mark.parametrize("order", ["whole", "breadth_first"])
@pytest.mark.parametrize("loss", ["dpo", "dpo_precomputed", "distillation"])
def test_reference_models_in_pieces_give_the_whole_sequences_losses_and_gradients(
    dataset: Path, one_process: Callable[..., Path], tmp_path: Path, loss: str, order: str
) -> None:
    """The reference model runs the pieces (its own keys and values of the earlier ones),
    run whole or each piece a unit of the schedule: the teacher's hidden states of each
    piece, DPO's answers whole over the pieces (its reference's log-probabilities in the
    step, or precomputed over whole micro-batches), against the micro-batches run whole."""
    options = reference_losses(loss, tmp_path, one_process)
    staged = ("schedule.breadth_first_micro_batches=2",) if order == "breadth_first" else ()
    whole = trainer(dataset, tmp_path / "whole", *options)
    pieces = trainer(dataset, tmp_path / "pieces", *options, SPLITS_4, *staged)
    assert pieces.engine.runner.whole == (order == "whole")
    micro_batches = next(iter(whole.data_loader()))
    if loss != "distillation":  # an answer in two pieces (the pairs are about 24 tokens long)
        prepared = whole.engine.batches.prepare(micro_batches)
        spans = [m.pairs.spans.view(2, 4, -1) for m in prepared if m.pairs is not None]
        assert any(bool(torch.isin(s[:, 0][s[:, 0] >= 0], s[:, 1]).any()) for s in spans)
    expected = whole.engine.forward_backward(micro_batches)
    got = pieces.engine.forward_backward(next(iter(pieces.data_loader())))  # its own table
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    theirs, ours = whole.engine.runner.named_losses, pieces.engine.runner.named_losses
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():  # DPO's margins: differences of sums over the pieces
        assert float(ours[name]) == pytest.approx(float(value), rel=1e-5, abs=1e-5), name
    assert_same_gradients(
        pieces.engine.stages.dense.buffers.grads, whole.engine.stages.dense.buffers.grads
    )
