"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) ↔ fastllm: its config keys, its latent attention's
and its mixture's tensors (the registry entry in architectures.py).

DeepSeek lays each rotary part out in interleaved pairs (x0, x1), (x2, x3), … (transformers'
rope_interleave, its default); our rotary kernel turns the pairs (x_i, x_(i+d/2)). The rows of
the projections that make the rotary parts are reordered on the way in (evens, then odds)
and back on the way out: both rotations then give the same numbers, and a round trip gives
back every tensor bit for bit."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from fastllm.checkpoint.hf_rules import Rule, concat, same, stack
from fastllm.config import BaseModelConfig, ConfigError
from fastllm.config.multi_token_prediction import MultiTokenPredictionConfig


def deepseek_v3_from_hf(hf: dict[str, Any], transformer: dict[str, Any]) -> None:
    if hf.get("rope_interleave") is False:
        raise ConfigError(
            "config.json:rope_interleave",
            "false is not supported (DeepSeek's checkpoints interleave the rotary pairs)",
        )
    if hf.get("attention_bias"):
        raise ConfigError("config.json:attention_bias", "latent attention has no biases")
    nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    latent: dict[str, Any] = {
        "type": "latent_attention",
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": hf["kv_lora_rank"],
        "qk_head_dim": nope,
        "qk_pos_emb_head_dim": rope,
        "v_head_dim": hf["v_head_dim"],
    }
    rotary = transformer["rotary"]
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rotary["type"] == "yarn":
        factor = rotary["scale_factor"]
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if scaling.get("attention_factor") is None and mscale and mscale_all_dim:
            rotary["attention_factor"] = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        if mscale_all_dim:
            latent["mscale_all_dim"] = mscale_all_dim
    transformer.update(
        {
            "mixer": latent,
            "kv_channels": nope + rope,
            "add_linear_biases": False,
            "ffn_hidden_size": hf["moe_intermediate_size"],
            "dense_ffn_hidden_size": hf["intermediate_size"],
            "first_dense_layers": hf.get("first_k_dense_replace") or 0,
            "num_experts": hf["n_routed_experts"],
            "num_experts_per_token": hf["num_experts_per_tok"],
            "expert_score_function": "sigmoid",
            "expert_bias": True,
            "expert_auxiliary_loss_coefficient": 0.0,
            "expert_groups": hf.get("n_group") or 1,
            "expert_groups_per_token": hf.get("topk_group") or hf.get("n_group") or 1,
            "expert_routed_scaling_factor": hf.get("routed_scaling_factor", 1.0),
            "expert_renormalize": bool(hf.get("norm_topk_prob", True)),
            "num_shared_experts": hf.get("n_shared_experts") or 0,
        }
    )


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's mscale, as DeepSeek computes it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_v3_from_tensors(config: BaseModelConfig, names: set[str]) -> None:
    """Multi-token prediction modules, as many as the checkpoint holds (DeepSeek's
    model.layers.{num_hidden_layers + k}.*): num_nextn_predict_layers does not say, as
    transformers writes 1 for checkpoints it saves without them."""
    layers = config.transformer.num_layers
    depth = 0
    while f"model.layers.{layers + depth}.eh_proj.weight" in names:
        depth += 1
    if depth:
        config.multi_token_prediction = MultiTokenPredictionConfig(depth=depth)


def deepseek_v3_to_hf(config: BaseModelConfig, hf: dict[str, Any]) -> None:
    t = config.transformer
    latent = t.latent_mixer
    assert latent is not None and t.ffn_hidden_size is not None
    hf.update(
        {
            "rms_norm_eps": t.normalization.epsilon,
            "attention_bias": False,
            "rope_interleave": True,
            "q_lora_rank": latent.q_lora_rank,
            "kv_lora_rank": latent.kv_lora_rank,
            "qk_nope_head_dim": latent.qk_head_dim,
            "qk_rope_head_dim": latent.qk_pos_emb_head_dim,
            "v_head_dim": latent.v_head_dim,
            "head_dim": latent.qk_pos_emb_head_dim,  # what transformers sets it to
            "intermediate_size": t.dense_ffn_width,
            "moe_intermediate_size": t.ffn_hidden_size,
            "first_k_dense_replace": t.first_dense_layers,
            "n_routed_experts": t.num_experts,
            "num_experts_per_tok": t.num_experts_per_token,
            "n_group": t.expert_groups,
            "topk_group": t.groups_per_token,
            "routed_scaling_factor": t.expert_routed_scaling_factor,
            "norm_topk_prob": t.expert_renormalize,
            "n_shared_experts": t.num_shared_experts,
        }
    )
    prediction = config.multi_token_prediction
    hf["num_nextn_predict_layers"] = prediction.depth if prediction is not None else 0
    if hf.get("rope_scaling") and latent.mscale_all_dim:
        hf["rope_scaling"]["mscale_all_dim"] = latent.mscale_all_dim


