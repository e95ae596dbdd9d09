"""Shared inputs of the data tests: the Python standard library's sources as the corpus, and a
small byte-level BPE trained on them once per session."""

from __future__ import annotations

import contextlib
import io
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from fastllm.cli import main

STDLIB = Path(sysconfig.get_paths()["stdlib"])

# Text that stresses the pre-tokenizer and the JSON decoder: empty and blank documents, runs of
# whitespace, CRLF, digits, contractions, non-ASCII (2-, 3- and 4-byte UTF-8, combining marks,
# no-break space), escapes, NUL, and the special tokens written out inside a document.
EDGE_CASES = [
    "",
    " ",
    "\n\n\n",
    "a\r\nb\r\n\r\n",
    "\t\tif x:\n\t\t\treturn  y   \n",
    "x" * 5000,
    "    " * 300 + "end",
    "3.14159 1e-10 0x1F 1_000_000 12345678901234567890",
    "don't we'll they've I'm she's you'd THEY'RE",
    "caf\u00e9 na\u00efve \u00fcber \u00a0 e\u0301 \u65e5\u672c\u8a9e \U0001f389\U0001f40d \u200b",
    'quote " backslash \\ slash / \u0000 nul \u007f del',
    "before<|endoftext|>after <fim_prefix>x<fim_suffix>y<fim_middle>z",
    "trailing spaces   \n   leading",
]


def stdlib_files(*names: str) -> list[Path]:
    """The *.py files of these stdlib packages (or single modules), in the order a directory
    walk sorted by name visits them."""
    files: list[Path] = []
    for name in names:
        path = STDLIB / name
        if path.is_dir():
            found = (f for f in path.rglob("*.py") if "__pycache__" not in f.parts)
            files += sorted(found, key=lambda f: f.relative_to(path).parts)
        else:
            files.append(path)
    return files


def write_jsonl(path: Path, texts: list[str], *, ensure_ascii: bool = True) -> Path:
    import gzip

    lines = "".join(
        json.dumps({"id": i, "text": t}, ensure_ascii=ensure_ascii) + "\n"
        for i, t in enumerate(texts)
    )
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as file:
            file.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*arguments: str) -> CliResult:
    """`fastllm ARGUMENTS` in this process (no interpreter start-up, torch already imported);
    the CLI contract itself is tested through tests.test_cli.fastllm in a subprocess."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(arguments))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
    return CliResult(code, stdout.getvalue(), stderr.getvalue())


def prepare(inputs: Path | str, tokenizer: Path, output: Path, *overrides: str) -> Path:
    result = run_cli(
        "prepare",
        f"input.path={inputs}",
        f"tokenizer.path={tokenizer}",
        f"output.path={output}",
        *overrides,
    )
    assert result.returncode == 0, result.stderr
    return output


@dataclass
class TrainedTokenizer:
    path: Path  # directory with tokenizer.json
    reference: Tokenizer  # the `tokenizers` library's own reading of it
    eos: int

    def encode(self, texts: list[str]) -> list[list[int]]:
        """What a prepared document must hold: the ids of `tokenizers` plus EOS."""
        encodings = self.reference.encode_batch(texts, add_special_tokens=False)
        return [[*encoding.ids, self.eos] for encoding in encodings]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TrainedTokenizer:
    """A 600-token byte-level BPE learned from the json and email packages, with the default
    special tokens (end of text and the four FIM tokens)."""
    corpus = tmp_path_factory.mktemp("corpus")
    write_jsonl(corpus / "train.jsonl", [f.read_text() for f in stdlib_files("json", "email")])
    output = tmp_path_factory.mktemp("tokenizer") / "tok"
    result = run_cli(
        "tokenizer",
        "train",
        f"input.path={corpus / 'train.jsonl'}",
        f"output={output}",
        "vocab_size=600",
    )
    assert result.returncode == 0, result.stderr
    reference = Tokenizer.from_file(str(output / "tokenizer.json"))
    eos = reference.token_to_id("<|endoftext|>")
    assert eos is not None
    for token in ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"):
        assert reference.token_to_id(token) is not None
    return TrainedTokenizer(output, reference, eos)


@pytest.fixture(scope="module")
def dataset(tokenizer: TrainedTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 40 ASCII stdlib sources of 1 to 8,000 tokens (email/mime/__init__.py is empty)."""
    directory = tmp_path_factory.mktemp("sources")
    texts = [f.read_text() for f in stdlib_files("json", "email/mime", "wsgiref", "this.py")]
    assert all(text.isascii() and "<|endoftext|>" not in text for text in texts)
    inputs = write_jsonl(directory / "sources.jsonl", texts)
    return prepare(inputs, tokenizer.path, directory / "data")
