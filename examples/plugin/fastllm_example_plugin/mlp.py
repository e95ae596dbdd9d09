"""The squared-ReLU MLP: a block's `mlp` component. It receives what fastllm's MLP receives,
declares its parameters' metadata (so the engine's buffers, ZeRO, tensor parallelism and
checkpoints handle them) and says how they start."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config.model import LoRAConfig, TransformerConfig
from fastllm.model.normalization import NormalizationLayer
from fastllm.model.parameters import TensorSplit, describe
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.tensor import enter, leave
from fastllm_example_plugin.config import SquaredReLUMLPConfig


class SquaredReLUMLP(torch.nn.Module):
    """layer_1 column-parallel, layer_2 row-parallel over the tensor ranks, as fastllm's MLP."""

    def __init__(
        self,
        config: SquaredReLUMLPConfig,
        transformer: TransformerConfig,
        layer_index: int,
        mesh: ParallelMesh,
        lora: LoRAConfig | None,
    ) -> None:
        super().__init__()
        # LoRA on mlp_1/mlp_2 is refused at config time for a plugin's MLP: `lora` is unused.
        self.tensor = mesh.tensor
        width, hidden = config.width(transformer), transformer.hidden_size
        self.layer_1 = torch.nn.Linear(hidden, width // self.tensor.size, bias=False)
        self.layer_2 = torch.nn.Linear(width // self.tensor.size, hidden, bias=False)
        describe(self.layer_1, "weight", weight_decay=True, tensor_split=TensorSplit(0, (width,)))
        describe(self.layer_2, "weight", weight_decay=True, tensor_split=TensorSplit(1, (width,)))

    def forward(self, x: Tensor, norm: NormalizationLayer) -> tuple[Tensor, None]:
        """The MLP of norm(x), x the block's residual stream; no auxiliary loss."""
        h = norm.project(enter(x, self.tensor), self.layer_1.weight, None)
        out = F.linear(F.relu(h).square(), self.layer_2.weight)
        return leave(out, self.tensor), None

    def initializers(
        self, std: float, output_std: float, generator: torch.Generator | None
    ) -> list[tuple[Tensor, Callable[[Tensor], None]]]:
        """normal(0, std) into the MLP, normal(0, output_std) back to the residual stream."""
        return [
            (self.layer_1.weight, lambda t: t.normal_(0.0, std, generator=generator)),
            (self.layer_2.weight, lambda t: t.normal_(0.0, output_std, generator=generator)),
        ]
