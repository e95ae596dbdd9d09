"""LoRA through the trainer: a Hugging Face model fine-tuned from `pretrained` with adapters,
against PEFT on the same `transformers` model with the same optimizer settings; the buffers
hold the adapters' state alone."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml

from fastllm.checkpoint.peft import PREFIX, adapter_rules
from fastllm.config import TrainerConfig, build
from fastllm.config.loading import load_raw
from fastllm.training.setup import with_pretrained_architecture
from fastllm.training.trainer import Trainer
from tests.model.hf_models import save_hf_model
from tests.model.test_lora import PEFT_MODULES

LORA = {
    "type": "lora",
    "rank": 4,
    "alpha": 8.0,
    "layers": ["query", "key", "value", "dense", "mlp_1", "mlp_2"],
}


def lora_config(dataset: Path, experiment: Path, hf: Path, **sections: object) -> Path:
    """A run that fine-tunes the Hugging Face model in `hf` with LoRA, architecture from it."""
    config = {
        "run": {"experiment_dir": str(experiment)},
        "pretrained": {"path": str(hf), "format": "llama"},
        "model": {
            "base_model": {"peft": LORA},
            "distributed": {"training_dtype": "float32", "seed": 7},
        },
        "training": {
            "train_iters": 10,
            "logs": {"interval": 1},
            "checkpoint": {"interval": None},
            "export": {"interval": None},
        },
        "batch": {"batch_size": 4, "sequence_length": 32, "micro_batch_size": 2},
        "data": {"path": [str(dataset)]},
        "optimizer": {
            "learning_rate": {"base": 3e-3},
            "weight_decay": 0.1,
            "beta_2": 0.95,
            "gradient_norm_clipping": 1.0,
        },
        **sections,
    }
    path = experiment.parent / f"{experiment.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def lora_trainer(config: Path, *overrides: str) -> Trainer:
    raw = with_pretrained_architecture(load_raw([str(config)], list(overrides)))
    return Trainer(build(TrainerConfig, raw))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama of the dataset's 512-token vocabulary."""
    directory = tmp_path_factory.mktemp("hf_llama")
    save_hf_model("llama", directory, vocab_size=512)
    return directory


def test_lora_buffers_hold_the_adapters_state_alone(
    dataset: Path, hf_llama: Path, tmp_path: Path
) -> None:
    run = lora_trainer(lora_config(dataset, tmp_path / "run", hf_llama))
    stages = run.engine.stages
    adapters = run.config.model.base_model.parameter_counts().adapters * 2  # 2 blocks
    trained = [name for group in stages.groups for name in group.buffers.names]
    assert trained and all("_lora." in name for name in trained)
    assert stages.frozen is not None
    assert not any("_lora." in name for name in stages.frozen.buffers.names)
    numel = {n: p.numel() for n, p in run.engine.model.named_parameters()}
    assert sum(numel[n] for n in trained) == adapters
    # Each parameter starts at an aligned offset of its stage: up to 127 elements of padding.
    layout = stages.dense.buffers.layout
    elements = sum(layout.stage_size(s) for s in stages.dense.buffers.owned)
    assert adapters <= elements < adapters + 128 * len(trained)
    shards = [s for group in stages.groups for s in group.buffers.shards.values()]
    for kind in ("exp_avg", "exp_avg_sq", "grad", "master"):
        assert sum(getattr(s, kind).numel() for s in shards) == elements, kind
    assert stages.dense.buffers.gradients.held_bytes == 4 * elements
    assert not hasattr(stages.frozen.buffers, "gradients")
    assert run.config.model.num_frozen_parameters() == (
        run.config.model.base_model.num_parameters() - adapters
    )


def test_ten_steps_match_peft_with_the_same_optimizer(
    dataset: Path, hf_llama: Path, tmp_path: Path
) -> None:
    run = lora_trainer(lora_config(dataset, tmp_path / "run", hf_llama))
    config = run.config.model.base_model
    ours = dict(run.engine.whole_parameters())

    # PEFT on the same model, its adapters set to ours (A drawn from our seed, B zero).
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama, dtype=torch.float32)
    base.config._attn_implementation = "eager"
    theirs = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=PEFT_MODULES)
    )
    adapters = {
        name.replace(".default", ""): p for name, p in theirs.named_parameters() if p.requires_grad
    }
    with torch.no_grad():
        for rule in adapter_rules(config, "llama"):
            for name, piece in zip(rule.theirs, rule.split(ours[rule.ours]), strict=True):
                adapters[PREFIX + name].copy_(piece)
    trainable = list(adapters.values())
    optimizer = torch.optim.AdamW(trainable, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    steps = iter(run.data_loader())
    for step in range(10):
        micro_batches = next(steps)
        our = run.engine.train_step(micro_batches)
        input_ids = torch.cat([b.input_ids for b in micro_batches])
        labels = torch.cat([b.labels for b in micro_batches])
        logits = theirs(input_ids=input_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        assert our["loss"] == pytest.approx(loss.item(), rel=2e-5), step
        assert our["grad_norm"] == pytest.approx(norm.item(), rel=1e-4), step
    final = dict(run.engine.whole_parameters())
    for rule in adapter_rules(config, "llama"):
        expected = rule.join([adapters[PREFIX + name].detach() for name in rule.theirs])
        torch.testing.assert_close(final[rule.ours], expected, rtol=1e-4, atol=1e-6)
    # The base weights did not move.
    for name, tensor in ours.items():
        if "_lora." not in name:
            torch.testing.assert_close(final[name], tensor, rtol=0, atol=0)
