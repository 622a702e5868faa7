#!/usr/bin/env bash
# The GPU checks of the CUDA path, as one script for a GPU machine (no network there: the
# machine's own torch with CUDA, plus this repo; transformers must be installed for the
# parity tests and the baseline). Writes JSON under $OUT (default ./gpu-check).
#
#   PY=python3 bash benchmarks/gpu_check.sh           # all of it
#   PY=python3 QUICK=1 bash benchmarks/gpu_check.sh   # tests + the bench preset at 8K only
#
# 1. make test-gpu: the `-m cuda` tests (transformers parity in float32 and bfloat16, the
#    overlap loop, CUDA's sync detector around a forward, the KV pool, attention kernels
#    against the reference; PP2/TP2 with two GPUs).
# 2. pipeserve bench, bench preset: prefill TTFT at 8K and 32K vs transformers + SDPA on
#    the same GPU; decode throughput with 64 requests, overlap vs plain loop.
# 3. The same for bench-deepseek (MLA + MoE).
set -euo pipefail
PY=${PY:-python3}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; \
print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
$PY -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tee "$OUT/test-gpu.txt"

bench() {  # model name, then bench flags
    local model=$1
    shift
    $PY -m pipeserve.cli bench --model "$model" --device cuda --dtype bfloat16 "$@"
}

lengths=(8192 32768)
models=(bench bench-deepseek)
if [[ -n "${QUICK:-}" ]]; then
    lengths=(8192)
    models=(bench)
fi
for model in "${models[@]}"; do
    for len in "${lengths[@]}"; do
        bench "$model" --input-len "$len" --output-len 1 --num-prompts 1 --repeat 3 \
            --chunked-prefill-size 8192 --baseline hf --json "$OUT/$model-prefill-$len.json"
    done
    bench "$model" --input-len 1024 --output-len 128 --num-prompts 64 --compare-loops \
        --max-running-requests 64 --json "$OUT/$model-decode-64.json"
done
echo "results in $OUT/"
