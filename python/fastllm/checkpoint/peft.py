"""LoRA adapters between fastllm and PEFT, and merged into their base weights.

PEFT gives each adapted Hugging Face projection (q_proj, gate_proj, …) its own `lora_A` and
`lora_B`; fastllm stacks those of a fused projection (model/lora.py), so each adapter tensor
is a concatenation of PEFT's, named from the base weight's conversion rule. A PEFT adapter
directory holds `adapter_config.json` and `adapter_model.safetensors`, its keys prefixed
`base_model.model.` (the `PeftModel` around the `…ForCausalLM`).

A mixture's routed experts are adapted in PEFT through `target_parameters`: transformers
holds each block's experts as one module, `mlp.experts`, of two 3D parameters,
`gate_up_proj` (experts, 2 × ffn, hidden) and `down_proj` (experts, hidden, ffn), and
PEFT's ParamWrapper gives each one adapter over all experts: lora_A (experts × rank, in),
expert e's A its rows e·rank …; lora_B (out, rank × experts), expert e's B its columns
e, e + experts, … (rank-major). Both parameters adapted, PEFT nests the wrappers in the
module's parameter order, so gate_up_proj's adapter is `experts.base_layer.lora_A` and
down_proj's `experts.lora_A`; one alone is `experts.lora_A`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import load_file
from torch import Tensor

from fastllm.checkpoint.hf_rules import Rule, concat, same
from fastllm.checkpoint.hf_weights import rules
from fastllm.config import BaseModelConfig, ConfigError
from fastllm.config.formats import HF_ARCHITECTURES, inexpressible
from fastllm.config.model import EXPERT_LORA_LAYERS, LoRAConfig, NoPeftConfig
from fastllm.model.lora import SUFFIX, Adapter, ExpertLoRA, LoRA

PREFIX = "base_model.model."
"""What PEFT puts before the wrapped model's tensor names."""
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def lora_of(config: BaseModelConfig) -> LoRAConfig:
    if not isinstance(config.peft, LoRAConfig):
        raise ConfigError("model.base_model.peft", "the model has no LoRA adapters")
    return config.peft


EXPERT_PARAMETERS = {"experts_1": "gate_up_proj", "experts_2": "down_proj"}
"""The fused experts' parameter of transformers that each of our expert layers is."""


def _adapters(config: BaseModelConfig) -> Iterator[tuple[str, Adapter]]:
    """Each projection with adapters (`layers.0.attention.query_key_value`, `layers.1.mlp.
    layer_1` for experts) and its module, in the model's order."""
    from fastllm.model import GPTModel

    with torch.device("meta"):
        model = GPTModel(config)
    for name, module in model.named_modules():
        if isinstance(module, Adapter):
            yield name.removesuffix(SUFFIX), module


def _weight_of(projection: str, module: Adapter) -> str:
    """The name of the weight an adapter adapts (the experts' weights are parameters of the
    mixture itself)."""
    return projection if isinstance(module, ExpertLoRA) else f"{projection}.weight"


def adapter_rules(config: BaseModelConfig, architecture: str) -> Iterator[Rule]:
    """Each adapter tensor of the model as a rule to PEFT's names (without `PREFIX`)."""
    base = {rule.ours: rule for rule in rules(config, architecture)}
    lora = lora_of(config)
    rank = lora.rank
    nested = all(layer in lora.adapted() for layer in EXPERT_LORA_LAYERS)
    for projection, module in _adapters(config):
        if isinstance(module, ExpertLoRA):
            yield from _expert_rules(projection, module, nested)
            continue
        theirs = base[f"{projection}.weight"].theirs
        modules = [theirs[i].removesuffix(".weight") for i in module.adapted]
        rows = [module.segments[i] for i in module.adapted]
        for ours, matrix, sizes in (("a", "lora_A", [rank] * len(rows)), ("b", "lora_B", rows)):
            names = tuple(f"{m}.{matrix}.weight" for m in modules)
            ours_name = f"{projection}{SUFFIX}.{ours}"
            yield same(ours_name, names[0]) if len(names) == 1 else concat(ours_name, names, sizes)