def deepseek_v3_attention(config: BaseModelConfig, ours: str, theirs: str) -> Iterator[Rule]:
    t = config.transformer
    latent = t.latent_mixer
    assert latent is not None
    mine, attention = f"{ours}.attention", f"{theirs}.self_attn"
    heads = t.num_attention_heads
    rope = latent.qk_pos_emb_head_dim
    # the rotary rows: the last `rope` of each head's query, the last `rope` of the down
    # projection of keys and values
    query_rows = _deinterleaved_rows(heads, latent.qk_head_dim, rope)
    if latent.q_lora_rank is None:
        yield _permuted(f"{mine}.query_up.weight", f"{attention}.q_proj.weight", query_rows)
    else:
        yield same(f"{mine}.query_down.weight", f"{attention}.q_a_proj.weight")
        yield same(f"{mine}.query_norm.weight", f"{attention}.q_a_layernorm.weight")
        yield _permuted(f"{mine}.query_up.weight", f"{attention}.q_b_proj.weight", query_rows)
    key_rows = _deinterleaved_rows(1, latent.kv_lora_rank, rope)
    yield _permuted(
        f"{mine}.key_value_down.weight", f"{attention}.kv_a_proj_with_mqa.weight", key_rows
    )
    yield same(f"{mine}.key_value_norm.weight", f"{attention}.kv_a_layernorm.weight")
    yield same(f"{mine}.key_value_up.weight", f"{attention}.kv_b_proj.weight")
    yield same(f"{mine}.dense.weight", f"{attention}.o_proj.weight")


def _deinterleaved_rows(heads: int, before: int, rope: int) -> Tensor:
    """Row order of a projection of `heads` heads of `before` rows then `rope` rotary rows
    each, with each head's rotary rows taken evens first, then odds."""
    width = before + rope
    order = torch.cat([torch.arange(before), before + torch.arange(0, rope, 2)])
    order = torch.cat([order, before + torch.arange(1, rope, 2)])
    return torch.cat([head * width + order for head in range(heads)])


def _permuted(ours: str, theirs: str, rows: Tensor) -> Rule:
    """Ours is theirs with its rows in the order `rows`."""
    inverse = torch.argsort(rows)
    return Rule(
        ours,
        (theirs,),
        lambda ts: ts[0].index_select(0, rows),
        lambda t: [t.index_select(0, inverse)],
    )


def deepseek_v3_mlp(config: BaseModelConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """A mixture's tensors (the first dense layers' are the common dense MLP's)."""
    t = config.transformer
    assert t.ffn_hidden_size is not None
    mlp, ffn = f"{theirs}.mlp", t.ffn_hidden_size
    yield same(f"{ours}.router.weight", f"{mlp}.gate.weight")
    yield same(f"{ours}.expert_bias", f"{mlp}.gate.e_score_correction_bias")
    gate_up = tuple(
        f"{mlp}.experts.{e}.{w}_proj.weight" for e in range(t.num_experts) for w in ("gate", "up")
    )
    yield stack(f"{ours}.layer_1", gate_up, [ffn, ffn])
    down = tuple(f"{mlp}.experts.{e}.down_proj.weight" for e in range(t.num_experts))
    yield stack(f"{ours}.layer_2", down)
    if t.num_shared_experts:
        shared = f"{mlp}.shared_experts"
        width = t.num_shared_experts * ffn
        gate_up_shared = (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")
        yield concat(f"{ours}.shared.layer_1.weight", gate_up_shared, [width, width])
        yield same(f"{ours}.shared.layer_2.weight", f"{shared}.down_proj.weight")
