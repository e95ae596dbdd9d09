"""Token data: prepared datasets, the sample stream of a run and its loader.

- `prepare`: `fastllm prepare`, raw text into token datasets (the Rust pipeline, driven);
  `tokenizer_training`: `fastllm tokenizer train` on the same inputs.
- `dataset`: a prepared dataset (shards + metadata) or a Megatron `.bin`/`.idx` prefix.
- `samples`: the run's sample stream: datasets cut into samples, blended, FIM-transformed.
- `source`: Python data sources (`data.source`), their documents packed or truncated into
  samples, FIM-transformed as the datasets' are.
- `fim`: FIM's settings resolved against a tokenizer, for both.
- `loader`: one data-parallel rank's batches, prepared ahead in pinned memory.
- `errors`: what a failed write of prepare raises.

The names are imported on first use, so that `fastllm prepare` (which lives here too) starts
without importing torch."""

from typing import Any

_EXPORTS = {
    "TokenDataset": "fastllm.data.dataset",
    "Batch": "fastllm.data.loader",
    "DataLoader": "fastllm.data.loader",
    "SampleStream": "fastllm.data.samples",
    "Samples": "fastllm.data.samples",
    "DataSource": "fastllm.data.source",
    "Document": "fastllm.data.source",
    "SourceContext": "fastllm.data.source",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastllm.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
