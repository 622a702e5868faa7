"""The GPU check as one time-boxed run (benchmarks/gpu_check.sh calls it): the `-m cuda`
tests, then `pipeserve bench` and the decode-step profile in priority order, each stage in a
process of its own with a timeout, none started past the deadline. After every stage
$OUT/summary.json is written anew (the figures so far) and the logs and JSON reports are
packed into $OUT/logs.tar.gz, so a run cut short still leaves everything it measured.

    OUT=dir BUDGET_S=450 python3 benchmarks/gpu_check.py          # everything, by priority
    ONLY=tests,decode-64 python3 benchmarks/gpu_check.py           # named stages only
    DRY=1 python3 benchmarks/gpu_check.py                          # on a CPU: the same commands
                                                                   # at toy sizes (a dry run)

Priority: (a) the -m cuda tests (bf16 parity included), (b) `pipeserve bench` with default
flags (decode of 64 requests, one request alone, 32K prefill against transformers + SDPA),
(c) the Triton backend with CUDA graphs on and off, (d) 128K and 1M-token prefills,
(e) bench-deepseek, the decode-step profiles, transformers at 1M."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", "gpu-check"))
LOGS = Path(os.environ.get("GPU_CHECK_LOGS", "/tmp/gpu-check-logs"))
DRY = bool(os.environ.get("DRY"))
BUDGET_S = float(os.environ.get("BUDGET_S", "450"))
ONLY = {s for s in os.environ.get("ONLY", "").split(",") if s}
TESTS = os.environ.get("TESTS", "").split()  # pytest arguments instead of TEST_FILES
PY = sys.executable
TEST_FILES = [  # compile checks first, then the engine
    "tests/kernels/test_triton_attention.py",
    "tests/kernels/test_triton_fp8.py",
    "tests/backends/test_torch_ops.py",
    "tests/layers/test_moe_grouped.py",
    "tests/cuda/test_engine_cuda.py",
    "tests/cuda/test_cuda_graphs.py",
    "tests/engine/test_engine_shutdown.py",
]


@dataclass
class Stage:
    name: str
    argv: list[str]
    cap_s: float  # its timeout, at most
    min_s: float = 20.0  # not started with less time left than this
    report: Path | None = None  # the JSON it writes
    result: dict[str, Any] = field(default_factory=dict)


def size(n: int) -> int:
    """A prompt length: as named on a GPU, a toy one in a dry run."""
    return max(16, n // 1024) if DRY else n


DRY_MODELS = {"bench-deepseek": "tiny-deepseek-v3"}  # a dry run's stand-ins


def bench(name: str, cap: float, *flags: Any, model: str = "bench", min_s: float = 20) -> Stage:
    report = LOGS / f"{name}.json"
    device = ["--device", "cpu", "--dtype", "float32"] if DRY else []
    model = DRY_MODELS.get(model, model) if DRY else model
    argv = [PY, "-m", "pipeserve.cli", "bench", "--model", model, *device, "--json", str(report)]
    return Stage(name, argv + [str(f) for f in flags], cap, min_s, report)


def profile(name: str, cap: float, *flags: Any) -> Stage:
    report = LOGS / f"{name}.json"
    argv = [PY, str(ROOT / "benchmarks" / "gpu_profile.py"), "--json", str(report)]
    if DRY:
        argv += ["--device", "cpu", "--dtype", "float32", "--input-len", "64"]
    return Stage(name, argv + [str(f) for f in flags], cap, report=report)


def fp8_gemm() -> Stage:
    """The block-scaled FP8 product against bfloat16 on the dequantised weights."""
    report = LOGS / "fp8-gemm.json"
    argv = [PY, str(ROOT / "benchmarks" / "fp8_gemm.py"), "--json", str(report)]
    if DRY:
        argv += ["--device", "cpu", "--small", "--rows", "1", "--repeats", "1"]
    return Stage("fp8-gemm", argv, 60, report=report)


def triton_tiles() -> Stage:
    """The attention kernels' tiles timed at the presets' shapes: which the defaults should be."""
    report = LOGS / "triton-tiles.json"
    argv = [PY, str(ROOT / "benchmarks" / "triton_tiles.py"), "--json", str(report)]
    if DRY:
        argv += ["--device", "cpu", "--cases", "bench decode", "bench-deepseek prefill"]
    return Stage("triton-tiles", argv, 150, 30, report)


def decode_gather() -> Stage:
    """The torch backend's decode steps, gathered against in place (GQA and MLA): where its
    GATHER_MAX_BYTES should stand on a GPU."""
    report = LOGS / "decode-gather.json"
    argv = [PY, str(ROOT / "benchmarks" / "decode_gather.py"), "--json", str(report)]
    lengths = [256, 1024] if DRY else [1024, 4096, 16384, 65536, 131072]
    argv += ["--device", "cpu" if DRY else "cuda", "--steps", 4 if DRY else 64]
    argv += ["--shape", "bench", "bench-deepseek", "v3-tp8", "--lengths", *lengths]
    return Stage("decode-gather", [str(a) for a in argv], 60, report=report)


def stages() -> list[Stage]:
    """In priority order. The default (auto) is the Triton path with CUDA graphs, prompt
    chunks over 16K keys on torch's flash kernels; the other backends run by name."""
    tests = [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "cuda", "--timeout", "240"]
    tests += ["--junitxml", str(LOGS / "tests.xml"), *(TESTS or TEST_FILES)]
    one = ["--input-len", size(1024), "--output-len", 256 if not DRY else 8, "--num-prompts", 1]
    many = ["--input-len", size(1024), "--num-prompts", 64 if not DRY else 4]
    many += ["--max-running-requests", 64]
    decode = [*many, "--output-len", 128 if not DRY else 8]
    eager = [*many, "--output-len", 32 if not DRY else 8]  # the torch path's steps are slow
    prefill = ["--output-len", 1, "--num-prompts", 1]
    long = [*prefill, "--chunked-prefill-size", 16384]
    hf = ["--baseline", "hf"]
    triton = ["--attention-backend", "triton"]
    torch_ = ["--attention-backend", "torch"]
    nograph = ["--disable-cuda-graph"]
    k32, k128, m1 = size(32768), size(131072), size(1_000_000)
    deepseek = "bench-deepseek"
    return [
        Stage("tests", tests, 240, min_s=60),
        bench("defaults", 60),  # pipeserve bench with no flags at all
        bench("decode-64", 60, *decode, "--compare-loops"),
        bench("decode-1", 45, *one),
        bench("prefill-32k", 60, "--input-len", k32, *prefill, "--repeat", 2, *hf),
        fp8_gemm(),
        triton_tiles(),
        bench("decode-64-nograph", 60, *decode, *nograph),
        bench("decode-1-nograph", 45, *one, *nograph),
        bench("decode-64-torch", 90, *eager, *torch_),
        bench("decode-1-torch", 45, *one, *torch_),
        bench("prefill-32k-triton", 60, "--input-len", k32, *prefill, *triton),
        bench("prefill-32k-torch", 60, "--input-len", k32, *prefill, *torch_),
        bench("prefill-128k", 60, "--input-len", k128, *long, *hf),
        bench("prefill-128k-triton", 60, "--input-len", k128, *long, *triton),
        bench("prefill-1m", 240, "--input-len", m1, *long, *hf, min_s=90),
        bench("deepseek-decode-64", 90, *decode, model=deepseek),
        bench("deepseek-decode-1", 60, *one, model=deepseek),
        bench("deepseek-decode-64-torch", 90, *eager, *torch_, model=deepseek),
        decode_gather(),
        profile("profile-decode-1", 45, "--requests", 1, "--steps", 64),
        profile("profile-decode-64", 45, "--requests", 64, "--steps", 32),
        profile("profile-decode-1-torch", 45, "--requests", 1, "--steps", 64, *torch_),
        bench("deepseek-prefill-32k", 90, "--input-len", k32, *prefill, *hf, model=deepseek),
        # MLA's prompt chunks of 64 requests: one Triton launch a layer against torch's calls
        bench("deepseek-prefill-64", 60, *many, "--output-len", 1, model=deepseek),
        bench("deepseek-prefill-64-torch", 60, *many, "--output-len", 1, *torch_, model=deepseek),
    ]


