"""Micro-sequences: a micro-batch's sequences cut into pieces that run one after another, each
piece's attention reading the keys and values of the pieces before it (Fast-LLM's
`micro_batch_splits`; `engine.batch` cuts them). When the step's program has one stage (the
whole model), the keys and values stay in the autograd graph (`KeyValueMemory`), so one
backward pass over the pieces' losses reaches the earlier pieces through them; run stage by
stage, each piece is a unit of the schedule and its backward pass its own
(`StagedKeyValueMemory`)."""

from __future__ import annotations

import torch
from torch import Tensor


class KeyValueMemory:
    """The keys and values of the pieces run so far, per layer, as the model's `cache` (the
    `update` / `get_seq_length` of a transformers Cache, in its (batch, heads, seq, head)
    layout): `update` appends a piece's and returns all of them."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[Tensor, Tensor]] = {}

    def get_seq_length(self) -> int:
        """Positions of the pieces run so far (where the next piece starts)."""
        return self._layers[0][0].shape[2] if 0 in self._layers else 0

    def update(self, k: Tensor, v: Tensor, layer_index: int) -> tuple[Tensor, Tensor]:
        if layer_index in self._layers:
            earlier_k, earlier_v = self._layers[layer_index]
            k, v = torch.cat([earlier_k, k], dim=2), torch.cat([earlier_v, v], dim=2)
        self._layers[layer_index] = (k, v)
        return k, v


class StagedKeyValueMemory:
    """The keys and values of a micro-batch's pieces when the pieces run stage by stage
    (the step runner): each stage's backward pass of a piece is its own autograd call, so a
    later piece reads an earlier piece's keys and values as leaves cut from that piece's
    graph; their gradients, added up over the later pieces' backward passes (which the
    schedule runs first), are what the earlier piece's backward pass starts from at those
    keys and values (`backward_roots`)."""

    def __init__(self) -> None:
        self._own: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        """(layer, piece) → the piece's keys and values, in its graph."""
        self._leaves: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        """(layer, piece) → the same, as leaves the later pieces read."""

    def piece(self, index: int, start: int) -> PieceCache:
        """The model's `cache` for piece `index`, which starts at position `start`."""
        return PieceCache(self, index, start)

    def update(self, k: Tensor, v: Tensor, layer_index: int, piece: int) -> tuple[Tensor, Tensor]:
        earlier = [self._leaves[(layer_index, p)] for p in range(piece)]
        if torch.is_grad_enabled():
            self._own[(layer_index, piece)] = (k, v)
            self._leaves[(layer_index, piece)] = (
                k.detach().requires_grad_(True),
                v.detach().requires_grad_(True),
            )
        else:
            self._leaves[(layer_index, piece)] = (k, v)
        if not earlier:
            return k, v
        keys = torch.cat([*(leaf for leaf, _ in earlier), k], dim=2)
        values = torch.cat([*(leaf for _, leaf in earlier), v], dim=2)
        return keys, values

    def backward_roots(self, layers: range, piece: int) -> tuple[list[Tensor], list[Tensor]]:
        """The keys and values of `piece` at `layers` (one stage's) and the gradients the
        later pieces gave them, for that stage's backward pass of the piece; forgets them."""
        tensors, grads = [], []
        for layer in layers:
            own = self._own.pop((layer, piece), None)
            leaves = self._leaves.pop((layer, piece), None)
            if own is None or leaves is None:
                continue
            for tensor, leaf in zip(own, leaves, strict=True):
                if leaf.grad is not None:
                    tensors.append(tensor)
                    grads.append(leaf.grad)
        return tensors, grads


class PieceCache:
    """One piece's view of a `StagedKeyValueMemory`, as the model's `cache`."""

    def __init__(self, memory: StagedKeyValueMemory, piece: int, start: int) -> None:
        self.memory, self.index, self.start = memory, piece, start

    def get_seq_length(self) -> int:
        return self.start

    def update(self, k: Tensor, v: Tensor, layer_index: int) -> tuple[Tensor, Tensor]:
        return self.memory.update(k, v, layer_index, self.index)


class AnswerStates:
    """A micro-batch's final hidden states of its pieces, for the losses that read whole
    answers: an answer's log-probability sums its tokens, which may fall in several pieces,
    and DPO's loss of it is no sum over them. They run once, at the last piece, on the
    states joined; with the reference models' log-probabilities summed over the pieces.
    Run whole, the pieces are one autograd graph; run stage by stage (`staged`), the earlier
    pieces' states are leaves cut from their graphs, whose gradients (from the last piece's
    backward pass, which the schedule runs first) are where their own backward passes start
    (`backward_root`)."""

    def __init__(self, staged: bool) -> None:
        self.staged = staged
        self._states: list[Tensor] = []
        """The earlier pieces' states, in order (leaves when staged)."""
        self._own: dict[int, Tensor] = {}
        """piece → its states in its graph, when staged."""
        self.log_probs: dict[str, Tensor] = {}
        """Reference model → its log-probabilities of each answer, summed over the pieces."""

    def keep(self, piece: int, states: Tensor) -> None:
        """An earlier piece's states (the pieces in order)."""
        if self.staged and states.requires_grad:
            self._own[piece] = states
            states = states.detach().requires_grad_(True)
        self._states.append(states)

    def add_log_probs(self, name: str, log_probs: Tensor) -> None:
        """Reference model `name`'s log-probabilities of a piece's tokens of each answer."""
        earlier = self.log_probs.get(name)
        self.log_probs[name] = log_probs if earlier is None else earlier + log_probs

    def join(self, states: Tensor) -> Tensor:
        """The micro-batch's states: the earlier pieces' and the last one's `states`."""
        return torch.cat([*self._states, states], dim=1)

    def backward_root(self, piece: int) -> tuple[Tensor, Tensor] | None:
        """An earlier piece's states and the gradient the losses gave them, for its last
        stage's backward pass (staged); forgets them."""
        own = self._own.pop(piece, None)
        if own is None:
            return None
        grad = self._states[piece].grad
        return None if grad is None else (own, grad)
