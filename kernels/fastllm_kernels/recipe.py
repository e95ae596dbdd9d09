"""What the ops know about one weight besides its values: whether it computes in FP8, and where
its gradient goes.

The layer that owns a weight makes an empty `WeightRecipe` for it and passes it to every op
that projects with the weight (`linear`, `norm_linear`, `gated_linear`, `gated_mlp`,
`grouped_linear`); a training engine fills it in. The op decides from it: FP8 or the compute
dtype, its gradient into a sink or returned. A recipe of None, or an empty one, is a plain
weight.

A gradient sink is Megatron-LM's gradient accumulation fusion: an engine that keeps fp32
gradient buffers gives a recipe a `gradient_sink`, and `sink(product)` has `product(out,
accumulate)` write (or add) the weight's gradient into its fp32 view of the buffer (a bf16
product through `matmul_into_fp32_`, an FP8 one through `torch._scaled_mm`). The weight's
autograd gradient is then None: the product never exists in the compute dtype and no separate
pass adds it to the buffer. While torch.compile traces, the ops ignore the sink (plain layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from fastllm_kernels.fp8.weight import Fp8Weight

GradientProduct = Callable[[Tensor, bool], None]
"""product(out, accumulate): the weight's gradient, computed in fp32, written into out (fp32)
or, `accumulate`, added to it."""
GradientSink = Callable[[GradientProduct], None]


@dataclass(eq=False)
class WeightRecipe:
    """How the ops compute with one weight (compared and hashed by identity: it is the weight's)."""

    fp8: Fp8Weight | None = None
    """Its products in FP8 under this recipe (fp8/weight.py); None: in the compute dtype."""
    gradient_sink: GradientSink | None = None
    """Where its gradient goes; None: autograd returns it."""

    @property
    def sliceable(self) -> bool:
        """Whether a row slice of the weight may be projected on its own, without the recipe:
        not in FP8, whose copy and scales are the whole weight's."""
        return self.fp8 is None
