"""Sequence-data parallelism under torchrun (Gloo, fp32) against the single-process run of the
same global batch, with and without document-masked attention: alone, with more data ranks
than one group, and with tensor and sequence-tensor parallelism, in contiguous and head-tail
chunks, and OLMo 2- and Gemma 3-style models; losses and final weights within 1e-5 relative
over 6 steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fastllm.config import ConfigError, TrainerConfig, load_config
from fastllm.training.setup import check_inputs
from tests.conftest import ROOT
from tests.training.conftest import Launched, Layout
from tests.training.test_data_parallel import final_weights
from tests.training.test_tensor_parallel import GEMMA3, OLMO2, assert_close_weights
from tests.training.test_train_cli import losses

STEPS = 6
COMMON = (
    f"training.train_iters={STEPS}",
    f"training.export.interval={STEPS}",
    "training.export.format=distributed",
    "batch.batch_size=8",
)
DOCUMENTS = ("batch.cross_document_attention=false",)
SDP_2 = ("model.distributed.sequence_data_parallel=2",)
TP_2 = ("model.distributed.tensor_parallel=2", "model.distributed.sequence_tensor_parallel=true")
HEAD_TAIL = ("model.distributed.sequence_data_chunking=head_tail",)


@pytest.fixture(scope="module")
def references(one_process: Callable[..., Path]) -> dict[str, Path]:
    """Single-process runs of the tiny StarCoder2-style model (biases on the q/k/v
    projection, grouped-query attention, a sliding window), attention across and within
    documents."""
    runs = {name: one_process(*COMMON, *overrides) for name, overrides in REFERENCES.items()}
    # The samples do hold several documents: masking them changes the run.
    assert losses(runs["across"]) != losses(runs["within"])
    return runs


# OLMo 2-style: QK-norm over all heads (the keys normalized before they are gathered), norms
# after attention and the MLP.
# Gemma 3-style: sliding and global blocks, each chunk's queries windowed over the gathered
# keys within their documents, with their own scale.
REFERENCES = {
    "across": (),
    "within": DOCUMENTS,
    "olmo2": OLMO2,
    "gemma3": (*GEMMA3, *DOCUMENTS),
}
# name: (ranks, reference, layout)
LAYOUTS = {
    "dp4-sdp2-zero2": (4, "across", ("model.multi_stage.zero_stage=2",)),  # two groups of two
    "sdp2-documents": (2, "within", ()),
    "sdp2-head-tail": (2, "across", HEAD_TAIL),
    "tp2-sdp2-head-tail-documents": (4, "within", (*TP_2, *HEAD_TAIL)),
    "tp2-sdp2-zero3": (4, "across", (*TP_2, "model.multi_stage.zero_stage=3")),
    "tp2-sdp2-olmo2": (4, "olmo2", TP_2),
    "sdp2-gemma3-documents": (2, "gemma3", ()),
}


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """The layouts of LAYOUTS (trained for the fixture `launched`, see conftest.py)."""
    return {
        name: Layout(ranks, (*COMMON, *SDP_2, *REFERENCES[reference], *layout))
        for name, (ranks, reference, layout) in LAYOUTS.items()
    }


@pytest.mark.parametrize("name", LAYOUTS)
def test_sequence_data_parallel_matches_one_process(
    references: dict[str, Path], launched: dict[str, Launched], name: str
) -> None:
    assert "sequence-data parallel 2" in launched[name].result.stdout
    run, reference = launched[name].succeeded(), references[LAYOUTS[name][1]]
    expected, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    assert_close_weights(final_weights(run, STEPS), final_weights(reference, STEPS))


@pytest.mark.parametrize(
    ("world_size", "overrides", "key"),
    [
        (1, ("model.distributed.sequence_data_parallel=5",), "batch.sequence_length"),
        (4, (*SDP_2, *TP_2, "batch.sequence_length=50"), "batch.sequence_length"),
        (1, ("model.distributed.sequence_data_parallel=4",), "sequence_data_parallel"),
        (4, (*SDP_2, "batch.batch_size=3"), "batch.batch_size"),
        (2, (*SDP_2, *HEAD_TAIL, "batch.sequence_length=50"), "batch.sequence_length"),
    ],
    ids=[
        "length-by-sdp",
        "length-by-sdp-and-tensor",
        "sdp-by-data",
        "batch-by-groups",
        "length-by-head-tail-chunks",
    ],
)
def test_sequence_data_parallel_config_errors_name_the_keys(
    dataset: Path, monkeypatch: pytest.MonkeyPatch, world_size: int, overrides: tuple, key: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    arguments = [f"data.path=[{dataset}]", "run.experiment_dir=/tmp/unused", *overrides]
    with pytest.raises(ConfigError) as error:
        check_inputs(load_config(TrainerConfig, [ROOT / "examples" / "tiny.yaml"], arguments))
    assert error.value.path.endswith(key), error.value
