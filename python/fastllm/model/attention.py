"""Self-attention: one fused q/k/v projection, QK-norm if any, rotary, then the kernels'
attention dispatch."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastllm.config.model import AttentionConfig, LoRAConfig, TransformerConfig
from fastllm.model.attend import attend
from fastllm.model.lora import adapter_of
from fastllm.model.normalization import InputNorm, Normalization
from fastllm.model.parameters import TensorSplit, describe
from fastllm.model.query_key_norm import query_key_norm
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.sequence_data import KeyValueGather, SequenceDataDimension
from fastllm.parallel.tensor import TensorDimension, enter, leave
from fastllm_kernels.attention import attention_of_qkv
from fastllm_kernels.linear import linear
from fastllm_kernels.qk_norm_rotary import split_qkv_norm_rotary
from fastllm_kernels.recipe import WeightRecipe
from fastllm_kernels.rotary import apply_rotary, split_qkv_rotary


def attention_mixer(
    config: AttentionConfig,
    transformer: TransformerConfig,
    layer_index: int,
    mesh: ParallelMesh,
    lora: LoRAConfig | None,
) -> Attention:
    """The `attention` component's layer: grouped-query attention."""
    return Attention(transformer, layer_index, mesh.tensor, mesh.sequence_data, lora)


class Attention(torch.nn.Module):
    """Column-parallel q/k/v (each tensor rank holds whole query heads and their key/value
    heads) and a row-parallel output projection. With sequence-data parallelism the queries
    of this rank's chunk attend to the keys and values of the chunks up to it, gathered from
    the group."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        tensor: TensorDimension | None = None,
        sequence_data: SequenceDataDimension | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        assert config.kv_channels is not None
        self.layer_index = layer_index
        self.tensor = tensor = tensor or TensorDimension()
        self.sequence_data = sequence_data or SequenceDataDimension()
        self.heads, self.kv_heads, self.head_size = (
            config.num_attention_heads // tensor.size,
            config.head_groups // tensor.size,
            config.kv_channels,
        )
        self.window_size = config.window_of(layer_index)
        self.scale = config.attention_scale
        self.q_size, self.kv_size = self.heads * self.head_size, self.kv_heads * self.head_size
        qkv_bias, dense_bias = config.biases_in_attention_qkv, config.biases_elsewhere
        hidden = config.hidden_size
        self.query_key_value = torch.nn.Linear(
            hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias
        )
        self.dense = torch.nn.Linear(self.q_size, hidden, bias=dense_bias)
        self.qkv_recipe, self.dense_recipe = WeightRecipe(), WeightRecipe()
        q_size, kv_size = tensor.size * self.q_size, tensor.size * self.kv_size
        qkv_split = TensorSplit(0, (q_size, kv_size, kv_size))
        describe(
            self.query_key_value,
            "weight",
            weight_decay=True,
            tensor_split=qkv_split,
            recipe=self.qkv_recipe,
        )
        describe(self.query_key_value, "bias", weight_decay=False, tensor_split=qkv_split)
        describe(
            self.dense,
            "weight",
            weight_decay=True,
            tensor_split=TensorSplit(1, (q_size,)),
            recipe=self.dense_recipe,
        )
        describe(self.dense, "bias", weight_decay=False, sequence_tensor_parallel_replicated=True)
        self.query_key_value_lora = adapter_of(
            lora, ("query", "key", "value"), hidden, (q_size, kv_size, kv_size), tensor
        )
        self.dense_lora = adapter_of(lora, ("dense",), q_size, (hidden,), tensor, row_parallel=True)
        scope = config.query_key_norm_scope
        self.query_norm = query_key_norm(
            config.query_norm, scope, self.heads, self.head_size, tensor
        )
        self.key_norm = query_key_norm(
            config.key_norm, scope, self.kv_heads, self.head_size, tensor
        )

    def forward(
        self,
        x: Tensor,
        norm: InputNorm,
        rotary: tuple[Tensor, Tensor] | None,
        document_ids: Tensor | None = None,
        cache: Any = None,
        branch_ids: Tensor | None = None,
    ) -> Tensor:
        """Attention over norm(x) (the block's input, normalized by the q/k/v projection);
        `document_ids` cover the keys (with sequence-data parallelism, the sequence up to the
        end of this rank's chunk)."""
        x = enter(x, self.tensor)
        batch, length, _ = x.shape
        cos, sin = rotary if rotary is not None else (None, None)
        out = self._attend(x, norm, cos, sin, document_ids, cache, branch_ids)
        out = out.reshape(batch, length, self.q_size)
        bias = None if self.tensor.split else self.dense.bias  # `leave` adds it after the sum
        if self.dense_lora is None:
            dense = linear(out, self.dense.weight, bias, self.dense_recipe)
        else:
            dense = self.dense_lora.project(out, self.dense.weight, bias, self.dense_recipe)
        return leave(dense, self.tensor, self.dense.bias) if self.tensor.split else dense

    def _attend(
        self,
        x: Tensor,
        norm: InputNorm,
        cos: Tensor | None,
        sin: Tensor | None,
        document_ids: Tensor | None,
        cache: Any,
        branch_ids: Tensor | None,
    ) -> Tensor:
        """The attention heads' outputs (batch, length, heads, head_size) over norm(x)."""
        if self.sequence_data.split:
            q, k, v = self._project_gathering_keys(x, norm, cos, sin)
        else:
            qkv = self._qkv(x, norm)
            if self._plain_causal(cache):  # shared prefixes' runs written by the split itself
                out = attention_of_qkv(
                    qkv, self.heads, self.kv_heads, cos, sin, document_ids=document_ids,
                    branch_ids=branch_ids, scale=self.scale,
                )  # fmt: skip
                if out is not None:
                    return out
            q, k, v = self._split_rotary(qkv, cos, sin)
        return attend(
            q, k, v, sequence_data=self.sequence_data, layer_index=self.layer_index,
            window_size=self.window_size, scale=self.scale, document_ids=document_ids,
            cache=cache, branch_ids=branch_ids,
        )  # fmt: skip

    def _plain_causal(self, cache: Any) -> bool:
        """Whether this call's attention is causal over its own positions with no window and
        q and k go only through rotary: what `attention_of_qkv` computes."""
        no_norms = self.query_norm is None and self.key_norm is None
        return cache is None and self.window_size is None and no_norms

    def _qkv(self, x: Tensor, norm: InputNorm) -> Tensor:
        """The q/k/v projection of norm(x), with its adapters' update (which read norm(x)
        itself, so the norm is not fused into the projection then)."""
        weight, bias = self.query_key_value.weight, self.query_key_value.bias
        if self.query_key_value_lora is None:
            return norm.project(x, weight, bias, self.qkv_recipe)
        return self.query_key_value_lora.project(norm(x), weight, bias, self.qkv_recipe)

    def _project_gathering_keys(
        self, x: Tensor, norm: InputNorm, cos: Tensor | None, sin: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q of this chunk, k and v of the causal prefix: keys and values are projected first,
        so that their all-gather runs while the queries are projected and rotated (a weight
        whose recipe is not `sliceable` is projected once, and the gather runs during the
        queries' rotary; so is one with adapters). (The two row slices of the projection's weight are projected without
        its recipe: they get their gradients through autograd, not its gradient sink.)"""
        batch, length, _ = x.shape
        weight, bias = self.query_key_value.weight, self.query_key_value.bias
        whole = not self.qkv_recipe.sliceable or self.query_key_value_lora is not None
        if whole:
            qkv = self._qkv(x, norm)
            q, kv = qkv.split([self.q_size, 2 * self.kv_size], dim=-1)
        else:
            rows = slice(self.q_size, None)
            kv = norm.project(x, weight[rows], None if bias is None else bias[rows])
        k, v = kv.view(batch, length, 2 * self.kv_heads, self.head_size).chunk(2, dim=2)
        if self.key_norm is not None:
            k = _normed_rotated(k, self.key_norm, cos, sin)
        elif cos is not None and sin is not None:
            k = apply_rotary(k.contiguous(), cos, sin)
        pending = KeyValueGather(k, v.contiguous(), self.sequence_data)
        if not whole:
            rows = slice(None, self.q_size)
            q = norm.project(x, weight[rows], None if bias is None else bias[rows])
        q = q.reshape(batch, length, self.heads, self.head_size)
        if self.query_norm is not None:
            q = _normed_rotated(q, self.query_norm, cos, sin)
        elif cos is not None and sin is not None:  # in place: not on a view of the projection's
            q = apply_rotary(q.clone(), cos, sin)
        k, v = pending.finish()
        return q, k, v

    def _split_rotary(
        self, qkv: Tensor, cos: Tensor | None, sin: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v from the fused projection, q and k through their norms (if any) and rotary."""
        if self.query_norm is None and self.key_norm is None:
            return split_qkv_rotary(qkv, self.heads, self.kv_heads, cos, sin)
        fused = _per_head_rms_weights(self.query_norm, self.key_norm)
        if fused is not None:
            query_weight, key_weight, epsilon = fused
            return split_qkv_norm_rotary(
                qkv, self.heads, self.kv_heads, cos, sin, query_weight, key_weight, epsilon
            )
        q, k, v = split_qkv_rotary(qkv, self.heads, self.kv_heads, None, None)
        return (
            _normed_rotated(q, self.query_norm, cos, sin),
            _normed_rotated(k, self.key_norm, cos, sin),
            v,
        )


def _per_head_rms_weights(
    query_norm: Normalization | None, key_norm: Normalization | None
) -> tuple[Tensor | None, Tensor | None, float] | None:
    """The scales (the weights, or 1 + them for zero-centered norms) and epsilon of QK-norms the
    fused split-norm-rotary kernel computes: RMSNorms over each head (or none) with one
    epsilon; None for others (LayerNorm, over all heads)."""
    norms = [norm for norm in (query_norm, key_norm) if norm is not None]
    if any(type(norm) is not Normalization or norm.bias is not None for norm in norms):
        return None
    if len({norm.epsilon for norm in norms}) != 1:
        return None
    weights = [None if norm is None else norm.scale for norm in (query_norm, key_norm)]
    return weights[0], weights[1], norms[0].epsilon


def _normed_rotated(
    x: Tensor, norm: Normalization | None, cos: Tensor | None, sin: Tensor | None
) -> Tensor:
    """Queries or keys (batch, seq, heads, head size) through their norm, if any, then rotary,
    into a new tensor (rotary turns its input in place)."""
    x = x.clone() if norm is None else norm(x)
    return x if cos is None or sin is None else apply_rotary(x, cos, sin)
