"""ZeRO-3 with FP8 linear layers on two Gloo processes (FP8 emulated on the CPU): every FP8
weight computes from the gathered FP8 image, which equals the quantization of the whole weight
bit for bit (an outlier lies in the second rank's shard, so scales taken from one rank's
pieces alone would not), the gradients are the unsharded FP8 model's, delayed scaling records
the whole weights' amaxes, and exports still gather the weights whole in bf16."""

from __future__ import annotations

from tests.data.conftest import CliResult

# Run by the fixture two_ranks (tests/engine/conftest.py).
TWO_RANKS = """
import copy
import torch
from fastllm.engine.fp8 import apply_fp8
from fastllm.parallel.process_group import setup_distributed
from fastllm.model import GPTModel, initialize
from fastllm.model.parameters import meta_of
from fastllm_kernels.fp8.amax_history import WEIGHT
from fastllm_kernels.fp8.quantize import E4M3, DelayedScale, quantize
from fastllm.engine.weights_io import full_parameters
from tests.engine.shards import assert_shard_gradients_double, two_rank_stages
from tests.engine.test_stage_buffers import tiny_config

distributed = setup_distributed()
cpu = torch.device("cpu")
config = tiny_config("model.base_model.transformer.num_layers=3", "model.multi_stage.recompute=none")
reference = GPTModel(config.model.base_model)
initialize(reference, torch.Generator().manual_seed(0))
outliers = [block.mlp.layer_2.weight for block in reference.layers]
with torch.no_grad():
    for weight in outliers:  # the last element of each stage's last FP8 weight
        weight[-1, -1] = 64 * weight.abs().max()
reference = reference.bfloat16()
tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
labels = torch.roll(tokens, -1, dims=1)
layers = lambda m: [l for b in m.layers for l in (b.attention.query_key_value, b.attention.dense, b.mlp.layer_1, b.mlp.layer_2)]

for recipe in ("tensorwise", "rowwise", "delayed"):
    tensorwise, delayed = recipe != "rowwise", recipe == "delayed"
    model, stages = two_rank_stages(config, reference, distributed.rank, 3, torch.bfloat16)
    dense = stages.dense
    name = "tensorwise" if tensorwise else "rowwise"
    histories = apply_fp8(model, name, cpu, keep_copies=False, delayed=delayed)
    unsharded = copy.deepcopy(reference)
    theirs = apply_fp8(unsharded, name, cpu, keep_copies=False, delayed=delayed)
    if delayed:  # below the outliers' amaxes: those saturate
        for h in (histories, theirs):
            h.history.fill_(1.0)
            h.primed = [True] * len(h.primed)
    for weight in outliers:
        name = next(n for n, p in reference.named_parameters() if p is weight)
        layout = dense.buffers.layout
        stage, offset, numel = layout.parameter(name)
        assert offset + numel - 1 >= layout.shard_range(stage, 1)[0], "outlier on rank 0"

    checked = []
    pairs = dict(zip(layers(model), layers(unsharded), strict=True))
    def check(module):
        fp8, full = meta_of(module, "weight").recipe.fp8, pairs[module].weight.detach()
        assert fp8.gathered is not None, "not gathered in FP8"
        index = layers(model).index(module)
        scale = DelayedScale(torch.ones(1), None) if delayed else None
        expected = quantize(full, E4M3, tensorwise=tensorwise, columns=True, delayed=scale)
        assert torch.equal(fp8.gathered.data.view(torch.uint8), expected.rows.data.view(torch.uint8)), recipe
        assert torch.equal(fp8.gathered.scale, expected.rows.scale)
        columns = fp8.columns(module.weight)
        assert torch.equal(columns.data.view(torch.uint8), expected.columns.data.view(torch.uint8))
        assert torch.equal(columns.scale, expected.columns.scale)
        checked.append(index)
    for layer in layers(model):  # the blocks call the projections' weights, not the modules
        fp8 = meta_of(layer, "weight").recipe.fp8
        fp8.rows = lambda w, rows=fp8.rows, layer=layer: (check(layer), rows(w))[1]
    model.loss(tokens, labels).backward()
    stages.finish_backward()
    assert sorted(set(checked)) == list(range(len(layers(model)))), checked
    unsharded.loss(tokens, labels).backward()
    if delayed:
        amaxes = torch.stack([l.weight.detach().float().abs().amax() for l in layers(unsharded)])
        assert torch.equal(histories.current[:, WEIGHT], amaxes)
        assert torch.equal(histories.current[:, WEIGHT], theirs.current[:, WEIGHT])
    grads = {name: p.grad for name, p in unsharded.named_parameters()}
    assert_shard_gradients_double(dense.buffers, grads, distributed.rank, rtol=2e-2, atol=1e-4)
    assert all(b.untyped_storage().nbytes() == 0 for b in dense.gatherer.buffers), "left gathered"
    exported = {name: tensor.clone() for name, tensor in full_parameters(dense)}
    for name, parameter in reference.named_parameters():
        assert torch.equal(exported[name], parameter.detach()), name
"""


def test_zero3_gathers_fp8_weights_as_their_whole_quantization(two_ranks: CliResult) -> None:
    assert two_ranks.returncode == 0, two_ranks.stderr