def _expert_rules(projection: str, module: ExpertLoRA, nested: bool) -> Iterator[Rule]:
    """The rules of one mixture's expert adapters (`projection`: `layers.N.mlp.layer_1` or
    `layer_2`): ours a (experts, rank, in) and b (experts, out, rank), theirs PEFT's
    ParamWrapper's (the module docstring says its layout)."""
    block, _, layer = projection.rpartition(".")
    # transformers' module path of the block's experts: `model.` before our `layers.N.mlp`.
    wrapper = f"model.{block}.experts"
    if nested and layer == "layer_1":  # gate_up_proj, wrapped first, is the inner wrapper
        wrapper += ".base_layer"
    experts, rank = module.a.shape[:2]
    ours = f"{projection}{SUFFIX}"
    yield Rule(
        f"{ours}.a",
        (f"{wrapper}.lora_A.weight",),
        lambda ts: ts[0].unflatten(0, (experts, rank)),
        lambda t: [t.flatten(0, 1)],
    )
    yield Rule(
        f"{ours}.b",
        (f"{wrapper}.lora_B.weight",),
        lambda ts: ts[0].unflatten(1, (rank, experts)).permute(2, 0, 1),
        lambda t: [t.permute(1, 2, 0).flatten(1, 2)],
    )


def target_modules(config: BaseModelConfig, architecture: str) -> list[str]:
    """PEFT's `target_modules`: the adapted projections' names (q_proj, …), the experts'
    (adapted as parameters) aside."""
    return sorted(
        {
            name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1]
            for rule in adapter_rules(config, architecture)
            for name in rule.theirs
            if name.endswith(".lora_A.weight") and ".experts." not in name
        }
    )


def target_parameters(config: BaseModelConfig) -> list[str]:
    """PEFT's `target_parameters`: the experts' adapted parameters (`mlp.experts.down_proj`)."""
    adapted = lora_of(config).adapted()
    return sorted(
        f"mlp.experts.{parameter}"
        for layer, parameter in EXPERT_PARAMETERS.items()
        if layer in adapted
    )


def architecture_for(config: BaseModelConfig, hf_config: dict[str, Any] | None) -> str:
    """The Hugging Face architecture whose names an adapter takes: the base model's when it
    came from one, else the first that can express the model."""
    model_type = (hf_config or {}).get("model_type")
    if model_type in HF_ARCHITECTURES and inexpressible(config, model_type) is None:
        return model_type
    for architecture in HF_ARCHITECTURES:
        if inexpressible(config, architecture) is None:
            return architecture
    raise ConfigError("output.format", "peft: no Hugging Face architecture expresses the model")


