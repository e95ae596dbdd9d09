"""LoRA through the trainer: a Hugging Face model fine-tuned from `pretrained` with adapters,
against PEFT on the same `transformers` model with the same optimizer settings (a Mixtral's
experts through PEFT's `target_parameters`); the buffers hold the adapters' state alone;
compiled blocks train adapters and frozen weights (`model.freeze` too) as eager ones do."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml
from safetensors.torch import load_file

import fastllm
from fastllm.checkpoint.peft import PREFIX, adapter_rules
from fastllm.config import ConfigError, TrainerConfig, build
from fastllm.config.loading import load_raw
from fastllm.hf import FastLLMForCausalLM
from fastllm.training.setup import with_pretrained_architecture
from fastllm.training.trainer import Trainer
from tests.model.hf_models import save_hf_model
from tests.model.test_lora import EXPERT_LAYERS, PEFT_EXPERTS, PEFT_MODULES
from tests.training.conftest import Launched, Layout, compiled_graphs
from tests.training.test_frozen import FROZEN, assert_same_run
from tests.training.test_training_options import trainer

LORA = {
    "type": "lora",
    "rank": 4,
    "alpha": 8.0,
    "layers": ["query", "key", "value", "dense", "mlp_1", "mlp_2"],
}


def lora_config(
    dataset: Path,
    experiment: Path,
    hf: Path,
    architecture: str = "llama",
    layers: list[str] | None = None,
    **sections: object,
) -> Path:
    """A run that fine-tunes the Hugging Face model in `hf` with LoRA (on `layers`, default
    every linear), architecture from it."""
    peft_section = LORA if layers is None else {**LORA, "layers": layers}
    config = {
        "run": {"experiment_dir": str(experiment)},
        "pretrained": {"path": str(hf), "format": architecture},
        "model": {
            "base_model": {"peft": peft_section},
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


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral (4 experts, top 2) of the dataset's 512-token vocabulary, without the
    router's auxiliary loss (which PEFT's loss, from the logits, leaves out)."""
    directory = tmp_path_factory.mktemp("hf_mixtral")
    save_hf_model("mixtral", directory, vocab_size=512, router_aux_loss_coef=0.0)
    return directory


# Each architecture's adapted layers and PEFT's targets of them.
ARCHITECTURES = {
    "llama": (None, {"target_modules": PEFT_MODULES}),
    "mixtral": (EXPERT_LAYERS, PEFT_EXPERTS),
}


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


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_ten_steps_match_peft_with_the_same_optimizer(
    dataset: Path, request: pytest.FixtureRequest, tmp_path: Path, architecture: str
) -> None:
    layers, targets = ARCHITECTURES[architecture]
    hf = request.getfixturevalue(f"hf_{architecture}")
    run = lora_trainer(lora_config(dataset, tmp_path / "run", hf, architecture, layers))
    config = run.config.model.base_model
    ours = dict(run.engine.whole_parameters())

    # PEFT on the same model, its adapters set to ours (A drawn from our seed, B zero).
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    base.config._attn_implementation = "eager"
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8.0, **targets))
    adapters = {
        name.replace(".default", ""): p for name, p in theirs.named_parameters() if p.requires_grad
    }
    with torch.no_grad():
        for rule in adapter_rules(config, architecture):
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
    for rule in adapter_rules(config, architecture):
        expected = rule.join([adapters[PREFIX + name].detach() for name in rule.theirs])
        torch.testing.assert_close(final[rule.ours], expected, rtol=1e-4, atol=1e-6)
    # The base weights did not move.
    for name, tensor in ours.items():
        if "_lora." not in name:
            torch.testing.assert_close(final[name], tensor, rtol=0, atol=0)


def trained(config: Path, *overrides: str) -> Trainer:
    run = lora_trainer(config, *overrides)
    assert run.fit() is None
    run.wait_for_checkpoints()
    return run


def logits_of(run: Trainer, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return run.engine.model(input_ids)


INPUT_IDS = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(5))


