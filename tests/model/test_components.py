"""A normalization and a mixer of another package (defined here, named by import path) build
into the model as fastllm's do: through their contracts, with their parameters' metadata and
initializers, counted by their configs, and trained by the gradients that reach them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config import BaseModelConfig, build
from fastllm.config.model import LoRAConfig, MixerConfig, NormalizationConfig, TransformerConfig
from fastllm.model import GPTModel
from fastllm.model.init import initialize
from fastllm.model.normalization import NormalizationLayer
from fastllm.model.parameters import describe, meta_of, parameter_metas
from fastllm.parallel.mesh import ParallelMesh

HERE = "tests.model.test_components"


class ScaleNormConfig(NormalizationConfig, tag="test_components_scale_norm"):
    """ScaleNorm (Nguyen and Salazar 2019): g · x / ‖x‖, one learned scalar g."""

    implementation = f"{HERE}:ScaleNorm"

    def num_parameters(self, size: int) -> int:
        return 1


class ScaleNorm(NormalizationLayer):
    def __init__(self, config: ScaleNormConfig, size: int, *, tensor_partial: bool) -> None:
        super().__init__()
        self.size, self.epsilon = size, config.epsilon
        self.scale = torch.nn.Parameter(torch.empty(1))
        describe(
            self,
            "scale",
            weight_decay=False,
            tensor_partial=tensor_partial,
            sequence_tensor_parallel_replicated=not tensor_partial,
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x / (x.norm(dim=-1, keepdim=True) + self.epsilon)

    def initializers(
        self, std: float, output_std: float, generator: torch.Generator | None
    ) -> list[tuple[Tensor, Callable[[Tensor], None]]]:
        return [(self.scale, lambda t: t.fill_(self.size**0.5))]


class CausalMeanMixerConfig(MixerConfig, tag="test_components_causal_mean"):
    """Each token's output: dense(the mean of value(norm(x)) over it and the tokens before)."""

    implementation = f"{HERE}:CausalMeanMixer"
    unsupported_settings: ClassVar[dict[str, str]] = {
        **MixerConfig.unsupported_settings,
        "model.distributed.tensor_parallel": "a test mixer, whole on every rank",
    }

    def num_parameters(self, transformer: TransformerConfig) -> int:
        return 2 * transformer.hidden_size**2


class CausalMeanMixer(torch.nn.Module):
    def __init__(
        self,
        config: CausalMeanMixerConfig,
        transformer: TransformerConfig,
        layer_index: int,
        mesh: ParallelMesh,
        lora: LoRAConfig | None,
    ) -> None:
        super().__init__()
        hidden = transformer.hidden_size
        self.value = torch.nn.Linear(hidden, hidden, bias=False)
        self.dense = torch.nn.Linear(hidden, hidden, bias=False)
        for layer in (self.value, self.dense):
            describe(layer, "weight", weight_decay=True)

    def forward(self, x: Tensor, norm: NormalizationLayer, *context: Any) -> Tensor:
        values = norm.project(x, self.value.weight, None)
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
        return F.linear(values.cumsum(dim=1) / counts, self.dense.weight)

    def initializers(
        self, std: float, output_std: float, generator: torch.Generator | None
    ) -> list[tuple[Tensor, Callable[[Tensor], None]]]:
        return [
            (self.value.weight, lambda t: t.normal_(0.0, std, generator=generator)),
            (self.dense.weight, lambda t: t.normal_(0.0, output_std, generator=generator)),
        ]


def model_config() -> BaseModelConfig:
    transformer = {
        "normalization": {"type": f"{HERE}:ScaleNormConfig"},
        "mixer": {"type": f"{HERE}:CausalMeanMixerConfig"},
        "num_layers": 2,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "ffn_hidden_size": 32,
    }
    return build(BaseModelConfig, {"transformer": transformer, "vocab_size": 31})


def test_a_norm_and_a_mixer_of_another_package_build_count_initialize_and_train() -> None:
    config = model_config()
    model = GPTModel(config)
    block = model.layers[0]
    assert isinstance(block.attention, CausalMeanMixer) and isinstance(block.norm_1, ScaleNorm)
    assert isinstance(model.final_norm, ScaleNorm)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    metas = parameter_metas(model)  # every parameter declared
    assert metas["layers.0.norm_1.scale"].tensor_partial
    assert not meta_of(block.attention.value, "weight").tensor_partial
    initialize(model, torch.Generator().manual_seed(0))
    assert torch.equal(block.norm_1.scale, torch.tensor([16**0.5]))
    ids = torch.randint(0, 31, (2, 7), generator=torch.Generator().manual_seed(1))
    model.loss(ids, ids.roll(-1, dims=1)).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    # causal: the first token's hidden state does not depend on the tokens after it
    changed = ids.clone()
    changed[:, 1:] = (changed[:, 1:] + 1) % 31
    with torch.no_grad():
        first, _ = model.hidden_states(ids)
        again, _ = model.hidden_states(changed)
    torch.testing.assert_close(first[:, 0], again[:, 0])
