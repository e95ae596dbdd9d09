"""Token data: prepared datasets, the sample stream of a run and its loader."""

from fastllm.data.dataset import TokenDataset
from fastllm.data.loader import Batch, DataLoader
from fastllm.data.samples import Samples, SampleStream

__all__ = ["Batch", "DataLoader", "SampleStream", "Samples", "TokenDataset"]
