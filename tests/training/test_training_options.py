"""Training options that change how a step is computed but not what it computes, and the ones
that start or watch a run: recomputation, float16 loss scaling, pretrained weights, validation."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastllm.config import TrainerConfig, build, load_raw
from fastllm.data import Batch
from fastllm.training import Trainer
from fastllm.training.setup import with_pretrained_architecture
from tests.data.conftest import run_cli as in_process
from tests.model.hf_models import save_hf_model
from tests.test_cli import fastllm as run_cli
from tests.training.conftest import compiled_graphs, train_arguments


def trainer(dataset: Path, experiment: Path, *overrides: str) -> Trainer:
    arguments = train_arguments(dataset, experiment, *overrides)
    files = [arguments[arguments.index("-c") + 1]]
    overrides = [a for a in arguments[3:] if "=" in a]
    return Trainer(build(TrainerConfig, with_pretrained_architecture(load_raw(files, overrides))))


MOE = (  # experts have no biases
    "model.base_model.transformer.num_experts=4",
    "model.base_model.transformer.add_linear_biases=only_attn_qkv",
)
GATED = (
    "model.base_model.transformer.gated=true",
    "model.base_model.transformer.activation_type=silu",
)


@pytest.mark.parametrize(
    ("level", "model"),
    [
        ("elementwise", ()),
        ("elementwise", GATED),
        ("selective", ()),
        ("full", ()),
        ("elementwise", (*MOE, *GATED)),
    ],
    ids=["elementwise", "elementwise-gated", "selective", "full", "elementwise-gated-moe"],
)
def test_recomputation_gives_the_same_losses_and_gradients(
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    level: str,
    model: tuple[str, ...],
) -> None:
    if level == "elementwise":
        # The fused kernels (norm_linear, gated_linear) against the stored path: they run
        # only on Triton (here its interpreter); their references are the stored path itself.
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # One block on sequences of 16 tokens: the interpreter's cost grows with the kernels
    # launched and their rows.
    options = ("training.train_iters=2", "batch.micro_batch_size=1", "batch.sequence_length=16")
    options += ("model.base_model.transformer.num_layers=1", *model)
    plain = trainer(dataset, tmp_path / "a", *options, "model.multi_stage.recompute=none")
    recomputed = trainer(dataset, tmp_path / "b", *options, f"model.multi_stage.recompute={level}")
    # The norms' biases start at zero, where a recomputation that dropped them would pass.
    generator = torch.Generator().manual_seed(0)
    for name, parameter in plain.engine.model.named_parameters():
        if "norm" in name and name.endswith("bias"):
            values = torch.randn(parameter.shape, generator=generator)
            for run in (plain, recomputed):
                run.engine.model.get_parameter(name).data.copy_(values)
    (batch,) = next(iter(plain.data_loader()))[:1]
    loss_plain = plain.engine.forward_backward([batch])
    loss_recomputed = recomputed.engine.forward_backward([batch])
    assert loss_recomputed.item() == pytest.approx(loss_plain.item(), rel=1e-6)
    for ours, theirs in zip(
        recomputed.engine.stages.dense.buffers.grads,
        plain.engine.stages.dense.buffers.grads,
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_float16_scales_the_loss_and_backs_off_on_overflow(dataset: Path, tmp_path: Path) -> None:
    run = trainer(
        dataset,
        tmp_path / "fp16",
        "training.train_iters=3",
        "model.distributed.training_dtype=float16",
    )
    assert run.engine.scaler.enabled and run.engine.scaler.scale == 2.0**16
    steps = iter(run.data_loader())
    metrics = run.engine.train_step(next(steps))
    assert not metrics["skipped"] and run.engine.scaler.scale == 2.0**16
    run.engine.scaler.scale = 2.0**120  # far beyond float16's range: the gradient overflows
    metrics = run.engine.train_step(next(steps))
    assert metrics["skipped"] and run.engine.state.skipped_steps == 1
    assert run.engine.scaler.scale == 2.0**119


def test_pretrained_hugging_face_weights_initialize_the_run(dataset: Path, tmp_path: Path) -> None:
    model = save_hf_model("starcoder2", tmp_path / "hf", vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, sliding_window=32)  # fmt: skip
    run = trainer(
        dataset, tmp_path / "run", "training.train_iters=1",
        "pretrained.format=starcoder2", f"pretrained.path={tmp_path / 'hf'}",
    )  # fmt: skip
    ids = torch.randint(0, 512, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(run.engine.model(ids), model(ids).logits, rtol=1e-5, atol=1e-5)


def test_architecture_comes_from_the_checkpoint_when_the_config_sets_none(tmp_path: Path) -> None:
    save_hf_model("qwen2", tmp_path / "hf")
    raw = with_pretrained_architecture(
        {"pretrained": {"format": "qwen2", "path": str(tmp_path / "hf")}}
    )
    config = build(TrainerConfig, raw)
    assert config.model.base_model.transformer.add_linear_biases == "only_attn_qkv"
    assert config.model.base_model.vocab_size == 97


def test_validation_loss_is_logged_at_its_interval(dataset: Path, tmp_path: Path) -> None:
    experiment = tmp_path / "run"
    arguments = train_arguments(
        dataset, experiment, "training.train_iters=4", "training.validation.interval=2",
        "training.validation.iterations=2", f"data.validation_path=[{dataset}]",
    )  # fmt: skip
    result = in_process(*arguments)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    validated = {
        r["step"]: r["validation_loss"] for r in records if r.get("validation_loss") is not None
    }
    assert sorted(validated) == [2, 4]
    assert all(0 < loss < 10 for loss in validated.values())


def test_metrics_also_go_to_tensorboard_and_offline_wandb(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    experiment = tmp_path / "run"
    arguments = train_arguments(
        dataset, experiment, "training.train_iters=2",
        "training.logs.tensorboard=true", "training.logs.wandb_project=fastllm-test",
    )  # fmt: skip
    result = run_cli(*arguments)
    assert result.returncode == 0, result.stderr
    assert list((experiment / "tensorboard").glob("events.out.tfevents.*"))
    offline_runs = list((experiment / "wandb").glob("offline-run-*"))
    assert offline_runs and list(offline_runs[0].glob("*.wandb"))


def test_attention_keeps_within_documents_only_when_asked_and_when_it_matters(
    dataset: Path, tmp_path: Path
) -> None:
    crossing = trainer(dataset, tmp_path / "a")
    within = trainer(dataset, tmp_path / "b", "batch.cross_document_attention=false")
    mixed = next(
        b
        for step in within.data_loader()
        for b in step
        if any(len(row.unique()) > 1 for row in b.document_ids)
    )
    assert crossing.engine.batches._attention_documents(mixed) is None
    assert torch.equal(within.engine.batches._attention_documents(mixed), mixed.document_ids)
    single = Batch(mixed.input_ids, mixed.labels, torch.zeros_like(mixed.document_ids))
    assert (
        within.engine.batches._attention_documents(single) is None
    )  # plain causal attention is the same
    # The two settings really compute different things on packed samples.
    assert (
        crossing.engine.forward_backward([mixed]).item()
        != within.engine.forward_backward([mixed]).item()
    )


@pytest.mark.parametrize(
    "variant",
    [
        ("model.multi_stage.recompute=none",),
        ("model.multi_stage.recompute=full",),
        MOE,
    ],
    ids=["plain", "recompute", "moe"],
)
def test_compiled_blocks_give_the_same_losses_and_gradients(
    dataset: Path, tmp_path: Path, variant: tuple[str, ...]
) -> None:
    options = ("training.train_iters=2", *variant)
    eager = trainer(dataset, tmp_path / "a", *options)
    compiled = trainer(dataset, tmp_path / "b", *options, "training.compile=true")

    def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-5)

    assert_compiled_steps_match(compiled, eager, 1e-5, close)


def assert_compiled_steps_match(
    compiled: Trainer,
    eager: Trainer,
    loss_rel: float,
    assert_grads_close: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Two steps of both, micro-batch by micro-batch: each loss within `loss_rel`, then each
    gradient buffer by `assert_grads_close`; graphs were compiled (`compiled_graphs`)."""
    with compiled_graphs() as compiled_since:
        for micro_batches in itertools.islice(eager.data_loader(), 2):
            for batch in micro_batches:
                ours, theirs = (
                    compiled.engine.forward_backward([batch]),
                    eager.engine.forward_backward([batch]),
                )
                assert ours.item() == pytest.approx(theirs.item(), rel=loss_rel)
            for ours, theirs in zip(
                compiled.engine.stages.dense.buffers.grads,
                eager.engine.stages.dense.buffers.grads,
                strict=True,
            ):
                assert_grads_close(ours, theirs)
            compiled.engine.optimizer_step()
            eager.engine.optimizer_step()
        assert compiled_since() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("cross_document_attention", ["true", "false"])
