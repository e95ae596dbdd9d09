"""DeepSeek-V3 against `transformers`: latent attention alone (every layer dense), without a
query latent, with yarn's softmax scale; its routing; conversion both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastllm
from fastllm.checkpoint.convert import convert
from fastllm.config import BaseModelConfig, ConfigError, build
from fastllm.config.convert import ConvertConfig
from fastllm.model.mlp import MixtureOfExperts
from fastllm.model.routing import bias_update, route_scored
from tests.model.hf_models import save_hf_model
from tests.model.test_parity import all_tensors, relative_error

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,  # DeepSeek-V3's: yarn's attention factor 1, the softmax scaled
}


@pytest.mark.parametrize(
    "overrides",
    [
        {"first_k_dense_replace": 2},  # latent attention alone
        {"first_k_dense_replace": 2, "q_lora_rank": None},  # Moonlight's query projection
        {"first_k_dense_replace": 2, "rope_scaling": YARN, "max_position_embeddings": 128},
        {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False},
    ],
    ids=["dense", "no-query-latent", "yarn", "moe-ungrouped"],
)
def test_logits_match_transformers(overrides: dict, tmp_path: Path) -> None:
    theirs = save_hf_model("deepseek_v3", tmp_path, **overrides)
    ours = fastllm.load_model(tmp_path)
    transformer = ours.config.transformer
    assert transformer.latent_mixer is not None
    assert sum(isinstance(b.mlp, MixtureOfExperts) for b in ours.layers) == 2 - min(
        overrides.get("first_k_dense_replace", 1), 2
    )
    input_ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(4))
    assert relative_error(ours(input_ids), theirs(input_ids).logits) <= 1e-5


def test_generate_matches_transformers_greedy_decoding(tmp_path: Path) -> None:
    from fastllm.hf import FastLLMForCausalLM

    theirs = save_hf_model("deepseek_v3", tmp_path)
    ours = FastLLMForCausalLM.wrap(fastllm.load_model(tmp_path))
    prompt = torch.tensor([[5, 17, 33, 8, 60, 2, 41]])
    settings = {"max_new_tokens": 10, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    assert torch.equal(ours.generate(prompt, **settings), theirs.generate(prompt, **settings))


def test_dense_model_converts_to_hf_and_back_bit_for_bit(tmp_path: Path) -> None:
    save_hf_model("deepseek_v3", tmp_path / "hf", first_k_dense_replace=2, q_lora_rank=None)
    for source, target, fmt in (("hf", "ours", "fastllm"), ("ours", "back", "deepseek_v3")):
        kind = "deepseek_v3" if source == "hf" else "fastllm"
        convert(
            build(
                ConvertConfig,
                {
                    "input": {"format": kind, "path": str(tmp_path / source)},
                    "output": {"type": fmt, "path": str(tmp_path / target)},
                },
            )
        )
    original, back = all_tensors(tmp_path / "hf"), all_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert torch.equal(tensor, back[name]), name


def routing_config(**overrides: object) -> BaseModelConfig:
    transformer = {
        "num_experts": 8,
        "num_experts_per_token": 3,
        "gated": True,
        "add_linear_biases": False,
        "expert_score_function": "sigmoid",
        "expert_auxiliary_loss_coefficient": 0.0,
        "expert_bias": True,
        "expert_groups": 4,
        "expert_groups_per_token": 2,
        "expert_routed_scaling_factor": 2.5,
        **overrides,
    }
    return build(BaseModelConfig, {"transformer": transformer})


def test_routing_chooses_only_from_the_best_groups_by_biased_scores() -> None:
    config = routing_config().transformer
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
    bias = torch.zeros(8)
    bias[6:] = 10.0  # group 3 is always among the best two, and both its experts chosen
    routing = route_scored(logits, config, bias, torch.float32)
    assert (routing.experts == 6).any(dim=1).all() and (routing.experts == 7).any(dim=1).all()
    groups = (routing.experts // 2).tolist()
    assert all(len(set(row)) <= 2 for row in groups)
    # the bias chooses, the scores weigh: renormalized sigmoids times the scaling factor
    scores = logits.sigmoid().gather(1, routing.experts)
    expected = scores / scores.sum(dim=1, keepdim=True) * 2.5
    torch.testing.assert_close(routing.weights, expected)
    assert routing.counts.sum() == 64 * 3


def test_bias_update_moves_towards_the_mean_load() -> None:
    load = torch.tensor([10, 2, 6, 6])
    torch.testing.assert_close(bias_update(load, 0.01), torch.tensor([-0.01, 0.01, 0.0, 0.0]))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"expert_auxiliary_loss_coefficient": 0.01}, "expert_auxiliary_loss_coefficient"),
        ({"expert_groups": 3}, "expert_groups"),
        ({"expert_groups_per_token": 5}, "expert_groups_per_token"),
        ({"expert_groups_per_token": 1}, "num_experts_per_token"),
        (
            {"mixer": {"type": "latent_attention", "kv_lora_rank": 8}, "head_groups": 2},
            "head_groups",
        ),
        ({"mixer": {"type": "latent_attention", "qk_pos_emb_head_dim": 5}}, "qk_pos_emb_head_dim"),
    ],
)
def test_bad_routing_and_latent_settings_are_refused_naming_the_key(
    overrides: dict, key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        routing_config(**overrides)


def test_the_former_latent_attention_key_says_it_is_now_a_mixer() -> None:
    with pytest.raises(ConfigError) as refused:
        routing_config(latent_attention={"kv_lora_rank": 16})
    assert refused.value.path == "transformer.latent_attention"
    assert "transformer.mixer: {type: latent_attention" in refused.value.message


@pytest.mark.parametrize(
    ("layers", "key", "named"),
    [
        (["query", "value"], "model.base_model.peft.layers", "'latent_attention'"),
        (["mlp_1"], "model.base_model.transformer.mixer", "model.base_model.peft"),
    ],
)
def test_lora_is_refused_with_latent_attention(layers: list[str], key: str, named: str) -> None:
    from fastllm.config import TrainerConfig, load_config

    overrides = [
        f"model.base_model.transformer.{setting}"
        for setting in (
            "head_groups=8",
            "window_size=null",
            "add_linear_biases=false",
            "mixer={type: latent_attention, kv_lora_rank: 16, qk_head_dim: 16, "
            "qk_pos_emb_head_dim: 16, v_head_dim: 32}",
        )
    ]
    lora = f"model.base_model.peft={{type: lora, layers: [{', '.join(layers)}]}}"
    export = "training.export.format=fastllm"  # a distributed export refuses LoRA itself
    examples = Path(__file__).resolve().parents[2] / "examples"
    with pytest.raises(ConfigError) as refused:
        load_config(TrainerConfig, [examples / "tiny.yaml"], [*overrides, lora, export])
    assert refused.value.path == key
    assert named in refused.value.message


def test_only_deepseek_v3_expresses_latent_attention_and_sigmoid_routing() -> None:
    from fastllm.checkpoint.hf_config import to_hf_config

    config = routing_config(num_shared_experts=1)
    with pytest.raises(ConfigError, match="latent_attention"):
        to_hf_config(config, "deepseek_v3")
    gated = routing_config(num_shared_experts=1, shared_expert_gate=True)
    with pytest.raises(ConfigError, match="expert_score_function"):
        to_hf_config(gated, "qwen2_moe")


def test_prediction_modules_convert_to_deepseek_names_and_back_bit_for_bit(
    tmp_path: Path,
) -> None:
    """transformers drops the modules; DeepSeek's checkpoints keep them as
    model.layers.{num_hidden_layers + k}.* (with copies of the embedding and the head), which
    is what we write and read back."""
    from fastllm.checkpoint.formats import ModelSource, open_model, write_model
    from fastllm.config.multi_token_prediction import MultiTokenPredictionConfig
    from fastllm.model import GPTModel
    from fastllm.model.init import initialize

    save_hf_model("deepseek_v3", tmp_path / "hf")
    config = open_model(tmp_path / "hf").config
    config.multi_token_prediction = MultiTokenPredictionConfig(depth=2)
    model = GPTModel(config)
    initialize(model, torch.Generator().manual_seed(6))
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    source = ModelSource(tmp_path, "fastllm", config, loaded=tensors)
    write_model(source, tmp_path / "deepseek", "deepseek_v3")
    written = all_tensors(tmp_path / "deepseek")
    assert torch.equal(
        written["model.layers.3.eh_proj.weight"], tensors["prediction_modules.1.projection.weight"]
    )
    assert torch.equal(written["model.layers.2.embed_tokens.weight"], tensors["embeddings.weight"])
    assert torch.equal(written["model.layers.3.shared_head.head.weight"], tensors["head.weight"])
    reread = open_model(tmp_path / "deepseek")
    assert reread.config.multi_token_prediction == MultiTokenPredictionConfig(depth=2)
    assert {name: t for name, t in reread.tensors()}.keys() == tensors.keys()
    for name, tensor in reread.tensors():
        assert torch.equal(tensor, tensors[name]), name
    # transformers reads the blocks and leaves the modules' tensors aside
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deepseek").eval()
    input_ids = torch.randint(0, 97, (1, 9))
    assert relative_error(model(input_ids), loaded(input_ids).logits) <= 1e-5
