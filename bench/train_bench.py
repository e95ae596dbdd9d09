"""Training throughput on one GPU: fastllm against a Hugging Face + torch.compile baseline, on
the same geometries, in the same run.

- fastllm:  the Trainer `fastllm train` builds from examples/llama3-*.yaml — bf16 compute, fp32
            master weights and gradients, fastllm's fused AdamW, gradient clipping — fed by its
            own data loader from a random-token dataset written here (Megatron .bin/.idx). Each
            step is `Trainer.train_step`: forward, backward, optimizer step, the code path of
            `fastllm train` minus logging and checkpoints.
- hf:       transformers' LlamaForCausalLM of the same geometry (config from fastllm's own
            conversion), attn_implementation="sdpa", bf16 parameters, `torch.compile`d, loss
            from `labels=`, gradient clipping, torch.optim.AdamW(fused=True) on the bf16
            parameters (no fp32 master copy); random tokens already on the GPU.
- fastllm-lora: the fastllm run with a LoRA adapter (LORA below: rank 16 on every attention and
            MLP projection, `model.base_model.peft`) and every other parameter frozen: only the
            adapters have gradients, fp32 masters and Adam moments.
- hf-peft:  the hf model wrapped by `peft.get_peft_model` with the same LoRA (PEFT's defaults
            otherwise: adapters upcast to fp32, the base in bf16), `torch.compile`d, fused AdamW
            and clipping over the adapters alone.

Each (model, system) runs in a fresh process, so memory and compile caches do not leak between
runs. Warm-up steps are excluded; then --steps steps are timed between two synchronizations.
tokens/s counts micro-batch × sequence length tokens per forward/backward; MFU is torchtitan's:
tokens/s × (6 × (parameters − embedding) + 12 × layers × hidden × seq) / 989.4e12, where the
output head counts as a matmul even when tied (fastllm.training.metrics.flops_per_token; the
baseline's is counted from its own parameters and must agree). A frozen parameter costs 4 FLOPs
a token instead of 6 (forward and input gradient, no weight gradient): the LoRA systems' MFU
counts the frozen base at 4 and the adapters at 6 (hf-peft from its own parameters; fastllm-lora
from fastllm's formula, and no MFU where that formula does not know LoRA).

    python bench/train_bench.py --models 1b 3b 8b --out bench/results/train_h200 --commit HASH
    python bench/train_bench.py --models mistral --systems fastllm-lora fastllm hf-peft \
        --out bench/results/lora_h200 --commit HASH                        # LoRA (issue 34)
    python bench/train_bench.py --tiny --device cpu --out /tmp/train_smoke     # CPU smoke test
    python bench/train_bench.py --plot bench/results/train_h200/train_bench.json
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import (
    EXAMPLES,
    GIB,
    ROOT,
    EnergyMeter,
    commit_info,
    fmt,
    log_tail,
    machine_info,
    markdown_table,
    pyplot,
    read_json,
    replot_report,
    write_json,
    write_random_dataset,
)

PEAK_FLOPS = 989.4e12
"""H100/H200 dense bf16 peak (fastllm.training.metrics.PEAK_FLOPS["cuda"], torchtitan's)."""
SYSTEMS = ("fastllm", "fastllm-compile", "fastllm-lora", "hf", "hf-peft")
"""fastllm-compile: the same run with training.compile=true (torch.compile of each block)."""
LORA_SYSTEMS = {"fastllm-lora", "hf-peft"}
BASELINES = {"fastllm": ("hf",), "fastllm-compile": ("hf",), "fastllm-lora": ("hf-peft", "fastllm")}
"""What each fastllm system is compared with, where both ran: LoRA against PEFT and against
fastllm's own full fine-tuning."""
T = "model.base_model.transformer."
LORA_RANK, LORA_ALPHA = 16, 32.0
LORA_MODULES = {
    "query": ("q_proj",),
    "key": ("k_proj",),
    "value": ("v_proj",),
    "dense": ("o_proj",),
    "mlp_1": ("gate_proj", "up_proj"),
    "mlp_2": ("down_proj",),
}
"""The adapted projections: fastllm's (Fast-LLM's) names and the transformers modules they are."""
LORA = (
    "model.base_model.peft.type=lora",
    f"model.base_model.peft.rank={LORA_RANK}",
    f"model.base_model.peft.alpha={LORA_ALPHA}",
    "model.base_model.peft.dropout=0.0",
    f"model.base_model.peft.layers=[{', '.join(LORA_MODULES)}]",
    "model.base_model.peft.freeze_others=true",
)
"""fastllm-lora's overrides; hf-peft's LoraConfig is made from the same constants."""


@dataclass(frozen=True)
class ModelSpec:
    config: str
    """Example config the geometry comes from."""
    overrides: tuple[str, ...]
    micro_batch: int
    name: str
    """For charts."""
    hf_format: str = "llama"
    """The transformers architecture of the hf systems (fastllm's conversion makes its
    config)."""
    variant_of: str | None = None
    """A model this one differs from by one option: its fastllm run is the baseline of this
    one's, the option's cost."""
    tiny: tuple[str, ...] | None = None
    """--tiny's overrides where TINY does not fit the architecture."""


QWEN3_1_7B = (
    T + "num_layers=28",
    T + "hidden_size=2048",
    T + "num_attention_heads=16",
    T + "head_groups=8",
    T + "kv_channels=128",
    T + "ffn_hidden_size=6144",
    "model.base_model.tie_word_embeddings=true",
)
MODELS = {
    "1b": ModelSpec("llama3-1b.yaml", (), 4, "llama-1b"),
    # Llama 3.2 3B: the 1B's rotary and tied embeddings, wider and deeper, head size 128.
    "3b": ModelSpec(
        "llama3-1b.yaml",
        (
            T + "num_layers=28",
            T + "hidden_size=3072",
            T + "num_attention_heads=24",
            T + "head_groups=8",
            T + "kv_channels=128",
            T + "ffn_hidden_size=8192",
        ),
        2,
        "llama-3b",
    ),
    "8b": ModelSpec("llama3-8b.yaml", (), 1, "llama-8b"),
    "mistral": ModelSpec("mistral-7b.yaml", (), 1, "mistral-7b"),
    # Qwen3 1.7B: the 8B's per-head QK-norm and rotary, tied embeddings.
    "qwen3-1.7b": ModelSpec("qwen3-8b.yaml", QWEN3_1_7B, 4, "qwen3-1.7b", hf_format="qwen3"),
    # The same without QK-norm: what the norms cost.
    "qwen3-1.7b-no-qk-norm": ModelSpec(
        "qwen3-8b.yaml",
        (*QWEN3_1_7B, T + "query_norm=null", T + "key_norm=null"),
        4,
        "qwen3-1.7b without QK-norm",
        hf_format="llama",  # Qwen3 without its QK-norm is Llama's architecture
        variant_of="qwen3-1.7b",
    ),
    # Moonlight 16B-A3B cut to fit one GPU with its optimizer state: 1 dense and 7 MoE blocks
    # of its 27 (4.7B parameters, 2.3B active a token).
    "moonlight-8l": ModelSpec(
        "moonlight-16b.yaml",
        (T + "num_layers=8",),
        1,
        "moonlight-16b (8 layers)",
        hf_format="deepseek_v3",
        tiny=(
            T + "num_layers=3",
            T + "hidden_size=64",
            T + "num_attention_heads=4",
            T + "head_groups=4",
            T + "mixer.kv_lora_rank=16",
            T + "mixer.qk_head_dim=8",
            T + "mixer.qk_pos_emb_head_dim=8",
            T + "mixer.v_head_dim=8",
            T + "ffn_hidden_size=32",
            T + "dense_ffn_hidden_size=128",
            T + "num_experts=8",
            T + "num_experts_per_token=2",
            T + "num_shared_experts=1",
            "model.base_model.vocab_size=512",
        ),
    ),
}
TINY = (
    T + "num_layers=2",
    T + "hidden_size=64",
    T + "num_attention_heads=4",
    T + "head_groups=2",
    T + "kv_channels=16",
    T + "ffn_hidden_size=128",
    "model.base_model.vocab_size=512",
)
"""--tiny: each model keeps its config (rotary, tying) at a CPU-sized geometry."""


# ---------------------------------------------------------------- the configs


def model_overrides(model: str, args: argparse.Namespace) -> list[str]:
    spec = MODELS[model]
    if not args.tiny:
        return list(spec.overrides)
    return [*spec.overrides, *(TINY if spec.tiny is None else spec.tiny)]


def micro_batch(model: str, args: argparse.Namespace) -> int:
    return args.micro_batch or (2 if args.tiny else MODELS[model].micro_batch)


def run_overrides(
    model: str, args: argparse.Namespace, experiment: Path, dataset: Path
) -> list[str]:
    """The example config turned into this benchmark's run: bf16 with fp32 masters, one
    optimizer step per `--accumulate` micro-batches, nothing written but the sampling cache."""
    mb = micro_batch(model, args)
    return [
        *model_overrides(model, args),
        f"run.experiment_dir={experiment}",
        f"data.path=[{dataset}]",
        "model.distributed.training_dtype=bfloat16",
        f"batch.sequence_length={args.seq}",
        f"batch.micro_batch_size={mb}",
        f"batch.batch_size={mb * args.accumulate}",
        f"training.train_iters={args.warmup + args.steps}",
        # The steps are the engine's alone, but the config is checked whole: under LoRA a
        # distributed export at an interval is refused.
        "training.checkpoint.interval=null",
        "training.export.interval=null",
    ]


def load_trainer_config(model: str, overrides: list[str]) -> Any:
    from fastllm.config import TrainerConfig, load_config

    return load_config(TrainerConfig, [EXAMPLES / MODELS[model].config], overrides)


def geometry(config: Any) -> dict[str, Any]:
    base = config.model.base_model
    t = base.transformer
    return {
        "layers": t.num_layers,
        "hidden": t.hidden_size,
        "heads": t.num_attention_heads,
        "kv_heads": t.head_groups,
        "head_size": t.kv_channels,
        "ffn": t.ffn_hidden_size,
        "vocab": base.vocab_size,
        "tied_embeddings": base.tie_word_embeddings,
        "parameters": base.num_parameters(),
        "non_embedding_parameters": base.num_parameters(embeddings=False),
    }


# ---------------------------------------------------------------- measuring (child process)


class StepClock:
    """Per-step times without adding synchronizations: CUDA events on a GPU, wall time on a
    CPU (where every op is synchronous)."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.torch, self.cuda = torch, cuda
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        pairs = zip(self.marks, self.marks[1:], strict=False)
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


def synchronize(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def memory(cuda: bool) -> dict[str, float | None]:
    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: KiB
    if not cuda:
        return {"allocated_gib": None, "reserved_gib": None, "host_rss_gib": rss}
    return {
        "allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "host_rss_gib": rss,
    }


def measure(step: Callable[[], Any], warmup: int, steps: int, cuda: bool) -> dict[str, Any]:
    """Warm-up steps (timed one by one, excluded), then `steps` steps between two
    synchronizations. Peak memory over the whole process (initialization included) and over the
    timed steps alone."""
    import torch

    warmup_s = []
    for _ in range(warmup):
        start = time.perf_counter()
        step()
        synchronize(cuda)
        warmup_s.append(time.perf_counter() - start)
    before = memory(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock, losses = StepClock(cuda), []
    meter = EnergyMeter(torch.cuda.current_device()) if cuda else None
    synchronize(cuda)
    joules = meter.joules() if meter else None
    start = time.perf_counter()
    clock.mark()
    for _ in range(steps):
        losses.append(step())
        clock.mark()
    synchronize(cuda)
    elapsed = time.perf_counter() - start
    spent = None if joules is None or meter is None else meter.joules() - joules
    steady = memory(cuda)
    process = {
        key: None if value is None else max(value, before[key] or 0.0)
        for key, value in steady.items()
    }
    return {
        "elapsed_s": elapsed,
        "step_s": clock.seconds(),
        "warmup_step_s": warmup_s,
        "losses": [float(loss) for loss in losses],
        "peak_memory": {"process": process, "timed_steps": steady},
        # At the power limit, time is energy over it: joules per step say which kernels cost.
        "joules_per_step": None if spent is None else spent / steps,
        "power_limit_w": meter.limit_w if meter else None,
    }


def time_trainer(
    config: Any,
    warmup: int,
    steps: int,
    train_step: Callable[[Any, list[Any]], dict[str, Any]] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Builds a Trainer from `config` and times its steps on its own data loader, each
    `train_step(trainer, micro_batches)` (default: the engine's step), which returns the step's
    metrics. Returns the trainer and the timing, with the device and the setup time."""
    from fastllm.training import Trainer

    start = time.perf_counter()
    trainer = Trainer(config)
    cuda = trainer.distributed.device.type == "cuda"
    synchronize(cuda)
    setup_s = time.perf_counter() - start
    batches = iter(trainer.data_loader())

    def step() -> float:
        micro_batches = next(batches)
        if train_step is None:
            return trainer.engine.train_step(micro_batches)["loss"]
        return train_step(trainer, micro_batches)["loss"]

    timing = measure(step, warmup, steps, cuda)
    return trainer, {"device": str(trainer.distributed.device), "setup_s": setup_s, **timing}


def run_fastllm(spec: dict[str, Any]) -> dict[str, Any]:
    config = load_trainer_config(spec["model"], spec["overrides"])
    spy = AttentionSpy()
    experts = config.model.base_model.transformer.num_experts > 1
    loads: list[dict[str, float]] = []

    def train_step(trainer: Any, micro_batches: list[Any]) -> dict[str, Any]:
        if spy.calls:
            metrics = trainer.engine.train_step(micro_batches)
        else:
            with spy:  # the first (warm-up) step only: which masks the kernels are asked for
                metrics = trainer.engine.train_step(micro_batches)
        if experts:  # each step's expert loads, as `fastllm train` logs them
            loads.append(trainer.engine.expert_load(1))
        return metrics

    trainer, timing = time_trainer(config, spec["warmup"], spec["steps"], train_step)
    cuda = trainer.distributed.device.type == "cuda"
    lora = spec["system"] == "fastllm-lora"
    return {
        "attention": spy.describe(cuda),
        "cross_document_attention": getattr(config.batch, "cross_document_attention", None),
        "flops_per_token": fastllm_flops_per_token(config, lora),
        "precision": "bf16 compute, fp32 master weights, gradients and Adam moments"
        # getattr: a baseline commit's config may predate the key (its wheels run this script).
        + _fp8_note(config.model.distributed)
        + (
            "; the base frozen (its bf16 weights only), only the LoRA adapters train"
            if lora
            else ""
        ),
        **({"expert_loads": expert_loads(loads)} if experts else {}),
        **timing,
    }


def expert_loads(loads: list[dict[str, float]]) -> dict[str, Any]:
    """Each step's most loaded expert (any layer) against the mean load, which a balanced
    router gives every expert: 1.0 is perfect balance."""
    ratios = [load["expert_tokens_max"] / load["expert_tokens_mean"] for load in loads]
    return {
        "max_over_mean_by_step": ratios,
        "max_over_mean_last": ratios[-1] if ratios else None,
        "per_step": loads,
    }


def fastllm_flops_per_token(config: Any, lora: bool) -> float | None:
    """fastllm's own count (the one its logs' MFU uses). Under LoRA, only where it knows LoRA:
    the frozen base at 4 FLOPs a parameter then puts it below full training's count, which a
    formula blind to the adapters and the freezing would return; None (no MFU) otherwise."""
    from fastllm.config.flops import flops_per_token

    base, seq = config.model.base_model, config.batch.sequence_length
    if not lora:
        return flops_per_token(base, seq)
    import msgspec

    from fastllm.config.model import NoPeftConfig

    adapted = flops_per_token(base, seq, config.model.freeze)
    full = flops_per_token(msgspec.structs.replace(base, peft=NoPeftConfig()), seq)
    return adapted if adapted < full else None


def _fp8_note(distributed: Any) -> str:
    recipe = getattr(distributed, "fp8_linear", "none")
    if recipe == "none":
        return ""
    delayed = getattr(distributed, "fp8_scaling", "current") == "delayed"
    return f"; {recipe}{' (delayed scaling)' if delayed else ''} FP8 linear layers in the blocks"


class AttentionSpy:
    """Records the masks the model asks of `fastllm_kernels.attention` (document ids, window),
    which decide the kernel: plain causal goes to SDPA (cuDNN first), anything else to
    flash-attn or flex_attention."""

    def __init__(self) -> None:
        import fastllm.model.attend as module

        self.module, self.original = module, module.attention
        self.calls: list[tuple[bool, int | None]] = []

    def __enter__(self) -> AttentionSpy:
        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((kwargs.get("document_ids") is not None, kwargs.get("window_size")))
            return self.original(*args, **kwargs)

        self.module.attention = spy
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.attention = self.original

    def describe(self, cuda: bool) -> dict[str, Any]:
        documents = any(d for d, _ in self.calls)
        windows = sorted({w for _, w in self.calls if w is not None})
        # The module's flash-attn import (the package's `attention` is the function).
        from fastllm_kernels.attention import flash_attn_func

        if not cuda:
            kernel = "SDPA (CPU)"
        elif not documents and not windows:
            kernel = "SDPA, cuDNN first (plain causal)"
        elif flash_attn_func is not None:
            kernel = "flash-attn" + (" varlen" if documents else "")
        else:
            kernel = "compiled flex_attention with a block mask"
        return {"kernel": kernel, "document_ids": documents, "window_sizes": windows}


def hf_flops_per_token(model: Any, sequence_length: int) -> float:
    """torchtitan's formula from the baseline's own parameters: every parameter but the input
    embedding multiplies, and a tied output head multiplies too; 6 FLOPs a token for a trained
    parameter, 4 for a frozen one (PEFT's base: forward and input gradient only)."""
    config = model.config

    def cost(parameter: Any) -> int:
        return (6 if parameter.requires_grad else 4) * parameter.numel()

    parameters = sum(cost(p) for p in model.parameters())  # a tied weight counts once
    embedding = cost(model.get_input_embeddings().weight)
    head = embedding if config.tie_word_embeddings else 0
    head_size = (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_size
    return parameters - embedding + head + attention * sequence_length


def build_hf_model(config: Any, device: Any, hf_format: str = "llama") -> Any:
    """transformers' model of `hf_format` (its class from fastllm's conversion registry) with
    the config fastllm's conversion writes for `config`'s model."""
    import msgspec
    import torch
    import transformers

    from fastllm.checkpoint.architectures import ARCHITECTURES
    from fastllm.checkpoint.hf_config import to_hf_config

    base = config.model.base_model
    window = base.transformer.window_size
    if window is not None and window >= config.batch.sequence_length:
        # A window as long as the sequence masks nothing (fastllm's attention drops it), but
        # transformers' Mistral would still build an explicit mask and leave SDPA's fused
        # kernels: Llama is the same model at this length.
        transformer = msgspec.structs.replace(base.transformer, window_size=None)
        base = msgspec.structs.replace(base, transformer=transformer)
    model_class = getattr(transformers, ARCHITECTURES[hf_format].hf_class)
    hf_config = model_class.config_class.from_dict(to_hf_config(base, hf_format))
    hf_config.use_cache = False
    torch.manual_seed(config.model.distributed.seed)
    with torch.device(device):
        model = model_class._from_config(
            hf_config, attn_implementation="sdpa", dtype=torch.bfloat16
        )
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    if next(model.parameters()).device != device:  # should the device context be ignored
        model.to(device)
    return model.train()


def with_lora(model: Any) -> Any:
    """`model` with fastllm-lora's adapters through PEFT, its other parameters frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=[module for modules in LORA_MODULES.values() for module in modules],
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    config = load_trainer_config(spec["model"], spec["overrides"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = build_hf_model(config, device, MODELS[spec["model"]].hf_format)
    if spec["system"] == "hf-peft":
        model = with_lora(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer_config = config.optimizer
    optimizer = torch.optim.AdamW(
        trained,
        lr=optimizer_config.learning_rate.base,
        betas=(optimizer_config.beta_1, optimizer_config.beta_2),
        eps=optimizer_config.epsilon,
        weight_decay=optimizer_config.weight_decay,
        fused=True,
    )
    forward = torch.compile(model) if spec["compile"] else model
    batch = config.batch
    accumulate = batch.batch_size // batch.micro_batch_size
    generator = torch.Generator(device).manual_seed(config.model.distributed.seed)
    tokens = [
        torch.randint(
            0,
            config.model.base_model.vocab_size,
            (batch.micro_batch_size, batch.sequence_length),
            device=device,
            generator=generator,
        )
        for _ in range(4)
    ]
    clipping = optimizer_config.gradient_norm_clipping
    position = 0

    def step() -> Any:
        nonlocal position
        losses = []
        for _ in range(accumulate):
            input_ids = tokens[position % len(tokens)]
            position += 1
            loss = forward(input_ids=input_ids, labels=input_ids).loss
            (loss / accumulate).backward()
            losses.append(loss.detach())
        if clipping is not None:
            torch.nn.utils.clip_grad_norm_(trained, clipping, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean()

    timing = measure(step, spec["warmup"], spec["steps"], cuda)
    return {
        "device": str(device),
        "flops_per_token": hf_flops_per_token(model, batch.sequence_length),
        "precision": "bf16 parameters, gradients and Adam moments (no fp32 master copy)"
        if spec["system"] == "hf"
        else "bf16 base, frozen; LoRA adapters in "
        + "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in trained}))
        + " (PEFT's default), with their gradients and Adam moments",
        "trained_parameters": sum(p.numel() for p in trained),
        "compiled": spec["compile"],
        "graph_breaks": sum(counters["graph_break"].values()),
        **timing,
    }


def add_run_arguments(
    parser: argparse.ArgumentParser, *, timeout: float, tiny: str, timeout_help: str
) -> None:
    """The arguments of a benchmark that times fastllm runs in child processes (dpo_bench,
    distill_bench): overrides, step counts, size, device, commit, directories, limit, seed."""
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides for fastllm"
    )
    parser.add_argument("--steps", type=int, help="timed steps (default 10; --tiny 2)")
    parser.add_argument("--warmup", type=int, help="untimed first steps (default 3; --tiny 1)")
    parser.add_argument("--tiny", action="store_true", help=tiny)
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--commit", help="commit being measured (default: git rev-parse HEAD)")
    parser.add_argument("--out", type=Path, help="result directory")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=timeout, help=timeout_help)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)


def resolve_run_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`add_run_arguments`' defaults and checks, for the parent process (a child takes its
    spec file only)."""
    if args.out is None:
        parser.error("--out is required")
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step compiles)")


def run_child(spec_path: Path, runner_of: Callable[[dict[str, Any]], Callable]) -> None:
    """One (model, system) run in its own process, by the runner `runner_of(spec)` names;
    writes its result to spec["result"]. Running out of memory is a result (status "oom"), not
    a crash."""
    import torch

    spec = read_json(spec_path)
    result: dict[str, Any] = {"model": spec["model"], "system": spec["system"]}
    start = time.perf_counter()
    try:
        result.update(runner_of(spec)(spec), status="ok")
    except Exception as error:
        # Some allocation failures (cuBLAS workspaces, compiled kernels) are not OutOfMemoryError.
        if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error):
            raise
        cuda = torch.cuda.is_available()
        where = traceback.format_list(traceback.extract_tb(error.__traceback__)[-3:])
        result.update(
            status="oom",
            error=str(error).splitlines()[0],
            where=[line.strip() for line in where],
            peak_memory=memory(cuda),
        )
    result["process_s"] = time.perf_counter() - start
    result["machine"] = machine_info()
    write_json(Path(spec["result"]), result)


