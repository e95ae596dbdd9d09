"""Data parallelism over the flat buffers: every rank holds the full compute weights but only
its shard of the fp32 masters and Adam moments (ZeRO-1), and with ZeRO-2 only its shard of the
gradients too. The gradients are reduce-scattered into the shards stage by stage during the
backward pass (GradientReducer); after the optimizer step, each rank's updated weight shard is
all-gathered back into everyone's weights, stage by stage, overlapping the next forward pass
(WeightRefresh; ZeRO-3 gathers each stage only while it runs: see WeightGatherer).
Every collective here is over the data group; tensor and pipeline ranks have buffers of their
own (a tied head on another pipeline rank gets the embedding's new weights after them)."""

from __future__ import annotations

import torch

from fastllm.engine.model_stages import ModelStages


@torch.no_grad()
def gather_weights(stages: ModelStages, wait: bool = True) -> None:
    """Every rank's updated shard of the compute weights, into every rank's full buffers (with
    ZeRO-3, gathered copies of the old weights are dropped: stages are gathered when used).
    `wait=False` leaves the stages' all-gathers in flight for their forward passes to wait on."""
    for group in stages.groups:
        if group.gatherer is not None:
            group.gatherer.weights_changed()
        elif group.refresh is not None:
            group.refresh.start()
            if wait:
                group.refresh.wait_all()
    if stages.tied is not None:
        stages.fence.wait(stages.tied.stage)
        stages.tied.sync()
