from __future__ import annotations

import pytest
import torch

from fastllm_kernels.accumulate import accumulate_, accumulate_reference_
from tests.kernels.conftest import cuda, triton_on_cpu


def _check(device: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    target = torch.randn(shape, device=device)
    source = torch.randn(shape, device=device).to(dtype)
    expected = target.clone()
    accumulate_reference_(expected, source)
    accumulate_(target, source)
    torch.testing.assert_close(target, expected, rtol=0, atol=0)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (4097,), (33, 130)])
def test_accumulate_adds_every_element_exactly(shape, dtype) -> None:
    _check("cpu", shape, dtype)


def test_accumulate_takes_strided_views_through_the_reference() -> None:
    target = torch.zeros(8, 6)
    source = torch.arange(48, dtype=torch.float32).view(6, 8).t().bfloat16()
    accumulate_(target[:, :4], source[:, :4])
    assert torch.equal(target[:, :4], source[:, :4].float())
    assert not target[:, 4:].any()


def test_accumulate_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="cannot accumulate"):
        accumulate_(torch.zeros(4), torch.zeros(5))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accumulate_on_gpu(dtype) -> None:
    _check("cuda", (3, 1_000_003), dtype)
