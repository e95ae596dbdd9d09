"""lm-eval on a model whose weights are sharded over the data ranks (ZeRO-3), in place: a
scoring pass gathers each stage as it runs and releases the others, so that no rank holds more
than two stages (and a tied head's embedding) at once; a generation call gathers every stage
once and keeps them until its last token, since gathering each stage again for each token
would move the whole model per token (its memory: the model's compute weights, whole, which
ZeRO-3 otherwise never holds).

The gathers are collectives of the data ranks, but each rank answers its own share of the
documents: a different number of passes, of other kinds, at other times. So the ranks take
turns: before each pass and before each of lm-eval's own collectives, they tell each other
what they are about to do; while some rank is about to run a pass, the others run its gathers
with it (an idle pass), then ask again. A rank reaches lm-eval's collective only once every
rank has."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import torch
import torch.distributed as dist

from fastllm.config.layout import pipeline_stages
from fastllm.engine.model_stages import ModelStages


class Pass(enum.IntEnum):
    NONE = 0
    """About to join one of lm-eval's collectives."""
    SCORE = 1
    GENERATE = 2


class ShardedPasses:
    """The passes of a model whose `stages` shard its weights over the data ranks of `group`
    (default: every rank); a pass gathers each stage as it runs it (`LayoutPasses`)."""

    def __init__(self, stages: ModelStages, group: dist.ProcessGroup | None) -> None:
        self.stages, self.group = stages, group
        self._ranks = dist.get_world_size(group)

    @contextlib.contextmanager
    def running(self, kind: Pass) -> Iterator[None]:
        """A pass of `kind` once every rank runs its gathers (a generation's weights all
        gathered first); every stage released at the end."""
        self.take_turn(kind)
        try:
            if kind == Pass.GENERATE:
                self.stages.hold_weights()
            yield
        finally:
            self.stages.release_weights()

    def take_turn(self, kind: Pass) -> None:
        """Return once `kind` is the lowest kind of pass that any rank is about to run (for
        NONE: once no rank is about to run one): the other ranks' passes meanwhile, the lowest
        kind first, run here as idle passes (their gathers only)."""
        while True:
            mine = torch.tensor(int(kind), device=self.stages.device)
            wanted = [torch.empty_like(mine) for _ in range(self._ranks)]
            dist.all_gather(wanted, mine, group=self.group)
            kinds = {Pass(k) for k in torch.stack(wanted).tolist()} - {Pass.NONE}
            if not kinds or min(kinds) == kind:
                return
            self._idle(min(kinds))

    def _idle(self, kind: Pass) -> None:
        if kind == Pass.GENERATE:
            self.stages.hold_weights()
        else:
            pipeline = self.stages.mesh.pipeline
            for stage in pipeline_stages(len(self.stages.stages), pipeline.size, pipeline.rank):
                self.stages.gather_for_forward(stage)
        self.stages.release_weights()
