"""Helpers for the kernel tests.

On CPU the Triton kernels run only under TRITON_INTERPRET=1 (as `make test` sets it); without it
the ops fall back to their references and the Triton tests are skipped. The fixture
`poisoned_empty` makes torch.empty / torch.empty_like return NaN-filled floats, so an output
element that a kernel never writes shows up as NaN in the comparison.
"""

from __future__ import annotations

import pytest
import torch

from fastllm_kernels._dispatch import use_triton

triton_on_cpu = pytest.mark.skipif(
    not use_triton(torch.empty(0)), reason="Triton kernels run on CPU only with TRITON_INTERPRET=1"
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def poisoned_empty(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **tolerances) -> None:
    """Close within the tolerances of actual's dtype (one bf16 rounding apart passes), NaN fails.

    Under TRITON_INTERPRET=1 a float → bf16 store truncates instead of rounding to nearest, so
    kernel outputs in bf16 may sit one unit in the last place from torch's.
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    low_precision = actual.dtype in (torch.bfloat16, torch.float16)
    tolerances = {"rtol": 2e-2 if low_precision else 1.3e-6, "atol": 1e-5, **tolerances}
    torch.testing.assert_close(actual.float(), expected.float(), **tolerances)
