"""How much any chunking can gain on a pipeline, from a cached chunk-time profile.

With every stage holding the same layers, a prompt chunk costs about the same time t_i on
each of the P stages, and the pipeline is a proportionate flow shop: one prompt's prefill
takes  sum_i t_i + (P - 1) * max_i t_i.  The attention part of sum_i t_i does not depend on
how the prompt is cut (sum_i 2 L_i x_i + x_i^2 = N^2), so chunking can only trade the
per-chunk overheads against the largest chunk's time. This script fits the prefix model
t(L, x) = c + g L + b x + a (2 L x + x^2) to a profile that `pipeserve tune` or
`--enable-dynamic-chunking` cached, and prints the predicted prefill time of fixed chunk
sizes and of the best equal-time chunking (the smallest achievable under the model).

    python benchmarks/chunking_bound.py PROFILE.json --input-len 32768 --pp-size 2
"""

from __future__ import annotations

import argparse
import json

from pipeserve.scheduler.chunk_cost import ChunkCost, fit_chunk_cost


def prefill_time(cost: ChunkCost, sizes: list[int], stages: int) -> float:
    times, prefix = [], 0
    for x in sizes:
        times.append(cost(prefix, x))
        prefix += x
    return sum(times) + (stages - 1) * max(times)


def equal_time_sizes(cost: ChunkCost, total: int, target: float, floor: int) -> list[int]:
    sizes, prefix = [], 0
    while prefix < total:
        root = cost.solve(prefix, target)
        x = total if root is None else max(floor, int(root) // floor * floor)
        sizes.append(min(x, total - prefix))
        prefix += sizes[-1]
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--pp-size", type=int, default=2)
    ap.add_argument("--fixed-sizes", default="256,512,768,1024,1536,2048")
    ap.add_argument("--floor", type=int, default=64)
    args = ap.parse_args()
    with open(args.profile) as f:
        data = json.load(f)
    points = [tuple(p) for p in data["key"]["points"]][1:]  # the first is the warm-up
    seconds = data["seconds"]
    if seconds and isinstance(seconds[0], list):  # per stage: the slowest stage sets the pace
        seconds = [max(per_stage) for per_stage in zip(*seconds, strict=True)]
    seconds = seconds[1:]
    cost, _ = fit_chunk_cost(points, seconds)
    n, p = args.input_len, args.pp_size
    report = {"fit": cost.as_dict(), "fixed": {}, "best_equal_time": None}
    for c in (int(s) for s in args.fixed_sizes.split(",")):
        report["fixed"][c] = prefill_time(cost, [c] * (n // c) + ([n % c] if n % c else []), p)
    targets = [cost(0, args.floor) * 1.1**k for k in range(80)]
    best = min(
        (prefill_time(cost, equal_time_sizes(cost, n, t, args.floor), p), t) for t in targets
    )
    report["best_equal_time"] = {"seconds": best[0], "target_chunk_s": best[1]}
    best_fixed = min(report["fixed"].values())
    report["best_equal_time_vs_best_fixed"] = best[0] / best_fixed
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
