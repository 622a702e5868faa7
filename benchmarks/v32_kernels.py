"""DeepSeek-V3.2's CPU kernels alone: the indexer's scores (and its fused top-k selection),
the sparse attention in latent space and on up-projected keys, in multiply-adds per second of
the work they do, beside the dense prefill kernel and torch's matmul on this machine. Prints
and saves JSON.

    python benchmarks/v32_kernels.py --json out.json
    python benchmarks/v32_kernels.py --dtype bfloat16   # the vdpbf16ps forms on AVX512-BF16
    python benchmarks/v32_kernels.py --pool-rows 8192 12289 32768   # the rows' cache footprint

Shapes are those of benchmarks/v32_sparse.py's configs: the indexer with 16 heads of 64 (and
4 of 128), 2048 queries over --keys keys; the latent kernel with 8 heads of 288 (latent 256 +
rope 32) over pools of --pool-rows rows, 2048 chosen per query at random (in position order,
as the indexer gives them); the expanded kernel with 8 heads of 96/64 and 16 of 192/128 (the
released model's widths) over --keys positions. The sparse kernels' rates fall once what they
read outgrows the caches (each query reads its rows scattered)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeserve.device import (
    DTYPES,
    native_bf16_pairs,
    native_index_scores,
    native_index_topk,
    native_prefill_kernel,
    native_sparse_expanded_kernel,
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


def chosen(rows: int, gen: torch.Generator) -> torch.Tensor:
    """TOPK of `rows` positions per query, at random, in increasing order."""
    return torch.stack(
        [torch.randperm(rows, generator=gen)[:TOPK].sort().values for _ in range(QUERIES)]
    )


def indexer(
    heads: int, dim: int, keys: int, repeats: int, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    scores, topk = native_index_scores(), native_index_topk()
    assert scores is not None and topk is not None, "the native kernels do not build here"
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(QUERIES, heads, dim, generator=gen).to(dtype)
    w = torch.rand(QUERIES, heads, generator=gen)
    k = torch.randn(keys, dim, generator=gen).to(dtype)
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


def sparse(
    heads: int, width: int, rank: int, rows: int, repeats: int, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    kernel = native_sparse_kernel()
    assert kernel is not None, "the native kernels do not build here"
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(QUERIES, heads, width, generator=gen).to(dtype)
    pool = torch.randn(rows, width, generator=gen).to(dtype)
    slots = chosen(rows, gen)
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


def expanded(
    heads: int, dk: int, dr: int, dv: int, keys: int, repeats: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The expanded kernel: per-head keys [k_nope | shared rope] and values as views of one
    up-projection, as the layer passes them."""
    kernel = native_sparse_expanded_kernel()
    assert kernel is not None, "the native kernels do not build here"
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(QUERIES, heads, dk + dr, generator=gen).to(dtype)
    up = torch.randn(keys, heads, dk + dv, generator=gen).to(dtype)
    rope = torch.randn(keys, dr, generator=gen).to(dtype)
    positions = chosen(keys, gen)
    read = torch.zeros(1, dtype=torch.long)
    k, v = up[..., :dk], up[..., dk:]
    seconds = best_seconds(lambda: kernel(q, k, v, rope, positions, 0.05, read), repeats)
    macs = QUERIES * TOPK * heads * (dk + dr + dv)
    return {
        "heads": heads,
        "widths": [dk, dr, dv],
        "keys": keys,
        "seconds": seconds,
        "gmac_s": macs / seconds / 1e9,
    }


def references(keys: int, repeats: int, dtype: torch.dtype) -> dict[str, Any]:
    """The dense prefill kernel for `dtype` (8 heads of 96, values padded to 96) and a 2048^3
    matmul, in `dtype`."""
    out: dict[str, Any] = {}
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    out["matmul_gmac_s"] = 2048**3 / best_seconds(lambda: a @ b, repeats) / 1e9
    kernel = native_prefill_kernel(dtype)
    if kernel is not None:
        q = torch.randn(QUERIES, 8, 96).to(dtype)
        k, v = torch.randn(8, keys, 96).to(dtype), torch.randn(8, keys, 96).to(dtype)
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
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    report: dict[str, Any] = {
        "threads": args.threads,
        "queries": QUERIES,
        "topk": TOPK,
        "dtype": args.dtype,
        "bf16_pairs": dtype == torch.bfloat16 and native_bf16_pairs(),
    }
    report["indexer"] = [
        indexer(16, 64, args.keys, args.repeats, dtype),
        indexer(4, 128, 2 * args.keys, args.repeats, dtype),
    ]
    for row in report["indexer"]:
        print(json.dumps(row), flush=True)
    report["sparse"] = [sparse(8, 288, 256, n, args.repeats, dtype) for n in args.pool_rows]
    for row in report["sparse"]:
        print(json.dumps(row), flush=True)
    report["expanded"] = [
        expanded(8, 64, 32, 64, args.keys, args.repeats, dtype),
        expanded(16, 128, 64, 128, args.keys, args.repeats, dtype),
    ]
    for row in report["expanded"]:
        print(json.dumps(row), flush=True)
    report["reference"] = references(args.keys, args.repeats, dtype)
    print(json.dumps(report["reference"]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
