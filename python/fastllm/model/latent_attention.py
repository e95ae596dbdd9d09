"""Multi-head latent attention (DeepSeek-V2, V3): queries, keys and values up-projected from
low-rank latents of the block's input, with a rotary part of each query and key apart from
the rest, the key's shared by the heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastllm.config.model import RMSNormConfig, TransformerConfig, YarnRotaryConfig
from fastllm.model.normalization import InputNorm, Normalization
from fastllm.model.parameters import TensorSplit, describe
from fastllm.parallel.tensor import TensorDimension, enter, leave
from fastllm_kernels.attention import attention
from fastllm_kernels.linear import linear
from fastllm_kernels.recipe import WeightRecipe
from fastllm_kernels.rotary import apply_rotary


class LatentAttention(torch.nn.Module):
    """norm(x) → [query_down → query_norm →] query_up: per head a query of qk_head_dim
    dimensions without position and qk_pos_emb_head_dim rotated; norm(x) → key_value_down:
    the latent of kv_lora_rank and the key's rotary part; key_value_norm → key_value_up: per
    head the key's other part and the value. Then attention (softmax scale
    `LatentAttentionConfig.softmax_scale`) and the output projection `dense`.

    Under tensor parallelism the up projections are column-parallel (each rank holds whole
    heads) and `dense` row-parallel; the down projections and the latents' norms are
    replicated, each rank's gradient of them only its heads' part (summed over the tensor
    ranks, as the block's norm's is). The rotary parts of the queries are turned in place in
    the projection's output where the kernels can; the keys are the one tensor made whole
    (the shared rotary part written beside every head's)."""

    def __init__(
        self, config: TransformerConfig, layer_index: int, tensor: TensorDimension | None = None
    ) -> None:
        super().__init__()
        latent = config.latent_attention
        assert latent is not None
        self.layer_index = layer_index
        self.tensor = tensor = tensor or TensorDimension()
        self.heads = config.num_attention_heads // tensor.size
        self.nope, self.rope = latent.qk_head_dim, latent.qk_pos_emb_head_dim
        self.value_size, self.kv_rank = latent.v_head_dim, latent.kv_lora_rank
        rotary = config.rotary
        self.scale = latent.softmax_scale(
            rotary.scale_factor if isinstance(rotary, YarnRotaryConfig) else None
        )
        hidden, heads = config.hidden_size, config.num_attention_heads
        query_heads = heads * latent.query_head_dim
        norm = RMSNormConfig(epsilon=latent.latent_norm_epsilon)
        self.recipes: dict[str, WeightRecipe] = {}
        self.query_down: torch.nn.Linear | None = None
        self.query_norm: Normalization | None = None
        if latent.q_lora_rank is not None:
            self.query_down = self._linear("query_down", hidden, latent.q_lora_rank, None)
            self.query_norm = Normalization(norm, latent.q_lora_rank)
            fan_in = latent.q_lora_rank
        else:
            fan_in = hidden
        self.query_up = self._linear(
            "query_up", fan_in, query_heads, TensorSplit(0, (query_heads,))
        )
        self.key_value_down = self._linear("key_value_down", hidden, self.kv_rank + self.rope, None)
        self.key_value_norm = Normalization(norm, self.kv_rank)
        key_value_heads = heads * (self.nope + self.value_size)
        self.key_value_up = self._linear(
            "key_value_up", self.kv_rank, key_value_heads, TensorSplit(0, (key_value_heads,))
        )
        self.dense = self._linear(
            "dense", heads * self.value_size, hidden, TensorSplit(1, (heads * self.value_size,))
        )

    def _linear(
        self, name: str, fan_in: int, fan_out: int, split: TensorSplit | None
    ) -> torch.nn.Linear:
        """A projection without bias, its weight split by `split` (None: replicated, with
        partial gradients)."""
        local = (fan_in, fan_out)
        if split is not None:
            local = (fan_in // self.tensor.size, fan_out) if split.dim else (
                fan_in, fan_out // self.tensor.size
            )  # fmt: skip
        layer = torch.nn.Linear(*local, bias=False)
        self.recipes[name] = recipe = WeightRecipe()
        describe(
            layer,
            "weight",
            weight_decay=True,
            tensor_split=split,
            tensor_partial=split is None,
            recipe=recipe,
        )
        return layer

    def forward(
        self,
        x: Tensor,
        norm: InputNorm,
        rotary: tuple[Tensor, Tensor] | None,
        document_ids: Tensor | None = None,
        cache: Any = None,
        branch_ids: Tensor | None = None,
    ) -> Tensor:
        """Attention over norm(x) (the block's input); as `Attention.forward`."""
        x = enter(x, self.tensor)
        batch, length, _ = x.shape
        q = self._queries(x, norm).view(batch, length, self.heads, self.nope + self.rope)
        key_value = norm.project(
            x, self.key_value_down.weight, None, self.recipes["key_value_down"]
        )
        latent, key_rope = key_value.split([self.kv_rank, self.rope], dim=-1)
        up = self.key_value_norm.project(
            latent, self.key_value_up.weight, None, self.recipes["key_value_up"]
        ).view(batch, length, self.heads, self.nope + self.value_size)
        key_nope, v = up.split([self.nope, self.value_size], dim=-1)
        key_rope = key_rope.unsqueeze(2)
        if rotary is not None:
            cos, sin = rotary
            q = _rotate_tail(q, self.nope, cos, sin)
            # a copy: rotary turns its input in place, and key_value is kept for the backward
            key_rope = apply_rotary(key_rope.clone(), cos, sin)
        k = torch.cat([key_nope, key_rope.expand(-1, -1, self.heads, -1)], dim=-1)
        if cache is None:
            out = attention(
                q, k, v, causal=True, document_ids=document_ids, scale=self.scale,
                branch_ids=branch_ids,
            )  # fmt: skip
        else:  # generation and micro-sequences: as `Attention._attend_with_cache`
            keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_index)
            out = attention(
                q, keys.transpose(1, 2), values.transpose(1, 2), causal=True,
                document_ids=document_ids, scale=self.scale,
            )  # fmt: skip
        out = out.reshape(batch, length, self.heads * self.value_size)
        dense = linear(out, self.dense.weight, None, self.recipes["dense"])
        return leave(dense, self.tensor) if self.tensor.split else dense

    def _queries(self, x: Tensor, norm: InputNorm) -> Tensor:
        weight, recipe = self.query_up.weight, self.recipes["query_up"]
        if self.query_down is None or self.query_norm is None:
            return norm.project(x, weight, None, recipe)
        down = norm.project(x, self.query_down.weight, None, self.recipes["query_down"])
        return self.query_norm.project(down, weight, None, recipe)


def _rotate_tail(x: Tensor, start: int, cos: Tensor, sin: Tensor) -> Tensor:
    """x (batch, seq, heads, size) with its last dimension's entries from `start` on rotated:
    in place where the rotary kernel runs (x is a projection's output, which its backward
    pass does not keep), else the reference's rotated copy joined to the rest."""
    tail = x[..., start:]
    rotated = apply_rotary(tail, cos, sin)
    if rotated.data_ptr() == tail.data_ptr():
        return x
    return torch.cat([x[..., :start], rotated], dim=-1)