# ---------------------------------------------------------------- the driver


def summarize(run: dict[str, Any], tokens_per_step: int, peak_flops: float) -> dict[str, Any]:
    """tokens/s over the timed window and MFU from it; the median step time alongside."""
    if run.get("status") != "ok":
        return run
    steps = len(run["step_s"])
    tokens_per_s = steps * tokens_per_step / run["elapsed_s"]
    ordered = sorted(run["step_s"])
    flops = run["flops_per_token"]  # None: not known (fastllm-lora without LoRA's count)
    return {
        **run,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "tflops": None if flops is None else tokens_per_s * flops / 1e12,
        "mfu": None if flops is None else tokens_per_s * flops / peak_flops,
        "median_step_s": ordered[len(ordered) // 2],
    }


def spawn(
    spec: dict[str, Any],
    work: Path,
    logs: Path,
    args: argparse.Namespace,
    script: Path = Path(__file__),
) -> dict:
    """Runs `script --child SPEC` (this file's child by default) under --timeout."""
    name = f"{spec['model']}_{spec['system']}"
    spec_path, log = work / f"{name}.spec.json", logs / f"{name}.log"
    write_json(spec_path, spec)
    # Fresh compile caches per run: a run must not reuse another's compiled kernels.
    caches = work / "caches" / name
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        TRITON_CACHE_DIR=str(caches / "triton"),
    )
    if args.device == "cpu":
        # One thread, no pool of compile workers: on a small shared machine these compete with
        # the measured steps (OpenMP barriers spin against other processes).
        env.update(CUDA_VISIBLE_DEVICES="", TORCHINDUCTOR_COMPILE_THREADS="1")
        env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, str(script.resolve()), "--child", str(spec_path)]
    start = time.perf_counter()
    try:
        with log.open("w") as output:
            code = subprocess.run(
                command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                timeout=args.timeout,
            ).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        code = "timeout"
    wall = time.perf_counter() - start
    result_path = Path(spec["result"])
    if code == 0 and result_path.is_file():
        return {**read_json(result_path), "wall_s": wall, "log": str(log)}
    status = "timeout" if code == "timeout" else "failed"
    return {
        "model": spec["model"],
        "system": spec["system"],
        "status": status,
        "exit_code": code,
        "log_tail": log_tail(log),
        "wall_s": wall,
        "log": str(log),
    }


