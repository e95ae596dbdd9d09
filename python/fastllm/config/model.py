"""`model`: the transformer's architecture (`base_model`) and how it is computed (`distributed`)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import ClassVar, Literal

import msgspec

from fastllm.config.layout import num_stages
from fastllm.config.multi_token_prediction import MultiTokenPredictionConfig
from fastllm.config.registry import Component
from fastllm.config.section import ConfigError, Section, check_non_negative, check_positive


class NormalizationConfig(Component):
    """A normalization layer (extension point `normalization`). Its implementation is built as
    `Layer(config, size, tensor_partial=…)` (model/normalization.py says the contract)."""

    point = "normalization"

    epsilon: float = 1e-5
    """Added to the variance before the square root."""
    zero_centered: bool = False
    """The weight is stored as its offset from 1: the norm scales by 1 + weight (in fp32), and
    the weight starts at 0 (Gemma's RMSNorm; Transformer Engine's zero_centered_gamma)."""

    def validate(self) -> None:
        check_positive(self.epsilon, "epsilon")

    def num_parameters(self, size: int) -> int:
        """Its parameters over `size` features."""
        return size


class RMSNormConfig(NormalizationConfig, tag="rms_norm"):
    """RMSNorm (Llama, Mistral, Mixtral, Qwen2, Qwen3, OLMo 2, Gemma 3): scale only."""

    implementation = "fastllm.model.normalization:Normalization"


class LayerNormConfig(NormalizationConfig, tag="layer_norm"):
    """LayerNorm (StarCoder2): mean subtracted, scale and bias."""

    implementation = "fastllm.model.normalization:Normalization"

    def num_parameters(self, size: int) -> int:
        return 2 * size


class RotaryConfig(Component):
    """Rotary position embedding (extension point `rotary`). Its implementation is built as
    `Tables(config, head_size)` and called with the position ids, giving the (cos, sin) tables
    attention rotates the queries and keys by (model/rotary.py)."""

    point = "rotary"


class DefaultRotaryConfig(RotaryConfig, tag="default"):
    implementation = "fastllm.model.rotary:RotaryTables"

    theta: float = 10000.0
    """Base of the rotary frequencies."""

    def validate(self) -> None:
        check_positive(self.theta, "theta")


class NoRotaryConfig(RotaryConfig, tag="none"):
    """No rotary embedding: the model has no position information."""


class Llama3RotaryConfig(DefaultRotaryConfig, tag="llama3"):
    scale_factor: float = 8.0
    """Context extension factor (Llama 3.1: 8, Llama 3.2: 32)."""
    low_frequency_factor: float = 1.0
    """Wavelengths above original_context_length / low_frequency_factor are scaled fully."""
    high_frequency_factor: float = 4.0
    """Wavelengths below original_context_length / high_frequency_factor are left as they are."""
    original_context_length: int = 8192
    """Context length the model was first trained with."""

    def validate(self) -> None:
        super().validate()
        check_positive(self.scale_factor, "scale_factor")
        check_positive(self.original_context_length, "original_context_length")
        if not 0 < self.low_frequency_factor < self.high_frequency_factor:
            raise ConfigError(
                "high_frequency_factor",
                f"must exceed low_frequency_factor ({self.low_frequency_factor}), "
                f"got {self.high_frequency_factor}",
            )


class LinearRotaryConfig(DefaultRotaryConfig, tag="linear"):
    scale_factor: float = 8.0
    """Every frequency divided by this (position interpolation; Gemma 3's global layers: 8)."""

    def validate(self) -> None:
        super().validate()
        check_positive(self.scale_factor, "scale_factor")


class YarnRotaryConfig(DefaultRotaryConfig, tag="yarn"):
    scale_factor: float = 8.0
    """Context extension factor."""
    attention_factor: float | None = None
    """Scale of the attention logits; default 0.1 * ln(scale_factor) + 1."""
    beta_fast: float = 32.0
    """Rotations per context above which frequencies are left as they are."""
    beta_slow: float = 1.0
    """Rotations per context below which frequencies are interpolated fully."""
    original_context_length: int = 8192
    """Context length the model was first trained with."""

    def validate(self) -> None:
        super().validate()
        check_positive(self.scale_factor, "scale_factor")
        check_positive(self.original_context_length, "original_context_length")
        if self.attention_factor is None:
            self.attention_factor = 0.1 * math.log(self.scale_factor) + 1.0


Activation = Literal["silu", "gelu", "relu", "squared_relu"]
LinearBiases = bool | Literal["nowhere", "everywhere", "only_attn_qkv"]
NormalizationPlacement = Literal["pre", "post", "sandwich"]
QueryKeyNormScope = Literal["head", "projection"]

ExpertScoreFunction = Literal["softmax", "sigmoid"]


class MixerConfig(Component):
    """What mixes the tokens of a block (extension point `mixer`). Its implementation is built
    as `Layer(config, transformer, layer_index, mesh, lora)` (model/block.py says the
    contract)."""

    point = "mixer"
    # Refused unless a mixer says it handles them (as attention does): it would otherwise see
    # only part of each sequence, silently.
    unsupported_settings: ClassVar[dict[str, str]] = {
        "model.distributed.sequence_data_parallel": "each rank holds a chunk of each sequence, "
        "whose earlier chunks a mixer gathers itself (parallel/sequence_data.py)",
        "schedule.micro_batch_splits": "each piece of a sequence reads the earlier pieces "
        "through the mixer's cache argument",
    }

    def num_parameters(self, transformer: TransformerConfig) -> int:
        """One block's mixer parameters (for the counts the run reports and its FLOPs)."""
        raise NotImplementedError(f"{type(self).__name__}.num_parameters")


class AttentionConfig(MixerConfig, tag="attention"):
    """Causal self-attention as the transformer's keys describe it (heads, head_groups,
    kv_channels, window_size, query_norm, key_norm, rotary)."""

    implementation = "fastllm.model.attention:attention_mixer"
    unsupported_settings: ClassVar[dict[str, str]] = {}

    def num_parameters(self, transformer: TransformerConfig) -> int:
        t = transformer
        assert t.kv_channels is not None, "validate() first"
        h = t.hidden_size
        q_size, kv_size = t.num_attention_heads * t.kv_channels, t.head_groups * t.kv_channels
        count = h * (q_size + 2 * kv_size) + q_size * h
        if t.biases_in_attention_qkv:
            count += q_size + 2 * kv_size
        return count + (h if t.biases_elsewhere else 0)


class LatentAttentionConfig(MixerConfig, tag="latent_attention"):
    """Multi-head latent attention (DeepSeek-V2, V3), Megatron-LM's names for its sizes:
    queries, keys and values from low-rank projections of the block's input. The keys and
    values of every head are up-projected from one normalized latent of `kv_lora_rank` per
    token, the queries from one of `q_lora_rank` (or projected whole); each head's query and
    key are a part without position (`qk_head_dim`) and a rotary part
    (`qk_pos_emb_head_dim`), the key's rotary part one per token, shared by the heads; the
    values have `v_head_dim` per head. Every head has its own key (the transformer's
    head_groups is num_attention_heads) and kv_channels is qk_head_dim + qk_pos_emb_head_dim."""

    implementation = "fastllm.model.latent_attention:LatentAttention"
    unsupported_settings: ClassVar[dict[str, str]] = {
        "model.base_model.peft": "LoRA is not supported with latent attention yet: its "
        "projections are not LoRA's query, key, value and dense",
    }

    q_lora_rank: int | None = None
    """Rank of the queries' down projection (normalized, then up-projected to the heads); null
    projects the queries from the block's input whole (DeepSeek-V2-Lite, Moonlight)."""
    kv_lora_rank: int = 512
    """Rank of the keys' and values' shared latent."""
    qk_head_dim: int = 128
    """Per head, the query and key dimensions without rotary embedding (DeepSeek's
    qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per head, the query and key dimensions with rotary embedding (DeepSeek's
    qk_rope_head_dim); the key's are computed once per token and shared by the heads."""
    v_head_dim: int = 128
    """Size of one value head, and of one head of attention's output."""
    latent_norm_epsilon: float = 1e-6
    """Epsilon of the RMSNorms of the two latents (DeepSeek's are 1e-6 whatever the blocks')."""
    mscale_all_dim: float = 0.0
    """With yarn rotary: the softmax scale (qk_head_dim + qk_pos_emb_head_dim)^-0.5 is
    multiplied by (0.1 · mscale_all_dim · ln(scale_factor) + 1)², as DeepSeek-V3 scales the
    dimensions without rotary too (0: not multiplied)."""

    def validate(self) -> None:
        for key in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim"):
            check_positive(getattr(self, key), key)
        check_positive(self.qk_pos_emb_head_dim, "qk_pos_emb_head_dim")
        if self.qk_pos_emb_head_dim % 2:
            raise ConfigError(
                "qk_pos_emb_head_dim",
                f"must be even (rotary pairs), got {self.qk_pos_emb_head_dim}",
            )
        check_positive(self.latent_norm_epsilon, "latent_norm_epsilon")
        check_non_negative(self.mscale_all_dim, "mscale_all_dim")

    @property
    def query_head_dim(self) -> int:
        """Size of one query (and key) head: both parts."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def norm_parameters(self) -> int:
        """The weights of the two latents' norms (the query's only with q_lora_rank)."""
        return self.kv_lora_rank + (self.q_lora_rank or 0)

    def softmax_scale(self, yarn_scale_factor: float | None) -> float:
        """The scale of q·k: 1/√(query_head_dim), times yarn's mscale² when it applies."""
        scale = self.query_head_dim**-0.5
        if yarn_scale_factor is not None and yarn_scale_factor > 1 and self.mscale_all_dim:
            mscale = 0.1 * self.mscale_all_dim * math.log(yarn_scale_factor) + 1.0
            scale *= mscale * mscale
        return scale

    def num_parameters(self, transformer: TransformerConfig) -> int:
        """Its projections' and its latents' norms'."""
        h, heads = transformer.hidden_size, transformer.num_attention_heads
        query_heads = heads * self.query_head_dim
        rank = self.q_lora_rank
        query = h * query_heads if rank is None else h * rank + rank * query_heads
        key_value = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim)
        key_value += self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim)
        return query + key_value + heads * self.v_head_dim * h + self.norm_parameters


