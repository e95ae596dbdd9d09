"""Tensor parallelism under torchrun (Gloo, fp32) against the single-process run of the same
global batch: losses and final weights within 1e-5 relative over 10 steps, alone, with
sequence parallelism and with data parallelism at every ZeRO stage, and checkpoints that move
between tensor sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastllm.checkpoint.distributed import STATE_KINDS, SavedCheckpoint
from fastllm.engine.flat_model import FlatModel
from fastllm.engine.mesh import Dimension, ParallelMesh
from fastllm.engine.tensor_parallel import TensorParallel
from fastllm.model import GPTModel
from fastllm.training.state import sharded_state
from tests.test_cli import fastllm as run_cli
from tests.torchrun import torchrun
from tests.training.conftest import train_arguments
from tests.training.test_data_parallel import final_weights
from tests.training.test_train_cli import losses

STEPS = 10
COMMON = (
    "training.train_iters=10",
    "training.export.interval=10",
    "training.export.format=distributed",
    "training.checkpoint.interval=5",
    "batch.batch_size=8",
    "model.multi_stage.debug_tensor_parallel=true",
)
LLAMA = (  # RMSNorm, gated MLP, no biases, four key/value heads, untied
    "model.base_model.transformer.normalization.type=rms_norm",
    "model.base_model.transformer.gated=true",
    "model.base_model.transformer.activation_type=silu",
    "model.base_model.transformer.add_linear_biases=false",
    "model.base_model.transformer.head_groups=4",
    "model.base_model.tie_word_embeddings=false",
)
TENSOR_2 = ("model.distributed.tensor_parallel=2",)
SEQUENCE = ("model.distributed.sequence_tensor_parallel=true",)


@pytest.fixture(scope="module")
def references(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Single-process runs of the StarCoder2-style tiny model (LayerNorm, biases, tied head)
    and of a Llama-style one."""
    root = tmp_path_factory.mktemp("references")
    runs = {}
    with pytest.MonkeyPatch.context() as patch:  # set up before the autouse fixture runs
        patch.delenv("TRITON_INTERPRET", raising=False)
        for name, overrides in (("starcoder2", ()), ("llama", LLAMA)):
            runs[name] = root / name
            result = run_cli(*train_arguments(dataset, runs[name], *COMMON, *overrides))
            assert result.returncode == 0, result.stderr
    return runs


