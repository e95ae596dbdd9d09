#!/usr/bin/env bash
# A first run of `fastllm train` on the H200: prepare a dataset from the machine's Python
# standard library, then train the llama3-1b geometry for a few steps (bf16, fp32 masters).
#   device run: bash bench/gpu_smoke.sh   (carry: dist)
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
for wheel in dist/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site; done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
STDLIB=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
python3 -m fastllm.cli tokenizer train input.path="$STDLIB" "input.extensions=[.py]" output=/tmp/tok vocab_size=8192 max_documents=800
python3 -m fastllm.cli prepare input.path="$STDLIB" "input.extensions=[.py]" tokenizer.path=/tmp/tok output.path=/tmp/data
python3 -m fastllm.cli train -c examples/llama3-1b.yaml "data.path=[/tmp/data]" run.experiment_dir=/tmp/exp \
  training.train_iters=16 batch.batch_size=4 batch.micro_batch_size=4 batch.sequence_length=4096 \
  training.logs.interval=4 training.export.interval=null optimizer.learning_rate.warmup_iterations=4 \
  2>&1 | tee "$OUT/train.log"
cp /tmp/exp/metrics.jsonl "$OUT/metrics.jsonl"