def write_datasets(models: list[str], args: argparse.Namespace, work: Path) -> dict[int, dict]:
    """One random-token dataset per vocabulary size, long enough for every step of the run."""
    needed: dict[int, int] = {}
    for model in models:
        vocab = load_trainer_config(model, model_overrides(model, args)).model.base_model.vocab_size
        samples = (args.warmup + args.steps) * micro_batch(model, args) * args.accumulate
        needed[vocab] = max(needed.get(vocab, 0), (samples + 1) * (args.seq + 1))
    return {
        vocab: write_random_dataset(
            work / f"random_{vocab}",
            vocab_size=vocab,
            tokens=tokens,
            document_length=None,
            seed=args.seed,
        )
        for vocab, tokens in needed.items()
    }


def comparisons(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fastllm system against its baselines (BASELINES), per model, where both ran."""
    by_key = {(run["model"], run["system"]): run for run in runs}
    rows = []
    for model in dict.fromkeys(run["model"] for run in runs):
        for system, baselines in BASELINES.items():
            for baseline in baselines:
                ours, theirs = by_key.get((model, system)), by_key.get((model, baseline))
                if ours and theirs and ours["status"] == theirs["status"] == "ok":
                    rows.append(comparison(model, system, baseline, ours, theirs))
        # A variant's option costs what the model that has it loses against the one without.
        variant = MODELS[model].variant_of if model in MODELS else None
        for system in ("fastllm", "fastllm-compile"):
            ours, theirs = by_key.get((variant, system)), by_key.get((model, system))
            if variant and ours and theirs and ours["status"] == theirs["status"] == "ok":
                rows.append(comparison(variant, system, f"{model} {system}", ours, theirs))
    return rows


def comparison(
    model: str, system: str, baseline: str, ours: dict[str, Any], theirs: dict[str, Any]
) -> dict[str, Any]:
    ours_memory = ours["peak_memory"]["timed_steps"]["allocated_gib"]
    theirs_memory = theirs["peak_memory"]["timed_steps"]["allocated_gib"]
    ours_flops, theirs_flops = ours["flops_per_token"], theirs["flops_per_token"]
    lora = {system, baseline} & LORA_SYSTEMS
    if ours_flops is None or theirs_flops is None or len(lora) == 1:
        same_flops = None  # unknown, or LoRA against full training: different work by design
    else:
        # fastllm may give mlp_1's gate and up one adapter input (A) where PEFT gives two:
        # rank × hidden parameters a layer, some 1e-4 of a LoRA token's FLOPs.
        tolerance = 1e-3 if lora else 1e-9
        same_flops = abs(ours_flops - theirs_flops) <= tolerance * ours_flops
    return {
        "model": model,
        "system": system,
        "baseline": baseline,
        "tokens_per_s_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "mfu": ours["mfu"],
        "mfu_baseline": theirs["mfu"],
        "peak_allocated_ratio": ours_memory / theirs_memory
        if ours_memory and theirs_memory
        else None,
        "flops_per_token_agree": same_flops,
    }


def table(report: dict[str, Any]) -> str:
    rows = []
    for run in report["runs"]:
        memory_ = run.get("peak_memory") or {}
        steady, process = memory_.get("timed_steps") or {}, memory_.get("process") or memory_
        rows.append(
            [
                run["model"],
                run["system"],
                f"{run.get('micro_batch', '?')} × {run.get('accumulate', 1)}",
                fmt(run.get("tokens_per_s"), ",.0f"),
                fmt(run.get("mfu") and 100 * run["mfu"], ".1f"),
                fmt(run.get("median_step_s") and 1e3 * run["median_step_s"], ",.0f"),
                fmt(steady.get("allocated_gib"), ".1f"),
                fmt(process.get("allocated_gib"), ".1f"),
                fmt(process.get("reserved_gib"), ".1f"),
                run["status"],
            ]
        )
    headers = [
        "model",
        "system",
        "micro-batch × accum.",
        "tokens/s/GPU",
        "MFU %",
        "step ms (median)",
        "peak alloc GiB (steps)",
        "peak alloc GiB (process)",
        "peak reserved GiB",
        "status",
    ]
    text = markdown_table(headers, rows, text_columns=2)
    if report["comparisons"]:
        ratio_rows = [
            [
                row["model"],
                f"{row.get('system', 'fastllm')} / {row.get('baseline', 'hf')}",
                f"{row['tokens_per_s_ratio']:.2f}x",
                fmt(row["peak_allocated_ratio"], ".2f"),
                {True: "yes", False: "NO", None: "—"}[row["flops_per_token_agree"]],
            ]
            for row in report["comparisons"]
        ]
        headers = ["model", "systems", "tokens/s ratio", "peak alloc ratio", "same FLOPs/token"]
        text += "\n\n" + markdown_table(headers, ratio_rows)
    return text


def plot(report: dict[str, Any], path: Path) -> bool:
    """Grouped bars: tokens/s per GPU and MFU, fastllm against the baseline, per model."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is missing: plot later with --plot RESULT.json", file=sys.stderr)
        return False
    models = list(dict.fromkeys(run["model"] for run in report["runs"]))
    systems = list(dict.fromkeys(run["system"] for run in report["runs"]))
    by_key = {(run["model"], run["system"]): run for run in report["runs"]}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(systems)
    labels = {
        "fastllm": "fastllm (bf16, fp32 masters)",
        "fastllm-compile": "fastllm, blocks compiled",
        "fastllm-lora": "fastllm, LoRA r16 (base frozen)",
        "hf": "HF + torch.compile (bf16)",
        "hf-peft": "HF + PEFT LoRA r16 + torch.compile",
    }
    for axis, key, scale, title in (
        (axes[0], "tokens_per_s", 1.0, "tokens/s per GPU"),
        (axes[1], "mfu", 100.0, "MFU (%)"),
    ):
        for i, system in enumerate(systems):
            xs = [m + (i - (len(systems) - 1) / 2) * width for m in range(len(models))]
            runs = [by_key.get((model, system), {}) for model in models]
            values = [(run.get(key) or 0.0) * scale for run in runs]
            bars = axis.bar(xs, values, width, label=labels.get(system, system))
            for bar, run in zip(bars, runs, strict=True):
                ok = run.get("status") == "ok"
                if run.get(key) is None:  # MFU of a LoRA run whose FLOPs fastllm cannot count
                    text = "n/a"
                elif key == "tokens_per_s":
                    text = f"{bar.get_height():,.0f}"
                else:
                    text = f"{bar.get_height():.1f}"
                axis.annotate(
                    text if ok else run.get("status", "not run").upper(),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8,
                )  # fmt: skip
        names = [MODELS[m].name if m in MODELS else m for m in models]
        axis.set_xticks(range(len(models)), names)
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    config, machine = report["config"], report.get("machine") or {}
    device = (machine.get("gpus") or ["CPU"])[0]
    figure.suptitle(
        f"Training throughput{' (tiny smoke geometry)' if config.get('tiny') else ''}, "
        f"{device}, seq {config['seq']} "
        f"(commit {report['commit'][:10]}{'+' if report.get('dirty') else ''})",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return True


def merge(results: list[Path]) -> dict[str, Any]:
    """Reports of several invocations (e.g. one per model, to stay within a time limit) as
    one: runs keyed by (model, system), later files winning; the first file's provenance."""
    reports = [read_json(path) for path in results]
    runs = {(run["model"], run["system"]): run for report in reports for run in report["runs"]}
    merged = {
        **reports[0],
        "runs": list(runs.values()),
        "comparisons": comparisons(list(runs.values())),
    }
    commits = {report["commit"] for report in reports}
    if len(results) > 1:
        merged["merged_from"] = [
            {"file": str(path), "commit": report["commit"], "machine": report.get("machine")}
            for path, report in zip(results, reports, strict=True)
        ]
    if len(commits) > 1:
        print(
            f"warning: the results come from different commits: {sorted(commits)}", file=sys.stderr
        )
    return merged


def replot(results: list[Path], out: Path | None) -> None:
    """Table and chart of saved results (here, where matplotlib is); several are merged."""
    stem = results[0].stem if len(results) == 1 else "train_bench_merged"
    replot_report(merge(results), out or results[0].parent, stem, len(results) > 1, table, plot)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["1b", "3b", "8b"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["fastllm", "hf"])
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides for fastllm"
    )
    parser.add_argument("--steps", type=int, help="timed steps (default 10; --tiny 3)")
    parser.add_argument("--warmup", type=int, help="untimed first steps (default 3; --tiny 1)")
    parser.add_argument("--seq", type=int, help="sequence length (default 4096; --tiny 128)")
    parser.add_argument("--micro-batch", type=int, help="override every model's micro-batch")
    parser.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches per optimizer step (both systems)"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU-sized geometry (smoke test)")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu"],
        default="auto",
        help="cpu hides the GPUs from the runs (default: the GPU when there is one)",
    )
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="baseline eager")
    parser.add_argument("--commit", help="commit being measured (default: git rev-parse HEAD)")
    parser.add_argument("--out", type=Path, help="result directory")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--plot",
        type=Path,
        nargs="+",
        metavar="RESULT.json",
        help="only tabulate and plot (merged)",
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child and not args.plot and args.out is None:
        parser.error("--out is required")
    args.steps = args.steps or (3 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    if not args.child and not args.plot and args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step compiles)")
    args.seq = args.seq or (128 if args.tiny else 4096)
    return args


