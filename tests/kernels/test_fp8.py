from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastllm_kernels.activation import gated_activation_reference
from fastllm_kernels.fp8.amax_history import GRADIENT, INPUT, WEIGHT, AmaxHistories
from fastllm_kernels.fp8.gated_linear import fp8_gated_linear
from fastllm_kernels.fp8.linear import fp8_linear
from fastllm_kernels.fp8.norm_linear import fp8_norm_linear
from fastllm_kernels.fp8.quantize import (
    FP8_MAX,
    DelayedScale,
    _quantize_triton,
    dequantize,
    quantize,
    quantize_reference,
)
from fastllm_kernels.fp8.weight import Fp8Weight
from fastllm_kernels.gated_linear import gated_linear
from fastllm_kernels.linear import linear
from fastllm_kernels.norm import rms_norm_reference
from fastllm_kernels.norm_linear import norm_linear
from fastllm_kernels.recipe import WeightRecipe
from tests.kernels.conftest import cuda, triton_on_cpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
RECIPES = ("tensorwise", "rowwise")
BOUNDS = {"tensorwise": (0.05, 0.1), "rowwise": (0.05, 0.05), "delayed": (0.05, 0.1)}
"""‖fp8 − fp32‖ / ‖fp32‖ of the output and of the gradients, on N(0, 1) data: e4m3 operands
round to 2⁻⁴ relative, e5m2 gradients (tensorwise) to 2⁻³."""


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return (
        torch.linalg.vector_norm(a.float() - b.float()) / torch.linalg.vector_norm(b.float())
    ).item()


