"""Helpers shared by the training benchmarks (train_bench.py, scale_bench.py): provenance,
a random-token dataset, random Llama checkpoints and their FLOPs, result files, markdown tables
and optional plotting.

Importing this module must stay cheap (no torch): `--plot` runs on machines without a GPU."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GIB = 2**30


# ---------------------------------------------------------------- provenance


def commit_info(explicit: str | None) -> dict[str, Any]:
    """The commit that ran: --commit when given (the GPU machine's copy has no .git), else
    HEAD of this checkout, with whether the working tree differs from it."""
    if explicit:
        return {"commit": explicit, "dirty": None, "commit_source": "--commit"}

    def git(*arguments: str) -> str | None:
        try:
            result = subprocess.run(["git", *arguments], capture_output=True, text=True, cwd=ROOT)
        except OSError:
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is None:
        return {"commit": "unknown", "dirty": None, "commit_source": "none"}
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": head, "dirty": dirty, "commit_source": "git"}


def machine_info() -> dict[str, Any]:
    """Host, library versions and accelerators (imports torch: call from a measuring process)."""
    import torch

    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    for name in ("fastllm", "fastllm_kernels", "transformers", "triton", "flash_attn"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "installed")
        except ImportError:
            info[name] = None
    return info


# ---------------------------------------------------------------- data


def write_random_dataset(
    directory: Path, *, vocab_size: int, tokens: int, document_length: int | None, seed: int
) -> dict[str, Any]:
    """Uniformly random tokens as a Megatron MMIDIDX v1 dataset (DIRECTORY/data.bin + .idx),
    the format `fastllm prepare` writes and `fastllm train` reads. Written under a temporary
    name and renamed, so an interrupted write never leaves a dataset that looks complete.

    `document_length` None makes one document of all tokens: every training sample then lies
    inside one document, so the packed-document attention does the work of plain causal
    attention, as the baseline does."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    generator = np.random.default_rng(seed)
    values = generator.integers(0, vocab_size, size=tokens, dtype=dtype)
    documents = write_token_dataset(directory, values, document_length)
    return {
        "path": str(directory),
        "kind": "uniformly random tokens",
        "vocab_size": vocab_size,
        "tokens": tokens,
        "documents": documents,
        "document_length": document_length or tokens,
        "seed": seed,
    }


def write_token_dataset(directory: Path, values: np.ndarray, document_length: int | None) -> int:
    """`values` (uint16 or int32 tokens) as DIRECTORY/data.bin + .idx, in documents of
    `document_length` (one document when None); returns the number of documents."""
    dtype, tokens = values.dtype, len(values)
    code = 8 if dtype == np.uint16 else 4  # Megatron's dtype codes
    length = document_length or tokens
    lengths = np.full(tokens // length, length, dtype=np.int32)
    if tokens % length:
        lengths = np.append(lengths, np.int32(tokens % length))
    partial = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    values.tofile(partial / "data.bin")
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(partial / "data.idx", "wb") as index:
        index.write(b"MMIDIDX\x00\x00")
        index.write(np.array([1], "<u8").tobytes() + bytes([code]))
        index.write(np.array([len(lengths), len(lengths) + 1], "<u8").tobytes())
        index.write(lengths.astype("<i4").tobytes())
        index.write(pointers.astype("<i8").tobytes())
        index.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    return len(lengths)


# ---------------------------------------------------------------- results


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def harmonic_mean(rates: list[float]) -> float:
    """The rate over equal amounts of work done at `rates` (total work / total time)."""
    return len(rates) / sum(1.0 / rate for rate in rates)


def markdown_table(headers: list[str], rows: list[list[str]], text_columns: int = 1) -> str:
    """Text in the first `text_columns` columns (left-aligned), numbers after them."""
    align = ["---"] * text_columns + ["---:"] * (len(headers) - text_columns)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def pyplot() -> Any:
    """matplotlib.pyplot on a file-only backend, or None where matplotlib is missing (the GPU
    image): the plot is then made later with `--plot RESULT.json`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def replot_report(
    report: dict[str, Any],
    directory: Path,
    stem: str,
    merged: bool,
    table: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], bool],
) -> None:
    """`--plot`: the table of saved results and their chart as directory/stem.png; results
    merged from several files are also saved as directory/stem.json."""
    if merged:
        write_json(directory / f"{stem}.json", report)
    print(table(report))
    if plot(report, directory / f"{stem}.png"):
        print(f"\n{directory / f'{stem}.png'}")


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def median_ms(work: Callable[[], Any], repeats: int = 20, warmup: int = 3) -> float:
    """The median CUDA-event time of `work()` in ms, after `warmup` untimed calls."""
    import torch

    times = []
    for i in range(repeats + warmup):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


class EnergyMeter:
    """The GPU's energy counter through NVML (nvidia-ml-py), in joules; `None` readings where
    NVML or the counter is missing (CPU runs). A step's joules over the power limit is the
    shortest time the card allows it when it runs at that limit."""

    def __init__(self, device_index: int = 0) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._read = pynvml.nvmlDeviceGetTotalEnergyConsumption
            self.limit_w: float | None = pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1e3
            self._read(self._handle)
        except Exception:  # no NVML here, or a counter the device lacks: no readings
            self._handle, self.limit_w = None, None

    def joules(self) -> float | None:
        return None if self._handle is None else self._read(self._handle) / 1e3


# ---------------------------------------------------------------- models and their FLOPs


def write_random_llama(
    directory: Path,
    example: str,
    *,
    shrink: dict[str, int] | None = None,
    seed: int,
    device: str,
) -> dict[str, Any]:
    """A Hugging Face Llama directory of random bf16 weights in the geometry of
    examples/EXAMPLE (fastllm's own conversion of its config), `shrink` replacing some of its
    transformers keys (a CPU-sized model); returns its geometry."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastllm.checkpoint.hf_config import to_hf_config
    from fastllm.config import TrainerConfig, load_config

    base = load_config(TrainerConfig, [EXAMPLES / example]).model.base_model
    hf_config = LlamaConfig.from_dict({**to_hf_config(base, "llama"), **(shrink or {})})
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()  # the runs measured are other processes: leave them the GPU
    return hf_geometry(hf_config)


def hf_geometry(config: Any) -> dict[str, Any]:
    """What the FLOP counts need of a transformers Llama config."""
    heads = config.num_attention_heads
    return {
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "heads": heads,
        "kv_heads": config.num_key_value_heads,
        "head_size": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "ffn": config.intermediate_size,
        "vocab": config.vocab_size,
        "tied_embeddings": config.tie_word_embeddings,
    }


def forward_flops(
    geometry: dict[str, Any], *, tokens: float, head_rows: float, attended_pairs: float
) -> float:
    """The FLOPs of one forward pass of a (gated-MLP) Llama: 2 per matmul weight per token
    through the blocks (`tokens`), the same for the output head over the rows it is applied
    to (`head_rows`: a fused head may skip the rows without a label), and 4 × heads × head
    size per layer for each (query, key) pair that attention computes (QKᵀ and PV). Norms,
    rotary, softmaxes and the embedding lookup are not counted. A trained pass (forward,
    input and weight gradients) costs 3 times this."""
    g = geometry
    attention_out = g["heads"] * g["head_size"]
    block = (
        g["hidden"] * (attention_out + 2 * g["kv_heads"] * g["head_size"])  # query, key, value
        + attention_out * g["hidden"]  # dense
        + 3 * g["hidden"] * g["ffn"]  # gate, up, down
    )
    matmuls = 2 * (g["layers"] * block * tokens + g["vocab"] * g["hidden"] * head_rows)
    return matmuls + 4 * g["layers"] * attention_out * attended_pairs
