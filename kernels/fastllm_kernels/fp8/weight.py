"""How a linear layer's weight computes in FP8: its recipe and its quantized copies.

The recipes:

- tensorwise: one scale per tensor; activations and weights in e4m3, gradients in e5m2
  (its wider range, as Transformer Engine and torchao's tensorwise recipe do).
- rowwise: one scale per row of each operand along the contracted dimension, everything in
  e4m3 (torchao's rowwise; `_scaled_mm` takes rowwise scales only for e4m3 operands).

Scaling is current (each tensor's scale from its own amax) or, tensorwise, delayed
(`AmaxHistories`: the inputs, the output gradients and the weights, as Transformer Engine's
delayed recipe; a weight's quantization is then one pass over it, not two).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fastllm_kernels.fp8.amax_history import WEIGHT, AmaxHistories
from fastllm_kernels.fp8.quantize import E4M3, DelayedScale, Fp8Tensor, quantize, requested


class Fp8Recipe(NamedTuple):
    tensorwise: bool
    """One scale per tensor (else one per row of each operand)."""
    gradient_dtype: torch.dtype
    """The format of the output gradients."""


RECIPES = {
    "tensorwise": Fp8Recipe(True, torch.float8_e5m2),
    "rowwise": Fp8Recipe(False, torch.float8_e4m3fn),
}


class Fp8Weight:
    """How a linear layer's weight computes in FP8 (a `WeightRecipe`'s `fp8`, recipe.py).

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
        rows = requested(quantized.rows)
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
        return requested(quantized.columns)

    def scale(self, tensor: int, record: bool = True) -> DelayedScale | None:
        """How the layer's input (INPUT), output gradient (GRADIENT) or weight (WEIGHT) is
        scaled: None for current scaling."""
        if self.delayed is None:
            return None
        histories, layer = self.delayed
        return histories.scale(layer, tensor, record)
