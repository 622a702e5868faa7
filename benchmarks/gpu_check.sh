#!/usr/bin/env bash
# The GPU checks of the CUDA path, as one script for a GPU machine (no network there: the
# machine's own torch with CUDA, plus this repo; transformers must be installed for the
# parity tests and the baseline). Writes JSON and logs under $OUT (default ./gpu-check) and
# prints one summary table at the end.
#
#   make gpu-wheels                                  # here, with network: fills .whl/
#   PY=python3 bash benchmarks/gpu_check.sh          # there: all of it (~5 min, one H100/H200)
#   PY=python3 QUICK=1 bash benchmarks/gpu_check.sh  # the tests + the bench preset (~2 min)
#
# 0. Wheels the machine lacks (pyzmq, fastapi, ...) install from .whl/ into a private
#    directory on PYTHONPATH (nothing of the machine's own Python changes).
# 1. The `-m cuda` tests, each file in a process of its own (a CUDA abort ends only its
#    process: that file's tests not yet reported then run one per process).
# 2. pipeserve bench, bench preset: prefill TTFT at 8K and 32K vs transformers + SDPA on the
#    same GPU; decode throughput with 64 requests (1K prompts, 128 new tokens), overlap vs
#    plain loop, with the default attention kernels and with --attention-backend triton
#    (its decode steps replay CUDA graphs), and the Triton path with graphs off; one request
#    alone (1K prompt, 256 new tokens), graphs on and off.
# 3. The same for bench-deepseek (MLA + MoE); QUICK: 8K and decode, bench only.
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}

if compgen -G ".whl/*.whl" > /dev/null; then
    SITE=${TMPDIR:-/tmp}/pipeserve-gpu-site
    $PY -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=$PYTHONPATH:$SITE
fi

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; \
print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt" || exit 1

# -- 1. tests, a process per file ----------------------------------------------------------
: > "$OUT/tests.txt"
for file in $(grep -rl --include='test_*.py' "mark.cuda" tests | sort); do
    name=$(basename "$file" .py)
    log="$OUT/test-$name.txt"
    timeout 600 $PY -m pytest -v -m cuda -p no:cacheprovider "$file" > "$log" 2>&1
    rc=$?
    if [[ $rc -ne 0 && $rc -ne 1 && $rc -ne 5 ]]; then  # killed: a CUDA abort, a crash
        echo "$file: process ended with $rc; its remaining tests one per process" >> "$log"
        for node in $($PY -m pytest -q --collect-only -m cuda -p no:cacheprovider "$file" \
            2>/dev/null | grep '::'); do
            grep -q "^$node " "$log" && continue  # reported before the crash
            timeout 300 $PY -m pytest -v -m cuda -p no:cacheprovider "$node" >> "$log" 2>&1
        done
    fi
    grep -E '::.* (PASSED|FAILED|SKIPPED|ERROR)' "$log" >> "$OUT/tests.txt"
done

# -- 2./3. benchmarks ------------------------------------------------------------------------
bench() {  # model name, then bench flags
    local model=$1
    shift
    timeout 900 $PY -m pipeserve.cli bench --model "$model" --device cuda --dtype bfloat16 "$@"
}

lengths=(8192 32768)
models=(bench bench-deepseek)
if [[ -n "${QUICK:-}" ]]; then
    lengths=(8192)
    models=(bench)
fi
for model in "${models[@]}"; do
    for len in "${lengths[@]}"; do
        for backend in auto triton; do
            bench "$model" --input-len "$len" --output-len 1 --num-prompts 1 --repeat 3 \
                --chunked-prefill-size 8192 --baseline hf --attention-backend "$backend" \
                --json "$OUT/$model-prefill-$len-$backend.json" \
                > "$OUT/$model-prefill-$len-$backend.txt" 2>&1
        done
    done
    for backend in auto triton; do  # auto: FlashInfer where installed, else torch
        bench "$model" --input-len 1024 --output-len 128 --num-prompts 64 --compare-loops \
            --max-running-requests 64 --attention-backend "$backend" \
            --json "$OUT/$model-decode-64-$backend.json" > "$OUT/$model-decode-64-$backend.txt" 2>&1
    done
    # CUDA graphs (the Triton path's decode steps): off, against the run above (on); one
    # request alone, on and off
    bench "$model" --input-len 1024 --output-len 128 --num-prompts 64 --compare-loops \
        --max-running-requests 64 --attention-backend triton --disable-cuda-graph \
        --json "$OUT/$model-decode-64-triton-nograph.json" \
        > "$OUT/$model-decode-64-triton-nograph.txt" 2>&1
    for graphs in "" --disable-cuda-graph; do
        name=$model-decode-1-triton${graphs:+-nograph}
        bench "$model" --input-len 1024 --output-len 256 --num-prompts 1 \
            --attention-backend triton $graphs --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    done
done

# -- summary -----------------------------------------------------------------------------
$PY - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import collections, json, pathlib, re, sys

out = pathlib.Path(sys.argv[1])
print((out / "device.txt").read_text().strip())
outcomes = [(line.split(" ")[0], m[1]) for line in (out / "tests.txt").read_text().splitlines()
            if (m := re.search(r" (PASSED|FAILED|SKIPPED|ERROR)", line))]
counts = collections.Counter(outcome for _, outcome in outcomes)
print("tests -m cuda:", dict(counts))
for node, outcome in outcomes:
    if outcome in ("FAILED", "ERROR"):
        print("  ", outcome, node)
summary = {"device": (out / "device.txt").read_text().strip(), "tests": dict(counts), "bench": {}}
for path in sorted(out.glob("*.json")):
    if path.name == "summary.json":
        continue
    r = json.loads(path.read_text())
    rows = []
    for lay in r.get("layouts", []):
        keys = ("layout", "loop", "prefill_s", "ttft_mean_s", "output_throughput_tok_s",
                "prefill_flops_share_of_peak")
        rows.append({k: lay.get(k) for k in keys})
    entry = {"layouts": rows, "ratio_to_baseline": r.get("ratio_to_baseline"),
             "baseline": (r.get("baseline") or {}).get("name")}
    summary["bench"][path.stem] = entry
    for row in rows:
        name = f"{row['layout']}/{row['loop']}"
        print(f"{path.stem:28s} {name:16s} prefill {row['prefill_s'] or 0:8.4f} s"
              f"  ttft {row['ttft_mean_s'] or 0:8.4f} s"
              f"  out {row['output_throughput_tok_s'] or 0:9.1f} tok/s")
    if r.get("ratio_to_baseline"):
        ratio = r["ratio_to_baseline"]
        print(f"{'':28s} vs {entry['baseline']}: prefill x{ratio['prefill_time']:.3f}")
(out / "summary.json").write_text(json.dumps(summary, indent=2))
EOF
echo "results in $OUT/"
