from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastllm import cli
from tests.conftest import ROOT
from tests.data.conftest import run_cli


def fastllm(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastllm.cli", *arguments], capture_output=True, text=True, cwd=ROOT
    )


def test_config_show_prints_every_default_with_overrides_applied() -> None:
    result = fastllm("config", "show", "-c", "examples/mistral-7b.yaml", "training.train_iters=5")
    assert result.returncode == 0, result.stderr
    assert "train_iters: 5\n" in result.stdout
    assert "window_size: 4096\n" in result.stdout
    assert "kv_channels: 128\n" in result.stdout  # derived default, resolved
    assert "expert_z_loss_coefficient: 0.0\n" in result.stdout  # untouched default, shown


def test_config_show_accepts_the_model_family() -> None:
    result = fastllm("config", "show", "gpt", "-c", "examples/tiny.yaml", "training.train_iters=5")
    assert result.returncode == 0, result.stderr
    assert fastllm("config", "show", "bert", "-c", "examples/tiny.yaml").returncode == 2


def test_config_validate_summarizes_the_model() -> None:
    result = fastllm("config", "validate", "-c", "examples/llama3-8b.yaml")
    assert result.returncode == 0, result.stderr
    assert "8.03B parameters" in result.stdout


def test_config_validate_counts_parameters_in_readable_units() -> None:
    result = fastllm("config", "validate", "-c", "examples/tiny.yaml")
    assert result.returncode == 0, result.stderr
    assert ": valid; 3.81M parameters, 4 layers" in result.stdout
    result = fastllm("config", "validate", "-c", "examples/mixtral-8x7b.yaml")
    assert result.returncode == 0, result.stderr
    assert "46.7B parameters (12.9B active per token)" in result.stdout


def test_bad_config_exits_2_with_the_key_path_and_no_traceback() -> None:
    result = fastllm(
        "config",
        "validate",
        "-c",
        "examples/tiny.yaml",
        "model.base_model.transformer.hiden_size=8",
    )
    assert result.returncode == 2
    assert (
        "model.base_model.transformer.hiden_size: unknown key; did you mean hidden_size?"
        in result.stderr
    )
    assert "Traceback" not in result.stderr
    result = fastllm("config", "show", "-c", "examples/tiny.yaml", "batch.batch_size=many")
    assert result.returncode == 2
    assert "batch.batch_size: expected int, got str: 'many'" in result.stderr


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = fastllm("config", "show", "-c", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "nope.yaml: no such config file" in result.stderr


def test_help_and_config_do_not_import_torch() -> None:
    probe = (
        "import sys, contextlib, io\n"
        "import fastllm.config, fastllm.cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    fastllm.cli.main(['--help'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_version_reports_the_native_extension() -> None:
    from fastllm import __version__, _native

    result = fastllm("--version")
    assert result.stdout.strip() == f"fastllm {__version__} (native extension {_native.version()})"
    assert _native.version() == __version__


def test_non_finite_and_oversized_numbers_exit_2_naming_the_key() -> None:
    result = fastllm(
        "config", "validate", "-c", "examples/tiny.yaml", "optimizer.weight_decay=.inf"
    )
    assert result.returncode == 2
    assert "optimizer.weight_decay: must be a finite number, got inf" in result.stderr
    result = fastllm("config", "validate", "-c", "examples/tiny.yaml", "training.train_iters=1e400")
    assert result.returncode == 2
    assert "training.train_iters" in result.stderr
    result = fastllm(
        "config", "validate", "-c", "examples/tiny.yaml", f"training.train_iters={2**64}"
    )
    assert result.returncode == 2
    assert "training.train_iters: must fit in a signed 64-bit integer" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-new-tokens", "0", "must be a positive integer, got 0"),
        ("--max-new-tokens", "many", "expected an integer, got 'many'"),
        ("--temperature", "-0.5", "must be a finite number ≥ 0, got -0.5"),
    ],
)
def test_generate_refuses_a_bad_option_in_one_line(
    option: str, value: str, message: str, tmp_path: Path
) -> None:
    result = fastllm("generate", str(tmp_path), "--prompt", "def", option, value)
    assert result.returncode == 2
    assert f"argument {option}: {message}" in result.stderr
    assert "Traceback" not in result.stderr


# In this process, where torch is imported already: the two below reach the point where
# `generate` imports it. An exception escaping `main` would fail them as a traceback would.


def test_generate_says_a_missing_model_directory_does_not_exist(tmp_path: Path) -> None:
    result = run_cli("generate", str(tmp_path / "nonexistent"), "--prompt", "def")
    assert result.returncode == 2
    assert f"{tmp_path / 'nonexistent'}: no such model directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_generate_on_cuda_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    result = run_cli("generate", str(tmp_path), "--prompt", "def", "--device", "cuda")
    assert result.returncode == 2
    assert "--device: cuda: no CUDA GPU is available on this machine" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_internal_error_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(_args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "_generate", failing)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["generate", "model", "--prompt", "def"])


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--tflops", "-1", "argument --tflops: must be a number > 0 and ≤ 1e6, got -1"),
        ("--tflops", "1e300", "argument --tflops: must be a number > 0 and ≤ 1e6, got 1e300"),
        ("--data-gbps", "0", "argument --data-gbps: must be a number > 0 and ≤ 1e6, got 0"),
        ("--png", "tiny.yaml/steps.png", "--png: examples/tiny.yaml is not a directory"),
    ],
)
def test_schedule_refuses_a_bad_argument_in_one_line(option: str, value: str, message: str) -> None:
    value = value.replace("tiny.yaml", "examples/tiny.yaml")
    result = fastllm("schedule", "-c", "examples/tiny.yaml", "--world-size", "2", option, value)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "out/x"),
            "out/x: No space left on device",
        ),
        (
            torch.OutOfMemoryError("CUDA out of memory.\nTried to allocate 2 GiB"),
            "CUDA out of memory. Tried to allocate 2 GiB",
        ),
    ],
)
def test_the_machine_failing_exits_1_in_one_line(
    error: Exception, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(_args: object) -> None:
        raise error

    monkeypatch.setattr(cli, "_generate", failing)
    result = run_cli("generate", "model", "--prompt", "def")
    assert result.returncode == 1
    assert result.stderr == f"fastllm: error: {message}\n"
