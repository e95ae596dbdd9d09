"""`schedule`: how each step's sequences are cut into passes."""

from __future__ import annotations

from fastllm.config.section import Section, check_positive


class ScheduleConfig(Section):
    micro_batch_splits: int = 1
    """Pieces each sequence of a micro-batch is cut into, run one after another (Fast-LLM's
    micro-sequences): a later piece attends to the keys and values of the earlier ones, which
    stay in the autograd graph, so one backward pass over the pieces' losses gives the
    gradients of the whole sequences. Each forward pass then holds one piece's transient
    activations (logit chunks, MLP intermediates, attention workspace); the stored ones are
    those of the whole sequences."""

    def validate(self) -> None:
        check_positive(self.micro_batch_splits, "micro_batch_splits")
