"""One version string: the workspace Cargo.toml's. maturin writes it into the fastllm wheel's
metadata (pyproject.toml declares the version dynamic), the Rust extension compiles it in, and
the kernels package and fastllm's requirement on it repeat it, checked here."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import fastllm
from fastllm import _native
from tests.conftest import ROOT


def workspace_version() -> str:
    return tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]


def test_every_version_string_is_the_workspace_version() -> None:
    version = workspace_version()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dynamic"] == ["version"] and "version" not in project
    kernels = tomllib.loads((ROOT / "kernels" / "pyproject.toml").read_text())["project"]
    assert kernels["version"] == version
    pins = [r for r in project["dependencies"] if r.startswith("fastllm-kernels")]
    assert pins == [f"fastllm-kernels=={version}"]
    assert _native.version() == version
    assert fastllm.__version__ == version


def test_version_without_installed_metadata_is_the_extension_version() -> None:
    probe = (
        "import importlib.metadata as metadata\n"
        "def missing(name):\n"
        "    raise metadata.PackageNotFoundError(name)\n"
        "metadata.version = missing\n"
        "import fastllm, fastllm._native\n"
        "print(fastllm.__version__, fastllm._native.version())\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    reported, native = result.stdout.split()
    assert reported == native == workspace_version()


def test_the_install_page_names_the_workspace_version() -> None:
    # docs/install.md shows the wheels' file names and what `fastllm --version` prints.
    page = (ROOT / "docs" / "install.md").read_text()
    named = re.findall(r"(?:fastllm(?:_kernels)?[- ]|extension )(\d+\.\d+\.\d+)", page)
    assert len(named) >= 3, "the install page no longer names the wheels and the version line"
    assert set(named) == {workspace_version()}, named
