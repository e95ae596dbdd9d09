from __future__ import annotations

import pytest
import torch

from fastllm_kernels.activation import gated_backward
from fastllm_kernels.fp8 import gated_mlp
from fastllm_kernels.fp8.amax_history import AmaxHistories
from fastllm_kernels.fp8.gated_mlp import fp8_gated_mlp, fused_mlp_applies, gated_backward_quantized
from fastllm_kernels.fp8.producers import gated_columns
from fastllm_kernels.fp8.quantize import DelayedScale, dequantize, quantize
from fastllm_kernels.fp8.weight import Fp8Weight
from fastllm_kernels.gated_linear import gated_linear
from fastllm_kernels.norm_linear import norm_linear
from fastllm_kernels.recipe import WeightRecipe
from tests.kernels.conftest import cuda, triton_on_cpu

HIDDEN, FFN = 64, 128
E5M2 = torch.float8_e5m2


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return (
        torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float())
    ).item()


def _mlp(device: str):
    """Up and down (weight, recipe) pairs in delayed tensorwise FP8 sharing one amax history, a
    norm weight and an input; the histories primed by one step of the unfused pair (current
    scaling)."""
    up_weight = torch.nn.Parameter(
        (torch.randn(2 * FFN, HIDDEN, device=device) / HIDDEN**0.5).to(torch.bfloat16)
    )
    down_weight = torch.nn.Parameter(
        (torch.randn(HIDDEN, FFN, device=device) / FFN**0.5).to(torch.bfloat16)
    )
    histories = AmaxHistories(2, 4, torch.device(device))
    up = (up_weight, WeightRecipe(fp8=Fp8Weight("tensorwise", True, (histories, 0))))
    down = (down_weight, WeightRecipe(fp8=Fp8Weight("tensorwise", True, (histories, 1))))
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(torch.bfloat16)
    x = (2 * torch.randn(4, 16, HIDDEN, device=device)).to(torch.bfloat16)
    assert not fused_mlp_applies(x, *up, *down)  # no history yet
    _run(_unfused, x, norm_weight, up, down)
    histories.roll()
    return x, norm_weight, up, down, histories


def _unfused(x, norm_weight, up, down):
    h = norm_linear(x, norm_weight, None, 1e-5, True, up[0], None, up[1])
    return gated_linear(h, down[0], None, "silu", down[1])


def _fused(x, norm_weight, up, down):
    return fp8_gated_mlp(x, norm_weight, None, 1e-5, True, *up, *down, "silu")


def _run(mlp, x, norm_weight, up, down):
    """Output and the gradients of x, up and down ((weight, recipe) pairs) for a fixed output
    gradient."""
    x = x.detach().requires_grad_()
    for weight, _ in (up, down):
        weight.grad = None
    out = mlp(x, norm_weight, up, down)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
    return out.detach(), x.grad, up[0].grad, down[0].grad


def _both(device: str):
    x, norm_weight, up, down, histories = _mlp(device)
    assert fused_mlp_applies(x, *up, *down)
    results = {}
    for name, mlp in (("fused", _fused), ("unfused", _unfused)):
        histories.current.zero_()
        results[name] = (*_run(mlp, x, norm_weight, up, down), histories.current.clone())
    return results["fused"], results["unfused"]


def _gated_backward_cases(device: str):
    """The fused kernel's outputs and the unfused path's: the bf16 gradient of [gate | up]
    quantized by `quantize` with the same history, and the recomputed activation's columns."""
    h = torch.randn(80, 2 * FFN, device=device).to(torch.bfloat16)  # 80: a partial tile
    d_activated = torch.randn(80, FFN, device=device).to(torch.bfloat16)
    history = torch.tensor([3.0, 2.0], device=device)
    activated_history = torch.tensor([4.0], device=device)
    records = [torch.zeros((), device=device) for _ in range(2)]
    ours = gated_backward_quantized(
        h, d_activated, "silu", DelayedScale(activated_history, None),
        DelayedScale(history, records[0]), E5M2,
    )  # fmt: skip
    dh = torch.empty_like(h)
    gated_backward(d_activated, h[:, :FFN], h[:, FFN:], dh[:, :FFN], dh[:, FFN:], "silu")
    theirs = quantize(
        dh, E5M2, tensorwise=True, columns=True, delayed=DelayedScale(history, records[1])
    )
    activated = gated_columns(h, "silu", activated_history)
    return ours, (theirs.rows, theirs.columns, activated), records


@triton_on_cpu
def test_the_fused_gated_backward_writes_the_unfused_operands(poisoned_empty) -> None:
    """Rows, columns and scales where the unfused path has them. The interpreter's fp8
    conversion (the fused kernel's) puts a few values a binade below the reference's (the
    unfused cast): on CPU most values match, the rest within a factor of two; on the GPU all."""
    ours, theirs, records = _gated_backward_cases("cpu")
    assert torch.equal(records[0], records[1])
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.scale, b.scale)
        assert a.data.shape == b.data.shape
        x, y = dequantize(a), dequantize(b)
        assert not x.isnan().any()
        same = x == y
        assert same.float().mean() > 0.9
        assert (((x[~same] / y[~same]) - 0.75).abs() <= 0.5).all()
    assert torch.equal(ours[1].data.float().t(), ours[0].data.float())


@triton_on_cpu
def test_the_fused_fp8_mlp_computes_the_unfused_pair(poisoned_empty) -> None:
    """Same forward kernels, so the same output, the same down-projection gradient (the same
    activation columns) and the same recorded amaxes; the gradients through [gate | up] only as
    close as the interpreter's rounding allows (above)."""
    fused, unfused = _both("cpu")
    assert torch.equal(fused[0], unfused[0])
    assert torch.equal(fused[3], unfused[3])
    assert torch.equal(fused[4], unfused[4])
    for a, b in zip(fused[1:3], unfused[1:3], strict=True):
        assert not a.isnan().any()
        assert _relative(a, b) < 0.15


@triton_on_cpu
def test_the_fused_fp8_mlp_of_frozen_weights_makes_no_weight_gradient_operands(
    poisoned_empty, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frozen up and down weights (`model.freeze`): the output and the input gradient of
    trained ones, and neither the weights' gradient products nor their operands (the columns
    of the gradient of [gate | up] and of the activation)."""
    x, norm_weight, up, down, _ = _mlp("cpu")
    trained = _run(_fused, x, norm_weight, up, down)
    products, operands = [], []
    monkeypatch.setattr(gated_mlp, "weight_gradient", lambda *args: products.append(args))
    original = gated_mlp.gated_backward_quantized

    def spied(*args, **kwargs):
        operands.append(original(*args, **kwargs))
        return operands[-1]

    monkeypatch.setattr(gated_mlp, "gated_backward_quantized", spied)
    for weight, _ in (up, down):
        weight.requires_grad_(False)
    frozen = _run(_fused, x, norm_weight, up, down)
    assert torch.equal(frozen[0], trained[0]) and torch.equal(frozen[1], trained[1])
    assert frozen[2] is None and frozen[3] is None and not products
    ((_, gradient_columns, activated_columns),) = operands
    assert gradient_columns is None and activated_columns is None


@pytest.mark.gpu
@cuda
def test_the_fused_fp8_mlp_matches_the_unfused_pair_bit_for_bit_on_gpu() -> None:
    ours, theirs, records = _gated_backward_cases("cuda")
    assert torch.equal(records[0], records[1])
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)
    fused, unfused = _both("cuda")
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)
