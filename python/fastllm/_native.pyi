"""fastllm's Rust crates, as the compiled module `fastllm._native` exposes them
(rust/fastllm-python): data preparation and reading, the flat-buffer layout, checkpoint I/O.

Type checkers and editors read this file; tests/test_native_stubs.py keeps it equal to the module.
"""

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias, TypedDict

import numpy as np
from numpy.typing import NDArray

_Path: TypeAlias = str | os.PathLike[str]
# An object with the buffer protocol, e.g. a pyarrow Buffer (collections.abc.Buffer from 3.12).
_Buffer: TypeAlias = Any
_InputFormat: TypeAlias = Literal["auto", "jsonl", "chat", "preference", "parquet", "text", "files"]

def version() -> str:
    """Version of the Rust extension (the Python package's, unless the extension imported was
    built from another version)."""

# Data: prepared token datasets and the samples drawn from them.

class TokenRangeError(ValueError):
    """A dataset holds a token id outside the model's vocabulary."""

class Cancelled(Exception):
    """Work stopped at the caller's request before it finished; it left nothing behind."""

class TokenDataset:
    """A memory-mapped Megatron indexed dataset (`prefix.bin` + `prefix.idx`)."""

    def __init__(self, prefix: _Path) -> None:
        """Open `prefix.bin` + `prefix.idx`, checking the header and the file sizes."""

    def __len__(self) -> int: ...
    @property
    def num_tokens(self) -> int:
        """Tokens in all documents."""

    @property
    def dtype(self) -> str:
        """The on-disk token dtype as a numpy name (`uint16`, `int32`, …)."""

    @property
    def has_loss_spans(self) -> bool:
        """Whether a `.spans` sidecar masks tokens from the loss."""

    def check_token_range(self, vocab_size: int, cache_dir: _Path) -> None:
        """Raise TokenRangeError naming the first document with an id outside `0..vocab_size`:
        the id range of the `.bin` file is scanned once, then read from `cache_dir`."""

    def document_lengths(self) -> NDArray[np.int32]:
        """Token count of every document."""

    def loss_spans(self, index: int) -> list[tuple[int, int]]:
        """The masked token ranges `(begin, end)` of document `index` (none without a sidecar)."""

    @property
    def is_preference(self) -> bool:
        """Whether a `.preference` sidecar says where each pair's answers lie."""

    def preference_spans(self, index: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The chosen and rejected token spans `((begin, end), (begin, end))` of pair `index`
        (None without a sidecar)."""

    def document(self, index: int) -> NDArray[np.int64]:
        """The tokens of document `index` as int64."""

class FimOptions:
    """Fill-in-the-middle settings with the special tokens already resolved to ids."""

    def __init__(
        self,
        *,
        rate: float,
        spm_rate: float,
        max_middle_len: int | None,
        split: Literal["token", "character"],
        prefix: int,
        middle: int,
        suffix: int,
        pad: int,
        eos: int,
    ) -> None: ...

class Fim:
    """The FIM transform of `SampleSource`, for samples made elsewhere (a data source's): a
    sample gets the transform its index and the seed give, wherever it is filled."""

    def __init__(self, options: FimOptions, *, seed: int, tokenizer: _Path | None = None) -> None:
        """`tokenizer`: the tokenizer.json of the tokens, for character-level FIM."""

    def fill(
        self,
        first_sample: int,
        tokens: NDArray[np.int64],
        document_ids: NDArray[np.int32],
        loss_mask: NDArray[np.uint8],
        real: Sequence[int],
    ) -> None:
        """Transforms samples `first_sample, first_sample + 1, …` in place, laid end to end in
        flat contiguous buffers, sample `k` holding `real[k]` real tokens: the transformed
        tokens, the loss mask 1 on them, then padding (the pad token, one more document id,
        loss mask 0). ValueError when the buffers do not hold `len(real)` samples of one
        length, each at least its real tokens."""

class SampleSource:
    """Training samples from prepared datasets (sampling index, blending, FIM), written straight
    into numpy buffers that Python owns."""

    def __init__(
        self,
        prefixes: Sequence[_Path],
        *,
        sequence_length: int,
        num_samples: int,
        seed: int,
        truncate: bool,
        weights: Sequence[float] | None,
        cache_dir: _Path,
        threads: int = 0,
        fim: FimOptions | None = None,
        tokenizer: _Path | None = None,
        vocab_size: int | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """`prefixes`: the `.bin`/`.idx` prefixes of every dataset (shard) to draw from;
        `truncate` cuts documents at sample boundaries instead of packing them; `threads` 0: all
        cores; `tokenizer`: the datasets' tokenizer.json, for character-level FIM; `vocab_size`:
        the model's, when every token filled in must lie below it (else TokenRangeError);
        `stop`: asked every 50 ms while the indices are built, after Python's signal handlers
        ran: once it returns true the build stops with `Cancelled`, caching nothing."""

    def __len__(self) -> int: ...
    @property
    def skipped_samples(self) -> int:
        """Samples of the datasets skipped for having no trained label."""

    @property
    def is_preference(self) -> bool:
        """Whether the datasets hold preference pairs (`fill` then takes `parts`)."""

    @property
    def skipped_pairs(self) -> int:
        """Preference pairs left out for being longer than the sequence."""

    @property
    def sample_length(self) -> int:
        """Tokens per sample: the sequence length plus one (inputs and shifted labels)."""

    def sample_pairs(self, sample: int) -> tuple[int, list[int]]:
        """The dataset (its place in `prefixes`) and the pairs (its documents) of sample
        `sample` of preference pairs: pair `k` of the list is the sample's document `k`."""

    def fill(
        self,
        first_sample: int,
        tokens: NDArray[np.int64],
        document_ids: NDArray[np.int32],
        loss_mask: NDArray[np.uint8],
        parts: NDArray[np.int8] | None = None,
    ) -> None:
        """Write samples `first_sample, first_sample + 1, …` into flat contiguous buffers of
        `count * sample_length` elements each; `parts` for preference pairs only (0 prompt,
        1 chosen, 2 rejected, -1 padding; see `fastllm.data.loader.Batch`)."""

# Data preparation: `fastllm prepare` and the reader `fastllm tokenizer train` shares with it.

class _PrepareProgress(TypedDict):
    documents: int
    tokens: int
    bytes_read: int
    total_bytes: int
    bad_records: int

class PrepareJob:
    """A `prepare` running on a background thread (made by `start_prepare`)."""

    def progress(self) -> _PrepareProgress:
        """Counters so far."""

    def warnings(self) -> list[str]:
        """What the job met that it leaves to the user, one line each (a staging directory of
        another machine's run, which it may not remove)."""

    def feed(
        self,
        *,
        input: int,
        file: _Path,
        kind: Literal["text", "json"],
        rows: Sequence[int],
        values: Sequence[str | None],
        reasons: Sequence[str],
        skipped: int,
        bytes: int,
    ) -> bool:
        """Sends records of input `input` (read from `file`) to a job started with
        `feed_inputs`: `values` are texts (`kind` "text") or JSON objects ("json"), one per row
        of `rows`; a None value is a bad record whose reason is the next of `reasons`. Waits
        while the job is busy; returns False once the job has ended (its error, if any, is
        `wait`'s)."""

    def feed_strings(
        self,
        *,
        input: int,
        file: _Path,
        first_row: int,
        validity: _Buffer | None,
        offsets: _Buffer,
        data: _Buffer,
        offset: int,
        length: int,
        large: bool,
        bytes: int,
    ) -> bool:
        """Like `feed` for the texts of an Arrow string array (`large`: large_string), read
        from its buffers (validity bitmap, offsets, data) without Python strings: `length` rows
        from element `offset`, the first of them row `first_row`."""

    def close_feed(self) -> None:
        """Says that every record was sent: the job finishes once it has written them."""

    def cancel(self) -> None:
        """Ask the job to stop; it then fails, leaving no output behind."""

    def wait(self, timeout: float) -> str | None:
        """The report as JSON once the job has finished, or None if it is still running after
        `timeout` seconds. Raises the job's error: OSError when the machine could not write the
        output, ValueError for bad inputs or options."""

def start_prepare(
    *,
    paths: Sequence[str],
    format: _InputFormat,
    field: str,
    extensions: Sequence[str] | None,
    messages_field: str,
    loss_masking_spans: str | None,
    chat_template: _Path | None,
    train_on: Literal["assistant", "last_assistant", "all"],
    tokenizer: _Path,
    eos_token: str | None,
    bos_token: str | None,
    add_eos: bool,
    add_bos: bool,
    output: _Path,
    shard_size_tokens: int,
    workers: int,
    strict: bool,
    overwrite: bool,
    prompt_text: str,
    chosen_text: str,
    rejected_text: str,
    max_pair_tokens: int | None,
    feed_inputs: Sequence[tuple[_Path, int]] | None = None,
) -> PrepareJob:
    """Start tokenizing the inputs into a dataset at `output` on a background thread (`workers`
    0: all cores); the arguments are those of the `prepare` config. With `feed_inputs` (each
    source's name and size), the records come from `PrepareJob.feed` instead of `paths`, JSON
    records read as `format` (jsonl, chat or preference)."""

class DocumentReader:
    """Documents of the same inputs `prepare` reads, in order, batch by batch (for training a
    tokenizer on them)."""

    def __init__(
        self,
        *,
        paths: Sequence[str],
        format: _InputFormat,
        field: str,
        extensions: Sequence[str] | None,
    ) -> None: ...
    def files(self) -> list[tuple[str, str, str, int]]:
        """Each file to read, in order: (input path, format, file, bytes on disk)."""

    def next_batch(self, max_bytes: int) -> tuple[list[str], list[str]] | None:
        """The next documents (about `max_bytes` of text) and the bad records met on the way
        ("file:line: reason"), or None at the end."""

class ChatTemplate:
    """A tokenizer's chat template, rendered as `prepare` renders it, for prompts at generation
    time."""

    def __init__(self, tokenizer: _Path, template: _Path | None = None) -> None:
        """The template of the tokenizer at `tokenizer` (file or directory), or the file
        `template`."""

    def render(self, messages_json: str, *, add_generation_prompt: bool) -> str:
        """The text of `messages_json` (a JSON list of messages)."""

# The flat buffers of the engine.

class BufferLayout:
    """The flat-buffer layout of a model's parameters: one buffer per stage, each parameter a
    view at an aligned offset, each stage split into equal aligned shards, one per data-parallel
    rank. Sizes and offsets count elements."""

    def __init__(
        self,
        parameters: Sequence[tuple[str, int, int, bool]],
        alignment: int,
        data_size: int,
        num_stages: int | None = None,
    ) -> None:
        """Lay out `parameters`, `(name, numel, stage, weight_decay)` in model order, each
        starting at a multiple of `alignment` elements, every stage split into `data_size` equal
        shards; stages without parameters are empty, up to `num_stages` when given."""

    @property
    def alignment(self) -> int:
        """Elements every parameter's offset and every shard boundary is a multiple of."""

    @property
    def data_size(self) -> int:
        """Data-parallel ranks: shards per stage."""

    @property
    def num_stages(self) -> int:
        """Stage buffers."""

    @property
    def num_parameters(self) -> int:
        """Parameters laid out."""

    @property
    def num_elements(self) -> int:
        """Elements in all stage buffers together, padding included."""

    def stage_size(self, stage: int) -> int:
        """Elements in the stage's buffer, padding included; a multiple of
        `data_size * alignment`."""

    def shard_size(self, stage: int) -> int:
        """Elements in each rank's shard of the stage."""

    def shard_range(self, stage: int, rank: int) -> tuple[int, int]:
        """`(start, end)` of the rank's shard within the stage's buffer."""

    def parameter(self, key: int | str) -> tuple[int, int, int]:
        """`(stage, offset, numel)` of a parameter given by index or name."""

    def shard_parameters(self, stage: int, rank: int) -> list[tuple[int, int, int, int, int]]:
        """The parameter elements the rank's shard holds, in order, as `(parameter_index,
        param_start, param_end, shard_start, shard_end)`: elements `param_start..param_end` of
        the flattened parameter lie at `shard_start..shard_end` of the shard."""

    def decay_runs(self, stage: int, rank: int) -> list[tuple[int, int, bool]]:
        """The rank's shard cut into maximal `(start, end, weight_decay)` runs, offsets within
        the shard, covering it exactly: one fused optimizer call each. Padding joins the run
        before it, so every boundary is aligned."""

# Checkpoints: safetensors files written on background threads, committed, verified, found.

class _FileReport(TypedDict):
    file_name: str
    bytes: int
    checksum: str

class CheckpointWriter:
    """Writes checkpoint files in the background, one job at a time."""

    def __init__(self) -> None: ...
    def submit(
        self,
        directory: _Path,
        files: Sequence[
            tuple[str, Sequence[tuple[str, NDArray[Any], str, Sequence[int]]], dict[str, str]]
        ],
    ) -> WriteJob:
        """Start writing `files`, `(file_name, tensors, metadata)` with tensors `(name, array,
        dtype, shape)`, into `directory` (created if missing) and return at once, after waiting
        for the previous job if it still runs. Each array is C-contiguous and holds the tensor's
        bytes (of any element type: bf16 arrives as a uint8 or int16 view), `dtype` is its
        safetensors dtype (`"BF16"`). The arrays are read in place: keep them unchanged until the
        job is done."""

class WriteJob:
    """A submitted write (made by `CheckpointWriter.submit`): `wait()` for its file reports, or
    poll `done`."""

    def wait(self) -> list[_FileReport]:
        """Block, without the GIL, until every file is written and fsynced; one report per file,
        in submission order."""

    @property
    def done(self) -> bool:
        """Whether `wait()` would return at once."""

def commit_checkpoint(
    partial_dir: _Path, final_dir: _Path, manifest_json: str, reports: Sequence[Mapping[str, Any]]
) -> None:
    """Write `manifest.json` (the `manifest_json` object plus the files of `reports`, as
    `WriteJob.wait()` returns them, gathered from every rank), fsync, and rename `partial_dir`
    to `final_dir`, which must not exist."""

def verify_checkpoint(directory: _Path) -> str:
    """Check the size and checksum of every file the manifest of `directory` lists; return the
    manifest as JSON."""

def latest_checkpoint(root: _Path) -> tuple[int, str, str, list[str]] | None:
    """`(step, directory, manifest_json, skipped)` of the newest committed checkpoint under
    `root` that verifies, `skipped` saying why each newer one was passed over; None if there is
    none."""