def assert_same_run(reference: Path, run: Path, first_step: int = 1, weights: bool = True) -> None:
    expected, got = losses(reference), losses(run)
    assert sorted(got) == list(range(first_step, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    if weights:
        assert_close_weights(final_weights(run, STEPS), final_weights(reference, STEPS))


def assert_close_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Per tensor, 1e-5 relative with a floor of 1e-6 per element (root mean square): split
    matmuls round differently, and Adam amplifies that where gradients are near zero (the key
    biases: softmax ignores what they add to every score of a query but for rotary's turn). A
    missing or wrong reduction is off by orders of magnitude more."""
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        error = torch.linalg.vector_norm(ours[name] - tensor)
        bound = 1e-5 * torch.linalg.vector_norm(tensor) + 1e-6 * tensor.numel() ** 0.5
        assert error <= bound, (name, float(error), float(bound))


@pytest.mark.parametrize(
    ("model", "overrides"),
    [
        # Tied head, LayerNorm, biases of row-parallel layers, as many key/value heads as
        # tensor ranks (grouped-query attention).
        ("starcoder2", SEQUENCE),
        # Untied head, gated MLP; blocks recomputed whole (their collectives run again in the
        # backward pass).
        ("llama", ("model.multi_stage.recompute=full",)),
    ],
    ids=["starcoder2-gqa-sequence-parallel", "llama-untied-full-recompute"],
)
def test_two_tensor_ranks_match_one_process(
    dataset: Path, tmp_path: Path, references: dict[str, Path], model: str, overrides: tuple
) -> None:
    run = tmp_path / "tp2"
    model_overrides = LLAMA if model == "llama" else ()
    arguments = train_arguments(dataset, run, *COMMON, *model_overrides, *TENSOR_2, *overrides)
    result = torchrun(2, *arguments)
    assert result.returncode == 0, result.stderr
    assert "tensor parallel 2" in result.stdout
    assert_same_run(references[model], run)
    manifest = json.loads((run / "export" / "10" / "manifest.json").read_text())
    assert (manifest["tensor_parallel"], manifest["data_parallel"]) == (2, 1)
    # `fastllm convert` merges the slices into a Hugging Face checkpoint (Mistral's format for
    # the Llama-style model: the tests' models use sliding windows).
    converted, architecture = {}, {"starcoder2": "starcoder2", "llama": "mistral"}[model]
    for name, experiment in (("ours", run), ("theirs", references[model])):
        converted[name] = tmp_path / f"hf_{name}"
        result = run_cli(
            "convert", "input.format=distributed", f"input.path={experiment / 'export' / '10'}",
            f"output.format={architecture}", f"output.path={converted[name]}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    ours, theirs = (load_file(converted[n] / "model.safetensors") for n in ("ours", "theirs"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape, name
    if model == "llama":  # its key/value heads split four ways too
        assert_restores_exactly_on_four_tensor_ranks(run / "checkpoint" / "5")


def assert_restores_exactly_on_four_tensor_ranks(checkpoint: Path) -> None:
    """A tensor-parallel-2 checkpoint restored into the four ranks of tensor_parallel 4 (in
    this process: restoring needs no communication) holds slices that merge back into the
    saved tensors exactly, moments included."""
    saved = SavedCheckpoint(checkpoint)
    slices: dict[tuple[str, str], list[torch.Tensor]] = {}
    metas = {}
    for rank in range(4):
        alone = Dimension(1, 0, None)
        mesh = ParallelMesh(4, rank, Dimension(4, rank, None), alone, alone, False)
        with torch.device("meta"):
            model = GPTModel(saved.model_config(), TensorParallel(4, rank))
        flat = FlatModel(model, compute_dtype=torch.float32, device=torch.device("cpu"), mesh=mesh)
        state = sharded_state(flat, STATE_KINDS)
        saved.restore(state, STATE_KINDS)
        layout = state.layout()
        for index, name in enumerate(flat.names):
            stage, offset, numel = layout.parameter(index)
            for kind in STATE_KINDS:
                piece = state.shards[stage][kind][offset : offset + numel].view(flat.shapes[name])
                slices.setdefault((name, kind), []).append(piece.clone())
        metas = flat.metas
    for (name, kind), pieces in slices.items():
        split = metas[name].tensor_split
        if split is None:
            assert all(torch.equal(piece, pieces[0]) for piece in pieces), (name, kind)
        whole = pieces[0] if split is None else split.merge(pieces)
        assert torch.equal(whole, saved.whole(name, kind)), (name, kind)


@pytest.mark.parametrize(
    ("zero_stage", "overrides"),
    [(1, SEQUENCE), (2, ("training.export.format=starcoder2",)), (3, SEQUENCE)],
    ids=["zero1-sequence-parallel", "zero2-hf-export", "zero3-sequence-parallel"],
)
def test_tensor_and_data_parallel_match_one_process_and_resume_elsewhere(
    dataset: Path, tmp_path: Path, references: dict[str, Path], zero_stage: int, overrides: tuple
) -> None:
    run = tmp_path / "tp2xdp2"
    zero = f"model.multi_stage.zero_stage={zero_stage}"
    result = torchrun(4, *train_arguments(dataset, run, *COMMON, *TENSOR_2, zero, *overrides))
    assert result.returncode == 0, result.stderr
    hf_export = zero_stage == 2  # gathered whole from the tensor slices by the run itself
    assert_same_run(references["starcoder2"], run, weights=not hf_export)
    if hf_export:
        converted = tmp_path / "reference_hf"
        result = run_cli(
            "convert", "input.format=distributed", "output.format=starcoder2",
            f"input.path={references['starcoder2'] / 'export' / '10'}", f"output.path={converted}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        ours, theirs = (
            load_file(d / "model.safetensors") for d in (run / "export" / "10", converted)
        )
        assert_close_weights(ours, theirs)
    if zero_stage != 3:
        return
    # Its step-5 checkpoint resumes on two data ranks without tensor parallelism and on one
    # process, raising train_iters from 5 to 10, with the uninterrupted run's losses.
    for ranks in (2, 1):
        resumed = tmp_path / f"resumed_on_{ranks}"
        (resumed / "checkpoint").mkdir(parents=True)
        shutil.copytree(run / "checkpoint" / "5", resumed / "checkpoint" / "5")
        arguments = train_arguments(dataset, resumed, *COMMON)
        result = torchrun(2, *arguments) if ranks == 2 else run_cli(*arguments)
        assert result.returncode == 0, result.stderr
        assert "resumed from" in result.stdout
        assert_same_run(references["starcoder2"], resumed, first_step=6)


def test_a_checkpoint_of_one_process_resumes_on_two_tensor_ranks(
    dataset: Path, tmp_path: Path, references: dict[str, Path]
) -> None:
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(references["llama"] / "checkpoint" / "5", resumed / "checkpoint" / "5")
    result = torchrun(2, *train_arguments(dataset, resumed, *COMMON, *LLAMA, *TENSOR_2))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    assert_same_run(references["llama"], resumed, first_step=6)


MOE_STEPS = 4
MOE = (  # Qwen2-MoE-style: routed experts (each gets every token: rounding cannot flip a
    # choice), a gated shared expert, z-loss; 4 steps, exported whole at the last
    "model.base_model.transformer.normalization.type=rms_norm",
    "model.base_model.transformer.gated=true",
    "model.base_model.transformer.activation_type=silu",
    "model.base_model.transformer.add_linear_biases=only_attn_qkv",
    "model.base_model.transformer.num_experts=4",
    "model.base_model.transformer.num_experts_per_token=4",
    "model.base_model.transformer.num_shared_experts=1",
    "model.base_model.transformer.shared_expert_gate=true",
    "model.base_model.transformer.expert_z_loss_coefficient=0.01",
    f"training.train_iters={MOE_STEPS}",
    f"training.export.interval={MOE_STEPS}",
    "training.export.format=distributed",
    "batch.batch_size=8",
    "model.multi_stage.debug_tensor_parallel=true",
)


def metric(experiment: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


@pytest.fixture(scope="module")
def moe_reference(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run of the mixture of experts (dropless)."""
    run = tmp_path_factory.mktemp("moe_reference") / "one"
    with pytest.MonkeyPatch.context() as patch:  # set up before the autouse fixture runs
        patch.delenv("TRITON_INTERPRET", raising=False)
        result = run_cli(*train_arguments(dataset, run, *MOE))
    assert result.returncode == 0, result.stderr
    return run


@pytest.mark.parametrize(
    "overrides",
    [SEQUENCE, ("model.base_model.transformer.dropless_moe=false",)],
    ids=["dropless-sequence-parallel", "looped"],
)
def test_mixture_of_experts_on_two_tensor_ranks_matches_one_process(
    dataset: Path, tmp_path: Path, moe_reference: Path, overrides: tuple
) -> None:
    """Each expert's ffn and the shared expert's split over the ranks, the router replicated:
    losses (router losses counted once), expert loads and weights, against the dropless run
    of one process (the looped path computes the same up to rounding); with sequence
    parallelism also the Qwen2-MoE export."""
    runs = {"one": moe_reference, "tp2": tmp_path / "tp2"}
    result = torchrun(2, *train_arguments(dataset, runs["tp2"], *MOE, *overrides, *TENSOR_2))
    assert result.returncode == 0, result.stderr
    for key in ("loss", "expert_tokens_max", "expert_tokens_mean"):
        expected, got = metric(runs["one"], key), metric(runs["tp2"], key)
        assert sorted(got) == list(range(1, MOE_STEPS + 1)), key
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-5), (key, step)
    weights = {name: final_weights(run, MOE_STEPS) for name, run in runs.items()}
    assert_close_weights(weights["tp2"], weights["one"])
    if overrides != SEQUENCE:
        return
    converted = {}
    for name, experiment in runs.items():
        converted[name] = tmp_path / f"hf_{name}"
        result = run_cli(
            "convert", "input.format=distributed", f"input.path={experiment / 'export' / str(MOE_STEPS)}",
            "output.format=qwen2_moe", f"output.path={converted[name]}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    ours, theirs = (load_file(converted[n] / "model.safetensors") for n in ("tp2", "one"))
    assert_close_weights(ours, theirs)
