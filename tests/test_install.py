"""Install without a Rust toolchain: build the wheels with `make wheel`'s own build lines (into a
temporary directory, so what is tested is never a stale dist/), install them into a fresh virtual
environment with examples/launch/install_wheels.sh (the Dockerfile's install step) with no
`cargo` or `rustc` on PATH, then run that environment's own `fastllm` script: `--version`,
`tokenizer train`, `prepare` and a few steps of `train` on examples/tiny.yaml.

Installing torch afresh would take minutes, so the fresh environment sees the third-party
packages of the environment running the tests, as a base image's preinstalled torch would be
seen: a `.pth` line names a directory of links to that environment's site-packages, leaving out
fastllm's own distributions and every `.pth` file (the editable install of the source tree).
pip runs without an index: it resolves every declared dependency against those packages or
fails; it downloads nothing."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.training.conftest import STDLIB, train_arguments

INSTALL_SCRIPT = ROOT / "examples" / "launch" / "install_wheels.sh"


def wheel_build_commands(out: Path) -> list[list[str]]:
    """The build lines of the Makefile's `wheel` recipe (`maturin build`, `pip wheel`), writing
    into `out` instead of dist/ and run with this environment's programs."""
    recipe = re.search(r"^wheel:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None, "the Makefile has no wheel recipe"
    lines = [line.strip() for line in recipe.group(1).splitlines()]
    builds = [line for line in lines if "/maturin build " in line or " pip wheel " in line]
    assert len(builds) == 2, builds
    bin_dir = str(Path(sys.executable).parent)
    commands = []
    for line in builds:
        words = shlex.split(line.replace("$(BIN)", bin_dir))
        words[words.index("--out" if "--out" in words else "-w") + 1] = str(out)
        commands.append(words)
    return commands


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    env = dict(os.environ)
    # The Makefile's compiled-crate cache: warm after `make setup` (maturin develop --release).
    env.setdefault("CARGO_TARGET_DIR", str(Path.home() / ".cache" / "fastllm" / "cargo-target"))
    env["PATH"] = os.pathsep.join([str(Path.home() / ".cargo" / "bin"), env.get("PATH", "")])
    for command in wheel_build_commands(out):
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"{shlex.join(command)}\n{result.stdout}{result.stderr}"
    return out


@pytest.fixture(scope="module")
def venv(wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh environment with the wheels installed, and the environment variables to run it:
    no cargo or rustc on PATH, no PYTHONPATH, no pip index."""
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    third_party = root / "third_party"
    third_party.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name
        if not (name.startswith(("fastllm", "__editable__")) or name.endswith(".pth")):
            (third_party / name).symlink_to(entry)
    site = subprocess.run(
        [
            venv / "bin" / "python",
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "third_party.pth").write_text(f"{third_party}\n")

    path = [str(venv / "bin")] + [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not any(shutil.which(tool, path=d) for tool in ("cargo", "rustc", "fastllm"))
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "CARGO", "RUSTUP"))}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET"):
        env.pop(name, None)
    env |= {
        "PATH": os.pathsep.join(path),
        "PIP_NO_INDEX": "1",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    assert shutil.which("cargo", path=env["PATH"]) is None
    assert shutil.which("rustc", path=env["PATH"]) is None
    result = subprocess.run(
        ["sh", INSTALL_SCRIPT, wheels], env=env, cwd=root, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return venv, env


def run(venv: tuple[Path, dict[str, str]], *arguments: str) -> subprocess.CompletedProcess[str]:
    """`fastllm ARGUMENTS` with the fresh environment's own script, from the repository root."""
    directory, env = venv
    fastllm = directory / "bin" / "fastllm"
    assert shutil.which("fastllm", path=env["PATH"]) == str(fastllm)
    return subprocess.run([fastllm, *arguments], env=env, cwd=ROOT, capture_output=True, text=True)


def test_wheels_are_abi3_manylinux_and_carry_the_workspace_version(wheels: Path) -> None:
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    assert sorted(p.name for p in wheels.iterdir()) == [
        f"fastllm-{version}-cp311-abi3-manylinux_2_34_x86_64.whl",
        f"fastllm_kernels-{version}-py3-none-any.whl",
    ]


def test_installed_fastllm_is_the_wheels_not_the_source_tree(venv) -> None:
    directory, env = venv
    probe = (
        "import fastllm, fastllm._native, fastllm_kernels\n"
        "for module in (fastllm, fastllm._native, fastllm_kernels): print(module.__file__)\n"
    )
    result = subprocess.run(
        [directory / "bin" / "python", "-c", probe], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    files = [Path(line) for line in result.stdout.split()]
    assert len(files) == 3
    assert all(file.is_relative_to(directory) for file in files), files


def test_version_of_the_installed_command(venv) -> None:
    from fastllm import __version__

    result = run(venv, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fastllm {__version__} (native extension {__version__})"


def test_installed_command_prepares_and_trains_the_tiny_example(venv, tmp_path: Path) -> None:
    sources = f"[{STDLIB / 'json'}]"
    result = run(
        venv, "tokenizer", "train", f"input.path={sources}", "input.extensions=[.py]",
        f"output={tmp_path / 'tokenizer'}", "vocab_size=512",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    result = run(
        venv, "prepare", f"input.path={sources}", "input.extensions=[.py]",
        f"tokenizer.path={tmp_path / 'tokenizer'}", f"output.path={tmp_path / 'dataset'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "dataset" / "metadata.json").is_file()
    experiment = tmp_path / "experiment"
    arguments = train_arguments(tmp_path / "dataset", experiment, "training.train_iters=3")
    result = run(venv, *arguments)
    assert result.returncode == 0, result.stderr
    assert "step 3/3 |" in result.stderr, result.stderr
    assert (experiment / "checkpoint" / "3" / "manifest.json").is_file()
