"""Tensor parallelism under torchrun (Gloo, fp32) against the single-process run of the same
global batch: losses and final weights within 1e-5 relative over 10 steps, alone, with
sequence parallelism and with data parallelism at every ZeRO stage, and checkpoints that move
between tensor sizes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastllm.checkpoint.distributed import STATE_KINDS, SavedCheckpoint
from fastllm.engine.checkpointing import sharded_state
from fastllm.engine.model_stages import ModelStages
from fastllm.model import GPTModel
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.tensor import TensorDimension
from tests.data.conftest import run_cli
from tests.training.conftest import Launched, Layout, train_arguments
from tests.training.test_data_parallel import final_weights
from tests.training.test_train_cli import assert_two_ranks_match_one_process, losses

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
QK_NORMS = (
    "model.base_model.transformer.query_norm={type: rms_norm, epsilon: 1.0e-5}",
    "model.base_model.transformer.key_norm={type: rms_norm, epsilon: 1.0e-5}",
)
QWEN3 = (*LLAMA, *QK_NORMS)  # QK-norm over each head
OLMO2 = (  # norms after attention and the MLP, QK-norm over all heads, no sliding window
    *LLAMA,
    *QK_NORMS,
    "model.base_model.transformer.query_key_norm_scope=projection",
    "model.base_model.transformer.normalization_placement=post",
    "model.base_model.transformer.window_size=null",
    "model.base_model.transformer.head_groups=2",
)

ZERO_CENTERED = "{type: rms_norm, epsilon: 1.0e-6, zero_centered: true}"
GEMMA3 = (  # tested under pipeline, tensor and sequence-data parallelism in their modules
    *(f"model.base_model.transformer.{norm}={ZERO_CENTERED}" for norm in ("normalization", "query_norm", "key_norm")),
    "model.base_model.transformer.normalization_placement=sandwich",
    "model.base_model.transformer.gated=true",
    "model.base_model.transformer.activation_type=gelu",
    "model.base_model.transformer.add_linear_biases=false",
    "model.base_model.transformer.head_groups=2",
    "model.base_model.transformer.window_size=16",
    "model.base_model.transformer.global_attention_interval=2",
    "model.base_model.transformer.rotary={type: linear, theta: 1000000, scale_factor: 8}",
    "model.base_model.transformer.window_rotary={type: default, theta: 10000}",
    "model.base_model.transformer.attention_scale=0.2",
    "model.base_model.transformer.scale_embeddings=true",
)  # fmt: skip
"""Gemma 3-style: zero-centered norms around attention and the MLP and over each query and
key head, a global block after each sliding one (window 16 of 48 tokens), each kind with its
own rotary, an attention scale of its own, scaled embeddings."""


MODELS = {"starcoder2": (), "llama": LLAMA, "qwen3": QWEN3, "olmo2": OLMO2}


@pytest.fixture(scope="module")
def references(one_process: Callable[..., Path]) -> dict[str, Path]:
    """Single-process runs of the StarCoder2-style tiny model (LayerNorm, biases, tied head)
    and of a Llama-style one."""
    return {name: one_process(*COMMON, *overrides) for name, overrides in MODELS.items()}


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    """The layouts of this module (trained for the fixture `launched`, see conftest.py)."""
    llama_reference = one_process(*COMMON, *MODELS["llama"])
    starcoder2, llama = (*COMMON, *MODELS["starcoder2"]), (*COMMON, *MODELS["llama"])
    qwen3, olmo2 = (*COMMON, *MODELS["qwen3"]), (*COMMON, *MODELS["olmo2"])
    zero = "model.multi_stage.zero_stage="
    return {
        "tp2xdp2-zero1": Layout(4, (*starcoder2, *TENSOR_2, f"{zero}1", *SEQUENCE)),
        "tp2xdp2-zero2": Layout(
            4, (*starcoder2, *TENSOR_2, f"{zero}2", "training.export.format=starcoder2")
        ),
        "tp2xdp2-zero3": Layout(4, (*starcoder2, *TENSOR_2, f"{zero}3", *SEQUENCE)),
        "tp2-starcoder2": Layout(2, (*starcoder2, *TENSOR_2, *SEQUENCE)),
        "tp2-llama": Layout(2, (*llama, *TENSOR_2, "model.multi_stage.recompute=full")),
        "tp2-qwen3": Layout(2, (*qwen3, *TENSOR_2)),
        "tp2xdp2-zero3-olmo2": Layout(4, (*olmo2, *TENSOR_2, f"{zero}3")),
        # Step-5 checkpoints resumed in another layout, raising train_iters from 5 to 10.
        "tp2xdp2-zero3-resumed-on-dp2": Layout(
            2, starcoder2, root / "tp2xdp2-zero3" / "checkpoint" / "5"
        ),
        "one-process-resumed-on-tp2": Layout(
            2, (*llama, *TENSOR_2), llama_reference / "checkpoint" / "5"
        ),
        "tp2-moe-dropless-sequence-parallel": Layout(2, (*MOE, *SEQUENCE, *TENSOR_2)),
        "tp2-moe-looped": Layout(
            2, (*MOE, "model.base_model.transformer.dropless_moe=false", *TENSOR_2)
        ),
    }


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
    "model",
    [
        # Tied head, LayerNorm, biases of row-parallel layers, as many key/value heads as
        # tensor ranks (grouped-query attention), sequence parallelism.
        "starcoder2",
        # Untied head, gated MLP; blocks recomputed whole (their collectives run again in the
        # backward pass).
        "llama",
    ],
    ids=["starcoder2-gqa-sequence-parallel", "llama-untied-full-recompute"],
)
def test_two_tensor_ranks_match_one_process(
    tmp_path: Path, references: dict[str, Path], launched: dict[str, Launched], model: str
) -> None:
    run = launched[f"tp2-{model}"].succeeded()
    assert "tensor parallel 2" in launched[f"tp2-{model}"].result.stdout
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


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        # Each rank normalizes its heads with the replicated weight (gradients summed over
        # the ranks); sequence parallelism.
        ("qwen3", "tp2-qwen3"),
        # The queries' and keys' norms over all heads, each rank holding its heads' slice of
        # the weight and summing their squares with the other's; the blocks' post-norms,
        # replicated (gradients not summed); data parallelism with ZeRO-3.
        ("olmo2", "tp2xdp2-zero3-olmo2"),
    ],
    ids=["qwen3-sequence-parallel", "olmo2-zero3"],
)
def test_query_key_and_post_norms_on_tensor_ranks_match_one_process(
    tmp_path: Path,
    references: dict[str, Path],
    launched: dict[str, Launched],
    model: str,
    layout: str,
) -> None:
    run = launched[layout].succeeded()
    assert_same_run(references[model], run)
    # Adam hides a gradient summed once too often (as a replicated norm's would be) from the
    # weights; not from the gradient norm.
    expected, got = metric(references[model], "grad_norm"), metric(run, "grad_norm")
    assert got == pytest.approx(expected, rel=1e-5)
    converted = {}
    for name, experiment in (("ours", run), ("theirs", references[model])):
        converted[name] = tmp_path / f"hf_{name}"
        result = run_cli(
            "convert", "input.format=distributed", f"input.path={experiment / 'export' / '10'}",
            f"output.format={model}", f"output.path={converted[name]}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    ours, theirs = (load_file(converted[n] / "model.safetensors") for n in ("ours", "theirs"))
    assert_close_weights(ours, theirs)


def assert_restores_exactly_on_four_tensor_ranks(checkpoint: Path) -> None:
    """A tensor-parallel-2 checkpoint restored into the four ranks of tensor_parallel 4 (in
    this process: restoring needs no communication) holds slices that merge back into the
    saved tensors exactly, moments included."""
    saved = SavedCheckpoint(checkpoint)
    slices: dict[tuple[str, str], list[torch.Tensor]] = {}
    metas = {}
    for rank in range(4):
        mesh = ParallelMesh(4, rank, TensorDimension(4, rank), Dimension(), Dimension())
        with torch.device("meta"):
            model = GPTModel(saved.model_config(), mesh)
        cpu = torch.device("cpu")
        stages = ModelStages(model, compute_dtype=torch.float32, device=cpu, mesh=mesh)
        state = sharded_state(stages, STATE_KINDS)
        buffers = stages.dense.buffers
        saved.restore(state, STATE_KINDS)
        layout = state.layout()
        for index, name in enumerate(buffers.names):
            stage, offset, numel = layout.parameter(index)
            for kind in STATE_KINDS:
                piece = state.shards[stage][kind][offset : offset + numel].view(
                    buffers.shapes[name]
                )
                slices.setdefault((name, kind), []).append(piece.clone())
        metas = buffers.metas
    for (name, kind), pieces in slices.items():
        split = metas[name].tensor_split
        if split is None:
            assert all(torch.equal(piece, pieces[0]) for piece in pieces), (name, kind)
        whole = pieces[0] if split is None else split.merge(pieces)
        assert torch.equal(whole, saved.whole(name, kind)), (name, kind)


@pytest.mark.parametrize(
    "zero_stage",
    [1, 2, 3],
    ids=["zero1-sequence-parallel", "zero2-hf-export", "zero3-sequence-parallel"],
)
def test_tensor_and_data_parallel_match_one_process_and_resume_elsewhere(
    dataset: Path,
    tmp_path: Path,
    references: dict[str, Path],
    launched: dict[str, Launched],
    zero_stage: int,
) -> None:
    run = launched[f"tp2xdp2-zero{zero_stage}"].succeeded()
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
    on_one = tmp_path / "resumed_on_1"
    shutil.copytree(run / "checkpoint" / "5", on_one / "checkpoint" / "5")
    result = run_cli(*train_arguments(dataset, on_one, *COMMON))
    assert result.returncode == 0, result.stderr
    for resumed in (launched["tp2xdp2-zero3-resumed-on-dp2"].result, result):
        assert "resumed from" in resumed.stdout
    assert_same_run(references["starcoder2"], on_one, first_step=6)
    on_two = launched["tp2xdp2-zero3-resumed-on-dp2"].succeeded()
    assert_same_run(references["starcoder2"], on_two, first_step=6)


def test_a_checkpoint_of_one_process_resumes_on_two_tensor_ranks(
    references: dict[str, Path], launched: dict[str, Launched]
) -> None:
    resumed = launched["one-process-resumed-on-tp2"]
    assert "resumed from" in resumed.result.stdout
    assert_same_run(references["llama"], resumed.succeeded(), first_step=6)


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
def moe_reference(one_process: Callable[..., Path]) -> Path:
    """The single-process run of the mixture of experts (dropless)."""
    return one_process(*MOE)


@pytest.mark.parametrize("path", ["dropless-sequence-parallel", "looped"])
def test_mixture_of_experts_on_two_tensor_ranks_matches_one_process(
    tmp_path: Path, moe_reference: Path, launched: dict[str, Launched], path: str
) -> None:
    """Each expert's ffn and the shared expert's split over the ranks, the router replicated:
    losses (router losses counted once), expert loads and weights, against the dropless run
    of one process (the looped path computes the same up to rounding); with sequence
    parallelism also the Qwen2-MoE export."""
    runs = {"one": moe_reference, "tp2": launched[f"tp2-moe-{path}"].succeeded()}
    for key in ("loss", "expert_tokens_max", "expert_tokens_mean"):
        expected, got = metric(runs["one"], key), metric(runs["tp2"], key)
        assert sorted(got) == list(range(1, MOE_STEPS + 1)), key
        for step in got:
            assert got[step] == pytest.approx(expected[step], rel=1e-5), (key, step)
    weights = {name: final_weights(run, MOE_STEPS) for name, run in runs.items()}
    assert_close_weights(weights["tp2"], weights["one"])
    if path != "dropless-sequence-parallel":
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


def test_zero2_on_one_data_rank_with_accumulation_reduces_the_tensor_sums_once_per_step(
    dataset: Path, tmp_path: Path
) -> None:
    """Two tensor ranks and one data rank under ZeRO-2 keep ZeRO-1's one reduction per step
    (the replicated parameters' tensor sums) over accumulated micro-batches (a reduction armed
    by each micro-batch failed the second)."""
    overrides = ("model.multi_stage.zero_stage=2", "batch.batch_size=8", "batch.micro_batch_size=2")
    layout = ("model.distributed.tensor_parallel=2",)
    assert_two_ranks_match_one_process(dataset, tmp_path, overrides, layout)