def adapter_config(config: BaseModelConfig, architecture: str, base: str | None) -> dict[str, Any]:
    """adapter_config.json for the model's adapters."""
    lora = lora_of(config)
    if reason := lora.peft_refusal():
        raise ConfigError("model.base_model.peft", reason)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target_modules(config, architecture) or None,
        "target_parameters": target_parameters(config) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def peft_tensors(
    config: BaseModelConfig, architecture: str, tensors: Iterator[tuple[str, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """The adapter tensors among a model's `tensors`, under PEFT's names (with `PREFIX`)."""
    by_name = {rule.ours: rule for rule in adapter_rules(config, architecture)}
    for name, tensor in tensors:
        rule = by_name.get(name)
        if rule is not None:
            for theirs, piece in zip(rule.theirs, rule.split(tensor), strict=True):
                yield PREFIX + theirs, piece.contiguous()


# PEFT options a plain LoRA of ours reproduces: any other value is refused on import.
_PLAIN = {
    "bias": "none",
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "lora_bias": False,
    "exclude_modules": None,
}


def read_adapter_config(directory: Path, config: BaseModelConfig, architecture: str) -> LoRAConfig:
    """The LoRA of a PEFT adapter directory for a base model of `config`, or a `ConfigError`
    naming the file and the key it cannot express."""
    path = directory / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(str(path), f"is not a readable adapter config ({error})") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        raise ConfigError(f"{path}:peft_type", f"must be LORA, got {raw.get('peft_type')!r}")
    for key, plain in _PLAIN.items():
        value = raw.get(key)
        if value is not None and value != plain:
            raise ConfigError(f"{path}:{key}", f"{value!r} is not supported (only {plain!r})")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        raise ConfigError(f"{path}:target_modules", "a regular expression is not supported")
    experts = _expert_layers_of(raw.get("target_parameters") or [], config, path)
    layers = _layers_of(set(targets or ()), config, architecture, path, bool(experts)) + experts
    try:
        return msgspec.convert(
            {
                "rank": raw["r"],
                "alpha": raw["lora_alpha"],
                "dropout": raw.get("lora_dropout", 0.0),
                "layers": layers,
            },
            LoRAConfig,
        )
    except (KeyError, msgspec.ValidationError) as error:
        raise ConfigError(str(path), f"bad LoRA settings ({error})") from None


def _expert_layers_of(parameters: list[str], config: BaseModelConfig, path: Path) -> list[str]:
    """Our expert `layers` for PEFT's target parameters: `mlp.experts.gate_up_proj` (or a
    dotted suffix of it, which PEFT matches alike) is experts_1, `…down_proj` experts_2."""
    layers = []
    for parameter in parameters:
        matches = [
            layer
            for layer, theirs in EXPERT_PARAMETERS.items()
            if f".mlp.experts.{theirs}".endswith(f".{parameter}")
        ]
        if not matches or config.transformer.num_experts == 1:
            raise ConfigError(
                f"{path}:target_parameters",
                f"{parameter!r} is not a parameter fastllm adapts (the fused experts' "
                "mlp.experts.gate_up_proj and mlp.experts.down_proj of a mixture of experts)",
            )
        layers += matches
    return [layer for layer in EXPERT_LORA_LAYERS if layer in layers]


def _layers_of(
    targets: set[str],
    config: BaseModelConfig,
    architecture: str,
    path: Path,
    experts: bool = False,
) -> list[str]:
    """Our `layers` for PEFT's target modules: each of our sub-layers maps to one or more of
    their projections (mlp_1 to gate_proj and up_proj), all adapted or none; with `experts`
    (target parameters adapt the experts) none is allowed."""
    every = ["query", "key", "value", "dense", "mlp_1", "mlp_2"]
    if not config.has_dense_mlp:
        every = every[:4]
    probe = msgspec.structs.replace(config, peft=LoRAConfig(rank=1, layers=every))  # type: ignore[arg-type]
    names: dict[str, set[str]] = {}
    for layer in every:
        single = msgspec.structs.replace(probe, peft=LoRAConfig(rank=1, layers=[layer]))  # type: ignore[arg-type]
        names[layer] = set(target_modules(single, architecture))
    layers = [layer for layer in every if names[layer] <= targets]
    covered = set().union(*(names[layer] for layer in layers))
    unknown = targets - covered
    if unknown:
        raise ConfigError(
            f"{path}:target_modules",
            f"{sorted(unknown)} are not adapters fastllm can load into {architecture} "
            f"(known: {sorted(set().union(*names.values()))}; gate_proj and up_proj go together)",
        )
    if not layers and not experts:
        raise ConfigError(f"{path}:target_modules", "names no projection")
    return layers


def adapter_tensors(
    directory: Path, config: BaseModelConfig, architecture: str
) -> Iterator[tuple[str, Tensor]]:
    """The adapters of a PEFT adapter directory under our names, for a model of `config`
    (whose LoRA must be the adapter's: rank, alpha and projections; dropout may differ)."""
    lora = lora_of(config)
    theirs = read_adapter_config(directory, config, architecture)
    for key in ("rank", "alpha"):
        if getattr(theirs, key) != getattr(lora, key):
            raise ConfigError(
                f"model.base_model.peft.{key}",
                f"is {getattr(lora, key)}, the adapter in {directory} has {getattr(theirs, key)}",
            )
    if sorted(theirs.adapted()) != sorted(lora.adapted()):
        raise ConfigError(
            "model.base_model.peft.layers",
            f"is {lora.layers}, the adapter in {directory} adapts {theirs.layers}",
        )
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(str(path), "no such file (only safetensors adapters are read)")
    try:
        stored = load_file(path)
    except Exception as error:  # safetensors raises its own error types
        raise ConfigError(str(path), f"is not a readable safetensors file ({error})") from None
    rules_ = list(adapter_rules(config, architecture))
    expected = {PREFIX + name for rule in rules_ for name in rule.theirs}
    for what, names in (
        ("lacks", expected - stored.keys()),
        ("holds tensors the model has no place for:", stored.keys() - expected),
    ):
        if names:
            raise ConfigError(str(path), f"{what} {', '.join(sorted(names)[:3])}")
    for rule in rules_:
        yield rule.ours, rule.join([stored[PREFIX + name].float() for name in rule.theirs])


def with_adapter(
    config: BaseModelConfig, hf_config: dict[str, Any] | None, directory: Path
) -> tuple[BaseModelConfig, Iterator[tuple[str, Tensor]]]:
    """The model of `config` (its Hugging Face config `hf_config`, if any) with the PEFT
    adapter in `directory`: its config, the adapter's LoRA added, and the adapter's tensors
    under our names (read as they are iterated)."""
    architecture = architecture_for(config, hf_config)
    lora = read_adapter_config(directory, config, architecture)
    adapted = msgspec.structs.replace(config, peft=lora)
    return adapted, adapter_tensors(directory, adapted, architecture)


def base_config(config: BaseModelConfig) -> BaseModelConfig:
    """The model without its adapters."""
    return msgspec.structs.replace(config, peft=NoPeftConfig())


def merged(
    config: BaseModelConfig, tensors: Iterator[tuple[str, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """The tensors of `base_config(config)`'s model: each adapted weight W with its adapters'
    update added, W + (alpha / rank) · B A per segment (computed in fp32, stored in W's
    dtype); a weight is held back until its adapters have come."""
    lora = lora_of(config)
    modules = dict(_adapters(config))
    weights = {_weight_of(projection, module): projection for projection, module in modules.items()}
    held: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors:
        head, _, part = name.rpartition(".")
        if name in weights:
            projection, part = weights[name], "weight"
        elif head.endswith(SUFFIX):
            projection = head.removesuffix(SUFFIX)
        else:
            yield name, tensor
            continue
        parts = held.setdefault(projection, {})
        parts[part] = tensor
        if len(parts) == 3:
            del held[projection]
            module = modules[projection]
            yield _weight_of(projection, module), _merge(parts, module, lora.scale)
    if held:
        raise ValueError(f"adapters without their weights, or weights without adapters: {held}")


def _merge(parts: dict[str, Tensor], module: Adapter, scale: float) -> Tensor:
    weight, a, b = parts["weight"], parts["a"].float(), parts["b"].float()
    if isinstance(module, ExpertLoRA):  # each expert's B_e A_e
        return torch.baddbmm(weight.float(), b, a, alpha=scale).to(weight.dtype)
    assert isinstance(module, LoRA)
    out = weight.float().clone()
    starts = [sum(module.segments[:i]) for i in range(len(module.segments))]
    b_row = 0
    for k, index in enumerate(module.adapted):
        rows = module.segments[index]
        a_k = a[k * module.rank : (k + 1) * module.rank]
        b_k = b[b_row : b_row + rows]
        out[starts[index] : starts[index] + rows] += scale * (b_k @ a_k)
        b_row += rows
    return out.to(weight.dtype)
