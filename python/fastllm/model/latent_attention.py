"""Multi-head latent attention (DeepSeek-V2, V3): queries, keys and values up-projected from
low-rank latents of the block's input, with a rotary part of each query and key apart from
the rest, the key's shared by the heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastllm.config.model import (
    LatentAttentionConfig,
    LoRAConfig,
    RMSNormConfig,
    TransformerConfig,
    YarnRotaryConfig,
)
from fastllm.model.attend import attend
from fastllm.model.normalization import InputNorm, Normalization
from fastllm.model.parameters import TensorSplit, describe
from fastllm.parallel.mesh import ParallelMesh
from fastllm.parallel.sequence_data import KeyValueGather, SequenceDataDimension
from fastllm.parallel.tensor import enter, leave
from fastllm_kernels.linear import linear
from fastllm_kernels.recipe import WeightRecipe
from fastllm_kernels.rotary import apply_rotary


class LatentAttention(torch.nn.Module):
    """The `latent_attention` mixer's layer, built as model/block.py's contract says (`lora`
    adapts none of its projections: its config refuses LoRA).

    norm(x) → [query_down → query_norm →] query_up: per head a query of qk_head_dim
    dimensions without position and qk_pos_emb_head_dim rotated; norm(x) → key_value_down:
    the latent of kv_lora_rank and the key's rotary part; key_value_norm → key_value_up: per
    head the key's other part and the value. Then attention (softmax scale
    `LatentAttentionConfig.softmax_scale`) and the output projection `dense`.

    Under tensor parallelism the up projections are column-parallel (each rank holds whole
    heads) and `dense` row-parallel; the down projections and the latents' norms are
    replicated, each rank's gradient of them only its heads' part (summed over the tensor
    ranks, as the block's norm's is). The rotary parts of the queries are turned in place in
    the projection's output where the kernels can; the keys are the one tensor made whole
    (the shared rotary part written beside every head's).

    With sequence-data parallelism each rank gathers the latents and rotated shared key parts
    of the chunks before its own (not every head's keys and values: kv_lora_rank +
    qk_pos_emb_head_dim values a token) while its queries are projected, and up-projects them
    itself."""

    def __init__(
        self,
        latent: LatentAttentionConfig,
        config: TransformerConfig,
        layer_index: int,
        mesh: ParallelMesh,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.tensor = tensor = mesh.tensor
        self.sequence_data = mesh.sequence_data
        self.window_size = None  # the whole causal context (windows are refused with it)
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

    def projections(self) -> list[torch.nn.Linear]:
        """Its linear layers, in the order the forward pass runs them."""
        first = [] if self.query_down is None else [self.query_down]
        return [*first, self.query_up, self.key_value_down, self.key_value_up, self.dense]

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
        key_value = norm.project(
            x, self.key_value_down.weight, None, self.recipes["key_value_down"]
        )
        latent, key_rope = key_value.split([self.kv_rank, self.rope], dim=-1)
        key_rope = key_rope.unsqueeze(2)
        cos, sin = rotary if rotary is not None else (None, None)
        if cos is not None and sin is not None:
            # a copy: rotary turns its input in place, and key_value is kept for the backward
            key_rope = apply_rotary(key_rope.clone(), cos, sin)
        pending = None
        if self.sequence_data.split:  # the latents of the earlier chunks, gathered meanwhile
            pending = _LatentGather(latent, key_rope, self.sequence_data)
        q = self._queries(x, norm).view(batch, length, self.heads, self.nope + self.rope)
        if cos is not None and sin is not None:
            q = _rotate_tail(q, self.nope, cos, sin)
        if pending is not None:
            latent, key_rope = pending.finish()
        k, v = self._keys_values(latent, key_rope)
        out = attend(
            q, k, v, sequence_data=self.sequence_data, layer_index=self.layer_index,
            window_size=None, scale=self.scale, document_ids=document_ids, cache=cache,
            branch_ids=branch_ids,
        )  # fmt: skip
        out = out.reshape(batch, length, self.heads * self.value_size)
        dense = linear(out, self.dense.weight, None, self.recipes["dense"])
        return leave(dense, self.tensor) if self.tensor.split else dense

    def _keys_values(self, latent: Tensor, key_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's key and value (batch, seq, heads, ·) from the latent (batch, seq,
        kv_lora_rank) and the rotated shared key part (batch, seq, 1, qk_pos_emb_head_dim)."""
        batch, length, _ = latent.shape
        up = self.key_value_norm.project(
            latent, self.key_value_up.weight, None, self.recipes["key_value_up"]
        ).view(batch, length, self.heads, self.nope + self.value_size)
        key_nope, v = up.split([self.nope, self.value_size], dim=-1)
        return torch.cat([key_nope, key_rope.expand(-1, -1, self.heads, -1)], dim=-1), v

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
    if rotated is tail:  # turned in place (an in-place autograd function returns its input)
        return x
    return torch.cat([x[..., :start], rotated], dim=-1)


class _LatentGather:
    """Sequence-data parallelism: the latents and rotated shared key parts of this rank's
    chunk gathered with the group's (the causal prefix): kv_lora_rank + qk_pos_emb_head_dim
    values a token cross, not every head's key and value; each rank then up-projects the
    prefix. Through `KeyValueGather` (its two halves as its keys and values), whose backward
    pass reduce-scatters the gradients back to their chunks."""

    def __init__(self, latent: Tensor, key_rope: Tensor, sequence_data: SequenceDataDimension):
        self.rank_size = latent.shape[-1]
        joined = torch.cat([latent, key_rope.squeeze(2)], dim=-1).unsqueeze(2)
        self.half = joined.shape[-1] // 2  # even: kv_lora_rank is (config/layout.py)
        self.gather = KeyValueGather(
            joined[..., : self.half], joined[..., self.half :], sequence_data
        )

    def finish(self) -> tuple[Tensor, Tensor]:
        first, second = self.gather.finish()
        joined = torch.cat([first, second], dim=-1).squeeze(2)
        latent, key_rope = joined.split([self.rank_size, joined.shape[-1] - self.rank_size], -1)
        return latent, key_rope.unsqueeze(2)
