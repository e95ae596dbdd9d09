from __future__ import annotations

import pytest
import torch

from fastllm_kernels import master_split
from fastllm_kernels._dispatch import use_triton
from fastllm_kernels.adam import adamw_step_, adamw_step_reference_
from tests.kernels.conftest import assert_close, cuda, triton_on_cpu

pytestmark = pytest.mark.usefixtures("poisoned_empty")

HYPER = {"lr": 3e-2, "beta_1": 0.9, "beta_2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def _run_against_torch(step_fn, n, grad_dtype, grad_scale, with_copy, device="cpu", steps=3):
    """Take `steps` steps with step_fn and with torch.optim.AdamW; compare after each."""
    param = torch.nn.Parameter(torch.randn(n, device=device))
    optimizer = torch.optim.AdamW(
        [param], lr=HYPER["lr"], betas=(HYPER["beta_1"], HYPER["beta_2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], foreach=False,
    )  # fmt: skip
    params_fp32 = param.detach().clone()
    exp_avg, exp_avg_sq = torch.zeros_like(params_fp32), torch.zeros_like(params_fp32)
    compute_copy = torch.empty(n, dtype=torch.bfloat16, device=device) if with_copy else None
    for step in range(1, steps + 1):
        grads = torch.randn(n, device=device).to(grad_dtype)
        param.grad = grads.float() * grad_scale
        optimizer.step()
        step_fn(params_fp32, grads, exp_avg, exp_avg_sq, step=step, compute_copy=compute_copy,
                grad_scale=grad_scale, **HYPER)  # fmt: skip
        state = optimizer.state[param]
        assert_close(exp_avg, state["exp_avg"])
        assert_close(exp_avg_sq, state["exp_avg_sq"])
        assert_close(params_fp32, param.detach())
        if with_copy:
            assert_close(compute_copy, param.detach().bfloat16())


@triton_on_cpu
@pytest.mark.parametrize("with_copy", [False, True])
@pytest.mark.parametrize(
    ("grad_dtype", "grad_scale"), [(torch.float32, 1.0), (torch.bfloat16, 0.25)]
)
@pytest.mark.parametrize("n", [1, 1000, 5000])
def test_adamw_step_matches_torch_adamw(n, grad_dtype, grad_scale, with_copy):
    _run_against_torch(adamw_step_, n, grad_dtype, grad_scale, with_copy)


@pytest.mark.parametrize("with_copy", [False, True])
def test_adamw_reference_matches_torch_adamw(with_copy):
    _run_against_torch(adamw_step_reference_, 777, torch.bfloat16, 0.5, with_copy)


@triton_on_cpu
def test_adamw_step_updates_only_its_range():
    buffers = [torch.randn(100) for _ in range(3)]
    exp_avg_sq = torch.rand(100)
    before = [b.clone() for b in (*buffers, exp_avg_sq)]
    params, grads, exp_avg = buffers
    adamw_step_(params[10:60], grads[10:60], exp_avg[10:60], exp_avg_sq[10:60], step=4, **HYPER)
    for buffer, old in zip((*buffers, exp_avg_sq), before, strict=True):
        assert torch.equal(buffer[:10], old[:10]) and torch.equal(buffer[60:], old[60:])
    assert not torch.equal(params[10:60], before[0][10:60])


def test_adamw_step_rejects_bad_buffers():
    a = torch.zeros(8)
    with pytest.raises(ValueError, match="same length"):
        adamw_step_(a, torch.zeros(7), a.clone(), a.clone(), step=1, **HYPER)
    with pytest.raises(ValueError, match="1-based"):
        adamw_step_(a, a.clone(), a.clone(), a.clone(), step=0, **HYPER)


@pytest.mark.gpu
@cuda
def test_adamw_step_matches_torch_adamw_on_a_large_buffer():
    _run_against_torch(adamw_step_, 50_000_000 + 17, torch.bfloat16, 0.5, True, device="cuda")


def _edge_values(n: int, generator: torch.Generator) -> torch.Tensor:
    """Values over many binades, signed zeros, subnormals, infinities, exact bf16 ties and
    values just below a power of two (where rounding carries into the exponent)."""
    scales = 10.0 ** torch.randint(-30, 30, (n,), generator=generator).float()
    ties = (torch.randint(0, 2**15, (64,), generator=generator, dtype=torch.int32) << 16) | 0x8000
    ties = ties.view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, float("inf"), -float("inf")])
    below = torch.nextafter(torch.tensor([2.0, 0.5, -4.0]), torch.zeros(3))
    return torch.cat([torch.randn(n, generator=generator) * scales, ties, -ties, special, below])


def test_split_masters_hold_fp32_exactly_and_their_high_half_is_the_bf16_cast():
    values = _edge_values(4000, torch.Generator().manual_seed(0))
    high = torch.empty(values.shape, dtype=torch.bfloat16)
    low = torch.empty(values.shape, dtype=torch.int16)
    master_split.split_(values, high, low)
    assert torch.equal(master_split.join(high, low).view(torch.int32), values.view(torch.int32))
    # The cast rounds ties to even, the split away from zero: they differ on ties only.
    tie = (values.view(torch.int32) & 0xFFFF) == 0x8000
    cast = values.bfloat16().view(torch.int16)
    assert torch.equal(high.view(torch.int16)[~tie], cast[~tie])
    assert (high.view(torch.int16)[tie] != cast[tie]).any()


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("n", [1, 5000])
def test_adamw_step_on_split_masters_is_the_fp32_master_step(n, path, monkeypatch):
    # The same steps on an fp32 master and on its split form: the master bit for bit, and the
    # compute copy the cast of it except on ties.
    if path == "kernel" and not use_triton(torch.empty(0)):
        pytest.skip("Triton kernels run on CPU only with TRITON_INTERPRET=1")
    if path == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    generator = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=generator)
    high, low = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    master_split.split_(master, high, low)
    moments = [torch.zeros(n) for _ in range(4)]
    for step in range(1, 4):
        grads = torch.randn(n, generator=generator).bfloat16()
        adamw_step_(master, grads, moments[0], moments[1], step=step, grad_scale=0.5, **HYPER)
        adamw_step_(None, grads, moments[2], moments[3], step=step, grad_scale=0.5,
                    compute_copy=high, master_low=low, **HYPER)  # fmt: skip
        joined = master_split.join(high, low)
        assert torch.equal(joined.view(torch.int32), master.view(torch.int32))
        assert torch.equal(moments[0], moments[2]) and torch.equal(moments[1], moments[3])
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(high[~tie], master.bfloat16()[~tie])


def test_adamw_step_rejects_a_half_split_master():
    a, copy, low = (
        torch.zeros(8),
        torch.zeros(8, dtype=torch.bfloat16),
        torch.zeros(8, dtype=torch.int16),
    )
    with pytest.raises(ValueError, match="master_low"):
        adamw_step_(None, a.clone(), a.clone(), a.clone(), step=1, compute_copy=copy, **HYPER)
    with pytest.raises(ValueError, match="master_low"):
        adamw_step_(a, a.clone(), a.clone(), a.clone(), step=1, compute_copy=copy, master_low=low,
                    **HYPER)  # fmt: skip