def report_of(args: argparse.Namespace, datasets: dict, runs: list[dict]) -> dict[str, Any]:
    machine = next((run["machine"] for run in runs if run.get("machine")), None)
    return {
        "benchmark": "train",
        **commit_info(args.commit),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "config": {
            "models": args.models,
            "systems": args.systems,
            "steps": args.steps,
            "warmup": args.warmup,
            "seq": args.seq,
            "micro_batch_override": args.micro_batch,
            "accumulate": args.accumulate,
            "tiny": args.tiny,
            "device": args.device,
            "baseline_compiled": args.compile,
            "peak_flops": PEAK_FLOPS,
        },
        "method": (
            "each (model, system) in a fresh process with fresh compile caches; warm-up steps "
            "excluded; tokens/s = timed steps × micro-batch × accumulate × seq / wall time "
            "between two synchronizations; MFU = tokens/s × flops_per_token / peak_flops "
            "(torchtitan's formula, output head counted; a frozen parameter 4 FLOPs a token, "
            "not 6, so a LoRA run counts its frozen base at 4 and its adapters at 6, and has no "
            "MFU where fastllm's formula does not count LoRA); peak memory per process "
            "(initialization included) and over the timed steps (after "
            "torch.cuda.reset_peak_memory_stats)"
        ),
        "datasets": list(datasets.values()),
        "runs": [{k: v for k, v in run.items() if k != "machine"} for run in runs],
        "comparisons": comparisons(runs),
    }