def _fp8_weight(
    out: int, inputs: int, recipe: str, device: str = "cpu", keep_copy: bool = True
) -> tuple[torch.nn.Parameter, WeightRecipe]:
    """A weight and its recipe computing in FP8; recipe "delayed": tensorwise with primed amax
    histories of its own (input and gradient amaxes around those of N(0, 1) data, the
    weight's around its own, one of each off by a binade)."""
    weight = torch.nn.Parameter(
        (torch.randn(out, inputs, device=device) / inputs**0.5).to(torch.bfloat16)
    )
    delayed = None
    if recipe == "delayed":
        histories = AmaxHistories(1, 3, torch.device(device))
        histories.history.copy_(torch.tensor([[3.0, 5.0, 2.5], [2.0, 9.0, 4.0], [0.3, 0.5, 0.2]]))
        histories.primed = [True, True, True]
        delayed = (histories, 0)
    fp8 = Fp8Weight("tensorwise" if recipe == "delayed" else recipe, keep_copy, delayed)
    return weight, WeightRecipe(fp8=fp8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("tensorwise", [True, False])
def test_quantization_rounds_to_nearest_under_a_power_of_two_scale(dtype, tensorwise) -> None:
    # Rows of very different magnitudes, columns too.
    x = (torch.randn(40, 24) * torch.logspace(-3, 3, 40)[:, None] * torch.rand(24)).to(
        torch.bfloat16
    )
    q = quantize_reference(x, dtype, tensorwise=tensorwise, rows=True, columns=True)
    for part, values, axis in ((q.rows, x.float(), 1), (q.columns, x.float().t(), 1)):
        assert part.data.dtype == dtype
        mantissa, _ = torch.frexp(part.scale)
        assert torch.all(mantissa == 0.5), "scales are powers of two"
        scaled_amax = values.abs().amax() if tensorwise else values.abs().amax(axis, keepdim=True)
        scaled_amax = scaled_amax / part.scale
        assert torch.all(scaled_amax <= FP8_MAX[dtype]) and torch.all(
            scaled_amax > FP8_MAX[dtype] / 2
        )
        # Half a unit in the last place of the format, or of its smallest subnormal.
        error = (dequantize(part) - values).abs()
        smallest = 2.0 ** (-9 if dtype == E4M3 else -16) * part.scale
        ulp = torch.maximum(values.abs() * 2.0 ** -MANTISSA_BITS[dtype], smallest)
        assert torch.all(error <= ulp / 2 * (1 + 1e-6))
    if tensorwise:
        assert torch.equal(q.columns.data.float(), q.rows.data.float().t())
        assert q.amax == x.float().abs().amax()


@pytest.mark.parametrize("recipe", (*RECIPES, "delayed"))
def test_fp8_linear_stays_within_the_recipe_bound_of_fp32(recipe) -> None:
    weight, weight_recipe = _fp8_weight(48, 64, recipe)
    x = torch.randn(2, 16, 64).to(torch.bfloat16).requires_grad_()
    out = linear(x, weight, None, weight_recipe)
    grad = torch.randn_like(out)
    out.backward(grad)
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    expected = F.linear(x32, w32)
    expected.backward(grad.float())
    output_bound, gradient_bound = BOUNDS[recipe]
    assert out.dtype == torch.bfloat16
    assert 1e-3 < _relative(out, expected) < output_bound
    assert _relative(x.grad, x32.grad) < gradient_bound
    assert _relative(weight.grad, w32.grad) < gradient_bound


@pytest.mark.parametrize("recipe", (*RECIPES, "delayed"))
def test_an_fp8_linear_of_a_frozen_weight_keeps_no_input_and_computes_no_weight_gradient(
    recipe,
) -> None:
    weight, weight_recipe = _fp8_weight(48, 64, recipe)
    x = torch.randn(2, 16, 64).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(2, 16, 48).to(torch.bfloat16)
    trained = fp8_linear(x, weight, None, weight_recipe)
    trained.backward(grad)
    x_grad, x.grad = x.grad, None
    weight.requires_grad_(False)
    weight_recipe.gradient_sink = lambda product: pytest.fail("a frozen weight's gradient")
    frozen = fp8_linear(x, weight, None, weight_recipe)
    assert frozen.grad_fn.saved_tensors[0] is None, "the input is not kept"
    frozen.backward(grad)
    assert torch.equal(frozen, trained) and torch.equal(x.grad, x_grad)


def test_rowwise_scaling_keeps_rows_that_one_tensor_scale_flushes() -> None:
    x = torch.randn(32, 64) * torch.logspace(-6, 0, 32)[:, None]
    x = x.to(torch.bfloat16)
    errors = {}
    for recipe in RECIPES:
        weight, weight_recipe = _fp8_weight(16, 64, recipe)
        out = fp8_linear(x, weight, None, weight_recipe)
        expected = x.float() @ weight.detach().float().t()
        errors[recipe] = _relative(out[:4], expected[:4])  # the smallest rows
    assert errors["rowwise"] < 0.05 < errors["tensorwise"]


@pytest.mark.parametrize("primed", [True, False])
def test_delayed_scaling_scales_by_the_history_saturates_and_records(primed) -> None:
    x = torch.tensor([[0.5, -3.0, 20.0, 1.0], [7.0, -40.0, 0.25, 2.0]]).to(torch.bfloat16)
    history = torch.tensor([1.0, 9.0, 4.0])  # max 9: multiplier 32 (9 * 32 <= 448 < 9 * 64)
    record = torch.tensor(2.0)
    scale = DelayedScale(history if primed else None, record)
    q = quantize(x, E4M3, tensorwise=True, rows=True, columns=True, delayed=scale)
    assert record.item() == 40.0, "the tensor's amax maxed into the record"
    if primed:
        assert q.rows.scale.item() == 1 / 32 and q.amax is None
        # 40 and 20 exceed 448 / 32 = 14: they saturate instead of turning into NaN.
        expected = torch.tensor([[0.5, -3.0, 14.0, 1.0], [7.0, -14.0, 0.25, 2.0]])
        assert torch.equal(dequantize(q.rows), expected)
        assert torch.equal(dequantize(q.columns), expected.t())
    else:  # no history yet: current scaling
        current = quantize_reference(x, E4M3, tensorwise=True, rows=True, columns=True)
        assert torch.equal(q.rows.data.float(), current.rows.data.float())
        assert torch.equal(q.rows.scale, current.rows.scale)


@triton_on_cpu
def test_the_delayed_cast_kernel_scales_saturates_and_records() -> None:
    """The Triton cast under the interpreter, whose fp8 conversion lands some values a binade
    off (the GPU test compares bits)."""
    x = (torch.randn(70, 150) * 4).to(torch.bfloat16)
    x[3, 7] = 200.0  # past the history's range
    history, record = torch.tensor([3.0, 10.0]), torch.tensor(0.0)
    q = _quantize_triton(x, E4M3, True, True, True, None, DelayedScale(history, record))
    assert record.item() == 200.0
    assert q.rows.scale.item() == 1 / 32 and q.columns.scale.item() == 1 / 32
    expected = x.float().clamp(-14.0, 14.0)
    values = dequantize(q.rows)
    assert values[3, 7] == 14.0
    assert torch.all((values - expected).abs() <= expected.abs() / 2 + 2**-9 / 32)
    assert torch.equal(q.columns.data.float(), q.rows.data.float().t())


def test_amax_histories_roll_the_step_amaxes_in_newest_first() -> None:
    histories = AmaxHistories(2, 3, torch.device("cpu"))
    assert histories.scale(1, INPUT).history is None, "no history before the first step"
    for step in (1.0, 2.0, 3.0, 4.0):
        histories.current.fill_(step)
        histories.roll()
    assert histories.history[1, INPUT].tolist() == [4.0, 3.0, 2.0]
    assert not histories.current.any()
    scale = histories.scale(1, INPUT, record=False)
    assert scale.record is None and scale.history.data_ptr() == histories.history[1, 0].data_ptr()
    restored = AmaxHistories(2, 3, torch.device("cpu"))
    restored.load_state(histories.state())
    assert all(restored.primed) and torch.equal(restored.history, histories.history)


def test_histories_from_before_the_weights_kind_load_with_the_weights_unprimed() -> None:
    histories = AmaxHistories(2, 3, torch.device("cpu"))
    old = {"history": torch.rand(2, 2, 3) + 1, "current": torch.rand(2, 2)}
    histories.load_state(old)
    assert histories.primed == [True, True, False]
    assert torch.equal(histories.history[:, :WEIGHT], old["history"])
    assert torch.equal(histories.current[:, :WEIGHT], old["current"])
    assert not histories.history[:, WEIGHT].any() and not histories.current[:, WEIGHT].any()
    assert histories.scale(1, WEIGHT).history is None, "the weights scale currently"
    # Another history length (one step would broadcast), layer count or kind count is refused.
    for shape in [(2, 3, 1), (2, 2, 4), (3, 3, 3), (2, 4, 3), (2, 3)]:
        with pytest.raises(ValueError, match=r"^history has shape"):
            histories.load_state({"history": torch.ones(shape), "current": torch.ones(shape[:2])})
    with pytest.raises(ValueError, match=r"^current has shape \(2, 2\)"):
        histories.load_state({"history": torch.ones(2, 3, 3), "current": torch.ones(2, 2)})


@pytest.mark.parametrize("keep_copy", [True, False])
def test_delayed_weights_scale_from_their_history_saturate_and_record(keep_copy) -> None:
    values = torch.tensor([[0.5, -3.0, 20.0, 1.0], [7.0, -40.0, 0.25, 2.0]])
    weight = torch.nn.Parameter(values.to(torch.bfloat16))
    histories = AmaxHistories(2, 2, torch.device("cpu"))
    fp8 = Fp8Weight("tensorwise", keep_copy, (histories, 1))
    # The first step has no history yet: current scaling, rows and columns, and recorded.
    current = quantize_reference(values, E4M3, tensorwise=True, columns=True)
    rows, columns = fp8.rows(weight), fp8.columns(weight)
    for ours, theirs in ((rows, current.rows), (columns, current.columns)):
        assert torch.equal(ours.data.float(), theirs.data.float())
        assert torch.equal(ours.scale, theirs.scale)
    assert histories.current[1].tolist() == [0.0, 0.0, 40.0]
    histories.roll()
    assert histories.history[1, WEIGHT].tolist() == [40.0, 0.0]
    histories.history[1, WEIGHT] = torch.tensor([1.0, 9.0])  # max 9: multiplier 32
    torch.autograd.graph.increment_version(weight)  # the optimizer step
    rows, columns = fp8.rows(weight), fp8.columns(weight)
    assert rows.scale.item() == columns.scale.item() == 1 / 32
    # 40 and 20 exceed 448 / 32 = 14: they saturate.
    expected = torch.tensor([[0.5, -3.0, 14.0, 1.0], [7.0, -14.0, 0.25, 2.0]])
    assert torch.equal(dequantize(rows), expected)
    assert torch.equal(dequantize(columns), expected.t())
    assert histories.current[1].tolist() == [0.0, 0.0, 40.0] and not histories.current[0].any()
    histories.roll()
    assert histories.history[1, WEIGHT].tolist() == [40.0, 1.0]
    # A skipped optimizer step leaves the weight as it was (its copy kept, or made again).
    fp8.rows(weight)
    histories.roll()
    assert histories.history[1, WEIGHT].tolist() == [40.0, 40.0]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_weight_gradient_goes_to_the_sink_in_fp32(recipe) -> None:
    weight, weight_recipe = _fp8_weight(32, 48, recipe)
    x = torch.randn(64, 48).to(torch.bfloat16)
    grad = torch.randn(64, 32).to(torch.bfloat16)
    plain = weight.detach().clone().requires_grad_()
    linear(x, plain, None, WeightRecipe(fp8=Fp8Weight(recipe))).backward(grad)
    buffer = torch.full((32, 48), 7.0)
    writes = []

    def sink(product) -> None:
        product(buffer, bool(writes))  # the first write overwrites, later ones add
        writes.append(buffer.clone())

    weight_recipe.gradient_sink = sink
    linear(x, weight, None, weight_recipe).backward(grad)
    assert weight.grad is None
    assert torch.allclose(writes[0], plain.grad.float(), rtol=1e-2, atol=1e-3)
    linear(x, weight, None, weight_recipe).backward(grad)
    assert torch.allclose(writes[1], 2 * writes[0], rtol=1e-6)


def test_without_keep_copy_only_the_weight_scale_outlives_the_product() -> None:
    weight, weight_recipe = _fp8_weight(16, 32, "tensorwise", keep_copy=False)
    fp8 = weight_recipe.fp8
    first = fp8.rows(weight)
    again = fp8.rows(weight)
    assert again is not first and torch.equal(again.data.float(), first.data.float())
    both = quantize_reference(weight.detach(), E4M3, tensorwise=True, columns=True)
    columns = fp8.columns(weight)
    assert torch.equal(columns.data.float(), both.columns.data.float())
    assert torch.equal(columns.scale, first.scale)


def test_the_weight_is_quantized_once_until_it_changes() -> None:
    weight, weight_recipe = _fp8_weight(16, 32, "rowwise")
    fp8 = weight_recipe.fp8
    first = fp8.rows(weight)
    assert fp8.rows(weight) is first
    with torch.no_grad():
        weight.mul_(2)  # an in-place op bumps the version
    second = fp8.rows(weight)
    assert torch.equal(second.scale, 2 * first.scale)
    torch.autograd.graph.increment_version(weight)  # what a fused optimizer kernel does
    assert fp8.rows(weight) is not second


@pytest.mark.parametrize("tensorwise", [True, False])
def test_the_transposed_weight_is_scaled_as_a_quantization_of_both_layouts(tensorwise) -> None:
    weight, weight_recipe = _fp8_weight(16, 32, "tensorwise" if tensorwise else "rowwise")
    both = quantize_reference(weight.detach(), E4M3, tensorwise=tensorwise, columns=True)
    columns = weight_recipe.fp8.columns(weight)
    assert torch.equal(columns.data.float(), both.columns.data.float())
    assert torch.equal(columns.scale, both.columns.scale)


def test_norm_and_gated_projections_take_the_fp8_path_of_their_weight(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # their references, exactly
    x = torch.randn(3, 8, 32).to(torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(32)).to(torch.bfloat16)
    weight, weight_recipe = _fp8_weight(16, 32, "rowwise")
    out = norm_linear(x, norm_weight, None, 1e-5, True, weight, None, weight_recipe)
    normed = rms_norm_reference(x, norm_weight, 1e-5)
    assert torch.equal(out, fp8_linear(normed, weight, None, weight_recipe))
    h = torch.randn(3, 8, 64).to(torch.bfloat16)
    activated = gated_activation_reference(*h.chunk(2, dim=-1), "silu")
    out = gated_linear(h, weight, None, "silu", weight_recipe)
    assert torch.equal(out, fp8_linear(activated, weight, None, weight_recipe))


def _fused_cases(recipe: str, device: str):
    """(fused call, reference of the same projection) pairs for norm_linear and gated_linear."""
    x = torch.randn(4, 16, 64, device=device).to(torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(64, device=device)).to(torch.bfloat16)
    h = torch.randn(4, 16, 128, device=device).to(torch.bfloat16)
    return [
        (
            lambda x, w, r: fp8_norm_linear(x, norm_weight, None, 1e-5, True, w, None, r),
            lambda x, w: F.linear(rms_norm_reference(x, norm_weight, 1e-5).float(), w.float()),
            x,
            _fp8_weight(32, 64, recipe, device),
        ),
        (
            lambda h, w, r: fp8_gated_linear(h, w, None, "silu", r),
            lambda h, w: F.linear(
                gated_activation_reference(*h.chunk(2, -1), "silu").float(), w.float()
            ),
            h,
            _fp8_weight(32, 64, recipe, device),
        ),
    ]


def _check_fused(recipe: str, device: str, output_bound: float, gradient_bound: float) -> None:
    for fused, reference, x, (weight, weight_recipe) in _fused_cases(recipe, device):
        x = x.requires_grad_()
        out = fused(x, weight, weight_recipe)
        grad = torch.randn_like(out)
        out.backward(grad)
        x32 = x.detach().float().requires_grad_()
        w32 = weight.detach().float().requires_grad_()
        expected = reference(x32, w32)
        expected.backward(grad.float())
        assert _relative(out, expected) < output_bound
        assert _relative(x.grad, x32.grad) < gradient_bound
        assert _relative(weight.grad, w32.grad) < gradient_bound


@triton_on_cpu
@pytest.mark.parametrize("recipe", (*RECIPES, "delayed"))
def test_fused_fp8_projections_run_their_kernels(recipe) -> None:
    """The interpreter's conversion to fp8, which the rowwise and delayed norm and activation
    kernels use here, rounds coarser than the GPU's (ties away from zero, some values a binade
    off): a looser output bound here (0.075 measured), the recipe's on the GPU."""
    _check_fused(recipe, "cpu", 0.12, 0.1)


@triton_on_cpu
def test_delayed_fused_producers_record_the_amaxes_of_their_outputs_and_gradients() -> None:
    x = (3 * torch.randn(64, 64)).to(torch.bfloat16).requires_grad_()
    norm_weight = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
    h = torch.randn(64, 128).to(torch.bfloat16).requires_grad_()
    cases = [
        (lambda w, r: fp8_norm_linear(x, norm_weight, None, 1e-5, True, w, None, r),
         rms_norm_reference(x.detach(), norm_weight, 1e-5)),
        (lambda w, r: fp8_gated_linear(h, w, None, "silu", r),
         gated_activation_reference(*h.detach().chunk(2, -1), "silu")),
    ]  # fmt: skip
    for fused, produced in cases:
        weight, weight_recipe = _fp8_weight(32, 64, "delayed")
        histories, _ = weight_recipe.fp8.delayed
        out = fused(weight, weight_recipe)
        grad = 5 * torch.randn_like(out)
        out.backward(grad)
        recorded = histories.current[0].tolist()
        assert recorded[INPUT] == pytest.approx(produced.float().abs().amax().item(), rel=1e-2)
        assert recorded[GRADIENT] == grad.float().abs().amax().item()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(48, 80), (130, 4096), (64, 16384), (257, 200)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_triton_quantization_matches_the_reference_bit_for_bit(shape, dtype) -> None:
    x = (torch.randn(shape, device="cuda") * torch.rand(shape[0], 1, device="cuda") * 10).to(
        torch.bfloat16
    )
    for tensorwise in (True, False):
        for rows, columns in ((True, False), (False, True), (True, True)):
            ours = quantize(x, dtype, tensorwise=tensorwise, rows=rows, columns=columns)
            theirs = quantize_reference(x, dtype, tensorwise=tensorwise, rows=rows, columns=columns)
            for a, b in ((ours.rows, theirs.rows), (ours.columns, theirs.columns)):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                    assert torch.equal(a.scale, b.scale)
    # Delayed: a history below the amax, so that the largest values saturate. Both layouts
    # (an activation), the rows recording (a weight's forward copy), the columns alone (its
    # backward copy).
    history = torch.tensor([0.1, 0.4], device="cuda") * x.float().abs().amax()
    for rows, columns, record in ((True, True, True), (True, False, True), (False, True, False)):
        records = [torch.zeros((), device="cuda") if record else None for _ in range(2)]
        ours = quantize(
            x, dtype, tensorwise=True, rows=rows, columns=columns,
            delayed=DelayedScale(history, records[0]),
        )  # fmt: skip
        theirs = quantize_reference(
            x, dtype, tensorwise=True, rows=rows, columns=columns,
            delayed=DelayedScale(history, records[1]),
        )  # fmt: skip
        if record:
            assert torch.equal(records[0], records[1])
        for a, b in ((ours.rows, theirs.rows), (ours.columns, theirs.columns)):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                assert torch.equal(a.scale, b.scale)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_products_match_the_cpu_emulation(recipe) -> None:
    weight, weight_recipe = _fp8_weight(256, 512, recipe, "cuda")
    x = torch.randn(2, 64, 512, device="cuda").to(torch.bfloat16).requires_grad_()
    out = linear(x, weight, None, weight_recipe)
    grad = torch.randn_like(out)
    out.backward(grad)
    cpu_weight = torch.nn.Parameter(weight.detach().cpu())
    cpu_x = x.detach().cpu().requires_grad_()
    expected = linear(cpu_x, cpu_weight, None, WeightRecipe(fp8=Fp8Weight(recipe)))
    expected.backward(grad.cpu())
    # The same fp8 operands; only the accumulation (fast in the forward product) differs.
    assert _relative(out.cpu(), expected) < 1e-2
    assert _relative(x.grad.cpu(), cpu_x.grad) < 1e-2
    assert _relative(weight.grad.cpu(), cpu_weight.grad) < 1e-2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_writes_and_adds_the_weight_gradient_into_the_fp32_sink(recipe) -> None:
    weight, weight_recipe = _fp8_weight(256, 512, recipe, "cuda")
    buffer = torch.full((256, 512), float("nan"), device="cuda")
    calls = []
    weight_recipe.gradient_sink = lambda product: (product(buffer, bool(calls)), calls.append(1))
    x = torch.randn(128, 512, device="cuda").to(torch.bfloat16)
    grad = torch.randn(128, 256, device="cuda").to(torch.bfloat16)
    linear(x, weight, None, weight_recipe).backward(grad)
    first = buffer.clone()
    cpu_weight = torch.nn.Parameter(weight.detach().cpu())
    cpu_recipe = WeightRecipe(fp8=Fp8Weight(recipe))
    linear(x.cpu(), cpu_weight, None, cpu_recipe).backward(grad.cpu())
    assert _relative(first.cpu(), cpu_weight.grad) < 1e-2
    linear(x, weight, None, weight_recipe).backward(grad)
    assert torch.allclose(buffer, 2 * first, rtol=1e-5)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("recipe", (*RECIPES, "delayed"))
def test_fused_fp8_projections_stay_within_the_recipe_bound_on_gpu(recipe) -> None:
    output_bound, gradient_bound = BOUNDS[recipe]
    _check_fused(recipe, "cuda", output_bound, gradient_bound)


@pytest.mark.gpu
@cuda
def test_misaligned_fp8_products_name_the_token_count() -> None:
    weight, weight_recipe = _fp8_weight(32, 64, "rowwise", "cuda")
    with pytest.raises(ValueError, match="token count"):
        linear(torch.randn(10, 64, device="cuda").to(torch.bfloat16), weight, None, weight_recipe)
