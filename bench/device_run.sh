#!/usr/bin/env bash
# One call on the H200 machine: install the carried wheels (dist/, from `make wheel`), then run
# the GPU tests, the kernel benchmark and the prepare benchmark; results and logs go to $OUT.
#   device run: bash bench/device_run.sh   (carry: dist)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
for wheel in dist/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site; done  # abi3/pure wheels
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import fastllm, fastllm._native, fastllm_kernels, msgspec; print('fastllm', fastllm.__version__)" || exit 1
python3 bench/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
if [ -f bench/prepare_bench.py ]; then
  python3 bench/prepare_bench.py --cores 1 2 4 8 16 --out "$OUT/prepare_h200.json" 2>&1 | tail -20 | tee "$OUT/prepare.log"
fi
