"""The MLP of a block: dense (gated or plain) or a mixture of experts (dropless, or looped as
the reference). Both take the block's residual stream and its norm, and return the output and
the auxiliary loss."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config.model import TransformerConfig
from fastllm.engine.expert_parallel import ExpertParallel, exchange
from fastllm.engine.tensor_parallel import TensorParallel, enter, leave
from fastllm.model.parameters import TensorSplit, describe
from fastllm_kernels.activation import gated_activation_fused, gated_linear
from fastllm_kernels.linear import linear
from fastllm_kernels.moe import combine, dispatch, grouped_linear, sparse_map

if TYPE_CHECKING:
    from fastllm.model.block import Normalization

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "squared_relu": lambda x: F.relu(x).square(),
}


class MLP(torch.nn.Module):
    """layer_2(act(layer_1 x)); when gated, layer_1 holds [gate; up] and act(gate) * up.
    layer_1 is column-parallel (each tensor rank holds matching gate and up rows), layer_2
    row-parallel.

    Its interface, shared with `MixtureOfExperts`: `forward(x, norm)` on the block's residual
    stream returns the output and the auxiliary loss (None here)."""

    recompute_activation = True
    """A gated activation is recomputed in the backward pass rather than stored."""

    def __init__(self, config: TransformerConfig, tp: TensorParallel) -> None:
        super().__init__()
        assert config.ffn_hidden_size is not None and config.activation_type is not None
        self.gated, self.activation, self.tp = config.gated, config.activation_type, tp
        inputs = 2 if self.gated else 1
        bias = config.biases_elsewhere
        ffn = config.ffn_hidden_size // tp.size
        self.layer_1 = torch.nn.Linear(config.hidden_size, inputs * ffn, bias=bias)
        self.layer_2 = torch.nn.Linear(ffn, config.hidden_size, bias=bias)
        split_1 = TensorSplit(0, (config.ffn_hidden_size,) * inputs)
        describe(self.layer_1, "weight", weight_decay=True, tensor_split=split_1)
        describe(self.layer_1, "bias", weight_decay=False, tensor_split=split_1)
        split_2 = TensorSplit(1, (config.ffn_hidden_size,))
        describe(self.layer_2, "weight", weight_decay=True, tensor_split=split_2)
        describe(self.layer_2, "bias", weight_decay=False, sequence_parallel_replicated=True)

    def forward(self, x: Tensor, norm: Normalization) -> tuple[Tensor, None]:
        """The MLP of norm(x) (the block's residual stream, normalized by the first projection)."""
        x = enter(x, self.tp)
        h = norm.project(x, self.layer_1.weight, self.layer_1.bias)
        split = self.tp.split
        out = _project(
            h,
            self.layer_2.weight,
            None if split else self.layer_2.bias,
            self.gated,
            self.activation,
            self.recompute_activation,
        )
        if not split:
            return out, None
        return leave(out, self.tp, self.layer_2.bias), None


def _project(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    gated: bool,
    activation: str,
    recompute: bool = True,
) -> Tensor:
    """The second projection of act(h); with `recompute`, a gated activation is recomputed in
    the backward pass rather than stored."""
    if gated and recompute:
        return gated_linear(h, weight, bias, activation)
    if gated:
        return linear(gated_activation_fused(h, activation), weight, bias)
    return linear(_ACTIVATIONS[activation](h), weight, bias)


class MixtureOfExperts(torch.nn.Module):
    """Top-k routing: softmax over the experts, each token sent to its k most probable, their
    probabilities (renormalized to sum to 1 with `expert_renormalize`, as Mixtral does) weighting
    the experts' outputs; plus, with `num_shared_experts`, an MLP every token goes through
    (Qwen2-MoE, DeepSeek), its output gated per token with `shared_expert_gate`.

    Dropless (`dropless_moe`): the routed tokens are permuted into a sparse layout of contiguous
    per-expert rows, both projections are grouped matmuls over it, and the outputs are permuted
    back scaled by the routing weights (kernels/fastllm_kernels/moe.py). Otherwise a loop over
    the experts, the reference.

    `forward` returns the output and the router's auxiliary losses (load balancing, z-loss),
    already weighted by their coefficients. While training, `load` sums the tokens routed to
    each expert until `take_expert_load` reads it.

    With expert parallelism (`ep` of more than one rank) this rank holds only its 1/E of the
    experts (`layer_1` and `layer_2` list them) and computes them for the tokens the expert
    group routes to them (engine/expert_parallel.py); routing, the shared experts and the
    auxiliary losses stay per rank, on its own tokens."""

    recompute_activation = True
    """The looped path recomputes a gated activation in the backward pass rather than storing
    it (the dropless path stores it: its grouped matmul keeps its input for the weight
    gradient anyway)."""

    def __init__(self, config: TransformerConfig, ep: ExpertParallel | None = None) -> None:
        super().__init__()
        assert config.ffn_hidden_size is not None and config.activation_type is not None
        self.gated, self.activation = config.gated, config.activation_type
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_token
        self.ep = ep or ExpertParallel()
        self.renormalize, self.dropless = config.expert_renormalize, config.dropless_moe
        self.auxiliary_coefficient = config.expert_auxiliary_loss_coefficient
        self.z_loss_coefficient = config.expert_z_loss_coefficient
        hidden, ffn = config.hidden_size, config.ffn_hidden_size
        inputs = 2 if self.gated else 1
        self.router = torch.nn.Linear(hidden, self.num_experts, bias=False)
        local = self.num_experts // self.ep.size
        self.layer_1 = torch.nn.Parameter(torch.empty(local, inputs * ffn, hidden))
        self.layer_2 = torch.nn.Parameter(torch.empty(local, hidden, ffn))
        describe(self.router, "weight", weight_decay=True)
        for name in ("layer_1", "layer_2"):
            describe(self, name, weight_decay=True, expert_split=True)
        self.shared = None
        if config.num_shared_experts:
            width = config.num_shared_experts * ffn
            shared = msgspec.structs.replace(config, ffn_hidden_size=width, num_experts=1)
            self.shared = MLP(shared, TensorParallel())
        self.shared_gate = (
            torch.nn.Linear(hidden, 1, bias=False) if config.shared_expert_gate else None
        )
        if self.shared_gate is not None:
            describe(self.shared_gate, "weight", weight_decay=True)
        self.load: Tensor | None = None

    def forward(self, x: Tensor, norm: Normalization) -> tuple[Tensor, Tensor]:
        """The mixture of norm(x), the block's residual stream."""
        normed = norm(x)
        tokens = normed.reshape(-1, normed.shape[-1])
        logits = self.router(tokens).float()
        probabilities = logits.softmax(dim=-1)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        if self.ep.split:
            out, counts = exchange(
                tokens, weights, experts, self.num_experts, self.ep, self._local_experts
            )
        elif self.dropless:
            out, counts = self._dropless(tokens, weights, experts)
        else:
            out, counts = self._looped(tokens, weights, experts)
        # Not while a backward pass recomputes the forward (selective or full recomputation).
        if self.training and torch._C._current_graph_task_id() == -1:
            self.load = counts if self.load is None else self.load + counts
        if self.shared is not None:
            shared = self.shared(x, norm)[0].reshape_as(out)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(tokens))
            out = out + shared
        return out.view_as(x), self._auxiliary_loss(logits, probabilities, counts)

    def _local_experts(self, rows: Tensor, experts: Tensor) -> Tensor:
        """This rank's experts on `rows` (rows, hidden), row i through its expert `experts[i]`
        (expert parallelism: the rows the expert group routed here), unweighted."""
        ones = rows.new_ones(rows.shape[0], 1)
        run = self._dropless if self.dropless else self._looped
        return run(rows, ones, experts[:, None])[0]

    def _dropless(self, tokens: Tensor, weights: Tensor, experts: Tensor) -> tuple[Tensor, Tensor]:
        sparse = sparse_map(experts, self.layer_1.shape[0])
        h = dispatch(tokens, sparse.rows, sparse.num_rows)
        h = grouped_linear(h, self.layer_1, sparse.ends)
        h = (
            gated_activation_fused(h, self.activation)
            if self.gated
            else _ACTIVATIONS[self.activation](h)
        )
        y = grouped_linear(h, self.layer_2, sparse.ends)
        return combine(y, sparse.rows, weights), sparse.counts

    def _looped(self, tokens: Tensor, weights: Tensor, experts: Tensor) -> tuple[Tensor, Tensor]:
        out = torch.zeros_like(tokens)
        num_experts = self.layer_1.shape[0]
        for expert in range(num_experts):
            rows, slot = torch.nonzero(experts == expert, as_tuple=True)
            if rows.numel() == 0:
                continue
            y = _project(
                F.linear(tokens[rows], self.layer_1[expert]),
                self.layer_2[expert],
                None,
                self.gated,
                self.activation,
                self.recompute_activation,
            )
            y = y * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return out, torch.bincount(experts.flatten(), minlength=num_experts)

    def _auxiliary_loss(self, logits: Tensor, probabilities: Tensor, counts: Tensor) -> Tensor:
        # Switch-Transformer balance as Hugging Face computes it (per layer here):
        # E * sum_e (tokens routed to e, summed over the k slots, / tokens) * (mean prob of e).
        routed = counts.float() / logits.shape[0]
        balance = self.num_experts * (routed * probabilities.mean(dim=0)).sum()
        loss = self.auxiliary_coefficient * balance
        if self.z_loss_coefficient:
            loss = loss + self.z_loss_coefficient * torch.logsumexp(logits, dim=-1).square().mean()
        return loss


def take_expert_load(model: torch.nn.Module) -> Tensor | None:
    """(layers, experts): the tokens routed to each expert of each mixture since the last
    call (None for a model without experts); resets the counts."""
    loads = []
    for module in model.modules():
        if isinstance(module, MixtureOfExperts) and module.load is not None:
            loads.append(module.load)
            module.load = None
    return torch.stack(loads) if loads else None
