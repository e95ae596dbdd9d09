"""The model formats fastllm reads and writes: the one list that configs, `fastllm convert`
and exports read (the Hugging Face mappings live in checkpoint/architectures.py, one per name
here)."""

from __future__ import annotations

from typing import Literal

HF_ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "starcoder2")
"""Hugging Face `model_type`s that fastllm converts to and from."""
MODEL_FORMATS = ("fastllm", "distributed", *HF_ARCHITECTURES)
"""fastllm (safetensors + config.yaml), distributed (what training writes: per-rank shards and
a manifest) and the Hugging Face architectures."""

ModelFormat = Literal[MODEL_FORMATS]  # type: ignore[valid-type]
