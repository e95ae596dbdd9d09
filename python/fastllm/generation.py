"""`fastllm generate`: load a model and its tokenizer, complete a prompt, or answer it as a chat
turn rendered with the model's chat template (the renderer `fastllm prepare` uses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fastllm.config import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def generate_text(
    path: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    device: str | None = None,
    chat: bool = False,
    system: str | None = None,
    adapter: str | Path | None = None,
) -> str:
    """The prompt followed by its completion (greedy unless `temperature` > 0); with `chat`,
    the assistant's reply to the prompt as a user turn (after `system`, if given), generated
    until the tokenizer's end-of-sequence token. `adapter`: a PEFT LoRA adapter directory run
    with the model in `path`."""
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
    model = FastLLMForCausalLM.wrap(load_model(path, device=device, adapter=adapter))
    text, stop = _chat_prompt(Path(path), tokenizer, prompt, system) if chat else (prompt, {})
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise ConfigError("--prompt", "encodes to no tokens")
    sampling = (
        {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    )
    with torch.no_grad():
        output = model.generate(
            torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, **sampling, **stop
        )
    if chat:
        return tokenizer.decode(output[0, len(ids) :].tolist(), skip_special_tokens=True)
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
    if device.type not in ("cpu", "cuda"):
        raise ConfigError("--device", f"{name}: fastllm generates on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"{name}: no CUDA GPU is available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            "--device", f"{name}: this machine has {torch.cuda.device_count()} GPU(s)"
        )
    return name


def _chat_prompt(
    path: Path, tokenizer: Tokenizer, prompt: str, system: str | None
) -> tuple[str, dict[str, int]]:
    """The conversation up to the assistant's turn, and the generation settings that stop at
    the tokenizer's end-of-sequence token."""
    from fastllm import _native

    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": prompt})
    try:
        template = _native.ChatTemplate(str(path))
        text = template.render(json.dumps(messages), add_generation_prompt=True)
    except (OSError, ValueError) as error:
        raise ConfigError("--chat", str(error)) from None
    settings = path / "tokenizer_config.json"
    eos = json.loads(settings.read_text()).get("eos_token") if settings.is_file() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tokenizer.token_to_id(eos) if eos else None
    return text, {} if eos_id is None else {"eos_token_id": eos_id, "pad_token_id": eos_id}
