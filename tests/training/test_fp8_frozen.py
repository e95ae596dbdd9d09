"""Frozen weights (`model.freeze`, LoRA's base with `freeze_others`) in FP8 linear layers: they
compute in FP8 as trained ones do, but no weight gradient is computed for them, each is
quantized once for the run and stays bit for bit; the runs train close to bf16, resume bit
for bit, and ZeRO-3 (their FP8 image gathered) matches one process."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fastllm.model.parameters import parameter_metas
from fastllm_kernels.fp8 import gated_mlp, linear, weight
from fastllm_kernels.fp8.amax_history import WEIGHT
from tests.training.conftest import Launched, Layout, Script
from tests.training.test_fp8_training import BF16, RECIPES, resumed_after_two_steps, step_losses
from tests.training.test_frozen import FOUR_STEPS
from tests.training.test_frozen import FROZEN as FROZEN_PREFIX
from tests.training.test_train_cli import losses
from tests.training.test_training_options import MOE, trainer

FROZEN = {
    # Block 0 frozen, block 1 trained.
    "freeze": ("model.freeze.blocks=[0,1]",),
    # Every projection's weight frozen; the adapters add their update in bf16.
    "lora": ("model.base_model.peft={type: lora, rank: 4, layers: [query, value, dense, mlp_2]}",),
    # A mixture's experts stay bf16 with their adapters; the attention is in FP8.
    "lora-experts": (
        *MOE,
        "model.base_model.peft={type: lora, rank: 4, layers: [query, dense, experts_1, experts_2]}",
    ),
}
ONE_FORWARD = ("batch.micro_batch_size=4",)
"""One forward pass a step: trained weights' FP8 copies are dropped after their product."""


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, counts: Counter[int]) -> None:
    """Count `module.name`'s calls by the data pointer of their first tensor argument (the
    quantized tensor, the weight), quantizations of a weight's rows only."""
    original = getattr(module, name)

    def spied(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rows", True):
            counts[args[0].data_ptr()] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spied)


@pytest.mark.parametrize(
    ("frozen", "recipe"),
    [
        *((frozen, recipe) for frozen in ("freeze", "lora") for recipe in RECIPES),
        ("lora-experts", "rowwise"),
    ],
)
def test_frozen_fp8_weights_compute_in_fp8_quantized_once_with_no_weight_gradient(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frozen: str, recipe: str
) -> None:
    options = ("training.train_iters=3", *ONE_FORWARD, *BF16, *FROZEN[frozen])
    bf16 = step_losses(trainer(dataset, tmp_path / "bf16", *options), 3)
    run = trainer(dataset, tmp_path / "fp8", *options, *RECIPES[recipe])
    metas = parameter_metas(run.engine.model)
    in_fp8 = {
        name: parameter
        for name, parameter in run.engine.model.named_parameters()
        if metas[name].recipe is not None and metas[name].recipe.fp8 is not None
    }
    fixed = {name for name in in_fp8 if metas[name].frozen}
    assert fixed and (fixed == set(in_fp8)) == frozen.startswith("lora"), "LoRA freezes all"
    before = {name: in_fp8[name].detach().clone() for name in fixed}
    quantized: Counter[int] = Counter()
    gradients: Counter[int] = Counter()
    _spy(monkeypatch, weight, "quantize", quantized)
    for module in (linear, gated_mlp):
        _spy(monkeypatch, module, "weight_gradient", gradients)

    fp8 = step_losses(run, 3)
    assert fp8 != bf16, "the linear layers computed in FP8"
    assert fp8 == pytest.approx(bf16, rel=2e-2)
    for name, parameter in in_fp8.items():
        pointer = parameter.data_ptr()
        if name in fixed:
            assert torch.equal(parameter.detach(), before[name]), name
            assert quantized[pointer] == 1 and not gradients[pointer], name
        else:  # requantized after each optimizer step
            assert quantized[pointer] == 3 and gradients[pointer] == 3, name
    if frozen.startswith("lora"):
        b = [p for n, p in run.engine.model.named_parameters() if n.endswith("_lora.b")]
        assert b and all(p.detach().any() for p in b), "the adapters train (B starts at zero)"


@pytest.mark.parametrize("frozen", ["freeze", "lora"])
def test_a_delayed_scaling_run_with_frozen_weights_resumes_bit_for_bit(
    dataset: Path, tmp_path: Path, frozen: str
) -> None:
    """The uninterrupted run keeps the frozen weights' copies of step 1, scaled currently; the
    resumed one quantizes them again from their histories, which roll their unchanged amax:
    the same scales, the same copies."""
    options = ("training.train_iters=4", *ONE_FORWARD, *BF16, *RECIPES["delayed"])
    options += FROZEN[frozen]
    straight, first, resumed = resumed_after_two_steps(dataset, tmp_path, options)
    history = resumed.engine.fp8_histories.history[:, WEIGHT]
    assert torch.all(history > 0), "every step's entry holds the frozen weights' amax too"
    assert torch.equal(history, first.engine.fp8_histories.history[:, WEIGHT])
    assert step_losses(resumed, 2) == straight[2:]


ZERO3 = (*FROZEN_PREFIX, *FOUR_STEPS, BF16[0], *RECIPES["delayed"])
"""The embedding, the head and block 0 frozen, in bf16 with delayed scaling (an ungated MLP, as
the export's starcoder2 has)."""


ZERO3_SCRIPT = """
import itertools
from pathlib import Path
import torch.distributed as dist
from fastllm.engine.fp8_gather import Fp8Gather
from tests.training.test_training_options import MOE, trainer

quantized = []
original = Fp8Gather.quantize
Fp8Gather.quantize = lambda self: (quantized.append(self.buffers.trainable), original(self))[1]
run = trainer(Path(DATASET), Path(EXPERIMENT), *OPTIONS)
for micro_batches in itertools.islice(run.data_loader(), 3):
    run.engine.train_step(micro_batches)
# The trained stages' images are made again after each optimizer step, the frozen ones' once.
assert sorted(quantized) == [False] + [True] * 3, quantized
dist.barrier()
dist.destroy_process_group()
"""


def layouts(
    dataset: Path, one_process: Callable[..., Path], root: Path
) -> dict[str, Layout | Script]:
    """Two data ranks at ZeRO-3: a run and a count of the FP8 images' quantizations (for the
    fixture `launched`)."""
    options = (*ZERO3, "model.multi_stage.zero_stage=3")
    script = ZERO3_SCRIPT.replace("DATASET", repr(str(dataset)))
    script = script.replace("EXPERIMENT", repr(str(root / "quantized"))).replace(
        "OPTIONS", repr(options)
    )
    return {"zero3-delayed": Layout(2, options), "quantized": Script(2, script)}


def test_zero3_gathers_frozen_fp8_weights_as_one_process_computes_them(
    launched: dict[str, Launched], one_process: Callable[..., Path]
) -> None:
    single, double = one_process(*ZERO3), launched["zero3-delayed"].succeeded()
    expected, got = losses(single), losses(double)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-2), step
    ours, theirs = (
        load_file(run / "export" / "4" / "model.safetensors") for run in (double, single)
    )
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-2, atol=1e-2, msg=name)


def test_zero3_quantizes_the_frozen_weights_image_once(launched: dict[str, Launched]) -> None:
    result = launched["quantized"].result
    assert result.returncode == 0, result.stderr