class MLPBaseConfig(Component):
    """The MLP of a block (extension point `mlp`). Its implementation is built as
    `Layer(config, transformer, layer_index, mesh, lora)` (model/block.py says the contract)."""

    point = "mlp"

    def num_parameters(self, transformer: TransformerConfig, *, active: bool = False) -> int:
        """One block's MLP parameters; with `active`, those one token uses."""
        raise NotImplementedError(f"{type(self).__name__}.num_parameters")


class MLPConfig(MLPBaseConfig, tag="mlp"):
    """The MLP the transformer's keys describe: dense (ffn_hidden_size, gated,
    activation_type) or, with num_experts > 1, a mixture of experts."""

    implementation = "fastllm.model.mlp:mlp_layer"

    def num_parameters(self, transformer: TransformerConfig, *, active: bool = False) -> int:
        t = transformer
        assert t.ffn_hidden_size is not None, "validate() first"
        h = t.hidden_size
        inputs = 2 if t.gated else 1
        expert = inputs * h * t.ffn_hidden_size + t.ffn_hidden_size * h
        if t.num_experts == 1:
            return expert + (inputs * t.ffn_hidden_size + h if t.biases_elsewhere else 0)
        # experts have no biases (validate)
        experts = t.num_experts_per_token if active else t.num_experts
        router = h * t.num_experts + (h if t.shared_expert_gate else 0)
        router += t.num_experts if t.expert_bias else 0  # the correction bias (DeepSeek-V3)
        return (experts + t.num_shared_experts) * expert + router


class BlockConfig(Component):
    """One transformer block (extension point `block`). Its implementation is built as
    `Block(config, transformer, layer_index, mesh, lora)` and called as
    `block(x, rotary, document_ids, cache, branch_ids)`, returning the new residual stream and
    its weighted auxiliary loss or None (model/block.py says the contract)."""

    point = "block"

    def num_norm_parameters(self, transformer: TransformerConfig) -> int:
        """One block's own norms' parameters: a block's parameters are counted as these, its
        mixer's and its MLP's (the counts the run reports, its FLOPs, `model.freeze.norms`)."""
        raise NotImplementedError(f"{type(self).__name__}.num_norm_parameters")


class DecoderBlockConfig(BlockConfig, tag="decoder"):
    """The mixer and then the MLP, each added to the residual stream, normalized where the
    transformer's `normalization_placement` says."""

    implementation = "fastllm.model.block:TransformerBlock"

    def num_norm_parameters(self, transformer: TransformerConfig) -> int:
        t = transformer
        return (t.pre_norms + t.post_norms) * 2 * t.normalization.num_parameters(t.hidden_size)


