"""Linear layers computing in FP8: the three products of a linear layer through `torch._scaled_mm`.

A training engine opts a weight in by setting `weight.fp8 = Fp8Weight(recipe)`; `linear`,
`norm_linear` and `gated_linear` then compute through here. The recipes:

- tensorwise: one scale per tensor; activations and weights in e4m3, gradients in e5m2
  (its wider range, as Transformer Engine and torchao's tensorwise recipe do).
- rowwise: one scale per row of each operand along the contracted dimension, everything in
  e4m3 (torchao's rowwise; `_scaled_mm` takes rowwise scales only for e4m3 operands).

Scaling is current (each tensor's scale from its own amax) or, tensorwise, delayed
(`AmaxHistories`: the inputs, the output gradients and the weights, as Transformer Engine's
delayed recipe; a weight's quantization is then one pass over it, not two). The forward
product and the input gradient come out in the compute dtype, the weight gradient in fp32
straight into the engine's gradient buffer when the weight has a gradient sink (linear.py);
the forward product accumulates in the faster mode of the fp8 tensor cores, the two gradient
products in full precision (torchao's choice). On CPU the products multiply the dequantized
fp32 operands: the same rounding of the operands as on the GPU, so the CPU tests cover the
recipes' logic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fastllm_kernels._dispatch import as_rows
from fastllm_kernels.fp8 import DelayedScale, Fp8Tensor, quantize


class Fp8Recipe(NamedTuple):
    tensorwise: bool
    """One scale per tensor (else one per row of each operand)."""
    gradient_dtype: torch.dtype
    """The format of the output gradients."""


RECIPES = {
    "tensorwise": Fp8Recipe(True, torch.float8_e5m2),
    "rowwise": Fp8Recipe(False, torch.float8_e4m3fn),
}
E4M3 = torch.float8_e4m3fn
_ALIGNMENT = 16
"""`_scaled_mm` wants every dimension of its operands a multiple of 16."""


INPUT, GRADIENT, WEIGHT = 0, 1, 2
"""The delayed-scaled tensors of a layer: its input, its output gradient and its weight."""
KINDS = 3
_KINDS_BEFORE_WEIGHT = 2
"""Checkpoints written before the weights were delayed-scaled hold INPUT and GRADIENT only."""


class AmaxHistories:
    """Delayed scaling state of `layers` linear layers: for each layer's input, output gradient
    and weight, the amaxes of the last `length` steps (newest first) and the amax so far of the
    step in progress. `roll` after each optimizer step. Until a kind's first roll its tensors
    scale currently (and record): there is no history yet. Part of a checkpoint (`state`)."""

    def __init__(self, layers: int, length: int, device: torch.device) -> None:
        if length < 1:
            raise ValueError(f"an amax history holds at least one step, got {length}")
        self.history = torch.zeros(layers, KINDS, length, device=device)
        self.current = torch.zeros(layers, KINDS, device=device)
        self.primed = [False] * KINDS
        """Per kind: whether its history holds a step."""

    def scale(self, layer: int, tensor: int, record: bool = True) -> DelayedScale:
        return DelayedScale(
            self.history[layer, tensor] if self.primed[tensor] else None,
            self.current[layer, tensor] if record else None,
        )

    @torch.no_grad()
    def roll(self) -> None:
        """The step's amaxes become the newest entries of the history. A weight that no pass of
        the step quantized (a skipped optimizer step left it unchanged, its copy kept) keeps
        its newest amax, still its amax."""
        weight = self.current[:, WEIGHT]
        weight.copy_(torch.where(weight > 0, weight, self.history[:, WEIGHT, 0]))
        self.history.copy_(torch.cat([self.current[..., None], self.history[..., :-1]], dim=-1))
        self.current.zero_()
        self.primed = [True] * KINDS

    def state(self) -> dict[str, Tensor]:
        return {"history": self.history, "current": self.current}

    @torch.no_grad()
    def load_state(self, state: dict[str, Tensor]) -> None:
        """Restore `state`; one without the weights' kind (an older checkpoint) leaves their
        histories empty: the weights scale currently until the next roll. A shape of other
        layers or another history length: ValueError naming the entry."""
        layers, _, length = self.history.shape
        history, current = state["history"], state["current"]
        kinds = history.shape[1] if history.dim() == 3 else 0
        expected = {"history": (layers, kinds, length), "current": (layers, kinds)}
        for key, shape in expected.items():
            if kinds not in (KINDS, _KINDS_BEFORE_WEIGHT) or tuple(state[key].shape) != shape:
                raise ValueError(
                    f"{key} has shape {tuple(state[key].shape)}; expected {layers} FP8 layers "
                    f"by {KINDS} kinds (or {_KINDS_BEFORE_WEIGHT}, before the weights')"
                    + (f" by {length} steps" if key == "history" else "")
                )
        self.history.zero_()
        self.current.zero_()
        self.history[:, :kinds].copy_(history)
        self.current[:, :kinds].copy_(current)
        self.primed = self.history.any(dim=2).any(dim=0).tolist()


class Fp8Weight:
    """How a linear layer's weight computes in FP8 (set as `weight.fp8`).

    Its row-quantized copy, the forward product's operand, is made at the first use after the
    weight changed: once per optimizer step, not once per micro-batch. With `keep_copy` (a step
    of several micro-batches) it is kept until the weight changes, a byte per parameter;
    without, it is dropped after the product and only its scale is kept. A change is seen
    through the weight's version counter, which in-place torch ops bump; whatever writes the
    weight behind autograd's back (a fused optimizer kernel) must bump it too
    (`torch.autograd.graph.increment_version`). The transposed copy that the input gradient
    needs is made in each backward pass and dropped after it, with the rows' scale. `delayed`:
    the layer's entry of the model's amax histories (tensorwise only); the weight's scale then
    comes from its WEIGHT history, the quantization of the rows recording its amax."""

    def __init__(
        self,
        recipe: str,
        keep_copy: bool = True,
        delayed: tuple[AmaxHistories, int] | None = None,
    ) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {tuple(RECIPES)}")
        self.name, self.recipe, self.keep_copy = recipe, RECIPES[recipe], keep_copy
        if delayed is not None and not self.recipe.tensorwise:
            raise ValueError(f"delayed scaling is tensorwise, not {recipe}")
        self.delayed = delayed
        self.gathered: Fp8Tensor | None = None
        """ZeRO-3: the weight's rows as gathered in FP8 with its stage (fastllm's
        engine/fp8_gather.py), used instead of quantizing the weight, whose bf16 copy is then
        not gathered."""
        self.gathered_columns: Fp8Tensor | None = None
        """ZeRO-3, rowwise: the column-scaled gathered values, (out, in), their scale (in, 1)."""
        self._key: tuple[int, int] | None = None
        self._rows: Fp8Tensor | None = None
        self._amax: Tensor | None = None

    def rows(self, weight: Tensor) -> Fp8Tensor:
        """The weight (out, in) in e4m3, scaled per row or for the tensor."""
        if self.gathered is not None:
            return self.gathered
        key = (weight.data_ptr(), weight._version)
        if self._rows is not None and key == self._key:
            return self._rows
        quantized = quantize(
            weight.detach(), E4M3, tensorwise=self.recipe.tensorwise, delayed=self.scale(WEIGHT)
        )
        self._key, self._amax = key, quantized.amax  # None when scaled from the history
        rows = _part(quantized.rows)
        self._rows = rows if self.keep_copy else None
        return rows

    def columns(self, weight: Tensor) -> Fp8Tensor:
        """The weight transposed (in, out) in e4m3, scaled per column or for the tensor (with
        the rows' scale: from their amax, or from the same history)."""
        if self.gathered is not None:
            image = self.gathered if self.recipe.tensorwise else self.gathered_columns
            assert image is not None
            return Fp8Tensor(image.data.t().contiguous(), image.scale)
        same = self._key == (weight.data_ptr(), weight._version)
        amax = self._amax if same else None
        delayed = self.scale(WEIGHT, record=False) if amax is None else None
        quantized = quantize(
            weight.detach(), E4M3, tensorwise=self.recipe.tensorwise, rows=False, columns=True,
            amax=amax, delayed=delayed,
        )  # fmt: skip
        return _part(quantized.columns)

    def scale(self, tensor: int, record: bool = True) -> DelayedScale | None:
        """How the layer's input (INPUT), output gradient (GRADIENT) or weight (WEIGHT) is
        scaled: None for current scaling."""
        if self.delayed is None:
            return None
        histories, layer = self.delayed
        return histories.scale(layer, tensor, record)


def scaled_matmul(
    a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, fast: bool, out: Tensor | None = None
) -> Tensor:
    """a (M, K) @ b (N, K)ᵀ with their scales, in `out_dtype` (into `out` when given):
    `torch._scaled_mm` on CUDA (b's transpose is the column-major operand it takes), the
    dequantized fp32 product elsewhere. `fast`: the tensor cores' faster, less precise
    accumulation."""
    (m, k), (n, k_b) = a.data.shape, b.data.shape
    if k != k_b:
        raise ValueError(f"scaled_matmul: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)}")
    if not a.data.is_cuda:
        product = ((a.data.float() * a.scale) @ (b.data.float() * b.scale).t()).to(out_dtype)
        return product if out is None else out.copy_(product)
    if m % _ALIGNMENT or n % _ALIGNMENT or k % _ALIGNMENT:
        raise ValueError(
            f"FP8 products need every dimension a multiple of {_ALIGNMENT}: got "
            f"({m} x {k}) @ ({k} x {n}); the token count of a micro-batch counts too"
        )
    return torch._scaled_mm(
        a.data,
        b.data.t(),
        scale_a=a.scale,
        scale_b=b.scale.t(),
        out_dtype=out_dtype,
        use_fast_accum=fast,
        **({} if out is None else {"out": out}),
    )


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Weight) -> Tensor:
    """F.linear(x, weight, bias) with all three products in FP8 under `fp8`'s recipe."""
    return _Fp8LinearFunction.apply(x, weight, bias, fp8)


