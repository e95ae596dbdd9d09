"""A gated MLP from its norm on: norm → up projection → gated activation → down projection, the
norm's and the activation's outputs recomputed in the backward pass rather than stored.

It is `norm_linear` then `gated_linear`, each under its weight's recipe (recipe.py), unless
both weights compute in delayed FP8 with primed amax histories and there are no biases: then
one fused FP8 function (fp8/gated_mlp.py), whose backward pass writes the up projection's
output gradient straight in fp8.
"""

from __future__ import annotations

from torch import Tensor

from fastllm_kernels.fp8.gated_mlp import fp8_gated_mlp, fused_mlp_applies
from fastllm_kernels.gated_linear import gated_linear
from fastllm_kernels.norm_linear import norm_linear
from fastllm_kernels.recipe import WeightRecipe


def gated_mlp(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    eps: float,
    rms: bool,
    up: Tensor,
    up_bias: Tensor | None,
    up_recipe: WeightRecipe,
    down: Tensor,
    down_bias: Tensor | None,
    down_recipe: WeightRecipe,
    activation: str,
) -> Tensor:
    """down(act(gate) * up) + down_bias of [gate | up] = up(norm(x)) + up_bias, the norm as
    `norm_linear` takes it."""
    plain = up_bias is None and down_bias is None
    if plain and fused_mlp_applies(x, up, up_recipe, down, down_recipe):
        return fp8_gated_mlp(
            x, norm_weight, norm_bias, eps, rms, up, up_recipe, down, down_recipe, activation
        )
    h = norm_linear(x, norm_weight, norm_bias, eps, rms, up, up_bias, up_recipe)
    return gated_linear(h, down, down_bias, activation, down_recipe)