def bench_figures(report: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "layout",
        "loop",
        "ttft_mean_s",
        "prefill_s",
        "decode_s",
        "output_throughput_tok_s",
        "input_throughput_tok_s",
        "attention_flops_per_s",
        "prefill_flops_share_of_peak",
        "peak_device_bytes",
        "cuda_graph_replays",
        "chunk_sizes",
    )
    rows = [{k: lay.get(k) for k in keys} for lay in report.get("layouts", [])]
    for row in rows:
        sizes = row.pop("chunk_sizes") or [[]]
        row["chunks"] = len(sizes[0])
    out: dict[str, Any] = {
        "rows": rows,
        "chunked_prefill_size": report.get("chunked_prefill_size"),
        "matmul_peak_flops": report.get("matmul_peak_flops"),
    }
    if report.get("baseline"):
        out["baseline"] = report["baseline"]
        out["ratio_to_baseline"] = report.get("ratio_to_baseline")
        out["same_greedy_tokens_as_baseline"] = report.get("same_greedy_tokens_as_baseline")
    return out


def test_results(log: Path) -> dict[str, Any]:
    """Counts and failures, from the JUnit XML where pytest wrote it, else its -v lines."""
    xml = LOGS / "tests.xml"
    outcomes: dict[str, str] = {}
    failures: dict[str, str] = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            node = f"{case.get('classname')}::{case.get('name')}"
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                el = case.find(kind)
                if el is not None:
                    outcome = kind
                    text = (el.get("message") or "") + "\n" + (el.text or "")
                    if kind != "skipped":
                        failures[node] = text.strip()[-1500:]
                    break
            outcomes[node] = outcome
    else:
        for line in log.read_text(errors="replace").splitlines():
            for word in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
                if f" {word}" in line and "::" in line:
                    outcomes[line.split(" ")[0]] = word.lower()
    counts: dict[str, int] = {}
    for o in outcomes.values():
        counts[o] = counts.get(o, 0) + 1
    return {"counts": counts, "outcomes": outcomes, "failures": failures}


