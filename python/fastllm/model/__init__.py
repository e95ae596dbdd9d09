"""The one transformer (Llama, Mistral, Mixtral, StarCoder2, Qwen2 and their kin)."""

from fastllm.model.gpt import GPTModel
from fastllm.model.init import initialize

__all__ = ["GPTModel", "initialize"]
