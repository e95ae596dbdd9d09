"""`fastllm generate`: load a model and its tokenizer, complete a prompt."""

from __future__ import annotations

from pathlib import Path

import torch

from fastllm.config import ConfigError


def generate_text(
    path: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    device: str | None = None,
) -> str:
    """The prompt followed by its completion (greedy unless `temperature` > 0)."""
    device = _device(device)
    if not Path(path).is_dir():
        raise ConfigError(str(path), "no such model directory")
    tokenizer_file = Path(path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(str(path), "has no tokenizer.json to encode the prompt with")
    # Imported once the arguments are known to be good (transformers takes seconds).
    from tokenizers import Tokenizer

    from fastllm.api import load_model
    from fastllm.hf import FastLLMForCausalLM

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ConfigError(str(tokenizer_file), f"is not a valid tokenizer ({error})") from None
    model = FastLLMForCausalLM.wrap(load_model(path, device=device))
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise ConfigError("--prompt", "encodes to no tokens")
    sampling = (
        {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    )
    with torch.no_grad():
        output = model.generate(
            torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, **sampling
        )
    return tokenizer.decode(output[0].tolist(), skip_special_tokens=False)


def _device(name: str | None) -> str:
    """`name` checked against the machine (default: cuda when there is a GPU)."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            "--device", f"{name!r} is not a torch device (cpu, cuda, cuda:1, …)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"{name}: no CUDA GPU is available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            "--device", f"{name}: this machine has {torch.cuda.device_count()} GPU(s)"
        )
    return name