def test_compiled_blocks_match_eager_on_gpu(
    dataset: Path, tmp_path: Path, cross_document_attention: str
) -> None:
    """On CUDA the eager blocks run the Triton kernels and the compiled ones inductor's fusion
    of the references (and cuDNN SDPA or flex_attention inside the graph)."""
    options = (
        "training.train_iters=2",
        "model.distributed.training_dtype=bfloat16",
        f"batch.cross_document_attention={cross_document_attention}",
    )
    eager = trainer(dataset, tmp_path / "a", *options)
    compiled = trainer(dataset, tmp_path / "b", *options, "training.compile=true")
    assert eager.distributed.device.type == "cuda"

    def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        assert torch.linalg.vector_norm(ours - theirs) <= 0.05 * torch.linalg.vector_norm(theirs)

    assert_compiled_steps_match(compiled, eager, 2e-2, close)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_storing_elementwise_activations_matches_recomputing_them_and_costs_memory_on_gpu(
    dataset: Path, tmp_path: Path
) -> None:
    """On CUDA the recomputing path is the fused Triton kernels (norm_linear, gated_linear),
    the storing one the plain norm, activation and linear ops."""
    peaks, runs = {}, {}
    for level in ("none", "elementwise"):
        run = trainer(
            dataset,
            tmp_path / level,
            "training.train_iters=2",
            f"model.multi_stage.recompute={level}",
        )
        (batch,) = next(iter(run.data_loader()))[:1]
        # A first pass makes what a path allocates once (kernel workspaces), whichever test
        # ran before in this process: the measured pass holds its activations only.
        run.engine.forward_backward([batch])
        run.engine.stages.zero_grad()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run.engine.forward_backward([batch])
        peaks[level], runs[level] = torch.cuda.max_memory_allocated() - before, run
    for ours, theirs in zip(
        runs["none"].engine.stages.dense.buffers.grads,
        runs["elementwise"].engine.stages.dense.buffers.grads,
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert peaks["none"] > peaks["elementwise"]
