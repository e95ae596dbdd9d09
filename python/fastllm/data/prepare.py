"""`fastllm prepare`: the Rust pipeline (`fastllm._native.start_prepare`) driven from Python,
with a progress bar, Ctrl-C cancellation (nothing is left behind) and the final report."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

from fastllm import _native
from fastllm.config import ConfigError
from fastllm.config.prepare import HuggingfaceInputConfig, InputConfig, PrepareConfig
from fastllm.data.errors import DataWriteError
from fastllm.data.fed_records import FedInput, huggingface_input, transformed
from fastllm.data.huggingface_dataset import open_dataset
from fastllm.data.record_files import file_chunks
from fastllm.data.record_transform import load_transform


def prepare(
    config: PrepareConfig, *, overwrite: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Tokenize `config.input` into a dataset at `config.output.path`; returns the report
    (the content of its metadata.json)."""
    if os.path.exists(config.output.path) and not overwrite:
        raise ConfigError(
            "output.path", f"{config.output.path} already exists (use --overwrite to replace it)"
        )
    fed = _fed_input(config.input)
    source: dict[str, Any] = (
        {
            "paths": config.input.path,
            "format": config.input.format,
            "field": config.input.field,
            "messages_field": config.input.messages_field,
            "loss_masking_spans": config.input.loss_masking_spans,
            "prompt_text": config.input.prompt_text,
            "chosen_text": config.input.chosen_text,
            "rejected_text": config.input.rejected_text,
        }
        if fed is None
        else {"paths": [], "format": fed.format, "feed_inputs": fed.inputs, **fed.fields}
    )
    job = _native.start_prepare(
        **source,
        extensions=getattr(config.input, "extensions", None),
        chat_template=config.input.chat_template,
        train_on=config.input.train_on,
        max_pair_tokens=config.input.max_pair_tokens,
        tokenizer=config.tokenizer.path,
        eos_token=config.tokenizer.eos_token,
        bos_token=config.tokenizer.bos_token,
        add_eos=config.add_eos,
        add_bos=config.add_bos,
        output=config.output.path,
        shard_size_tokens=config.output.shard_size_tokens,
        workers=config.workers or 0,
        strict=config.strict,
        overwrite=overwrite,
    )
    bar = _ProgressBar(enabled=progress)
    try:
        if fed is not None:
            _feed(job, fed, bar)
        while (report := _wait(job, 0.25)) is None:
            bar.update(job.progress())
    except BaseException:  # Ctrl-C, or an error of the records Python reads
        job.cancel()
        job.close_feed()
        with contextlib.suppress(RuntimeError, ConfigError, DataWriteError):
            _wait(job, None, cancelled=True)
        raise
    finally:
        bar.close(job.progress())
        for warning in job.warnings():
            print(f"fastllm: warning: {warning}", file=sys.stderr)
    return report


def _fed_input(config: InputConfig | HuggingfaceInputConfig) -> FedInput | None:
    """The records Python reads and sends to the job: a Hugging Face dataset's, or any input's
    through a transform; None for files the Rust readers read themselves."""
    transform = None if config.transform is None else load_transform(config.transform)
    if isinstance(config, HuggingfaceInputConfig):
        return huggingface_input(config, open_dataset(config), transform)
    if transform is None:
        return None
    return transformed(transform, *file_chunks(config))


def _feed(job: Any, fed: FedInput, bar: _ProgressBar) -> None:
    """Sends every batch, then says that was all; stops early once the job has ended (its
    error is then `wait`'s)."""
    for batch in fed.batches:
        if not batch.send(job):
            break
        bar.update(job.progress())
    job.close_feed()


def _wait(job: Any, timeout: float | None, cancelled: bool = False) -> dict[str, Any] | None:
    try:
        text = job.wait(3600.0 if timeout is None else timeout)
    except (OSError, ValueError) as error:
        if cancelled:
            return None
        if isinstance(error, OSError):  # the machine could not write the output
            raise DataWriteError(str(error)) from None
        raise ConfigError("prepare", str(error)) from None
    return None if text is None else json.loads(text)


class _ProgressBar:
    """One line on stderr: documents, tokens, MB/s and ETA, from the job's byte counters."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def _line(self, counters: dict[str, int]) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        done, total = counters["bytes_read"], counters["total_bytes"]
        rate = done / elapsed
        eta = (total - done) / rate if rate > 0 else 0.0
        line = (
            f"{counters['documents']:,} documents | {counters['tokens']:,} tokens | "
            f"{rate / 1e6:.1f} MB/s | {counters['tokens'] / elapsed:,.0f} tokens/s"
        )
        # A streamed dataset's size is not known ahead.
        return f"{100 * done / total:5.1f}% | {line} | ETA {eta:.0f}s" if total else line

    def update(self, counters: dict[str, int]) -> None:
        if self.enabled:
            sys.stderr.write("\r" + self._line(counters))
            sys.stderr.flush()

    def close(self, counters: dict[str, int]) -> None:
        if self.enabled:
            sys.stderr.write("\r" + self._line(counters) + "\n")
            sys.stderr.flush()


def summary(report: dict[str, Any], output: str, seconds: float) -> str:
    """What `fastllm prepare` prints when it is done."""
    lines = [
        f"{output}: {report['documents']:,} documents, {report['tokens']:,} tokens in "
        f"{len(report['shards'])} shard(s) ({report['dtype']}, vocabulary {report['vocab_size']:,}), "
        f"{seconds:.1f}s, {report['tokens'] / max(seconds, 1e-9):,.0f} tokens/s, "
        f"tokenizer: {report['tokenizer']['implementation']}",
    ]
    if report["loss_masking_spans"]:
        share = report["trained_tokens"] / max(report["tokens"], 1)
        lines.append(
            f"{report['format']}: {report['trained_tokens']:,} tokens trained on ({share:.1%})"
            + (f", train_on: {report['train_on']}" if report["train_on"] else "")
        )
    if report["format"] == "preference":
        share = report["trained_tokens"] / max(report["tokens"], 1)
        lines.append(
            f"preference: {report['documents']:,} pairs, {report['trained_tokens']:,} answer "
            f"tokens ({share:.1%}), the rest prompts (once per pair)"
        )
    if report["bad_records"]:
        lines.append(f"{report['bad_records']:,} bad record(s) skipped; the first ones:")
        lines += [f"  {record}" for record in report["first_bad_records"]]
    if report.get("skipped_files"):
        lines.append(f"{report['skipped_files']:,} file(s) skipped (not UTF-8 text)")
    return "\n".join(lines)
