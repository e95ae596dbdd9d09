from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


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
