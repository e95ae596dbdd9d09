"""A Gemma 3-style model on the GPU (bf16: the Triton norms with 1 + weight in fp32, fused into
the projections; sliding and global blocks through flash-attn or flex_attention with document
masks) against the same weights in fp32 on the CPU (the torch references, dense masks)."""

from __future__ import annotations

import pytest
import torch

from fastllm.config import TrainerConfig, load_config
from fastllm.model import GPTModel, initialize
from tests.conftest import ROOT
from tests.kernels.conftest import cuda


@pytest.mark.gpu
@cuda
def test_gemma3_style_model_on_gpu_matches_the_cpu_reference() -> None:
    small = [
        f"model.base_model.transformer.{key}"
        for key in (
            "num_layers=4",
            "hidden_size=256",
            "num_attention_heads=4",
            "head_groups=2",
            "kv_channels=64",
            "ffn_hidden_size=512",
            "window_size=64",
            "global_attention_interval=2",
        )
    ] + ["model.base_model.vocab_size=1024"]
    config = load_config(TrainerConfig, [ROOT / "examples" / "gemma3-4b.yaml"], small)
    reference = GPTModel(config.model.base_model)
    generator = torch.Generator().manual_seed(8)
    initialize(reference, generator)
    with torch.no_grad():  # zero-centered norms away from their start
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.1, generator=generator)
    model = GPTModel(config.model.base_model).cuda().bfloat16()
    model.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, 1024, (2, 512), generator=generator)
    labels = torch.randint(0, 1024, (2, 512), generator=generator)
    documents = (torch.arange(512) >= 200).long() + (torch.arange(512) >= 390).long()
    documents = documents.expand(2, -1).contiguous()

    expected = reference.loss(input_ids, labels, document_ids=documents)
    expected.backward()
    loss = model.loss(input_ids.cuda(), labels.cuda(), document_ids=documents.cuda())
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=2e-2)
    gpu = dict(model.named_parameters())
    for name, parameter in reference.named_parameters():
        ours, theirs = gpu[name].grad.float().cpu(), parameter.grad
        error = (ours - theirs).norm() / theirs.norm()
        assert error <= 5e-2, (name, error.item())