def run(stage: Stage, deadline: float) -> None:
    log = LOGS / f"{stage.name}.txt"
    timeout = min(stage.cap_s, deadline - time.monotonic())
    # the CUDA runs use no native CPU kernels: none is compiled (tests' session start would)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PIPESERVE_NATIVE_KERNELS="0")
    if DRY:
        env.update(PIPESERVE_NATIVE_KERNELS="1", TRITON_INTERPRET="1")
    start = time.monotonic()
    with log.open("w") as f:
        f.write(" ".join(stage.argv) + "\n")
        f.flush()
        proc = subprocess.Popen(
            stage.argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "timeout"
    stage.result = {
        "rc": rc,
        "seconds": round(time.monotonic() - start, 1),
        "timeout_s": round(timeout),
    }
    if stage.name == "tests":
        stage.result.update(test_results(log))
    elif stage.report is not None and stage.report.is_file():
        data = json.loads(stage.report.read_text())
        stage.result.update(bench_figures(data) if "layouts" in data else data)
    if rc != 0:
        lines = log.read_text(errors="replace").splitlines()
        stage.result["log_tail"] = lines[-25:]


def headline(stage: Stage) -> str:
    r = stage.result
    words = [f"{stage.name}: rc {r.get('rc')} in {r.get('seconds')} s"]
    if "counts" in r:
        words.append(str(r["counts"]))
        words += [f"FAILED {n}" for n in r["failures"]]
    for row in r.get("rows", []):
        words.append(
            f"{row['layout']}/{row['loop']} ttft {row['ttft_mean_s']:.4f} s prefill "
            f"{row['prefill_s']:.4f} s out {row['output_throughput_tok_s']:.0f} tok/s attn "
            f"{(row['attention_flops_per_s'] or 0) / 1e12:.1f} TFLOP/s peak "
            f"{(row['peak_device_bytes'] or 0) / 2**30:.2f} GiB graphs {row['cuda_graph_replays']}"
        )
    if r.get("baseline", {}).get("error"):
        words.append(f"hf: {r['baseline']['error']}")
    elif r.get("baseline"):
        b = r["baseline"]
        words.append(
            f"hf prefill {b['prefill_s']:.4f} s out {b['output_throughput_tok_s']:.0f} "
            f"tok/s ratio {r['ratio_to_baseline']} kernels {b.get('sdpa_kernels')}"
        )
    for row in r.get("results", []):  # fp8-gemm
        words.append(
            f"{row['shape']} rows {row['rows']}: fp8/bf16 {row['fp8_over_dequantised']:.2f}, "
            f"error {row['fp8_rel_error']:.1e}"
        )
    for case in r.get("cases", []):  # triton-tiles
        words.append(
            f"{case['case']}: default {case['default']} over fastest {case['fastest']} "
            f"{case['default_over_fastest']}, outputs agree {case['outputs_agree']}"
        )
    for row in r.get("gather", []):  # decode-gather
        words.append(
            f"{row['shape']} {row['length']} ({row['step_bytes']} B): gathered "
            f"{row['gathered_us']:.1f} us, in place {row['in_place_us']:.1f} us a step "
            f"({row['ratio']:.2f})"
        )
    if "wall_ms_per_step" in r:
        words.append(
            f"step {r['wall_ms_per_step']:.3f} ms, kernels {r['kernel_ms_per_step']:.3f}"
            f" ms ({r['kernels_per_step']:.0f}), host {r['host_ms_per_step']}"
        )
    if r.get("rc") != 0:
        words += r.get("log_tail", [])[-6:]
    return "\n  ".join(words)


def device_info() -> dict[str, Any]:
    code = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': "
        "torch.__version__, 'cuda': torch.version.cuda, 'device': "
        "torch.cuda.get_device_name() if c else 'cpu', 'memory_bytes': "
        "torch.cuda.get_device_properties(0).total_memory if c else None}))"
    )
    info = json.loads(subprocess.check_output([PY, "-c", code], text=True))
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def save(summary: dict[str, Any], done: list[Stage]) -> None:
    summary["stages"] = {s.name: s.result for s in done}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1))
    with tarfile.open(OUT / "logs.tar.gz", "w:gz") as tar:
        tar.add(LOGS, arcname="gpu-check-logs")


def main() -> None:
    deadline = time.monotonic() + BUDGET_S
    LOGS.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "dry": DRY,
        "budget_s": BUDGET_S,
        **device_info(),
    }
    print(json.dumps(summary), flush=True)
    if not DRY and summary["device"] == "cpu":
        sys.exit("no CUDA GPU (DRY=1 runs the check's commands on a CPU)")
    done: list[Stage] = []
    for stage in stages():
        if ONLY and stage.name not in ONLY:
            continue
        left = deadline - time.monotonic()
        if left < stage.min_s:
            stage.result = {"rc": "not run", "reason": f"{left:.0f} s left"}
        else:
            run(stage, deadline)
        done.append(stage)
        save(summary, done)
        print(headline(stage), flush=True)
    print(f"results in {OUT}/ (summary.json, logs.tar.gz)")


if __name__ == "__main__":
    main()