def forward_product(
    rows: Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Weight
) -> tuple[Tensor, Tensor | None]:
    """rows @ weightᵀ + bias in the rows' dtype, and (tensorwise, current scaling) the rows'
    amax, which the weight gradient's quantization of the same rows reuses."""
    x = quantize(rows, E4M3, tensorwise=fp8.recipe.tensorwise, delayed=fp8.scale(INPUT))
    return product_of_rows(_part(x.rows), weight, bias, fp8, rows.dtype), x.amax


def product_of_rows(
    x: Fp8Tensor, weight: Tensor, bias: Tensor | None, fp8: Fp8Weight, dtype: torch.dtype
) -> Tensor:
    """The forward product of rows already in fp8."""
    out = scaled_matmul(x, fp8.rows(weight), dtype, fast=True)
    return out if bias is None else out.add_(bias)


def backward_products(
    grad_rows: Tensor,
    input_rows: Tensor | Fp8Tensor | None,
    input_amax: Tensor | None,
    weight: Tensor,
    fp8: Fp8Weight,
    need_input: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """The input gradient (when `need_input`) and the weight gradient (when `input_rows`, the
    forward product's input, recomputed or kept, is given, or its columns already in fp8;
    None once handed to the weight's gradient sink) from the output gradient rows. The input
    rows are scaled as in the forward product: from `input_amax`, or from the same amax
    history."""
    need_weight = input_rows is not None
    if not (need_input or need_weight):
        return None, None
    tensorwise = fp8.recipe.tensorwise
    grad = quantize(
        grad_rows,
        fp8.recipe.gradient_dtype,
        tensorwise=tensorwise,
        rows=need_input,
        columns=need_weight,
        delayed=fp8.scale(GRADIENT),
    )
    d_input = d_weight = None
    if need_input:
        w = fp8.columns(weight)
        d_input = scaled_matmul(_part(grad.rows), w, grad_rows.dtype, fast=False)
    if isinstance(input_rows, Fp8Tensor):
        d_weight = weight_gradient(weight, _part(grad.columns), input_rows)
    elif input_rows is not None:
        delayed = fp8.scale(INPUT, record=False) if input_amax is None else None
        x = quantize(
            input_rows, E4M3, tensorwise=tensorwise, rows=False, columns=True, amax=input_amax,
            delayed=delayed,
        )  # fmt: skip
        d_weight = weight_gradient(weight, _part(grad.columns), _part(x.columns))
    return d_input, d_weight


def input_scale_source(fp8: Fp8Weight, input_amax: Tensor | None) -> Tensor | None:
    """What the backward pass scales a tensorwise layer's input columns from, as in its forward
    product: the input's amax (current scaling) or the amax history (delayed); None: rowwise."""
    if not fp8.recipe.tensorwise:
        return None
    if input_amax is not None:
        return input_amax
    delayed = fp8.scale(INPUT, record=False)
    assert delayed is not None and delayed.history is not None
    return delayed.history


def weight_gradient(weight: Tensor, grad: Fp8Tensor, x: Fp8Tensor) -> Tensor | None:
    """gradᵀ x (both transposed already): into the weight's gradient sink in fp32 (no copy of
    it in the compute dtype), else returned in the weight's dtype."""
    sink = getattr(weight, "gradient_sink", None)
    if sink is None:
        return scaled_matmul(grad, x, weight.dtype, fast=False)

    def product(out: Tensor, accumulate: bool) -> None:
        if accumulate:
            out.add_(scaled_matmul(grad, x, torch.float32, fast=False))
        else:
            scaled_matmul(grad, x, torch.float32, fast=False, out=out)

    sink(product)
    return None


def _part(t: Fp8Tensor | None) -> Fp8Tensor:
    """A layout `quantize` was asked for (so not None)."""
    assert t is not None
    return t


def bias_gradient(grad_rows: Tensor, bias_dtype: torch.dtype) -> Tensor:
    return grad_rows.sum(dim=0, dtype=torch.float32).to(bias_dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fp8):
        rows = as_rows(x)
        out, amax = forward_product(rows, weight, bias, fp8)
        ctx.save_for_backward(rows, weight, amax)
        ctx.fp8, ctx.bias_dtype = fp8, None if bias is None else bias.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, weight, amax = ctx.saved_tensors
        need_x, need_weight, need_bias, _ = ctx.needs_input_grad
        grad_rows = as_rows(grad)
        dx, d_weight = backward_products(
            grad_rows, rows if need_weight else None, amax, weight, ctx.fp8, need_x
        )
        d_bias = bias_gradient(grad_rows, ctx.bias_dtype) if need_bias else None
        if dx is not None:
            dx = dx.view(*grad.shape[:-1], rows.shape[1])
        return dx, d_weight, d_bias, None
