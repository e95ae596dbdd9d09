#!/usr/bin/env bash
# The H200 measurements. One device call runs one or more parts (keep a call under the
# 10-minute limit). Carry `dist` (from `make wheel`); pass the commit the wheels were built
# from, since the device copy has no .git. Everything lands in one archive, $OUT/results.tgz
# (the device returns at most 8 files), with each part's console output in $OUT/PART.log.
#   nvidia-h200-x2: bash bench/device_run.sh HASH tests zero-8b prepare
#   nvidia-h200-x2: bash bench/device_run.sh HASH train-1b scale-x2
#   nvidia-h200:    bash bench/device_run.sh HASH train-3b
#   nvidia-h200-x8: bash bench/device_run.sh HASH scale-x8
#   nvidia-h200:    bash bench/device_run.sh HASH sft
#   nvidia-h200:    bash bench/device_run.sh HASH offload-8b   (issue 34; RUNS=8b-8192: sequence 8192)
#   nvidia-h200:    bash bench/device_run.sh HASH fp8   (issue 18: GPU tests, tiles, speed matrix)
#   nvidia-h200:    FP8_TILES= FP8_MODELS=3b FP8_RECIPES="none delayed" FP8_ROUNDS=3 \
#                   bash bench/device_run.sh HASH fp8-parity fp8   (issue 18: loss, repeated pairs)
#   nvidia-h200:    LONG_ONLY="1b:16384:hf 1b:16384:fastllm 1b:32768:hf 1b:32768:fastllm" \
#                   bash bench/device_run.sh HASH long   (issue 16: the same-call HF baselines)
#   nvidia-h200-x2: bash bench/device_run.sh HASH layouts-x2 bfdf-x2 sdp-x2 ep-x2   (issue 19)
#   nvidia-h200-x2: TESTS='nccl or expert' bash bench/device_run.sh HASH tests   (issue 19: NCCL layouts)
#   nvidia-h200-x4: bash bench/device_run.sh HASH layouts-x4   (issue 19)
#   nvidia-h200:    bash bench/device_run.sh HASH lora-7b lora-8b   (issue 34: LoRA on one GPU)
#   nvidia-h200:    bash bench/device_run.sh HASH energy-1b   (issue 36: logged energy against NVML)
#   nvidia-h200:    bash bench/device_run.sh HASH lmeval-1b   (issue 36; carry .whl: lm-eval's wheels)
#   nvidia-h200:    bash bench/device_run.sh HASH dpo-1b   (issue 35; carry .whl: TRL's wheels)
#   nvidia-h200:    bash bench/device_run.sh HASH distill-1b   (issue 35; a call of its own)
#   nvidia-h200:    bash bench/device_run.sh HASH qwen3 moonlight   (issue 38)
# A second setting of a train part in the same call (its results under train_MODEL_TAG):
#   ... && APPEND=1 SYSTEMS=fastllm SET=model.multi_stage.recompute=none TAG=store \
#          bash bench/device_run.sh HASH train-1b
# Another commit's wheels in the same call (a baseline): WHEELS=DIR (carried, default dist)
# and SITE=DIR (where they are unpacked, default /tmp/site), with its own HASH and TAG.
# Parts: tests (GPU tests; the data-parallel ones need 2 GPUs), mistral (Mistral-7B on one GPU), kernels (kernel timings),
# sustained (bf16 matmul TFLOP/s, clock and power over a minute of load),
# prepare (16-core scaling), train-1b | train-3b (train_bench + profile), zero-8b (llama-8b
# ZeRO-2 and 3 on 2 GPUs), profile-8b (one profiled llama-8b step on 2 GPUs), scale-x2 |
# scale-x8 (Mistral-7B scaling), long (llama-1b/3b at 16k-128k tokens per sequence against HF),
# sft (llama-1b fine-tuning on packed, masked conversations against HF + compile on the same
# batches; chat prepare against apply_chat_template in a pool), fp8 (FP8 GPU tests, tile sweep,
# bf16 and each recipe on llama-3b and llama-1b), fp8-parity (500 steps of each recipe against
# bf16), moe (MoE GPU tests, MOE_PROBE=1 bench/grouped_gemm_probe.py, then bench/moe_bench.py:
# dropless against looped, on nvidia-h200); layouts-x2, bfdf-x2, sdp-x2, ep-x2 (issue 19, on
# nvidia-h200-x2); layouts-x4 (issue 19, on nvidia-h200-x4); memory (issue 16: the 16k step's
# peak memory by origin, pinned copy bandwidth, attention backends, the 16k kernel profile);
# attention (cuDNN attention by memory layout and head grouping, issue 16); energy (the
# joules a step's matmuls and attention take at the power limit, issue 16); energy-1b (issue
# 36: a llama-1b run's logged energy against NVML read by the benchmark); lora-7b, lora-8b
# (issue 34: LoRA rank 16 against full fine-tuning and HF + PEFT + compile; llama-8b with LoRA);
# profile-lora (issue 34: lora-7b's fastllm step under torch.profiler);
# lmeval-1b (issue 36: lm-eval's hf backend against fastllm's model interface on llama-1b);
# dpo-1b (issue 35: DPO of llama-1b against TRL's DPOTrainer, reference in the step and
# precomputed); distill-1b (issue 35: llama-1b distilled from a llama-8b-geometry teacher);
# qwen3 (issue 38: Qwen3-1.7B against HF + compile, and without its QK-norm); moonlight
# (issue 38: Moonlight-16B cut to 8 blocks, MFU on active parameters and expert loads);
# masked-sdpa (issue 36: SDPA with a boolean mask at evaluation's shapes, by backend);
# branch-attention (issue 35: shared-prefix attention's varlen and dense forms).
set -uo pipefail
COMMIT=$1
shift
OUT=${OUT:-/tmp/out}
RES=/tmp/results
# A warm machine keeps the last call's files; APPEND=1 adds to this call's earlier results
# (a second invocation in the same command, with other settings).
[ -n "${APPEND:-}" ] || rm -rf "$RES"
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" "$RES" "$SITE"
for wheel in "${WHEELS:-dist}"/*.whl; do python3 -m zipfile -e "$wheel" "$SITE"; done  # abi3/pure wheels
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$RES/gpu.txt"
python3 -c "import fastllm, fastllm._native, fastllm_kernels, msgspec; print('fastllm', fastllm.__version__)" || exit 1

pack() { tar -czf "$OUT/results.tgz.part" -C "$RES" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }

run_part() {
  case $1 in
    tests)
      # TESTS: a pytest -k expression, to run only some of them; TEST_PATHS: the folders (both
      # take more than 290 s); TESTS_S: their time limit.
      timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TEST_PATHS:-tests/kernels tests/training} \
        ${TESTS:+-k "$TESTS"} >"$RES/gpu_tests${TAG:+_$TAG}.log" 2>&1
      grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$RES/gpu_tests${TAG:+_$TAG}.log" | tail -40 ;;
    sustained)
      # The bf16 matmul ceiling at the boost clock and once the power limit is reached.
      timeout 100 python3 bench/sustained_matmul.py --seconds 60 --commit "$COMMIT" \
        --out "$RES/sustained_matmul.json" ;;
    kernels)
      timeout 150 python3 bench/kernel_bench.py --out "$RES/kernels.json" ;;
    prepare)
      lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\))"; grep -H . /sys/devices/system/cpu/cpu{0,1,16}/topology/thread_siblings_list
      # Against the Python pipelines on the standard library, then fastllm alone on it 32 times
      # over (about 340 MB), long enough for 16 cores to show their scaling.
      timeout 120 python3 bench/prepare_bench.py --cores 1 2 4 8 16 --repeats 2 \
        --out "$RES/prepare_h200.json" 2>&1 | tail -12
      timeout 90 python3 bench/prepare_bench.py --cores 1 2 4 8 16 --copies 32 --baselines-up-to 0 \
        --out "$RES/prepare_h200_scaling.json" 2>&1 | tail -12 ;;
    train-1b | train-3b)
      local model=${1#train-}
      # SET: more overrides for the fastllm runs (the results then go to train_MODEL_TAG);
      # STEPS: timed steps (train_bench's default otherwise); SEQ and MICRO_BATCH: another
      # geometry than the model's 4096 x its micro-batch (for the profile too).
      python3 bench/train_bench.py --models "$model" --systems ${SYSTEMS:-fastllm fastllm-compile hf} \
        ${SET:+--set $SET} ${STEPS:+--steps $STEPS} ${SEQ:+--seq $SEQ} \
        ${MICRO_BATCH:+--micro-batch $MICRO_BATCH} --timeout 170 --commit "$COMMIT" \
        --out "$RES/train_$model${TAG:+_$TAG}" 2>&1 | tail -30
      [ "${PROFILE:-1}" = 0 ] || timeout 90 python3 bench/profile_step.py --model "$model" \
        ${SET:+--set $SET} ${SEQ:+--seq $SEQ} ${MICRO_BATCH:+--micro-batch $MICRO_BATCH} \
        --commit "$COMMIT" --out "$RES/profile_$model${TAG:+_$TAG}" 2>&1 | tail -45 ;;
    qwen3)
      # Issue 38: Qwen3-1.7B against HF + torch.compile (target 1.2x), and its QK-norm's cost
      # against the same geometry without it (target at most 2%); 4 runs of ~2 min.
      python3 bench/train_bench.py --models qwen3-1.7b qwen3-1.7b-no-qk-norm \
        --systems ${SYSTEMS:-fastllm hf} ${STEPS:+--steps $STEPS} --timeout 170 \
        --commit "$COMMIT" --out "$RES/train_qwen3${TAG:+_$TAG}" 2>&1 | tail -16 ;;
    moonlight)
      # Issue 38: Moonlight-16B's geometry cut to 8 blocks (MLA, sigmoid routing balanced by
      # its correction bias, no auxiliary loss): MFU on active parameters (target 40%) and
      # each step's most loaded expert against the mean (expert_loads in its run's JSON).
      # ACCUMULATE micro-batches of 4096 a step (default 8): at 1, 6a3efc8 measured 25.7%
      # in steps of 112 ms, a third of which the Adam update of 4.7B parameters would take
      # by estimate (16 bytes of state a parameter read and written at 4.2 TB/s: ~36 ms).
      # MICRO_BATCH: sequences of 4096 a micro-batch (default the config's, 1); SET: more
      # overrides (model.base_model.transformer.num_layers=6 fits an 80 GB GPU at ACCUMULATE=8).
      # On an H100 at 6 blocks, MICRO_BATCH=2 ACCUMULATE=4 gave 41.0% MFU against 34.0% at 1 x 8
      # (7272fbd): each micro-batch adds the experts' weight gradients into fp32.
      python3 bench/train_bench.py --models moonlight-8l --systems ${SYSTEMS:-fastllm} \
        --steps "${STEPS:-20}" --accumulate "${ACCUMULATE:-8}" --timeout 300 \
        ${MICRO_BATCH:+--micro-batch $MICRO_BATCH} ${SET:+--set $SET} \
        --commit "$COMMIT" --out "$RES/train_moonlight${TAG:+_$TAG}" 2>&1 | tail -10 ;;
    energy)
      # What one step's matmuls and attention alone take in joules at the power limit
      # (bench/energy_floor.py; SEQ, default 16384; STEP_J: a measured step's joules).
      timeout 120 python3 bench/energy_floor.py --seq "${SEQ:-16384}" ${STEP_J:+--step-joules $STEP_J} \
        --commit "$COMMIT" --out "$RES/energy_floor${TAG:+_$TAG}" 2>&1 | tail -8 ;;
    energy-1b)
      # Issue 36: a llama-1b run's logged energy (joules per step, tokens per kWh, total kWh)
      # against the benchmark's own NVML reading of the same steps (bench/energy_check.py;
      # 4 logged windows of 5 steps of 8 x 4096; target: within 2%).
      timeout 240 python3 bench/energy_check.py --commit "$COMMIT" \
        --out "$RES/energy_check${TAG:+_$TAG}" 2>&1 | tail -10 ;;
    attention)
      # cuDNN attention at llama-1b's shape in each layout and head grouping the model could
      # give it, under sustained load (bench/attention_probe.py; SEQ, default 16384).
      timeout 120 python3 bench/attention_probe.py --seq "${SEQ:-16384}" --commit "$COMMIT" \
        --out "$RES/attention_probe${TAG:+_$TAG}" 2>&1 | tail -14 ;;
    zero-8b)
      for stage in ${STAGES:-2 3}; do
        python3 bench/scale_bench.py --config examples/llama3-8b.yaml --gpus 2 --zero-stage "$stage" \
          --micro-batch "${MICRO_BATCH:-2}" --per-gpu-batch 2 --steps 6 --kill-at-end --timeout 150 \
          ${SET:+--set $SET} \
          --commit "$COMMIT" --out "$RES/zero${stage}_8b${TAG:+_$TAG}" 2>&1 | tail -8
      done ;;
    profile-8b)
      # One step of llama-8b on 2 GPUs under torch.profiler (training.profile): per-rank tables.
      python3 bench/scale_bench.py --config examples/llama3-8b.yaml --gpus 2 \
        --zero-stage "${ZERO:-3}" --micro-batch 2 --per-gpu-batch 2 --steps 5 --kill-at-end \
        --timeout 150 --keep-experiments --work /tmp/profile8b --set training.profile.step=4 \
        --commit "$COMMIT" --out "$RES/profile_8b" 2>&1 | tail -8
      cp /tmp/profile8b/exp_gpus_2/profile/rank_*.txt "$RES/profile_8b/" ;;
    mistral)
      # Issue 31: the seed's Mistral-7B geometry trained through `fastllm train -c
      # examples/mistral-7b.yaml` on one GPU (ZeRO-1, 8 sequences of 4096 accumulated a step);
      # SET: more overrides (FP8: model.distributed.fp8_linear=tensorwise ...).
      python3 bench/scale_bench.py --gpus 1 --per-gpu-batch 8 --steps 5 --zero-stage 1 \
        --kill-at-end --timeout 200 ${SET:+--set $SET} --commit "$COMMIT" \
        --out "$RES/mistral${TAG:+_$TAG}" 2>&1 | tail -6 ;;
    lora-7b | lora-8b)
      # Issue 34: train_bench's fastllm-lora (rank 16 on every attention and MLP projection,
      # the rest frozen) at sequence 4096, micro-batch MICRO_BATCH (default 1, the same for
      # every system), on the Mistral-7B geometry against fastllm's full fine-tuning and HF +
      # PEFT + torch.compile (lora-7b), and on llama-8b's (128k vocabulary) alone (lora-8b);
      # checkpoints are never written. SYSTEMS: others; SET: more fastllm overrides.
      local model=mistral systems="fastllm-lora hf-peft fastllm"
      [ "$1" = lora-8b ] && model=8b systems=fastllm-lora
      python3 bench/train_bench.py --models "$model" --systems ${SYSTEMS:-$systems} --seq 4096 \
        --warmup 2 --steps "${STEPS:-6}" ${MICRO_BATCH:+--micro-batch $MICRO_BATCH} \
        ${SET:+--set $SET} --timeout 200 --commit "$COMMIT" \
        --out "$RES/lora_${1#lora-}${TAG:+_$TAG}" 2>&1 | tail -16 ;;
    profile-lora)
      # Issue 34: train_bench's fastllm-lora step on the Mistral-7B geometry at 4096 under
      # torch.profiler: its kernels by group, the matmuls by shape, and where the GPU idles.
      timeout 240 python3 bench/profile_step.py --model mistral --lora --timeline --ops 24 \
        ${MICRO_BATCH:+--micro-batch $MICRO_BATCH} ${SET:+--set $SET} --commit "$COMMIT" \
        --out "$RES/profile_lora_7b${TAG:+_$TAG}" 2>&1 | tail -60 ;;
    oom-8b)
      # Issue 34: llama3-8b's example on one GPU does not fit (16 bytes a parameter and the
      # activations): the one line `fastllm train` ends with, and its exit code.
      python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench')
from bench_common import write_random_dataset
write_random_dataset(Path('/tmp/oom8b/data'), vocab_size=128256, tokens=200_000, document_length=None, seed=1)"
      python3 -m fastllm.cli train -c examples/llama3-8b.yaml "data.path=[/tmp/oom8b/data]" \
        run.experiment_dir=/tmp/oom8b/run training.train_iters=2 batch.batch_size=2 \
        training.checkpoint.at_end=false training.export.interval=null \
        >"$RES/oom_8b.out" 2>"$RES/oom_8b.err"
      echo "exit code $?" | tee -a "$RES/oom_8b.err"; tail -c 2000 "$RES/oom_8b.err" ;;
    offload-8b)
      # Issue 34: full training with the optimizer state in host memory
      # (model.multi_stage.offload_optimizer) on one GPU, 64 sequences of 4096 a step in
      # micro-batches of MICRO_BATCH (default 2), checkpoints off, STEPS steps (default 3).
      # RUNS (default "8b 3b-offload 3b"): 8b, llama3-8b's example, which the GPU alone does not
      # hold (oom-8b); 3b-offload and 3b, llama-3b's geometry (train_bench's) with and without
      # the offload on the same batches, where the GPU alone fits: what the offload costs;
      # 8b-8192, the example's own sequence of 8192 (micro-batch 1, 8 sequences a step, 2 steps).
      # Each: its start-up line (buffers by kind, the state in host memory), then tokens/s over
      # the steps after the first and peak memory (metrics in offload_RUN.metrics.jsonl).
      python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench')
from bench_common import write_random_dataset
write_random_dataset(Path('/tmp/offload8b/data'), vocab_size=128256, tokens=4_000_000, document_length=None, seed=1)"
      local t=model.base_model.transformer
      local llama3b=("$t.num_layers=28" "$t.hidden_size=3072" "$t.num_attention_heads=24"
        "$t.head_groups=8" "$t.kv_channels=128" "$t.ffn_hidden_size=8192")
      for run in ${RUNS:-8b 3b-offload 3b}; do
        local config=examples/llama3-8b.yaml limit=280
        local shape=(batch.batch_size=64 batch.sequence_length=4096
          "batch.micro_batch_size=${MICRO_BATCH:-2}" "training.train_iters=${STEPS:-3}")
        local extra=(model.multi_stage.offload_optimizer=true)
        case $run in
          8b-8192)
            shape=(batch.batch_size=8 batch.sequence_length=8192 batch.micro_batch_size=1
              training.train_iters=2)
            limit=200 ;;
          3b-offload) config=examples/llama3-1b.yaml; extra+=("${llama3b[@]}"); limit=130 ;;
          3b) config=examples/llama3-1b.yaml; extra=("${llama3b[@]}"); limit=130 ;;
        esac
        timeout "$limit" python3 -m fastllm.cli train -c "$config" "data.path=[/tmp/offload8b/data]" \
          "run.experiment_dir=/tmp/offload8b/$run" "${shape[@]}" "${extra[@]}" \
          training.logs.interval=1 training.checkpoint.at_end=false training.export.interval=null \
          >"$RES/offload_$run.out" 2>"$RES/offload_$run.err"
        echo "$run: exit code $?"; grep -E "parameters" "$RES/offload_$run.out"; tail -c 600 "$RES/offload_$run.err" | grep -E "error"
        cp "/tmp/offload8b/$run/metrics.jsonl" "$RES/offload_$run.metrics.jsonl" 2>/dev/null
        python3 - "$RES/offload_$run.metrics.jsonl" <<'EOF_SUMMARY' | tee -a "$RES/offload_8b.txt"
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
steps = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
steps = [r for r in steps if "tokens_per_s" in r]
later = [r for r in steps if r["step"] > 1] or steps
if later:
    rate = sum(r["tokens_per_s"] for r in later) / len(later)
    print(f"{path.name}: {rate:,.0f} tok/s (steps {[r['step'] for r in later]}), "
          f"peak {max(r['memory_gib'] for r in steps):.1f} GiB allocated, "
          f"{max(r['memory_reserved_gib'] for r in steps):.1f} reserved")
else:
    print(f"{path.name}: no step logged")
EOF_SUMMARY
        rm -rf "/tmp/offload8b/$run"
      done ;;
    freeze-1b)
      # Issue 34: llama-1b trained whole, then with the embedding, the head and blocks 0-7 of 16
      # frozen (model.freeze), on the same random tokens: the start-up line's buffers by kind,
      # tokens/s and peak memory of each (steps 5-12 of 12, logged every 4).
      python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench')
from bench_common import write_random_dataset
write_random_dataset(Path('/tmp/freeze1b/data'), vocab_size=128256, tokens=8_000_000, document_length=None, seed=1)"
      for run in whole frozen; do
        extra=()
        [ "$run" = frozen ] && extra=(model.freeze.embeddings=true model.freeze.head=true "model.freeze.blocks=[0,8]")
        python3 -m fastllm.cli train -c examples/llama3-1b.yaml "data.path=[/tmp/freeze1b/data]" \
          run.experiment_dir=/tmp/freeze1b/$run training.train_iters=12 batch.batch_size=8 \
          batch.micro_batch_size=2 batch.sequence_length=4096 training.logs.interval=4 \
          training.checkpoint.at_end=false training.export.interval=null "${extra[@]}" \
          >"$RES/freeze_1b_$run.out" 2>"$RES/freeze_1b_$run.err"
        echo "$run: exit code $?"; grep -E "parameters|step 12/" "$RES/freeze_1b_$run.out"
        cp /tmp/freeze1b/$run/metrics.jsonl "$RES/freeze_1b_$run.metrics.jsonl"
      done ;;
    scale-x2)
      # ZERO: the ZeRO stage (scale_bench's default 2 otherwise).
      python3 bench/scale_bench.py --gpus 1 2 --per-gpu-batch 8 --steps 5 --kill-at-end --timeout 150 \
        ${ZERO:+--zero-stage $ZERO} --commit "$COMMIT" --out "$RES/scale_x2${TAG:+_$TAG}" 2>&1 |
        tail -12 ;;
    scale-x8)
      # ZeRO-1 by default: it reduces once per step, where ZeRO-2 reduce-scatters every
      # micro-batch (on 2 GPUs: 98.8% scaling against 91.8%, h200-94993d3).
      python3 bench/scale_bench.py --gpus 1 2 8 --steps 5 --kill-at-end --timeout 190 \
        --zero-stage "${ZERO:-1}" --commit "$COMMIT" --out "$RES/scale_x8" 2>&1 | tail -12 ;;
    layouts-x2)
      # Issue 19 on nvidia-h200-x2: llama-8b, the same global batch (PER_GPU sequences per GPU
      # of 1 × 4096, default 4) as ZeRO-3 alone, with tp2 + sequence parallelism and pp2
      # breadth-first (all of a rank's micro-batches in one group).
      local per_gpu=${PER_GPU:-4}
      for layout in "zero3:model.multi_stage.zero_stage=3" \
        "tp2:model.distributed.tensor_parallel=2 model.distributed.sequence_tensor_parallel=true" \
        "pp2:model.distributed.pipeline_parallel=2 model.multi_stage.zero_stage=3 model.multi_stage.layers_per_stage=4 schedule.breadth_first_micro_batches=$((2 * per_gpu))"; do
        python3 bench/scale_bench.py --config examples/llama3-8b.yaml --gpus 2 --micro-batch 1 \
          --per-gpu-batch "$per_gpu" --steps 6 --kill-at-end --timeout 170 --set ${layout#*:} \
          --commit "$COMMIT" --out "$RES/layout_8b_${layout%%:*}" 2>&1 | tail -6
      done ;;
    bfdf-x2)
      # Breadth-first against depth-first micro-batches with ZeRO-3 over 2 data ranks, llama-8b,
      # at 1, 2 and 4 sequences per GPU (compare with `fastllm schedule` on the same settings).
      for per_gpu in 1 2 4; do
        for order in breadth depth; do
          python3 bench/scale_bench.py --config examples/llama3-8b.yaml --gpus 2 --micro-batch 1 \
            --per-gpu-batch "$per_gpu" --steps 6 --kill-at-end --timeout 170 --zero-stage 3 \
            --set "schedule.${order}_first_micro_batches=$per_gpu" \
            --commit "$COMMIT" --out "$RES/bfdf_8b_${order}_$per_gpu" 2>&1 | tail -4
        done
      done ;;
    sdp-x2)
      # llama-1b with sequence-data parallelism 2 at 128k and 256k tokens (one sequence shared
      # by the 2 GPUs), in contiguous and head-tail chunks (which is faster decides
      # model.distributed.sequence_data_chunking's default); the one-GPU 128k figure is part
      # long's. SDP_SEQS / SDP_CHUNKINGS pick a subset (all four runs may pass 10 minutes:
      # then split them over two calls, e.g. SDP_SEQS=262144).
      for seq in ${SDP_SEQS:-131072 262144}; do
        for chunking in ${SDP_CHUNKINGS:-contiguous head_tail}; do
          python3 bench/scale_bench.py --config examples/llama3-1b.yaml --gpus 2 --micro-batch 1 \
            --per-gpu-batch 1 --seq "$seq" --steps 5 --skip 1 --kill-at-end --timeout 200 \
            --set model.distributed.sequence_data_parallel=2 \
            "model.distributed.sequence_data_chunking=$chunking" \
            --commit "$COMMIT" --out "$RES/sdp2_1b_${seq}_$chunking" 2>&1 | tail -4
        done
      done ;;
    layouts-x4)
      # Issue 19 on nvidia-h200-x4: llama-8b tp2 x pp2 and tp2 x dp2 (ZeRO-1) at one global
      # batch (PER_GPU sequences of 1 x 4096 per GPU, default 4), then a 13B-class geometry
      # (Llama-2-13B's: hidden 5120, 40 layers, ffn 13824) breadth-first on pp4 (one data rank,
      # so ZeRO shards nothing there) and on pp2 x dp2 with ZeRO-3.
      local per_gpu=${PER_GPU:-4}
      for layout in "tp2pp2:model.distributed.tensor_parallel=2 model.distributed.sequence_tensor_parallel=true model.distributed.pipeline_parallel=2 model.multi_stage.layers_per_stage=4 schedule.breadth_first_micro_batches=$((2 * per_gpu))" \
        "tp2dp2:model.distributed.tensor_parallel=2 model.distributed.sequence_tensor_parallel=true"; do
        python3 bench/scale_bench.py --config examples/llama3-8b.yaml --gpus 4 --micro-batch 1 \
          --per-gpu-batch "$per_gpu" --steps 6 --kill-at-end --timeout 170 --zero-stage 1 \
          --set ${layout#*:} --commit "$COMMIT" --out "$RES/layout4_8b_${layout%%:*}" 2>&1 | tail -6
      done
      local t=model.base_model.transformer
      for layout in "pp4:4:1:$((4 * per_gpu))" "pp2dp2:2:3:$((2 * per_gpu))"; do
        IFS=: read -r name pipeline zero breadth <<<"$layout"
        python3 bench/scale_bench.py --config examples/llama3-8b.yaml --gpus 4 --micro-batch 1 \
          --per-gpu-batch "$per_gpu" --steps 6 --kill-at-end --timeout 200 --zero-stage "$zero" \
          --set $t.hidden_size=5120 $t.num_layers=40 $t.num_attention_heads=40 $t.head_groups=40 \
          $t.ffn_hidden_size=13824 model.distributed.pipeline_parallel="$pipeline" \
          model.multi_stage.layers_per_stage=5 schedule.breadth_first_micro_batches="$breadth" \
          --commit "$COMMIT" --out "$RES/layout4_13b_$name" 2>&1 | tail -6
      done ;;
    ep-x2)
      # The Mixtral geometry cut to EP_LAYERS layers (default 4), micro-batch 2 × 4096, 4
      # sequences per GPU, ZeRO-1: expert parallelism 2 against data parallelism alone.
      for layout in "dp2:model.distributed.expert_parallel=1" "ep2:model.distributed.expert_parallel=2"; do
        python3 bench/scale_bench.py --config examples/mixtral-8x7b.yaml --gpus 2 --micro-batch 2 \
          --per-gpu-batch 4 --steps 6 --kill-at-end --timeout 170 --zero-stage 1 \
          --set model.base_model.transformer.num_layers="${EP_LAYERS:-4}" ${layout#*:} \
          --commit "$COMMIT" --out "$RES/ep_mixtral_${layout%%:*}" 2>&1 | tail -4
      done ;;
    fp8)
      # Issue 18: the FP8 GPU tests, the fused gated backward's tile sweep (FP8_TILES: the
      # kernels to sweep, default gated; empty: none), then llama-3b and llama-1b in bf16 and
      # each recipe (FP8_MODELS, FP8_RECIPES to narrow), 20 timed steps; FP8_ROUNDS rounds of
      # that matrix, one after the other (results under train_MODEL_RECIPE_ROUND).
      timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8.py \
        tests/kernels/test_fp8_gated_mlp.py tests/model/test_mlp_fp8.py tests/training/test_fp8_zero3_gpu.py \
        >"$RES/gpu_tests_fp8.log" 2>&1
      tail -n 3 "$RES/gpu_tests_fp8.log"
      if [ -n "${FP8_TILES-gated}" ]; then
        timeout 150 python3 bench/fp8_tiles.py --kernels ${FP8_TILES-gated} --commit "$COMMIT" \
          --out "$RES/fp8_tiles.json" 2>&1 | tail -12
      fi
      local -A recipes=([none]="" [delayed]="model.distributed.fp8_linear=tensorwise model.distributed.fp8_scaling=delayed"
        [tensorwise]="model.distributed.fp8_linear=tensorwise" [rowwise]="model.distributed.fp8_linear=rowwise")
      local rounds=${FP8_ROUNDS:-1}
      for round in $(seq "$rounds"); do
        for model in ${FP8_MODELS:-3b 1b}; do
          for recipe in ${FP8_RECIPES:-none delayed tensorwise rowwise}; do
            python3 bench/train_bench.py --models "$model" --systems fastllm --steps 20 --timeout 150 \
              ${recipes[$recipe]:+--set ${recipes[$recipe]}} --commit "$COMMIT" \
              --out "$RES/train_${model}_$recipe$([ "$rounds" = 1 ] || echo "_$round")" 2>&1 \
              | grep "| $model |" | sed "s/^/$recipe /"
          done
        done
      done ;;
    fp8-parity)
      # Issue 18: the FP8 recipes' loss against bf16, PARITY_STEPS (500) steps of llama-1b's
      # blocks x 6 from one initialization and batch order, with the chart.
      timeout 280 python3 bench/fp8_loss_parity.py --steps "${PARITY_STEPS:-500}" --layers 6 \
        --commit "$COMMIT" --out "$RES/fp8_loss_parity" 2>&1 | tail -12 ;;
    long)
      # llama-1b at 16k-128k and llama-3b at 32k-64k tokens in one sequence against HF +
      # compile, and attention alone at those lengths; LONG_S: seconds for all its runs.
      # LONG_ONLY: a subset of its plan (e.g. "1b:16384:hf 1b:16384:fastllm 1b:32768:hf
      # 1b:32768:fastllm", the HF baselines of issue 16 in one call).
      python3 bench/long_context_bench.py --deadline "${LONG_S:-330}" --commit "$COMMIT" \
        ${LONG_ONLY:+--only $LONG_ONLY} --out "$RES/long_context${TAG:+_$TAG}" 2>&1 | tail -40 ;;
    memory)
      # Issue 16's 16k budget: what holds the step's peak, pinned copy bandwidth under load,
      # attention by backend (bench/memory_probe.py; SEQ, default 16384, SET overrides), then
      # the step's kernel profile at that length (PROFILE=0 skips it).
      timeout 240 python3 bench/memory_probe.py --seq "${SEQ:-16384}" ${SET:+--set $SET} \
        --commit "$COMMIT" --out "$RES/memory${TAG:+_$TAG}" 2>&1 | tail -12
      [ "${PROFILE:-1}" = 0 ] || timeout 120 python3 bench/profile_step.py --model 1b \
        --seq "${SEQ:-16384}" --micro-batch 1 --warmup 2 --steps 1 --ops 16 ${SET:+--set $SET} \
        --commit "$COMMIT" --out "$RES/profile_1b_${SEQ:-16384}${TAG:+_$TAG}" 2>&1 | tail -45 ;;
    sft)
      # SFT_PARTS: train and/or prepare (both by default).
      python3 bench/sft_bench.py --parts ${SFT_PARTS:-train prepare} --cores 1 2 4 8 16 \
        --timeout 170 --commit "$COMMIT" --out "$RES/sft${TAG:+_$TAG}" 2>&1 | tail -24 ;;
    moe)
      # The MoE kernels' GPU tests (MOE_TESTS=0: none), then bench/moe_bench.py (dropless
      # against looped, the layer against a dense MLP of the same active FLOPs; MOE_ARGS: more
      # arguments, e.g. "--layer-only --geometries fine").
      if [ "${MOE_TESTS:-1}" != 0 ]; then
        timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe.py \
          tests/kernels/test_grouped_matmul.py >"$RES/gpu_tests_moe${TAG:+_$TAG}.log" 2>&1
        tail -3 "$RES/gpu_tests_moe${TAG:+_$TAG}.log"
      fi
      # MOE_PROBE=1: first the grouped matmuls alone, CUTLASS against ours at several tiles.
      if [ "${MOE_PROBE:-0}" = 1 ]; then
        (cd bench && timeout 150 python3 grouped_gemm_probe.py \
          --out "$RES/grouped_gemm_probe${TAG:+_$TAG}.json" | tail -4)
      fi
      python3 bench/moe_bench.py ${MOE_ARGS:-} --timeout 150 --commit "$COMMIT" \
        --out "$RES/moe${TAG:+_$TAG}" 2>&1 | tail -20
      rm -rf "$RES/moe${TAG:+_$TAG}"/work/{dataset,caches,exp_*} ;;
    lmeval-1b)
      # Issue 36: lm-eval 0.4.13's hf backend (batch_size=auto) against FastLLMLM (what
      # `fastllm evaluate` runs) on a random llama-1b in bf16, each in a fresh process: 2,000
      # four-choice documents of 200-token contexts, then 200 prompts of 200 tokens with 64
      # greedy tokens; wall times with the model's load, agreement per document. lm-eval and
      # its pure-Python needs come as wheels in LMEVAL_WHEELS (default .whl, carried).
      for wheel in "${LMEVAL_WHEELS:-.whl}"/*.whl; do python3 -m zipfile -e "$wheel" "$SITE"; done
      python3 -c "import lm_eval, datasets, pytablewriter" || return 1
      python3 bench/lm_eval_bench.py ${LMEVAL_ARGS:-} --commit "$COMMIT" \
        --out "$RES/lm_eval_1b${TAG:+_$TAG}" 2>&1 | grep -v "it/s\]" | tail -12 ;;
    branch-attention)
      # Issue 35: shared-prefix attention's varlen and dense forms at llama-1b's heads, on the
      # DPO benchmark's rows and on ragged pairs, forward and backward.
      timeout 120 python3 bench/branch_attention_probe.py --commit "$COMMIT" \
        --out "$RES/branch_attention_probe${TAG:+_$TAG}" 2>&1 | tail -8 ;;
    masked-sdpa)
      # Issue 36: SDPA with a boolean mask at evaluation's shapes, by backend.
      timeout 120 python3 bench/masked_sdpa_probe.py --out "$RES/masked_sdpa.json" ;;
    dpo-1b)
      # Issue 35: DPO of a random llama-1b, 8 pairs a step of a 512-token prompt with 512-token
      # chosen and rejected answers: TRL 1.16's DPOTrainer (bf16 autocast on fp32 weights,
      # Liger's kernels, its fused LM head, fused AdamW) against `fastllm train -c
      # examples/dpo-llama3-1b.yaml`, the reference in the step, then precomputed; each system
      # and mode in a fresh process; tokens/s as TRL counts them, MFU over the FLOPs each
      # computes, peak memory. DPO_ARGS: more arguments (e.g. "--modes reference",
      # "--trl-dtype bfloat16", "--pairs-per-row 2 --micro-batch 4", "--trl-checkpointing").
      # trl, liger-kernel, datasets and its pure-Python needs come as wheels in DPO_WHEELS
      # (default .whl, carried; the same folder as lmeval-1b's), made here by
      #   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      #     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      #     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      #     --platform manylinux1_x86_64 -d .whl trl==1.16.0 liger-kernel==0.8.5 \
      #     datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
      for wheel in "${DPO_WHEELS:-.whl}"/*.whl; do python3 -m zipfile -e "$wheel" "$SITE"; done
      python3 -c "import trl, liger_kernel, datasets" || return 1
      # 30 timed steps, not train_bench's 10: single steps ranged over 240-277 ms (h100-ac549d2).
      timeout 570 python3 bench/dpo_bench.py --steps 30 ${DPO_ARGS:-} --timeout 130 --commit "$COMMIT" \
        --out "$RES/dpo_1b${TAG:+_$TAG}" 2>&1 | grep -v "it/s\]" | tail -16 ;;
    distill-1b)
      # Issue 35: `fastllm train -c examples/distill-llama3-1b.yaml`, a random llama-1b learning
      # from a random llama-8b-geometry teacher (both written here as Hugging Face directories,
      # about 19 GB), 8 sequences of 4096 a step in micro-batches of 2: tokens/s, MFU over both
      # models' FLOPs (target 50%), peak memory. DISTILL_ARGS: more arguments (e.g.
      # "--micro-batch 4", "--set model.multi_stage.recompute=none").
      timeout 570 python3 bench/distill_bench.py ${DISTILL_ARGS:-} --timeout 330 \
        --commit "$COMMIT" --out "$RES/distill_1b${TAG:+_$TAG}" 2>&1 | tail -8 ;;
    *) echo "unknown part $1"; return 2 ;;
  esac
}

for part in "$@"; do
  echo "=== $part ($(date +%T))"
  start=$SECONDS
  # SM clock, power and temperature of the GPUs every 0.5 s: a GPU at its power limit lowers
  # its clock, which moves every figure of the part.
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu --format=csv \
    -lms 500 >"$RES/gpu_clocks_$part${TAG:+_$TAG}.csv" &
  sampler=$!
  run_part "$part" 2>&1 | tee "$OUT/$part${TAG:+_$TAG}.log"
  kill "$sampler"
  echo "=== $part took $((SECONDS - start)) s"
  pack  # after every part, so a call stopped at its limit still returns the finished ones
done
