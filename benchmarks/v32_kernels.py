"""DeepSeek-V3.2's two CPU kernels alone: the indexer's scores (and its fused top-k selection)
and the sparse latent attention, in multiply-adds per second of the work they do, beside the
dense prefill kernel and torch's float32 matmul on this machine. Prints and saves JSON.

    python benchmarks/v32_kernels.py --json out.json
    python benchmarks/v32_kernels.py --pool-rows 8192 12289 32768   # the rows' cache footprint

Shapes are those of benchmarks/v32_sparse.py's configs: the indexer with 16 heads of 64 (and
4 of 128), 2048 queries over --keys keys; the sparse kernel with 8 heads of 288 (latent 256 +
rope 32) over pools of --pool-rows rows, 2048 chosen per query at random. The sparse kernel's
rate falls once the pool outgrows the caches (each query reads its rows scattered)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeserve.device import (
    native_index_scores,
    native_index_topk,
    native_prefill_kernel,
    native_sparse_kernel,
)

QUERIES, TOPK = 2048, 2048


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (and the kernels' build, the first time)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def indexer(heads: int, dim: int, keys: int, repeats: int) -> dict[str, Any]:
    scores, topk = native_index_scores(), native_index_topk()
    assert scores is not None and topk is not None, "the native kernels do not build here"
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(QUERIES, heads, dim, generator=gen)
    w = torch.rand(QUERIES, heads, generator=gen)
    k = torch.randn(keys, dim, generator=gen)
    prefix = keys - QUERIES
    macs = (QUERIES * prefix + QUERIES * (QUERIES + 1) / 2) * heads * dim
    s_scores = best_seconds(lambda: scores(q, w, k, prefix, 0.1), repeats)
    s_topk = best_seconds(lambda: topk(q, w, k, prefix, 0.1, TOPK), repeats)
    return {
        "heads": heads,
        "dim": dim,
        "keys": keys,
        "scores_s": s_scores,
        "scores_gmac_s": macs / s_scores / 1e9,
        "topk_s": s_topk,
        "topk_gmac_s": macs / s_topk / 1e9,
    }


def sparse(heads: int, width: int, rank: int, rows: int, repeats: int) -> dict[str, Any]:
    kernel = native_sparse_kernel()
    assert kernel is not None, "the native kernels do not build here"
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(QUERIES, heads, width, generator=gen)
    pool = torch.randn(rows, width, generator=gen)
    slots = torch.stack([torch.randperm(rows, generator=gen)[:TOPK] for _ in range(QUERIES)])
    read = torch.zeros(1, dtype=torch.long)
    seconds = best_seconds(lambda: kernel(q, pool, slots, rank, 0.05, read), repeats)
    macs = QUERIES * TOPK * heads * (width + rank)
    return {
        "heads": heads,
        "width": width,
        "rank": rank,
        "pool_rows": rows,
        "pool_mb": pool.nbytes / 2**20,
        "seconds": seconds,
        "gmac_s": macs / seconds / 1e9,
    }


def references(keys: int, repeats: int) -> dict[str, Any]:
    """The dense prefill kernel (8 heads of 96, values padded to 96) and a 2048^3 matmul."""
    out: dict[str, Any] = {}
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    out["matmul_gmac_s"] = 2048**3 / best_seconds(lambda: a @ b, repeats) / 1e9
    kernel = native_prefill_kernel(torch.float32)
    if kernel is not None:
        q = torch.randn(QUERIES, 8, 96)
        k, v = torch.randn(8, keys, 96), torch.randn(8, keys, 96)
        runs, prefix = torch.tensor([[0, keys]]), keys - QUERIES
        seconds = best_seconds(lambda: kernel(q, k, v, runs, prefix, 0.1), repeats)
        pairs = QUERIES * prefix + QUERIES * (QUERIES + 1) / 2
        out["dense_prefill_gmac_s"] = pairs * 8 * (96 + 64) / seconds / 1e9  # real widths
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=16384, help="indexer keys (prefix + queries)")
    ap.add_argument("--pool-rows", type=int, nargs="*", default=[8192, 12289, 32768])
    ap.add_argument("--repeats", type=int, default=4, help="timed runs; the best is kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"threads": args.threads, "queries": QUERIES, "topk": TOPK}
    report["indexer"] = [
        indexer(16, 64, args.keys, args.repeats),
        indexer(4, 128, 2 * args.keys, args.repeats),
    ]
    for row in report["indexer"]:
        print(json.dumps(row), flush=True)
    report["sparse"] = [sparse(8, 288, 256, n, args.repeats) for n in args.pool_rows]
    for row in report["sparse"]:
        print(json.dumps(row), flush=True)
    report["reference"] = references(args.keys, args.repeats)
    print(json.dumps(report["reference"]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