def run_one(
    model: str, system: str, args: argparse.Namespace, work: Path, datasets: dict
) -> dict[str, Any]:
    probe = load_trainer_config(model, model_overrides(model, args))
    dataset = datasets.get(probe.model.base_model.vocab_size, {}).get("path", str(work))
    overrides = run_overrides(model, args, work / f"exp_{model}", Path(dataset))
    if not system.startswith("hf"):
        overrides.extend(args.set)
    if system == "fastllm-compile":
        overrides.append("training.compile=true")
    if system == "fastllm-lora":
        overrides.extend(LORA)
    config = load_trainer_config(model, overrides)
    spec = {
        "model": model,
        "system": system,
        "overrides": overrides,
        "warmup": args.warmup,
        "steps": args.steps,
        "compile": args.compile,
        "result": str(args.out / "runs" / f"{model}_{system}.json"),
    }
    print(f"{model} {system} ...", file=sys.stderr, flush=True)
    run = spawn(spec, work, args.out / "logs", args)
    tokens_per_step = config.batch.batch_size * config.batch.sequence_length
    run = summarize(run, tokens_per_step, PEAK_FLOPS)
    run.update(
        micro_batch=config.batch.micro_batch_size,
        accumulate=args.accumulate,
        seq=config.batch.sequence_length,
        geometry=geometry(config),
        config_file=f"examples/{MODELS[model].config}",
        overrides=model_overrides(model, args),
        extra_overrides=[] if system.startswith("hf") else args.set,
        lora={"rank": LORA_RANK, "alpha": LORA_ALPHA, "layers": LORA_MODULES}
        if system in LORA_SYSTEMS
        else None,
    )
    write_json(Path(spec["result"]), run)
    print(
        f"  {run['status']}: {fmt(run.get('tokens_per_s'), ',.0f')} tokens/s, "
        f"MFU {fmt(run.get('mfu'), '.1%')}",
        file=sys.stderr,
        flush=True,
    )
    return run


def main() -> None:
    args = parse_args()
    if args.child:
        run_child(
            args.child, lambda spec: run_hf if spec["system"].startswith("hf") else run_fastllm
        )
        return
    if args.plot:
        replot(args.plot, args.out)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="fastllm-train-bench-"))
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    fastllm = any(not system.startswith("hf") for system in args.systems)
    datasets = write_datasets(args.models, args, work) if fastllm else {}
    result = args.out / "train_bench.json"
    runs: list[dict[str, Any]] = []
    for model in args.models:
        for system in args.systems:
            runs.append(run_one(model, system, args, work, datasets))
            # After every run, so that a run cut short by a time limit keeps what it measured.
            write_json(result, report_of(args, datasets, runs))
    report = read_json(result)
    text = table(report)
    (args.out / "train_bench.md").write_text(text + "\n")
    print(f"\n{result}\n\n{text}")
    if plot(report, args.out / "train_bench.png"):
        print(f"\n{args.out / 'train_bench.png'}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
