"""The MLP of a block: dense (gated or plain) or a mixture of experts (dropless, or looped as
the reference). Both take the block's residual stream and its norm, and return the output and
the auxiliary loss."""

from __future__ import annotations

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor

from fastllm.config.model import LoRAConfig, MLPConfig, TransformerConfig
from fastllm.model.lora import adapter_of, expert_adapter_of
from fastllm.model.normalization import InputNorm, Normalization
from fastllm.model.parameters import TensorSplit, describe
from fastllm.model.routing import route_scored
from fastllm.parallel.dimension import Dimension
from fastllm.parallel.expert import exchange
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.tensor import TensorDimension, counted_once, enter, leave
from fastllm_kernels.activation import gated_activation_fused
from fastllm_kernels.gated_linear import gated_linear
from fastllm_kernels.gated_mlp import gated_mlp
from fastllm_kernels.linear import linear
from fastllm_kernels.moe.grouped_linear import grouped_linear
from fastllm_kernels.moe.routing import route
from fastllm_kernels.moe.sparse_copy import combine, dispatch
from fastllm_kernels.moe.sparse_map import SparseMap, sparse_map
from fastllm_kernels.recipe import WeightRecipe

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "squared_relu": lambda x: F.relu(x).square(),
}


def mlp_layer(
    config: MLPConfig,
    transformer: TransformerConfig,
    layer_index: int,
    mesh: ParallelMesh,
    lora: LoRAConfig | None,
) -> MLP | MixtureOfExperts:
    """The `mlp` component's layer: a mixture of experts in the blocks that have experts, else
    the dense MLP (`dense_ffn_width` wide in a mixture-of-experts model's first dense
    blocks)."""
    if transformer.has_experts(layer_index):
        return MixtureOfExperts(transformer, mesh.tensor, mesh.expert, lora)
    return MLP(_dense(transformer), mesh.tensor, lora)


def _dense(config: TransformerConfig) -> TransformerConfig:
    """`config` for a dense MLP: a mixture-of-experts model's first dense blocks are
    `dense_ffn_width` wide."""
    if config.num_experts == 1:
        return config
    return msgspec.structs.replace(config, ffn_hidden_size=config.dense_ffn_width, num_experts=1)


