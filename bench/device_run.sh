#!/usr/bin/env bash
# The H200 measurements, one device call per part (each under the 10-minute limit). Carry
# `dist` (from `make wheel`); pass the commit the wheels were built from, since the device copy
# has no .git. Results and logs go to $OUT.
#   device run (nvidia-h200):    bash bench/device_run.sh HASH kernels   (GPU tests, kernels, prepare scaling)
#   device run (nvidia-h200):    bash bench/device_run.sh HASH train-1b  (train_bench 1b, profile 1b)
#   device run (nvidia-h200):    bash bench/device_run.sh HASH train-3b
#   device run (nvidia-h200-x2): bash bench/device_run.sh HASH zero-8b   (NCCL test, llama-8b ZeRO-2 and 3)
#   device run (nvidia-h200-x2): bash bench/device_run.sh HASH scale-x2  (rehearsal of the 8-GPU run)
#   device run (nvidia-h200-x8): bash bench/device_run.sh HASH scale-x8
set -uo pipefail
COMMIT=$1 PART=$2
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
for wheel in dist/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site; done  # abi3/pure wheels
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import fastllm, fastllm._native, fastllm_kernels, msgspec; print('fastllm', fastllm.__version__)" || exit 1
case $PART in
  kernels)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/training/test_training_options.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
    python3 bench/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
    # Against the Python pipelines on the standard library, then fastllm alone on it 32 times
    # over (about 340 MB), long enough for 16 cores to show their scaling.
    timeout 200 python3 bench/prepare_bench.py --cores 1 2 4 8 16 \
      --out "$OUT/prepare_h200.json" 2>&1 | tail -12 | tee "$OUT/prepare.log"
    timeout 120 python3 bench/prepare_bench.py --cores 1 2 4 8 16 --copies 32 --baselines-up-to 0 \
      --out "$OUT/prepare_h200_scaling.json" 2>&1 | tail -12 | tee -a "$OUT/prepare.log" ;;
  train-1b | train-3b)
    model=${PART#train-}
    python3 bench/train_bench.py --models "$model" --systems fastllm fastllm-compile hf \
      --timeout 200 --commit "$COMMIT" --out "$OUT/train_$model" 2>&1 | tail -30
    if [ "$model" = 1b ]; then
      timeout 90 python3 bench/profile_step.py --model 1b --commit "$COMMIT" --out "$OUT/profile_1b" 2>&1 | tail -40
    fi ;;
  zero-8b)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/training/test_data_parallel_gpu.py 2>&1 | tail -5 | tee "$OUT/gpu_dp_tests.log"
    for stage in 2 3; do
      python3 bench/scale_bench.py --config examples/llama3-8b.yaml --gpus 2 --zero-stage "$stage" \
        --micro-batch 1 --per-gpu-batch 2 --steps 6 --kill-at-end --timeout 200 \
        --commit "$COMMIT" --out "$OUT/zero${stage}_8b" 2>&1 | tail -8
    done ;;
  scale-x2)
    python3 bench/scale_bench.py --gpus 1 2 --per-gpu-batch 16 --steps 5 --kill-at-end --timeout 270 \
      --commit "$COMMIT" --out "$OUT/scale_x2" 2>&1 | tail -12 ;;
  scale-x8)
    python3 bench/scale_bench.py --gpus 1 2 8 --steps 5 --kill-at-end --timeout 190 \
      --commit "$COMMIT" --out "$OUT/scale_x8" 2>&1 | tail -12 ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
