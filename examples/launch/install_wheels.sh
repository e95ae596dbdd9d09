#!/bin/sh
# Installs fastllm from the two wheels `make wheel` writes (in WHEELS, default dist) into the
# environment of the `python` on PATH, then runs `fastllm --version`. pip resolves the wheels'
# dependencies (torch, triton, transformers, ...) and keeps those already installed; no Rust
# toolchain is needed. examples/launch/Dockerfile and tests/test_install.py run this script.
set -eu
WHEELS=${1:-dist}
python -m pip install --no-cache-dir "$WHEELS"/fastllm-[0-9]*.whl "$WHEELS"/fastllm_kernels-[0-9]*.whl
fastllm --version