class TransformerConfig(Section):
    mixer: MixerConfig = msgspec.field(default_factory=AttentionConfig)
    """What mixes the tokens in each block (Fast-LLM's key): attention, latent_attention
    (DeepSeek-V2, V3), or a component of another package."""
    mlp: MLPBaseConfig = msgspec.field(default_factory=MLPConfig)
    """The MLP of each block (Fast-LLM's key): mlp, the one the keys below describe, or a
    component of another package."""
    block: BlockConfig = msgspec.field(default_factory=DecoderBlockConfig)
    """How each block joins its mixer and MLP to the residual stream: decoder, one after the
    other (every model fastllm converts), or a component of another package."""
    normalization: NormalizationConfig = msgspec.field(default_factory=RMSNormConfig)
    """Normalization of the blocks (where `normalization_placement` says) and before the head."""
    normalization_placement: NormalizationPlacement = "pre"
    """Where each block normalizes: pre, the input of attention and of the MLP (Llama and most
    models); post, their outputs, before each is added to the residual stream, which is never
    normalized itself but before the head (OLMo 2); sandwich, both (Gemma 2 and 3). (Fast-LLM
    has a normalization config for each of the four places: pre_mixer_normalization,
    post_mixer_normalization, pre_mlp_normalization, post_mlp_normalization.)"""
    query_norm: NormalizationConfig | None = None
    """Normalization of the queries after their projection and before rotary (QK-norm:
    Qwen3, OLMo 2, Gemma 3), over what `query_key_norm_scope` says; null: not normalized."""
    key_norm: NormalizationConfig | None = None
    """Normalization of the keys after their projection and before rotary, as `query_norm`."""
    query_key_norm_scope: QueryKeyNormScope = "head"
    """What `query_norm` and `key_norm` normalize: head, each head over its kv_channels, one
    weight of kv_channels shared by the heads (Qwen3, Gemma 3; Fast-LLM's); projection, all the
    heads of the projection together, one weight over all of them (OLMo 2; rms_norm only).
    Under tensor parallelism each rank holds some heads: their mean square over all heads is
    summed over the tensor ranks."""
    rotary: RotaryConfig = msgspec.field(default_factory=DefaultRotaryConfig)
    """Rotary position embedding of queries and keys (of the global blocks only when
    `window_rotary` is set)."""
    num_layers: int = 12
    """Number of transformer blocks."""
    hidden_size: int = 1024
    """Width of the residual stream."""
    num_attention_heads: int = 8
    """Number of query heads."""
    head_groups: int = 1
    """Number of key/value heads: 1 is multi-query, num_attention_heads is multi-head attention,
    anything between is grouped-query attention (Fast-LLM's name and default)."""
    kv_channels: int | None = None
    """Size of one attention head; default hidden_size / num_attention_heads."""
    ffn_hidden_size: int | None = None
    """Width of the MLP; default 4 * hidden_size."""
    gated: bool = False
    """Gated MLP (SwiGLU/GeGLU: act(x W_gate) * (x W_up)) instead of act(x W_up)."""
    activation_type: Activation | None = None
    """MLP activation; default silu when gated, else gelu (tanh approximation)."""
    add_linear_biases: LinearBiases = True
    """Biases on linear layers: true/everywhere, false/nowhere, or only_attn_qkv (Qwen2)."""
    window_size: int | None = None
    """Sliding-window attention: each token attends to at most this many tokens (itself
    included); none attends to the whole causal context."""
    global_attention_interval: int | None = None
    """With window_size: every this-many-th block (blocks interval - 1, 2 × interval - 1, …,
    counted from 0) attends to the whole causal context and the others slide (Gemma 3: 6,
    Hugging Face's sliding_window_pattern); none: every block slides."""
    window_rotary: RotaryConfig | None = None
    """Rotary of the sliding blocks when global_attention_interval mixes them with global
    ones, `rotary` being the global blocks' (Gemma 3: theta 10000 here, 1e6 with linear
    scaling 8 there); none: `rotary` in every block."""
    attention_scale: float | None = None
    """Factor of the query-key products before the softmax; default kv_channels ** -0.5
    (Gemma 3: query_pre_attn_scalar ** -0.5)."""
    scale_embeddings: bool = False
    """Multiply the input embeddings by sqrt(hidden_size), rounded to the compute dtype
    (Gemma); the tied head reads the weights unscaled."""
    num_experts: int = 1
    """Experts per MLP; more than 1 makes every MLP a mixture of experts."""
    num_experts_per_token: int = 1
    """Experts each token is routed to (top-k)."""
    expert_auxiliary_loss_coefficient: float = 0.01
    """Weight of the router's load-balancing loss."""
    expert_z_loss_coefficient: float = 0.0
    """Weight of the router's z-loss (mean squared log-sum-exp of the router logits)."""
    expert_renormalize: bool = True
    """Each token's k routing weights are renormalized to sum to 1 (Mixtral); false keeps
    them the softmax over all experts (Qwen2-MoE with norm_topk_prob false)."""
    num_shared_experts: int = 0
    """Always-on experts added to the routed ones (Qwen2-MoE, DeepSeek): one MLP of
    num_shared_experts × ffn_hidden_size that every token goes through."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x · w), w learned (Qwen2-MoE)."""
    dropless_moe: bool = True
    """Experts run as grouped matmuls over a sparse layout of the routed tokens, none dropped;
    false loops over the experts (slower, kept as the reference)."""
    expert_score_function: ExpertScoreFunction = "softmax"
    """The router's scores of the experts from its logits: softmax over the experts (Mixtral,
    Qwen) or each expert's sigmoid (DeepSeek-V3); a token's routing weights are the scores of
    its chosen experts (renormalized with `expert_renormalize`, then scaled by
    `expert_routed_scaling_factor`). The load-balancing loss needs softmax."""
    expert_bias: bool = False
    """A per-expert correction bias added to the scores only to choose the experts, never to
    weight them, which no gradient trains (DeepSeek-V3's e_score_correction_bias): after each
    optimizer step every bias moves by expert_bias_update_rate towards the mean load,
    bias += rate · sign(mean load − load), the loads summed over the step and the data ranks
    (auxiliary-loss-free load balancing)."""
    expert_bias_update_rate: float = 0.001
    """How far `expert_bias` moves per step (0: kept as it is, as when fine-tuning)."""
    expert_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts form this many groups of
    consecutive experts; each token chooses among those of its `expert_groups_per_token` best
    groups, a group scored by the sum of its two best (biased) scores."""
    expert_groups_per_token: int | None = None
    """The groups each token's experts are chosen from (DeepSeek-V3's topk_group); default
    expert_groups, every group."""
    expert_routed_scaling_factor: float = 1.0
    """The routing weights are multiplied by this (DeepSeek-V3's routed_scaling_factor)."""
    first_dense_layers: int = 0
    """With num_experts > 1, the first blocks (this many) have a dense MLP of
    `dense_ffn_hidden_size` instead of a mixture (DeepSeek-V3's first_k_dense_replace;
    Qwen-MoE's mlp_only_layers [0, …, k - 1])."""
    dense_ffn_hidden_size: int | None = None
    """Width of the dense MLPs of the first_dense_layers; default ffn_hidden_size."""
    init_method_std: float | None = None
    """Standard deviation of the normal initialization of weights; default hidden_size ** -0.5."""
    moved: ClassVar[dict[str, str]] = {
        "latent_attention": "is now transformer.mixer: {type: latent_attention, q_lora_rank: "
        "…, kv_lora_rank: …} (the same keys)",
    }

    def validate(self) -> None:
        for key in ("num_layers", "hidden_size", "num_attention_heads", "head_groups"):
            check_positive(getattr(self, key), key)
        for key in ("kv_channels", "ffn_hidden_size", "window_size", "init_method_std"):
            check_positive(getattr(self, key), key)
        self._validate_window_pattern()
        if self.num_attention_heads % self.head_groups:
            raise ConfigError(
                "head_groups",
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"head_groups ({self.head_groups})",
            )
        if self.kv_channels is None and self.latent_mixer is not None:
            self.kv_channels = self.latent_mixer.query_head_dim
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    "num_attention_heads",
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or kv_channels must be set",
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.activation_type is None:
            self.activation_type = "silu" if self.gated else "gelu"
        if self.init_method_std is None:
            self.init_method_std = self.hidden_size**-0.5
        check_positive(self.num_experts, "num_experts")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ConfigError(
                "num_experts_per_token",
                f"must be between 1 and num_experts ({self.num_experts}), "
                f"got {self.num_experts_per_token}",
            )
        check_non_negative(
            self.expert_auxiliary_loss_coefficient, "expert_auxiliary_loss_coefficient"
        )
        check_non_negative(self.expert_z_loss_coefficient, "expert_z_loss_coefficient")
        check_non_negative(self.num_shared_experts, "num_shared_experts")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ConfigError("shared_expert_gate", "needs num_shared_experts > 0")
        self._validate_query_key_norms()
        if self.num_experts > 1 and not isinstance(self.mlp, MLPConfig):
            raise ConfigError(
                "num_experts",
                f"is {self.num_experts}: a mixture of experts is mlp type mlp's, and mlp has "
                f"type {self.mlp.__struct_config__.tag!r}",
            )
        self._validate_latent_attention()
        self._validate_routing()
        if self.num_experts > 1 and self.biases_elsewhere:
            raise ConfigError(
                "add_linear_biases",
                f"experts have no biases: with num_experts ({self.num_experts}) > 1 it must be "
                f"false, nowhere or only_attn_qkv, got {self.add_linear_biases!r}",
            )

    def _validate_latent_attention(self) -> None:
        latent = self.latent_mixer
        if latent is None:
            return
        if self.head_groups != self.num_attention_heads:
            raise ConfigError(
                "head_groups",
                f"latent attention has a key per head: must be num_attention_heads "
                f"({self.num_attention_heads}), got {self.head_groups}",
            )
        if self.kv_channels != latent.query_head_dim:
            raise ConfigError(
                "kv_channels",
                f"latent attention's heads are mixer.qk_head_dim + qk_pos_emb_head_dim "
                f"({latent.query_head_dim}) wide, got {self.kv_channels}",
            )
        # its softmax scale is the mixer's (softmax_scale)
        for key in ("query_norm", "key_norm", "window_size", "attention_scale"):
            if getattr(self, key) is not None:
                raise ConfigError(key, "is not supported with mixer type latent_attention")
        if self.add_linear_biases not in (False, "nowhere"):
            raise ConfigError(
                "add_linear_biases",
                f"latent attention has no biases: must be false, got {self.add_linear_biases!r}",
            )

    def _validate_routing(self) -> None:
        check_non_negative(self.expert_bias_update_rate, "expert_bias_update_rate")
        check_positive(self.expert_routed_scaling_factor, "expert_routed_scaling_factor")
        check_positive(self.expert_groups, "expert_groups")
        check_non_negative(self.first_dense_layers, "first_dense_layers")
        check_positive(self.dense_ffn_hidden_size, "dense_ffn_hidden_size")
        check_positive(self.expert_groups_per_token, "expert_groups_per_token")
        if self.num_experts % self.expert_groups:
            raise ConfigError(
                "expert_groups",
                f"must divide num_experts ({self.num_experts}), got {self.expert_groups}",
            )
        per_group = self.num_experts // self.expert_groups
        if self.expert_groups > 1 and per_group < 2:
            raise ConfigError(
                "expert_groups",
                f"a group is scored by its two best experts: num_experts ({self.num_experts}) "
                f"must be at least twice expert_groups ({self.expert_groups})",
            )
        if self.groups_per_token > self.expert_groups:
            raise ConfigError(
                "expert_groups_per_token",
                f"must be at most expert_groups ({self.expert_groups}), "
                f"got {self.expert_groups_per_token}",
            )
        if self.num_experts_per_token > self.groups_per_token * per_group:
            raise ConfigError(
                "num_experts_per_token",
                f"{self.num_experts_per_token} exceeds the experts of "
                f"expert_groups_per_token ({self.groups_per_token}) groups of {per_group}",
            )
        if self.expert_score_function == "sigmoid" and self.expert_auxiliary_loss_coefficient:
            raise ConfigError(
                "expert_auxiliary_loss_coefficient",
                f"the load-balancing loss is over softmax scores: must be 0 with "
                f"expert_score_function sigmoid (balance with expert_bias), got "
                f"{self.expert_auxiliary_loss_coefficient}",
            )

    @property
    def groups_per_token(self) -> int:
        """`expert_groups_per_token`, every group when unset."""
        return self.expert_groups_per_token or self.expert_groups

    @property
    def dense_ffn_width(self) -> int:
        """`dense_ffn_hidden_size`, ffn_hidden_size when unset."""
        width = self.dense_ffn_hidden_size or self.ffn_hidden_size
        assert width is not None
        return width

    @property
    def latent_mixer(self) -> LatentAttentionConfig | None:
        """The mixer when it is latent attention (its sizes), else None."""
        return self.mixer if isinstance(self.mixer, LatentAttentionConfig) else None

    @property
    def rotary_channels(self) -> int:
        """The dimensions of a query or key head that rotary turns."""
        if self.latent_mixer is not None:
            return self.latent_mixer.qk_pos_emb_head_dim
        assert self.kv_channels is not None
        return self.kv_channels

    @property
    def default_routing(self) -> bool:
        """The router is top-k of a softmax, nothing more (the fused routing kernels')."""
        return (
            self.expert_score_function == "softmax"
            and not self.expert_bias
            and self.expert_groups == 1
            and self.expert_routed_scaling_factor == 1.0
        )

    def has_experts(self, layer: int) -> bool:
        """Block `layer` (from 0) has a mixture of experts."""
        return self.num_experts > 1 and layer >= self.first_dense_layers

    def _validate_window_pattern(self) -> None:
        check_positive(self.global_attention_interval, "global_attention_interval")
        check_positive(self.attention_scale, "attention_scale")
        if self.global_attention_interval is not None and self.window_size is None:
            raise ConfigError(
                "global_attention_interval",
                "mixes sliding and global blocks but window_size is not set",
            )
        if self.window_rotary is not None and self.global_attention_interval is None:
            raise ConfigError(
                "window_rotary",
                "is the sliding blocks' rotary beside global ones: it needs "
                "global_attention_interval (with every block sliding, set rotary)",
            )

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block `layer` (counted from 0); None where it attends to the
        whole causal context."""
        interval = self.global_attention_interval
        if interval is not None and (layer + 1) % interval == 0:
            return None
        return self.window_size

    def _validate_query_key_norms(self) -> None:
        if self.query_key_norm_scope == "head":
            return
        norms = {"query_norm": self.query_norm, "key_norm": self.key_norm}
        if not any(norms.values()):
            raise ConfigError(
                "query_key_norm_scope",
                f"is {self.query_key_norm_scope!r} but neither query_norm nor key_norm is set",
            )
        for key, norm in norms.items():
            if norm is not None and not isinstance(norm, RMSNormConfig):
                raise ConfigError(
                    key,
                    f"{norm.__struct_config__.tag} over the whole projection "
                    "(query_key_norm_scope: projection) is not supported (only rms_norm sums "
                    "its mean square over the tensor ranks; OLMo 2's is an rms_norm): use "
                    "rms_norm, or scope head",
                )

    @property
    def pre_norms(self) -> bool:
        """The blocks normalize the inputs of attention and of the MLP."""
        return self.normalization_placement in ("pre", "sandwich")

    @property
    def post_norms(self) -> bool:
        """The blocks normalize the outputs of attention and of the MLP."""
        return self.normalization_placement in ("post", "sandwich")

    @property
    def biases_in_attention_qkv(self) -> bool:
        return self.add_linear_biases in (True, "everywhere", "only_attn_qkv")

    @property
    def biases_elsewhere(self) -> bool:
        """Biases on the attention output and the MLP layers."""
        return self.add_linear_biases in (True, "everywhere")


LoraLayer = Literal[
    "query", "key", "value", "key_value", "dense", "mlp_1", "mlp_2", "experts_1", "experts_2"
]
EXPERT_LORA_LAYERS = ("experts_1", "experts_2")
"""The `layers` that adapt a mixture's routed experts."""


class PeftConfig(Section, tag_field="type"):
    """Parameter-efficient fine-tuning: adapters added to the model's projections."""


class NoPeftConfig(PeftConfig, tag="none"):
    """No adapters."""


class LoRAConfig(PeftConfig, tag="lora"):
    """LoRA (Hu et al. 2021), as PEFT computes it: each adapted projection W gets
    x ↦ W x + (alpha / rank) · B A dropout(x), with A (rank × in) drawn Kaiming-uniform and
    B (out × rank) zero, so training starts from the base model; W + BA is never formed."""

    rank: int = 8
    """Rank of each adapter (PEFT's `r`)."""
    alpha: float = 8.0
    """The adapter's output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on the adapter's input only (PEFT's `lora_dropout`)."""
    layers: list[LoraLayer] = msgspec.field(default_factory=lambda: ["query", "value"])
    """The projections adapted in every block (Fast-LLM's names): query, key, value (q_proj,
    k_proj, v_proj; key_value is both key and value), dense (o_proj), mlp_1 (the MLP's input:
    gate_proj and up_proj when gated), mlp_2 (its output, down_proj); in a mixture of experts,
    experts_1 (every routed expert's input, one adapter per expert over its fused gate and up:
    PEFT's target_parameters `mlp.experts.gate_up_proj`) and experts_2 (every routed expert's
    output, `mlp.experts.down_proj`), while mlp_1 and mlp_2 adapt its dense MLPs (the shared
    experts, the first dense blocks)."""
    freeze_others: bool = True
    """Every parameter but the adapters frozen (as `model.freeze` freezes)."""

    def validate(self) -> None:
        check_positive(self.rank, "rank")
        check_positive(self.alpha, "alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.layers:
            raise ConfigError("layers", "names no projection: add at least one, or type: none")
        if len(set(self.adapted())) != len(self.adapted()):
            raise ConfigError("layers", f"names a projection twice: {self.layers}")

    def adapted(self) -> list[str]:
        """`layers` with key_value spelled out as key and value."""
        return [
            part
            for layer in self.layers
            for part in (("key", "value") if layer == "key_value" else (layer,))
        ]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def adapts_experts(self) -> bool:
        return any(layer in EXPERT_LORA_LAYERS for layer in self.layers)

    def peft_refusal(self) -> str | None:
        """Why PEFT cannot load these adapters, or None."""
        if self.adapts_experts and self.dropout:
            return (
                f"PEFT's LoRA of fused experts (target_parameters) has no dropout, and the "
                f"experts are adapted with model.base_model.peft.dropout {self.dropout}"
            )
        return None


class LossConfig(Component):
    """One loss of the head (Fast-LLM's `losses` entries), by its `type` (extension point
    `head_loss`). The implementation of a loss of another package is a function called as
    `loss(config, model, hidden, targets)` (model/head_losses.py says the contract)."""

    point = "head_loss"
    # Refused unless a loss says it handles it (as fastllm's do): it would otherwise compute on
    # this rank's part of the vocabulary as if it were all of it, silently.
    unsupported_settings: ClassVar[dict[str, str]] = {
        "model.distributed.tensor_parallel": "the head's vocabulary is split over the tensor "
        "ranks (the vocab-parallel forms of parallel/vocab_parallel_losses.py)"
    }

    weight: float = 1.0
    """Its weight in the total the model is trained on."""

    def validate(self) -> None:
        check_non_negative(self.weight, "weight")

    @property
    def reference_models(self) -> set[str]:
        """The names of the `reference_models` it reads."""
        return set()


class LabelLossConfig(LossConfig, tag="label"):
    """Next-token cross-entropy against the labels (the fused chunked head), averaged over the
    trained tokens of the global batch."""

    unsupported_settings: ClassVar[dict[str, str]] = {}


class ZLossConfig(LossConfig, tag="z_loss"):
    """The z-loss (PaLM): the mean over the trained tokens (those the label loss counts) of
    logsumexp(logits)², which keeps the head's log-normalizer near zero; from the label loss's
    own pass over the logits (typical weights: 1e-4)."""

    unsupported_settings: ClassVar[dict[str, str]] = {}


class DistillationLossConfig(LossConfig, tag="distillation"):
    """The divergence between a teacher's (a reference model's) next-token distribution and
    the model's, both at `temperature`, averaged over the trained tokens; neither model's
    logits exist whole (the fused chunked head)."""

    unsupported_settings: ClassVar[dict[str, str]] = {}

    reference_model: str = "teacher"
    """The teacher, a name of `reference_models`; its vocabulary must be the model's."""
    temperature: float = 1.0
    """Both distributions are softmax(logits / temperature)."""
    loss_type: Literal["forward_kl", "reverse_kl", "cross_entropy"] = "forward_kl"
    """forward_kl: KL(teacher ‖ model); reverse_kl: KL(model ‖ teacher); cross_entropy: the
    model's cross-entropy against the teacher's distribution."""

    def validate(self) -> None:
        super().validate()
        check_positive(self.temperature, "temperature")

    @property
    def reference_models(self) -> set[str]:
        return {self.reference_model}


class DPOLossConfig(LossConfig, tag="dpo"):
    """Direct preference optimization (Rafailov et al. 2023) on preference pairs, averaged over
    the pairs of the global batch: −log σ(β · m) with m the policy's log-probability margin of
    the chosen over the rejected answer minus the reference model's; the sequence
    log-probabilities from the fused chunked head. Logs TRL's metrics (rewards/chosen,
    rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected)."""

    unsupported_settings: ClassVar[dict[str, str]] = {}

    reference_model: str = "reference"
    """The reference model, a name of `reference_models` (usually the model it starts from)."""
    beta: float = 0.1
    """How far the policy may move from the reference (TRL's default; Fast-LLM's is 1.0)."""
    label_smoothing: float = 0.0
    """cDPO: the probability that a pair's preference is flipped, in [0, 0.5) (sigmoid only)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO; ipo: IPO's squared loss on the length-normalized margin, as TRL computes
    it."""
    reference_log_probs: Literal["in_step", "precomputed"] = "in_step"
    """in_step: the reference model runs on each micro-batch, in the step; precomputed: its
    log-probabilities of every pair of the run's preference datasets are computed once before
    training (TRL's precompute_ref_log_probs), kept in EXPERIMENT_DIR/cache/reference_log_probs
    and read by the step, and its weights are freed before the first step."""

    def validate(self) -> None:
        super().validate()
        check_positive(self.beta, "beta")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type == "ipo":
            raise ConfigError("label_smoothing", "applies to loss_type sigmoid only")

    @property
    def reference_models(self) -> set[str]:
        return {self.reference_model}


Loss = LossConfig
"""Any loss type (a component of the `head_loss` point, chosen by `type`)."""


class HeadConfig(Section):
    losses: dict[str, Loss] = msgspec.field(default_factory=dict)
    """The losses the model trains on, by name (each logged as NAME_loss), weighted and
    summed; none: the label loss alone, logged as loss."""

    def validate(self) -> None:
        dpo = [name for name, loss in self.losses.items() if isinstance(loss, DPOLossConfig)]
        if len(dpo) > 1:
            raise ConfigError("losses", f"{dpo}: one dpo loss at most")

    @property
    def precomputed_references(self) -> set[str]:
        """The reference models whose log-probabilities a dpo loss reads precomputed: they
        never run in the step."""
        return {
            loss.reference_model
            for loss in self.losses.values()
            if isinstance(loss, DPOLossConfig) and loss.reference_log_probs == "precomputed"
        }

    @property
    def preference(self) -> bool:
        """It trains on preference pairs (a dpo loss)."""
        return any(isinstance(loss, DPOLossConfig) for loss in self.losses.values())

    def active_losses(self) -> dict[str, Loss]:
        """`losses`, or the label loss alone when none is given."""
        return dict(self.losses) if self.losses else {"label": LabelLossConfig()}


class BaseModelConfig(Section):
    transformer: TransformerConfig = msgspec.field(default_factory=TransformerConfig)
    """The stack of transformer blocks."""
    vocab_size: int = 49152
    """Rows of the embedding and of the output head."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output head."""
    peft: NoPeftConfig | LoRAConfig = msgspec.field(default_factory=NoPeftConfig)
    """Adapters (`type: lora`) trained in place of, or beside, the model's weights."""
    head: HeadConfig = msgspec.field(default_factory=HeadConfig)
    """What the output head is trained on."""
    multi_token_prediction: MultiTokenPredictionConfig | None = None
    """DeepSeek-V3's multi-token prediction modules after the blocks, trained with the
    model (null: none)."""

    def validate(self) -> None:
        check_positive(self.vocab_size, "vocab_size")
        peft = self.peft
        if isinstance(peft, LoRAConfig):
            self._check_adapted_layers(peft)
        if isinstance(peft, LoRAConfig) and self.multi_token_prediction is not None:
            raise ConfigError("peft", "LoRA is not supported with multi_token_prediction yet")
        t = self.transformer
        if isinstance(peft, LoRAConfig) and t.num_experts > 1 and not self.has_dense_mlp:
            mlp = [layer for layer in peft.layers if layer in ("mlp_1", "mlp_2")]
            if mlp:
                raise ConfigError(
                    "peft.layers",
                    f"{mlp}: the mixture of experts has no dense MLP (no shared experts, no "
                    "first dense blocks); adapt its routed experts with experts_1 and "
                    "experts_2",
                )
        if isinstance(peft, LoRAConfig) and self.transformer.num_experts == 1:
            experts = [layer for layer in peft.layers if layer in EXPERT_LORA_LAYERS]
            if experts:
                raise ConfigError(
                    "peft.layers",
                    f"{experts}: the model has no mixture of experts (num_experts 1); "
                    "adapt its MLP with mlp_1 and mlp_2",
                )

    @property
    def has_dense_mlp(self) -> bool:
        """Some block has a dense MLP (one of a mixture of experts: its shared experts or
        its first dense blocks)."""
        t = self.transformer
        return t.num_experts == 1 or t.num_shared_experts > 0 or t.first_dense_layers > 0

    def _check_adapted_layers(self, lora: LoRAConfig) -> None:
        """LoRA adapts the projections of the built-in attention and MLP only."""
        t = self.transformer
        for layers, component, builtin in (
            (("query", "key", "value", "dense"), t.mixer, AttentionConfig),
            (("mlp_1", "mlp_2", *EXPERT_LORA_LAYERS), t.mlp, MLPConfig),
        ):
            adapted = [layer for layer in lora.adapted() if layer in layers]
            if adapted and not isinstance(component, builtin):
                raise ConfigError(
                    "peft.layers",
                    f"{adapted}: LoRA adapts the projections of type "
                    f"{builtin.__struct_config__.tag!r}, and transformer.{component.point} has "
                    f"type {component.__struct_config__.tag!r}",
                )

    def num_parameters(self, *, embeddings: bool = True, active: bool = False) -> int:
        """Parameters of the model; with `active`, only those one token uses (its
        num_experts_per_token routed experts, not all of them); without the input and output
        embeddings when `embeddings` is false, as MFU formulas count them."""
        counts = self.parameter_counts(active=active)
        blocks = self.block_counts(active=active)
        layers = sum(c.block + c.adapters for c in blocks) + counts.final_norm
        return (
            layers
            + self.prediction_parameters(active=active)
            + (counts.embedding + counts.head if embeddings else 0)
        )

    def adapter_parameters(
        self, blocks: Collection[int] | None = None, *, active: bool = False
    ) -> int:
        """The LoRA adapters' parameters in `blocks` (indices from 0; default: all); with
        `active`, as in `num_parameters`."""
        counts = self.block_counts(active=active)
        return sum(counts[i].adapters for i in (range(len(counts)) if blocks is None else blocks))

    def block_counts(self, *, active: bool = False) -> list[ParameterCounts]:
        """Each transformer block's parameter counts, in order (`active`: as in
        `num_parameters`): a mixture's first dense blocks have a dense MLP's."""
        t = self.transformer
        counts = self.parameter_counts(active=active)
        dense = self.parameter_counts(dense=True) if t.num_experts > 1 else counts
        return [counts if t.has_experts(i) else dense for i in range(t.num_layers)]

    def prediction_parameters(self, *, active: bool = False) -> int:
        """The multi-token prediction modules' parameters: each a block (a mixture's when
        the model has experts), three norms and its projection of 2 × hidden to hidden."""
        if self.multi_token_prediction is None:
            return 0
        counts = self.parameter_counts(active=active)
        h = self.transformer.hidden_size
        module = counts.block + 3 * counts.final_norm + 2 * h * h
        return self.multi_token_prediction.depth * module

    def parameter_counts(self, *, active: bool = False, dense: bool = False) -> ParameterCounts:
        """The parameters of each part of the model (`active`: as in `num_parameters`); with
        `dense`, a block's of the `first_dense_layers`, whose MLP is dense."""
        t = self.transformer
        assert t.kv_channels is not None and t.ffn_hidden_size is not None, "validate() first"
        h, kv = t.hidden_size, t.kv_channels
        q_size, kv_size = t.num_attention_heads * kv, t.head_groups * kv
        # the latents' norms of latent attention count among the block's norms
        latent_norms = 0 if t.latent_mixer is None else t.latent_mixer.norm_parameters
        attention = t.mixer.num_parameters(t) - latent_norms
        mlp_inputs = 2 if t.gated else 1
        if dense:  # a mixture-of-experts model's first dense blocks
            mlp = (mlp_inputs + 1) * h * t.dense_ffn_width
        else:
            mlp = t.mlp.num_parameters(t, active=active)
        norm = t.normalization.num_parameters(h)
        block_norms = t.block.num_norm_parameters(t) + latent_norms
        block_norm_elements = block_norms
        for query_key_norm, heads in (
            (t.query_norm, t.num_attention_heads),
            (t.key_norm, t.head_groups),
        ):
            if query_key_norm is None:
                continue
            # per head: one weight (and bias) of kv_channels, scaling every head
            width = kv if t.query_key_norm_scope == "head" else heads * kv
            block_norms += query_key_norm.num_parameters(width)
            block_norm_elements += query_key_norm.num_parameters(heads * kv)
        adapters = 0
        if isinstance(self.peft, LoRAConfig):
            # The dense MLP's width: a mixture's shared experts' (none without them), or its
            # first dense blocks'.
            if dense:
                dense_ffn = t.dense_ffn_width
            else:
                dense_ffn = t.ffn_hidden_size * (t.num_shared_experts if t.num_experts > 1 else 1)
            outputs = {
                "query": (h, q_size),
                "key": (h, kv_size),
                "value": (h, kv_size),
                "dense": (q_size, h),
                "mlp_1": (h, mlp_inputs * dense_ffn),
                "mlp_2": (dense_ffn, h),
            }
            rank = self.peft.rank
            for layer in self.peft.adapted():
                if layer in EXPERT_LORA_LAYERS or (layer.startswith("mlp") and not dense_ffn):
                    continue
                fan_in, fan_out = outputs[layer]
                # gate and up have an adapter each, both reading the same input
                copies = mlp_inputs if layer == "mlp_1" else 1
                adapters += rank * (copies * fan_in + fan_out)
            if not dense:  # each expert's adapter, one over its fused gate and up
                experts = t.num_experts_per_token if active else t.num_experts
                ffn = t.ffn_hidden_size
                expert_shapes = {"experts_1": (h, mlp_inputs * ffn), "experts_2": (ffn, h)}
                for layer in self.peft.adapted():
                    if layer in EXPERT_LORA_LAYERS:
                        fan_in, fan_out = expert_shapes[layer]
                        adapters += experts * rank * (fan_in + fan_out)
        return ParameterCounts(
            embedding=self.vocab_size * h,
            head=0 if self.tie_word_embeddings else self.vocab_size * h,
            block=attention + mlp + block_norms,
            block_norms=block_norms,
            block_norm_elements=block_norm_elements,
            final_norm=norm,
            adapters=adapters,
        )


@dataclass(frozen=True)
class ParameterCounts:
    """The parameters of each part of a model."""

    embedding: int
    head: int
    """0 when the head is the embedding (tied)."""
    block: int
    """One transformer block's, its norms included, its LoRA adapters not."""
    block_norms: int
    """One transformer block's norm parameters (weights and biases)."""
    block_norm_elements: int
    """The elements per token one block's norms scale by their weights (and shift by their
    biases): their parameters, but that a norm over each head scales every head."""
    final_norm: int
    adapters: int = 0
    """One transformer block's LoRA adapters (with `active`, of a mixture's experts only
    those one token uses)."""


class DistributedConfig(Section):
    training_dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    """Compute dtype. bfloat16 and float16 keep fp32 master weights and accumulate gradients
    in fp32; float16 adds dynamic loss scaling. In bfloat16 each master is held as the bf16
    weight the model computes with (its upper 16 bits, rounded) plus a 16-bit remainder: the
    fp32 value bit for bit in 4 bytes instead of 6 (the weight rounds an exact tie away from
    zero, where a cast rounds it to even). Checkpoints hold fp32 masters either way."""
    seed: int = 1234
    """Seed of the initialization and of every random stream of the run."""
    tensor_parallel: int = 1
    """Ranks that split each layer (Megatron-style: attention heads, MLP width and vocabulary
    divided among them). Ranks are ordered tensor, then data, then pipeline, so tensor ranks
    are neighbours; the data-parallel size is world / (tensor_parallel × pipeline_parallel)."""
    sequence_tensor_parallel: bool = False
    """With tensor_parallel > 1, split the activations between the layers along the sequence
    too (their all-reduces become all-gather / reduce-scatter pairs): less activation memory,
    the same communication. Ignored at tensor_parallel 1."""
    pipeline_parallel: int = 1
    """Ranks that split the model's stages (`model.multi_stage.layers_per_stage`): stage s
    runs on pipeline rank s mod pipeline_parallel, so more stages than ranks loops over them.
    The order of the micro-batches through the stages is `schedule`'s."""
    sequence_data_parallel: int = 1
    """Consecutive ranks of the data group that share each sequence, each computing a part of
    it (`sequence_data_chunking`; attention all-gathers the keys and values of the earlier
    chunks); it must divide the data-parallel size. ZeRO and the gradient sum still span the
    whole data group."""
    sequence_data_chunking: Literal["contiguous", "head_tail"] = "contiguous"
    """How the sequence-data ranks share a sequence: contiguous (rank r of S computes chunk r
    of S) or head_tail (chunks r and 2S-1-r of 2S: with causal attention every rank then
    attends to as many keys, where with contiguous chunks the last rank does S times the
    first's attention work; the sequence length must be divisible by 2S)."""
    expert_parallel: int = 1
    """Consecutive ranks of the data group that split each mixture's experts among them
    (rank r of E holds experts r·N/E to (r+1)·N/E - 1) and send each other the tokens routed
    to them (all-to-all); it must divide the data-parallel size and
    model.base_model.transformer.num_experts. The expert parameters get buffers of their own,
    which ZeRO shards over the data ranks holding the same experts."""
    fp8_linear: Literal["none", "tensorwise", "rowwise"] = "none"
    """FP8 compute of the blocks' linear layers (attention q/k/v and output, dense MLP; the
    embedding, the head and mixture-of-experts layers stay bf16; the fp32 master weights and
    the optimizer do not change). tensorwise: one scale per tensor, gradients in e5m2;
    rowwise: one scale per row of each operand, all in e4m3. Needs bfloat16 training and a
    GPU with FP8 tensor cores (compute capability 8.9 or more); on CPU the FP8 rounding is
    emulated. Not with tensor parallelism yet; with pipeline parallelism each rank computes
    its stages' layers in FP8 and keeps their amax histories, with sequence-data parallelism
    each rank scales its own chunk of the sequence."""
    fp8_scaling: Literal["current", "delayed"] = "current"
    """How tensorwise FP8 scales the layers' inputs, output gradients and weights. current:
    each tensor by its own amax (a pass to find it before the cast). delayed: by the largest
    amax of the last `fp8_amax_history_length` steps (Transformer Engine's delayed scaling),
    so the kernel that produces a tensor (the norm, the gated activation) writes it in FP8
    and records its amax in the same pass, and a weight is quantized in one pass; values past
    the range saturate. The histories are part of the checkpoint. rowwise scales currently."""
    fp8_amax_history_length: int = 16
    """Steps of amaxes that delayed scaling takes the max of (Transformer Engine's
    amax_history_len)."""

    def validate(self) -> None:
        check_non_negative(self.seed, "seed")
        check_positive(self.tensor_parallel, "tensor_parallel")
        check_positive(self.sequence_data_parallel, "sequence_data_parallel")
        check_positive(self.pipeline_parallel, "pipeline_parallel")
        check_positive(self.expert_parallel, "expert_parallel")
        check_positive(self.fp8_amax_history_length, "fp8_amax_history_length")
        if self.fp8_linear != "none" and self.training_dtype != "bfloat16":
            raise ConfigError(
                "fp8_linear",
                f"{self.fp8_linear} needs model.distributed.training_dtype bfloat16, got "
                f"{self.training_dtype}",
            )
        if self.fp8_scaling == "delayed" and self.fp8_linear != "tensorwise":
            raise ConfigError(
                "fp8_scaling",
                f"delayed scaling needs fp8_linear=tensorwise, got fp8_linear={self.fp8_linear}",
            )


class MultiStageConfig(Section):
    zero_stage: Literal[1, 2, 3] = 1
    """What data-parallel ranks shard: 1, the fp32 master weights and Adam moments; 2, also the
    gradients (each stage is reduce-scattered as soon as its backward pass is done); 3, also
    the compute weights (each stage is all-gathered one stage ahead of its use in the forward
    and backward passes, and freed after)."""
    layers_per_stage: int = 1
    """Transformer blocks per stage (the embedding joins the first, the final norm and the
    head the last): the unit in which weights are laid out, gradients reduce-scattered,
    (ZeRO-3) weights gathered and the pipeline split. Larger stages mean fewer, larger
    messages."""
    debug_tensor_parallel: bool = False
    """After every optimizer step, check that the parameters replicated across tensor ranks
    (norms, biases of row-parallel layers) are still identical on every tensor rank; an error
    names those that drifted apart. Costs one broadcast of them per step."""
    recompute: Literal["none", "elementwise", "selective", "full"] = "elementwise"
    """Activations recomputed in the backward pass instead of stored. none: nothing (fastest,
    most memory); elementwise: each norm's output and each gated MLP's act(gate)·up, from the
    inputs their backward passes keep anyway (two hidden-size and one ffn-size activation less
    per token and layer, for three elementwise passes); selective: also each MLP whole (its
    wide intermediate activations); full: whole blocks."""
    offload_activations: int = 0
    """The first blocks (this many) whose stored activations go to pinned host memory during
    the forward pass, copied beside the compute, and come back two blocks ahead of their
    backward passes (engine/activation_offload.py): no recomputation, but the forward pass
    must leave the bytes time to cross (about 55 GB/s on an H200 host). Not with compiled
    blocks, pipeline parallelism, breadth-first micro-batches or micro-sequences."""
    offload_optimizer: bool = False
    """Keep this rank's optimizer state in (pinned) host memory: the fp32 masters (with bf16
    compute weights, their low halves) and the Adam moments, 10 of the 16 bytes per trained
    parameter of bf16 training (8 in fp32 training, whose masters are the compute weights).
    Each step streams it through the GPU in chunks for the same update as on the GPU
    (engine/offloaded_optimizer.py): 20 bytes per parameter cross the host link, an estimated
    1.5 s per step for 8B parameters on an H200 host."""

    def validate(self) -> None:
        check_positive(self.layers_per_stage, "layers_per_stage")
        if self.offload_activations < 0:
            raise ConfigError(
                "offload_activations", f"must be 0 or more, got {self.offload_activations}"
            )

    def num_stages(self, num_layers: int) -> int:
        return num_stages(num_layers, self.layers_per_stage)


class FreezeConfig(Section):
    embeddings: bool = False
    """The input embedding (with `tie_word_embeddings`, the head too: set `head` alike)."""
    head: bool = False
    """The output head."""
    norms: bool = False
    """Every normalization layer's weights (and biases), the final norm's too."""
    blocks: list[int] | None = None
    """`[first, end)`: transformer blocks frozen whole, counted from 0 (none: no block)."""

    @property
    def any(self) -> bool:
        return self.embeddings or self.head or self.norms or self.blocks is not None

    def frozen_blocks(self) -> range:
        return range(*self.blocks) if self.blocks is not None else range(0)


class ModelConfig(Section):
    base_model: BaseModelConfig = msgspec.field(default_factory=BaseModelConfig)
    """The architecture."""
    distributed: DistributedConfig = msgspec.field(default_factory=DistributedConfig)
    """Precision, seeding and the parallel layout."""
    multi_stage: MultiStageConfig = msgspec.field(default_factory=MultiStageConfig)
    """How the model's memory is traded against compute."""
    freeze: FreezeConfig = msgspec.field(default_factory=FreezeConfig)
    """Parameters that do not train: they hold only their weights (no gradient, no fp32
    master, no Adam moments), are never reduced, and count in neither the gradient norm nor
    the optimizer step. Checkpoints hold the trained parameters only: a resume reads the
    frozen ones again from `pretrained` (or draws them from the seed), as the run began."""

    def validate(self) -> None:
        freeze, base = self.freeze, self.base_model
        if base.tie_word_embeddings and freeze.embeddings != freeze.head:
            raise ConfigError(
                "freeze.head",
                f"is {str(freeze.head).lower()} but freeze.embeddings is "
                f"{str(freeze.embeddings).lower()}: with tie_word_embeddings they are one tensor",
            )
        if freeze.blocks is not None:
            layers = base.transformer.num_layers
            if len(freeze.blocks) != 2 or not 0 <= freeze.blocks[0] < freeze.blocks[1] <= layers:
                raise ConfigError(
                    "freeze.blocks",
                    f"must be [first, end) with 0 <= first < end <= num_layers ({layers}), "
                    f"got {freeze.blocks}",
                )
            everything = freeze.embeddings and freeze.head and freeze.norms
            if (everything or self.others_frozen) and freeze.blocks == [0, layers]:
                raise ConfigError("freeze", "freezes every parameter: nothing would train")

    @property
    def others_frozen(self) -> bool:
        """LoRA's `freeze_others`: every parameter but the adapters frozen."""
        peft = self.base_model.peft
        return isinstance(peft, LoRAConfig) and peft.freeze_others

    @property
    def any_frozen(self) -> bool:
        return self.freeze.any or self.others_frozen

    def num_frozen_parameters(self) -> int:
        """Parameters `freeze` (and LoRA's `freeze_others`) hold fixed."""
        freeze, base = self.freeze, self.base_model
        counts = base.parameter_counts()
        of_block = base.block_counts()  # a mixture's dense blocks are smaller, adapted otherwise
        frozen_blocks = set(freeze.frozen_blocks())
        training = [c for i, c in enumerate(of_block) if i not in frozen_blocks]
        if self.others_frozen:
            return base.num_parameters() - sum(c.adapters for c in training)
        frozen = sum(of_block[i].block + of_block[i].adapters for i in frozen_blocks)
        if freeze.norms:
            frozen += sum(c.block_norms for c in training) + counts.final_norm
            if base.multi_token_prediction is not None:  # each module's block and three norms
                module = counts.block_norms + 3 * counts.final_norm
                frozen += base.multi_token_prediction.depth * module
        if freeze.embeddings:
            frozen += counts.embedding
        if freeze.head:
            frozen += counts.head
        return frozen