def test_exports_load_in_peft_and_transformers_with_the_same_logits(
    dataset: Path, hf_llama: Path, tmp_path: Path
) -> None:
    config = lora_config(dataset, tmp_path / "run", hf_llama)
    exports = ("training.train_iters=3", "training.export.interval=3")
    adapter = trained(config, *exports, "training.export.format=peft")
    merged = trained(
        config,
        *exports,
        "training.export.format=llama",
        "run.experiment_dir=" + str(tmp_path / "merged"),
    )
    ours = logits_of(adapter, INPUT_IDS)
    torch.testing.assert_close(logits_of(merged, INPUT_IDS), ours, rtol=0, atol=0)

    exported = tmp_path / "run" / "export" / "3"
    assert sorted(p.name for p in exported.iterdir() if p.suffix in (".json", ".safetensors")) >= [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama, dtype=torch.float32)
    with torch.no_grad():
        plain = base.eval()(input_ids=INPUT_IDS).logits
    with_adapter = peft.PeftModel.from_pretrained(base, exported).eval()  # wraps base in place
    with torch.no_grad():
        theirs = with_adapter(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters trained

    # The base with the adapter, through the API and the transformers wrapper that
    # `fastllm generate --adapter` runs: PEFT's greedy completion.
    loaded = fastllm.load_model(hf_llama, adapter=exported)
    with torch.no_grad():
        torch.testing.assert_close(loaded(INPUT_IDS), ours, rtol=1e-5, atol=1e-5)
        prompt = INPUT_IDS[:1, :6]
        expected = with_adapter.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
        got = FastLLMForCausalLM.wrap(loaded).generate(prompt, max_new_tokens=8, do_sample=False)
    assert got.tolist() == expected.tolist()

    whole = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged" / "export" / "3", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(whole(input_ids=INPUT_IDS).logits, ours, rtol=1e-5, atol=1e-5)


def test_expert_adapters_export_to_peft_and_import_back(
    dataset: Path, hf_mixtral: Path, tmp_path: Path
) -> None:
    config = lora_config(dataset, tmp_path / "run", hf_mixtral, "mixtral", EXPERT_LAYERS)
    exports = ("training.train_iters=3", "training.export.interval=3")
    run = trained(config, *exports, "training.export.format=peft")
    ours = logits_of(run, INPUT_IDS)
    exported = tmp_path / "run" / "export" / "3"
    written = json.loads((exported / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_mixtral, dtype=torch.float32)
    with torch.no_grad():
        plain = base.eval()(input_ids=INPUT_IDS).logits
        theirs = peft.PeftModel.from_pretrained(base, exported).eval()(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters trained

    imported = lora_trainer(
        config, f"run.experiment_dir={tmp_path / 'imported'}", f"pretrained.adapter={exported}"
    )
    expected = dict(run.engine.whole_parameters())
    for name, tensor in imported.engine.whole_parameters():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_an_imported_peft_adapter_continues_as_our_own_export_does(
    dataset: Path, hf_llama: Path, tmp_path: Path
) -> None:
    # Run A writes its adapters at step 3 as PEFT does and as fastllm does; run B starts from
    # the PEFT adapter on the Hugging Face base, run C from the fastllm export (base and
    # adapters): they start from the same model and train alike.
    config = lora_config(dataset, tmp_path / "a", hf_llama)
    first = ("training.train_iters=3", "training.export.interval=3")
    trained(config, *first, "training.export.format=peft")
    trained(
        config, *first, "training.export.format=fastllm", f"run.experiment_dir={tmp_path / 'a2'}"
    )
    steps = ("training.train_iters=3",)
    imported = lora_trainer(
        config, *steps, f"run.experiment_dir={tmp_path / 'b'}",
        f"pretrained.adapter={tmp_path / 'a' / 'export' / '3'}",
    )  # fmt: skip
    ours = lora_trainer(
        config, *steps, f"run.experiment_dir={tmp_path / 'c'}",
        f"pretrained.path={tmp_path / 'a2' / 'export' / '3'}", "pretrained.format=fastllm",
    )  # fmt: skip
    expected = dict(ours.engine.whole_parameters())
    for name, tensor in imported.engine.whole_parameters():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    batches = zip(imported.data_loader(), ours.data_loader(), strict=True)
    for step, (left, right) in enumerate(itertools.islice(batches, 3)):
        a, b = imported.engine.train_step(left), ours.engine.train_step(right)
        assert a["loss"] == b["loss"], step


def test_a_lora_run_resumes_exactly_and_refuses_another_base(
    dataset: Path, hf_llama: Path, tmp_path: Path
) -> None:
    config = lora_config(dataset, tmp_path / "whole", hf_llama)
    checkpoints = ("training.train_iters=4", "training.checkpoint.interval=2")
    whole = trained(config, *checkpoints)
    reference = dict(whole.engine.whole_parameters())
    part = tmp_path / "part"
    trained(config, *checkpoints, f"run.experiment_dir={part}", "training.train_iters=2")
    resumed = lora_trainer(config, *checkpoints, f"run.experiment_dir={part}")
    assert resumed.resume() is not None
    assert resumed.fit() is None
    for name, tensor in resumed.engine.whole_parameters():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)

    other = tmp_path / "other_base"
    save_hf_model("llama", other, seed=1, vocab_size=512)
    elsewhere = lora_trainer(
        config, *checkpoints, f"run.experiment_dir={part}", f"pretrained.path={other}"
    )
    with pytest.raises(ConfigError, match="other frozen weights") as caught:
        elsewhere.resume()
    assert caught.value.path == "pretrained.path"


# LoRA on the tests' tiny model, its frozen weights drawn from the seed.
LORA_ARGS = (
    "model.base_model.peft.type=lora",
    "model.base_model.peft.rank=4",
    "model.base_model.peft.alpha=8",
    "model.base_model.peft.layers=[query,key,value,dense,mlp_1,mlp_2]",
)
FOUR_STEPS = (
    "training.train_iters=4",
    "training.export.interval=4",
    "training.export.format=fastllm",
)
MOE = (  # top-2 of 4 experts: the routed experts and attention adapted, the rest frozen
    "model.base_model.transformer.num_experts=4",
    "model.base_model.transformer.num_experts_per_token=2",
    "model.base_model.transformer.add_linear_biases=only_attn_qkv",
    "model.base_model.peft.layers=[query,key,value,dense,experts_1,experts_2]",
)
TENSOR = ("model.distributed.tensor_parallel=2", "model.distributed.sequence_tensor_parallel=true")
LAYOUTS = {  # the model's overrides, the layout's
    "zero3": ((), ("model.multi_stage.zero_stage=3",)),
    "tensor": ((), TENSOR),
    "pipeline": ((), ("model.distributed.pipeline_parallel=2",)),
    "sequence_data": ((), ("model.distributed.sequence_data_parallel=2",)),
    "expert": (MOE, ("model.distributed.expert_parallel=2", "model.multi_stage.zero_stage=3")),
    "expert_tensor": (MOE, TENSOR),  # the experts' adapters split as their weights
    # ZeRO-3 gathers the frozen weights' shards into the buffers the compiled blocks read.
    "compiled_zero3": ((), ("model.multi_stage.zero_stage=3", "training.compile=true")),
}


def layouts(dataset: Path, one_process: Callable[..., Path], root: Path) -> dict[str, Layout]:
    return {
        f"lora_{name}": Layout(2, (*LORA_ARGS, *model, *FOUR_STEPS, *layout))
        for name, (model, layout) in LAYOUTS.items()
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_with_lora_match_one_process(
    launched: dict[str, Launched], one_process: Callable[..., Path], layout: str
) -> None:
    model = LAYOUTS[layout][0]
    single = one_process(*LORA_ARGS, *model, *FOUR_STEPS)
    double = launched[f"lora_{layout}"].succeeded()
    assert_same_run(single, double)
    start = load_file(single / "export" / "4" / "model.safetensors")
    assert any("_lora.b" in name and start[name].abs().max() > 0 for name in start)  # trained


@pytest.mark.parametrize(
    "frozen",
    [(*LORA_ARGS, *MOE), FROZEN],
    ids=["lora_experts", "freeze"],
)
def test_compiled_blocks_train_frozen_weights_and_adapters_as_eager_ones(
    dataset: Path, tmp_path: Path, frozen: tuple[str, ...]
) -> None:
    # LoRA (freeze_others) on attention and the experts (grouped matmuls), or `model.freeze`
    # of the embedding, the head and block 0 (whose input then needs no gradient).
    options = ("training.train_iters=3", *frozen)
    eager = trainer(dataset, tmp_path / "eager", *options)
    compiled = trainer(dataset, tmp_path / "compiled", *options, "training.compile=true")
    model = compiled.engine.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    graphs = []
    with compiled_graphs() as compiled_since:
        for micro_batches in itertools.islice(eager.data_loader(), 3):
            ours, theirs = (run.engine.train_step(micro_batches) for run in (compiled, eager))
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
            graphs.append(compiled_since())
    assert graphs[0] == graphs[-1] > 0  # compiled in the first step, never again
    expected = dict(eager.engine.model.named_parameters())
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(parameter, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(parameter.detach(), before[name]), name
    assert any(p.requires_grad for p in model.parameters())
    assert any(not p.requires_grad for p in model.parameters())
