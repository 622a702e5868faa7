"""DeepSeek-V3.2's sparse attention against V3's dense attention on two random-weight
checkpoints that differ only in V3.2's indexer: prompt TTFT per length and one request's
decode rate at a long context, as ratios taken in the same run. Prints and saves JSON.

    python benchmarks/v32_sparse.py --lengths 4096 8192 16384 --decode 8192 --json out.json
    python benchmarks/v32_sparse.py --released-ratios ...   # indexer ~1/5 of attention width
    python benchmarks/v32_sparse.py --lengths 16384 --repeats 3   # the fastest of 3 alternating

The config (issue 47): hidden 512, 4 layers, 8 heads, q/kv LoRA 256, rope 32, nope 64, v 64;
V3.2 with 16 index heads of 64 and index_topk 2048 (--released-ratios: 4 index heads of 64
under 16 attention heads of 192/128, about the released model's width ratio). Each length
runs in a fresh engine after a short warm-up; the FLOP share counts the work the sparse
attention really does (pipeserve/bench/flops.py), against this machine's matmul peak."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeserve.bench.flops import prefill_flops
from pipeserve.bench.offline import make_prompts
from pipeserve.bench.peak import matmul_peak_flops
from pipeserve.device import DTYPES, best_dtype, native_bf16_pairs
from pipeserve.engine.engine import Engine
from pipeserve.models.arch import ArchConfig
from pipeserve.models.presets import make_model

BASE = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 256,
    "kv_lora_rank": 256,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "max_position_embeddings": 65536,
}
INDEXER = {"index_n_heads": 16, "index_head_dim": 64, "index_topk": 2048}
RELEASED = {  # about the released model's ratios: indexer heads x dim ~ a fifth of attention's
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
RELEASED_INDEXER = {"index_n_heads": 4, "index_head_dim": 128, "index_topk": 2048}


def checkpoints(root: Path, released: bool) -> dict[str, Path]:
    base = {**BASE, **(RELEASED if released else {})}
    index = RELEASED_INDEXER if released else INDEXER
    return {
        "v3": make_model("tiny-deepseek-v3", root / "v3", overrides=base),
        "v32": make_model("tiny-deepseek-v32", root / "v32", overrides={**base, **index}),
    }


def ttft(path: Path, length: int, threads: int) -> float:
    with Engine(str(path), threads_per_worker=threads, max_total_tokens=length + 4096) as e:
        e.generate(input_ids=[list(range(64))], sampling_params={"max_new_tokens": 2})
        prompt = make_prompts(e.arch.vocab_size, 1, length, seed=0)
        start = time.perf_counter()
        out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
        assert isinstance(out, list)
        return out[0]["meta_info"]["ttft_s"] or time.perf_counter() - start


def decode_rate(path: Path, context: int, tokens: int, threads: int) -> float:
    """One request's output tokens per second after a `context`-token prompt."""
    with Engine(str(path), threads_per_worker=threads, max_total_tokens=context + 4096) as e:
        prompt = make_prompts(e.arch.vocab_size, 1, context, seed=1)
        sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        out = e.generate(input_ids=prompt, sampling_params=sp)
        assert isinstance(out, list)
        start = time.perf_counter()
        e.generate(input_ids=prompt, sampling_params=sp)  # prefix cached: mostly decode
        return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384])
    ap.add_argument("--decode", type=int, default=0, help="context of the decode run (0: none)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--released-ratios", action="store_true")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="prefills per length and checkpoint, the two alternating; the fastest of each is "
        "reported (a shared machine's speed swings by 10%% between runs)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    torch.set_num_threads(args.threads)
    dtype = best_dtype(torch.device("cpu"))
    peak = matmul_peak_flops(DTYPES[dtype], torch.device("cpu"))
    report: dict[str, Any] = {
        "dtype": dtype,
        # the V3.2 kernels' vdpbf16ps forms (a bfloat16 run on AVX512-BF16), else float32
        "bf16_pairs": dtype == "bfloat16" and native_bf16_pairs(),
        "threads": args.threads,
        "prefill": [],
        "released_ratios": args.released_ratios,
        "matmul_peak": peak,
    }
    with tempfile.TemporaryDirectory() as tmp:
        paths = checkpoints(Path(tmp), args.released_ratios)
        archs = {name: ArchConfig.load(p) for name, p in paths.items()}
        for length in args.lengths:
            row: dict[str, Any] = {"length": length}
            runs: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, path in paths.items():
                    runs[name].append(ttft(path, length, args.threads))
            for name, seconds_each in runs.items():
                seconds = min(seconds_each)
                row[f"{name}_ttft_s"] = seconds
                row[f"{name}_flop_share"] = prefill_flops(archs[name], length) / seconds / peak
                if args.repeats > 1:
                    row[f"{name}_ttft_runs_s"] = seconds_each
            row["v32_over_v3"] = row["v32_ttft_s"] / row["v3_ttft_s"]
            report["prefill"].append(row)
            print(json.dumps(row), flush=True)
        if args.decode:
            rates = {
                n: decode_rate(p, args.decode, args.decode_tokens, args.threads)
                for n, p in paths.items()
            }
            report["decode"] = {
                "context": args.decode,
                **{f"{n}_tok_s": r for n, r in rates.items()},
                "v32_over_v3": rates["v32"] / rates["v3"],
            }
            print(json.dumps(report["decode"]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
