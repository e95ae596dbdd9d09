"""One dimension of the parallel mesh (tensor, data, pipeline or a sub-group of the data
dimension) as this rank sees it: its size, this rank's place in it and its process group."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Dimension:
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    """None when size is 1: nothing is communicated over it."""

    @property
    def split(self) -> bool:
        """More than one rank: the dimension communicates."""
        return self.size > 1
