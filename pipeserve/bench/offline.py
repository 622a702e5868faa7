"""`pipeserve bench`: prefill/decode timing on identical random prompts, the achieved prefill
FLOP/s against this machine's matmul peak, and optionally the same workload on Hugging Face
transformers (`--baseline hf`) as a ratio taken in the same run."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pipeserve.bench.flops import prefill_flops
from pipeserve.bench.peak import matmul_peak_flops
from pipeserve.device import resolve_device, resolve_dtype
from pipeserve.engine.engine import Engine
from pipeserve.models.arch import ArchConfig
from pipeserve.scheduler.request import Req, SamplingParams


def make_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for _ in range(num)]


def summarize(ttfts: list[float], total_s: float, input_tokens: int, output_tokens: int,
              num_prompts: int) -> dict[str, float]:
    """Prefill span = until the last request has its first token; decode span = the rest."""
    prefill_s = max(ttfts)
    decode_s = total_s - prefill_s
    decode_tokens = output_tokens - num_prompts
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "input_throughput_tok_s": input_tokens / prefill_s,
        "output_throughput_tok_s": decode_tokens / decode_s if decode_tokens > 0 else 0.0,
    }


def run_pipeserve(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    sp = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.run([Req(f"warmup-{i}", p[:64], SamplingParams(max_new_tokens=2, temperature=0.0))
                for i, p in enumerate(prompts[:2])])
    reqs = [Req(f"bench-{i}", p, sp) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    outputs = engine.run(reqs)
    total = time.perf_counter() - start
    ttfts = [o["meta_info"]["ttft_s"] for o in outputs]
    out_tokens = sum(len(o["output_ids"]) for o in outputs)
    stats = summarize(ttfts, total, sum(map(len, prompts)), out_tokens, len(prompts))
    stats["chunk_sizes"] = [o["meta_info"]["chunk_sizes"] for o in outputs]
    stats["output_ids"] = [o["output_ids"] for o in outputs]
    return stats


def run_bench(engine: Engine, input_len: int, output_len: int, num_prompts: int, seed: int = 0,
              baseline: str | None = None, json_path: str | None = None) -> dict[str, Any]:
    arch: ArchConfig = engine.arch
    prompts = make_prompts(arch.vocab_size, num_prompts, input_len, seed)
    device = resolve_device(engine.config.model.device)
    dtype = resolve_dtype(engine.config.model.dtype, arch.torch_dtype)
    threads = torch.get_num_threads()
    peak = matmul_peak_flops(dtype, device)
    stats = run_pipeserve(engine, prompts, output_len)
    flops = sum(prefill_flops(arch, len(p)) for p in prompts)
    report: dict[str, Any] = {
        "model": str(engine.model_path), "dtype": str(dtype).removeprefix("torch."),
        "threads": threads, "input_len": input_len, "output_len": output_len,
        "num_prompts": num_prompts, "chunked_prefill_size": engine.config.scheduler.chunked_prefill_size,
        "matmul_peak_flops": peak,
        "prefill_flops": flops,
        "prefill_flops_per_s": flops / stats["prefill_s"],
        "prefill_flops_share_of_peak": flops / stats["prefill_s"] / peak,
        **{k: v for k, v in stats.items() if k != "output_ids"},
    }
    if baseline == "hf":
        from pipeserve.bench.hf_baseline import run_hf

        base = run_hf(engine.model_path, prompts, output_len, dtype)
        report["baseline"] = {"name": "hf-transformers", **{k: v for k, v in base.items()
                                                            if k != "output_ids"}}
        report["ratio_to_baseline"] = {
            "prefill_time": stats["prefill_s"] / base["prefill_s"],
            "ttft_mean": stats["ttft_mean_s"] / base["ttft_mean_s"],
            "decode_throughput": (base["output_throughput_tok_s"] / stats["output_throughput_tok_s"]
                                  if stats["output_throughput_tok_s"] else None),
        }
        report["same_greedy_tokens_as_baseline"] = base["output_ids"] == stats["output_ids"]
    print_report(report)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"saved {json_path}")
    return report


def print_report(r: dict[str, Any]) -> None:
    print(f"model {r['model']}  dtype {r['dtype']}  threads {r['threads']}  "
          f"{r['num_prompts']} x {r['input_len']} in / {r['output_len']} out")
    print(f"matmul peak {r['matmul_peak_flops'] / 1e9:.1f} GFLOP/s; prefill achieved "
          f"{r['prefill_flops_per_s'] / 1e9:.1f} GFLOP/s = {r['prefill_flops_share_of_peak']:.2f} of peak")
    rows = [("ttft_mean_s", "{:.3f}"), ("ttft_p50_s", "{:.3f}"), ("prefill_s", "{:.3f}"),
            ("decode_s", "{:.3f}"), ("input_throughput_tok_s", "{:.1f}"),
            ("output_throughput_tok_s", "{:.1f}")]
    base = r.get("baseline")
    print(f"{'metric':<26}{'pipeserve':>14}" + (f"{'hf':>14}" if base else ""))
    for key, fmt in rows:
        line = f"{key:<26}{fmt.format(r[key]):>14}"
        if base:
            line += f"{fmt.format(base[key]):>14}"
        print(line)
    if base:
        ratio = r["ratio_to_baseline"]
        print("ratio to hf: prefill time {:.3f}, decode throughput (hf/pipeserve) {}".format(
            ratio["prefill_time"],
            "n/a" if ratio["decode_throughput"] is None else f"{ratio['decode_throughput']:.3f}"))
        print(f"same greedy tokens as hf: {r['same_greedy_tokens_as_baseline']}")
