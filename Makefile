# Quick start: `make demo` (set up + main job) and `make test` (set up + all tests).
# Set-up is idempotent: stamps under .venv record what is done. Caches live outside the clone
# (~/.cache), so a fresh clone on the same machine reuses downloads and compiled crates.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CACHE := $(HOME)/.cache/fastllm
export CARGO_TARGET_DIR ?= $(CACHE)/cargo-target
export PIP_CACHE_DIR ?= $(HOME)/.cache/pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PATH := $(abspath $(BIN)):$(HOME)/.cargo/bin:$(PATH)
export VIRTUAL_ENV := $(abspath $(VENV))

RUST_SOURCES := Cargo.toml $(wildcard Cargo.lock) $(shell find rust -name '*.rs' -o -name Cargo.toml)
# PyPI's large wheels (torch's CUDA libraries, ~400 MB each) are sometimes cut off mid-download:
# pip resumes them, and the whole install is tried three times before set-up fails.
PIP_NETWORK := --retries 10 --timeout 60
WHEEL_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))

.PHONY: setup demo test fuzz lint format wheel reference docs clean

setup: $(VENV)/.fastllm $(VENV)/.plugin

# Third-party packages: torch (a CUDA build from PyPI; it runs on the CPU too), triton, …
$(VENV)/.requirements: requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP_NETWORK) --upgrade pip
	for attempt in 1 2 3; do \
	  $(BIN)/python -m pip install -q $(PIP_NETWORK) --resume-retries 30 -r requirements.txt && break; \
	  test $$attempt -lt 3 && echo "pip install failed (attempt $$attempt of 3), trying again" >&2 || exit 1; \
	done
	touch $@

# fastllm (Rust extension built in release mode, Python sources live) and fastllm-kernels.
$(VENV)/.fastllm: $(VENV)/.requirements pyproject.toml kernels/pyproject.toml $(RUST_SOURCES)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e ./kernels
	$(BIN)/maturin develop --release --quiet 2>&1 | sed "/^Requirement already satisfied/d"
	touch $@

# The example plugin (examples/plugin), installed as a user installs theirs: the tests train with it.
PLUGIN_SOURCES := $(shell find examples/plugin -name '*.py' -not -path '*/build/*') examples/plugin/pyproject.toml
$(VENV)/.plugin: $(VENV)/.fastllm $(PLUGIN_SOURCES)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation ./examples/plugin
	touch $@

demo: setup
	$(BIN)/python -m fastllm.demo

test: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	cargo test --workspace --quiet
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q --durations=15

# The property tests (tests/fuzz) with 20 times the examples `make test` draws: minutes, not seconds.
fuzz: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests/fuzz --hypothesis-profile=fuzz --hypothesis-show-statistics

format: setup
	cargo fmt --all
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The generated pages of docs/reference (config keys, compatibility table, command line); tests
# fail when a committed one is stale.
reference: setup
	$(BIN)/python -m fastllm.config.reference docs/reference
	$(BIN)/python -m fastllm.cli_reference docs/reference

# The documentation site, into site/; strict: a broken link or a docstring warning fails it.
docs: setup
	$(BIN)/mkdocs build --strict

# Wheels for an install without Rust (docs/install.md), built afresh into dist/: fastllm (abi3,
# CPython >= 3.11; manylinux_2_34, glibc >= 2.34, which maturin's audit of the extension's symbols
# checks) and fastllm-kernels; then msgspec for the GPU machine's Python 3.12 (bench/device_run.sh).
# tests/test_install.py runs the two build lines below and installs what they build.
wheel: setup
	rm -rf dist
	$(BIN)/maturin build --release --compatibility manylinux_2_34 --quiet --out dist
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist ./kernels
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(WHEEL_PLATFORMS) -d dist msgspec
	ls -1 dist

clean:
	rm -rf $(VENV) dist site
