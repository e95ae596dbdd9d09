"""The dense MLP's FP8 paths: once its projections' delayed amax histories are primed, the
whole MLP runs as one fused function (kernels/fastllm_kernels/fp8/gated_mlp.py); before that, and
with biases, as the unfused pair. Triton only (the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

import fastllm.model.mlp as mlp
import fastllm_kernels.gated_mlp
from fastllm.model.normalization import Normalization
from fastllm.model.parameters import meta_of
from fastllm_kernels.fp8.amax_history import AmaxHistories
from fastllm_kernels.fp8.weight import Fp8Weight
from tests.kernels.conftest import triton_on_cpu
from tests.model.test_moe import HIDDEN, transformer


def _module(biases: str) -> tuple[mlp.MLP, Normalization, AmaxHistories]:
    config = transformer(
        gated="true", activation_type="silu", ffn_hidden_size=32, add_linear_biases=biases
    )
    module, norm = mlp.MLP(config), Normalization(config.normalization, HIDDEN)
    module.bfloat16(), norm.bfloat16()
    histories = AmaxHistories(2, 2, torch.device("cpu"))
    for index, layer in enumerate((module.layer_1, module.layer_2)):
        meta_of(layer, "weight").recipe.fp8 = Fp8Weight("tensorwise", True, (histories, index))
    return module, norm, histories


@triton_on_cpu
@pytest.mark.parametrize(("biases", "fused_steps"), [("false", 1), ("true", 0)])
def test_the_mlp_runs_fused_once_its_histories_are_primed(
    monkeypatch: pytest.MonkeyPatch, biases: str, fused_steps: int
) -> None:
    calls: list[int] = []
    fused = fastllm_kernels.gated_mlp.fp8_gated_mlp
    monkeypatch.setattr(
        fastllm_kernels.gated_mlp, "fp8_gated_mlp", lambda *args: calls.append(1) or fused(*args)
    )
    module, norm, histories = _module(biases)
    x = torch.randn(2, 16, HIDDEN).to(torch.bfloat16).requires_grad_()
    for _ in range(2):
        out, _ = module(x, norm)
        out.float().square().sum().backward()
        assert not x.grad.isnan().any()
        histories.roll()
    assert len(calls) == fused_steps