class MLP(torch.nn.Module):
    """layer_2(act(layer_1 x)); when gated, layer_1 holds [gate; up] and act(gate) * up.
    layer_1 is column-parallel (each tensor rank holds matching gate and up rows), layer_2
    row-parallel.

    Its interface, shared with `MixtureOfExperts`: `forward(x, norm)` on the block's residual
    stream returns the output and the auxiliary loss (None here)."""

    recompute_activation = True
    """A gated activation is recomputed in the backward pass rather than stored."""

    def __init__(
        self,
        config: TransformerConfig,
        tensor: TensorDimension | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        assert config.ffn_hidden_size is not None and config.activation_type is not None
        self.gated, self.activation = config.gated, config.activation_type
        self.tensor = tensor = tensor or TensorDimension()
        inputs = 2 if self.gated else 1
        bias = config.biases_elsewhere
        ffn = config.ffn_hidden_size // tensor.size
        self.layer_1 = torch.nn.Linear(config.hidden_size, inputs * ffn, bias=bias)
        self.layer_2 = torch.nn.Linear(ffn, config.hidden_size, bias=bias)
        self.layer_1_recipe, self.layer_2_recipe = WeightRecipe(), WeightRecipe()
        split_1 = TensorSplit(0, (config.ffn_hidden_size,) * inputs)
        describe(
            self.layer_1,
            "weight",
            weight_decay=True,
            tensor_split=split_1,
            recipe=self.layer_1_recipe,
        )
        describe(self.layer_1, "bias", weight_decay=False, tensor_split=split_1)
        split_2 = TensorSplit(1, (config.ffn_hidden_size,))
        describe(
            self.layer_2,
            "weight",
            weight_decay=True,
            tensor_split=split_2,
            recipe=self.layer_2_recipe,
        )
        describe(self.layer_2, "bias", weight_decay=False, sequence_tensor_parallel_replicated=True)
        full, hidden = config.ffn_hidden_size, config.hidden_size
        self.layer_1_lora = adapter_of(lora, ("mlp_1",) * inputs, hidden, (full,) * inputs, tensor)
        self.layer_2_lora = adapter_of(lora, ("mlp_2",), full, (hidden,), tensor, row_parallel=True)

    def forward(self, x: Tensor, norm: InputNorm) -> tuple[Tensor, None]:
        """The MLP of norm(x) (the block's residual stream, normalized by the first projection)."""
        out = self.partial(enter(x, self.tensor), norm)
        if not self.tensor.split:
            return out, None
        return leave(out, self.tensor, self.layer_2.bias), None

    def partial(self, x: Tensor, norm: InputNorm) -> Tensor:
        """This tensor rank's part of the MLP of norm(x), x already through `enter` (whole);
        the second layer's bias added only when not split (`leave` adds it after the sum)."""
        adapted = self.layer_1_lora is not None or self.layer_2_lora is not None
        fused = isinstance(norm, Normalization) and norm.recompute and self.gated
        if fused and self.recompute_activation and not self.tensor.split and not adapted:
            # The MLP from the norm on as one op, which fuses it where the recipes allow (FP8);
            # tensor-parallel ranks keep the two projections apart.
            return gated_mlp(
                x, norm.scale, norm.bias, norm.epsilon, norm.bias is None,
                self.layer_1.weight, self.layer_1.bias, self.layer_1_recipe,
                self.layer_2.weight, self.layer_2.bias, self.layer_2_recipe, self.activation,
            )  # fmt: skip
        weight, bias = self.layer_1.weight, self.layer_1.bias
        if self.layer_1_lora is None:
            h = norm.project(x, weight, bias, self.layer_1_recipe)
        else:  # the adapters read norm(x) too: the norm is not fused into the projection
            h = self.layer_1_lora.project(norm(x), weight, bias, self.layer_1_recipe)
        bias_2 = None if self.tensor.split else self.layer_2.bias
        if self.layer_2_lora is None:
            return _project(
                h,
                self.layer_2.weight,
                bias_2,
                self.gated,
                self.activation,
                self.recompute_activation,
                self.layer_2_recipe,
            )
        # The adapters read act(h): it is stored, not recomputed in the backward pass.
        active = _activate(h, self.gated, self.activation)
        return self.layer_2_lora.project(active, self.layer_2.weight, bias_2, self.layer_2_recipe)


def _activate(h: Tensor, gated: bool, activation: str) -> Tensor:
    """act(h), or act(gate) * up of h = [gate; up] when gated."""
    return gated_activation_fused(h, activation) if gated else _ACTIVATIONS[activation](h)


def _project(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    gated: bool,
    activation: str,
    recompute: bool = True,
    recipe: WeightRecipe | None = None,
) -> Tensor:
    """The second projection of act(h), under the weight's `recipe`; with `recompute`, a gated
    activation is recomputed in the backward pass rather than stored."""
    if gated and recompute:
        return gated_linear(h, weight, bias, activation, recipe)
    return linear(_activate(h, gated, activation), weight, bias, recipe)


class MixtureOfExperts(torch.nn.Module):
    """Top-k routing: softmax over the experts, each token sent to its k most probable, their
    probabilities (renormalized to sum to 1 with `expert_renormalize`, as Mixtral does) weighting
    the experts' outputs; plus, with `num_shared_experts`, an MLP every token goes through
    (Qwen2-MoE, DeepSeek), its output gated per token with `shared_expert_gate`.

    With tensor parallelism every expert's ffn (and the shared MLP's) is split as the dense
    MLP's is, layer_1 column-parallel and layer_2 row-parallel, while the router and the shared
    gate are replicated: `enter` gives every tensor rank the same whole tokens (gathering the
    sequence under sequence parallelism), so all route alike, and one `leave` sums the routed
    and shared parts. Each rank's routing-weight gradient is then its part of the whole, so
    the router's and the shared gate's gradients are summed over the tensor ranks.

    Dropless (`dropless_moe`): the routed tokens are permuted into a sparse layout of contiguous
    per-expert rows, both projections are grouped matmuls over it, and the outputs are permuted
    back scaled by the routing weights (kernels/fastllm_kernels/moe/). Otherwise a loop over
    the experts, the reference.

    `forward` returns the output and the router's auxiliary losses (load balancing, z-loss),
    already weighted by their coefficients. While training, `load` sums the tokens routed to
    each expert until `take_expert_load` reads it.

    With expert parallelism (`ep` of more than one rank) this rank holds only its 1/E of the
    experts (`layer_1` and `layer_2` list them) and computes them for the tokens the expert
    group routes to them (parallel/expert.py; with tensor parallelism too, each tensor
    rank exchanging with its peers of the other data ranks); routing, the shared experts and
    the auxiliary losses stay per rank, on its own tokens.

    With LoRA on the experts (`experts_1`, `experts_2`), `layer_1_lora` and `layer_2_lora`
    hold each expert's adapters, split as the experts' weights are (model/lora.py); they
    compute on the same expert-ordered rows as the weights. The shared MLP is adapted as a
    dense one (`mlp_1`, `mlp_2`)."""

    recompute_activation = True
    """The looped path recomputes a gated activation in the backward pass rather than storing
    it (the dropless path stores it: its grouped matmul keeps its input for the weight
    gradient anyway)."""

    def __init__(
        self,
        config: TransformerConfig,
        tensor: TensorDimension | None = None,
        expert: Dimension | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        assert config.ffn_hidden_size is not None and config.activation_type is not None
        self.tensor = tensor = tensor or TensorDimension()
        self.gated, self.activation = config.gated, config.activation_type
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_token
        self.renormalize, self.dropless = config.expert_renormalize, config.dropless_moe
        self.routing = None if config.default_routing else config
        """The config of a router other than top-k of a softmax (model/routing.py)."""
        self.auxiliary_coefficient = config.expert_auxiliary_loss_coefficient
        self.z_loss_coefficient = config.expert_z_loss_coefficient
        hidden, ffn = config.hidden_size, config.ffn_hidden_size
        inputs = 2 if self.gated else 1
        local = ffn // tensor.size
        self.router = torch.nn.Linear(hidden, self.num_experts, bias=False)
        self.expert = expert or Dimension()
        held = self.num_experts // self.expert.size
        self.layer_1 = torch.nn.Parameter(torch.empty(held, inputs * local, hidden))
        self.layer_2 = torch.nn.Parameter(torch.empty(held, hidden, local))
        self.layer_1_recipe, self.layer_2_recipe = WeightRecipe(), WeightRecipe()
        describe(self.router, "weight", weight_decay=True, tensor_partial=True)
        split_1 = TensorSplit(1, (ffn,) * inputs)  # matching gate and up rows of every expert
        describe(
            self,
            "layer_1",
            weight_decay=True,
            tensor_split=split_1,
            expert_split=True,
            recipe=self.layer_1_recipe,
        )
        split_2 = TensorSplit(2, (ffn,))
        describe(
            self,
            "layer_2",
            weight_decay=True,
            tensor_split=split_2,
            expert_split=True,
            recipe=self.layer_2_recipe,
        )
        self.layer_1_lora = expert_adapter_of(
            lora, "experts_1", held, hidden, (ffn,) * inputs, tensor
        )
        self.layer_2_lora = expert_adapter_of(
            lora, "experts_2", held, ffn, (hidden,), tensor, row_parallel=True
        )
        self.shared = None
        if config.num_shared_experts:
            width = config.num_shared_experts * ffn
            shared = msgspec.structs.replace(config, ffn_hidden_size=width, num_experts=1)
            self.shared = MLP(shared, tensor, lora)  # a dense MLP: mlp_1 and mlp_2 adapt it
        self.shared_gate = (
            torch.nn.Linear(hidden, 1, bias=False) if config.shared_expert_gate else None
        )
        if self.shared_gate is not None:
            describe(self.shared_gate, "weight", weight_decay=True, tensor_partial=True)
        self.expert_bias = (
            torch.nn.Parameter(torch.zeros(self.num_experts)) if config.expert_bias else None
        )
        self.expert_bias_update_rate = config.expert_bias_update_rate
        describe(self, "expert_bias", weight_decay=False, balancing_bias=True)
        self.load: Tensor | None = None
        self.step_load: Tensor | None = None
        """With `expert_bias`: the tokens routed to each expert since the last optimizer step
        (`take_step_loads`)."""

    def forward(self, x: Tensor, norm: InputNorm) -> tuple[Tensor, Tensor | None]:
        """The mixture of norm(x), the block's residual stream, and the router's weighted
        losses (None when it has none)."""
        x = enter(x, self.tensor)
        normed = norm(x)
        tokens = normed.reshape(-1, normed.shape[-1])
        if self.routing is None:
            weights, experts, counts, auxiliary, sparse = route(
                self.router(tokens),
                self.top_k,
                self.renormalize,
                x.dtype,
                self.auxiliary_coefficient,
                self.z_loss_coefficient,
            )
        else:
            weights, experts, counts, auxiliary, sparse = route_scored(
                self.router(tokens), self.routing, self.expert_bias, x.dtype
            )
            if not (self.auxiliary_coefficient or self.z_loss_coefficient):
                auxiliary = None  # no loss of the router's: nothing to differentiate
        if self.expert.split:
            out = exchange(tokens, weights, experts, counts, self.expert, self._held)
        elif self.dropless:
            out = self._dropless(tokens, weights, sparse)
        else:
            out = self._looped(tokens, weights, experts)
        # Not while a backward pass recomputes the forward (selective or full recomputation).
        if self.training and torch._C._current_graph_task_id() == -1:
            self.load = counts if self.load is None else self.load + counts
            if self.expert_bias is not None:
                step = self.step_load
                self.step_load = counts if step is None else step + counts
        if self.shared is not None:
            shared = self.shared.partial(x, norm).reshape_as(out)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(tokens))
            out = out + shared
        if not self.tensor.split:
            return out.view_as(x), auxiliary
        once = None if auxiliary is None else counted_once(auxiliary, self.tensor)
        return leave(out.view_as(x), self.tensor), once

    def _held(self, rows: Tensor, experts: Tensor) -> Tensor:
        """This rank's experts on `rows` (rows, hidden), row i through its expert `experts[i]`
        (expert parallelism: the rows the expert group routed here), unweighted."""
        ones = rows.new_ones(rows.shape[0], 1)
        if self.dropless:
            return self._dropless(rows, ones, sparse_map(experts[:, None], self.layer_1.shape[0]))
        return self._looped(rows, ones, experts[:, None])

    def _dropless(self, tokens: Tensor, weights: Tensor, sparse: SparseMap) -> Tensor:
        rows = dispatch(tokens, sparse)
        h = grouped_linear(rows, self.layer_1, sparse.ends, self.layer_1_recipe)
        if self.layer_1_lora is not None:
            h = self.layer_1_lora.add_grouped(h, rows, sparse.ends)
        h = _activate(h, self.gated, self.activation)
        y = grouped_linear(h, self.layer_2, sparse.ends, self.layer_2_recipe)
        if self.layer_2_lora is not None:
            y = self.layer_2_lora.add_grouped(y, h, sparse.ends)
        return combine(y, sparse, weights)

    def _looped(self, tokens: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        out = torch.zeros_like(tokens)
        for expert in range(self.layer_1.shape[0]):  # the experts this rank holds
            rows, slot = torch.nonzero(experts == expert, as_tuple=True)
            if rows.numel() == 0:
                continue
            x = tokens[rows]
            h = F.linear(x, self.layer_1[expert])
            if self.layer_1_lora is not None:
                h = self.layer_1_lora.add_expert(h, x, expert)
            if self.layer_2_lora is None:
                y = _project(
                    h,
                    self.layer_2[expert],
                    None,
                    self.gated,
                    self.activation,
                    self.recompute_activation,
                )
            else:  # the adapters read act(h): stored, not recomputed
                active = _activate(h, self.gated, self.activation)
                y = self.layer_2_lora.add_expert(
                    F.linear(active, self.layer_2[expert]), active, expert
                )
            y = y * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return out


def take_expert_load(model: torch.nn.Module) -> Tensor | None:
    """(layers, experts): the tokens routed to each expert of each mixture since the last
    call (None for a model without experts); resets the counts."""
    loads = []
    for module in model.modules():
        if isinstance(module, MixtureOfExperts) and module.load is not None:
            loads.append(module.load)
            module.load = None
    return torch.stack(loads) if loads else None


def take_step_loads(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, Tensor, float]]:
    """Each mixture with an `expert_bias`: the bias, the tokens routed to each of its experts
    since the last call (zeros if none were) and its update rate; resets the counts."""
    loads = []
    for module in model.modules():
        bias = module.expert_bias if isinstance(module, MixtureOfExperts) else None
        if bias is not None and bias.device.type != "meta":  # not another pipeline rank's
            load = module.step_load
            if load is None:
                load = torch.zeros(module.num_experts, dtype=torch.int64, device=bias.device)
            loads.append((bias, load, module.expert_bias_update_rate))
            module.step_load = None
    return loads
