"""MLA's decode steps on the torch backend: gathered per group (one call for all the steps,
their latent rows copied into one padded tensor) against in place (a call per step over a
view of its rows), per step and context length: where the torch backend's
LATENT_GATHER_MAX_KEYS should stand on this device.

bench-deepseek's absorbed attention (16 heads over 288-value latent rows; --v3: DeepSeek-V3's
128 heads of 576 at TP8, 16 a rank), the engine's dtype for the device, each step's rows one
run of the cache; median of a few runs, timed with the device synchronised. Prints and saves
JSON.

    python benchmarks/mla_decode_gather.py --json out/mla_decode_gather.json
    python3 benchmarks/mla_decode_gather.py --device cuda --steps 64 --lengths 1024 16384 65536
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pipeserve.backends.torch_ops import gathered_latent_attention, latent_over_parts
from pipeserve.device import DTYPES, best_dtype

LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
WIDTHS = {"bench-deepseek": (16, 256, 32), "v3-tp8": (16, 512, 64)}  # heads, rank, rope


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    length: int, steps: int, shape: tuple[int, int, int], device: torch.device, repeats: int
) -> dict[str, float]:
    heads, rank, rope = shape
    dtype = DTYPES[best_dtype(device)]
    width = rank + rope
    cache = torch.randn(steps * length, width, dtype=dtype, device=device)
    q = torch.randn(steps, heads, width, dtype=dtype, device=device)
    slots = torch.arange(steps * length, device=device).view(steps, length)
    scale = width**-0.5

    def gathered() -> None:
        gathered_latent_attention(q, cache, slots, rank, scale)

    def in_place() -> None:
        for i in range(steps):
            part = cache[i * length : (i + 1) * length]
            latent_over_parts(q[i : i + 1], [part], scale)[0, :, :rank]

    g = timed(gathered, device, repeats) / steps
    p = timed(in_place, device, repeats) / steps
    return {"length": length, "gathered_us": g * 1e6, "in_place_us": p * 1e6, "ratio": p / g}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=16, help="decode steps in the group")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--shape", choices=list(WIDTHS), default="bench-deepseek")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="save the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = WIDTHS[args.shape]
    print(f"{args.shape} {shape}, {args.steps} steps, {DTYPES[best_dtype(device)]}, {device}")
    print(f"threads {torch.get_num_threads()}; us per step; in place / gathered (>1: gather)")
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            row = measure(length, args.steps, shape, device, args.repeats)
            rows.append(row)
            print(
                f"  {length:>7}: gathered {row['gathered_us']:9.1f}  "
                f"in place {row['in_place_us']:9.1f}  ratio {row['ratio']:.2f}"
            )
    if args.json:
        meta = {"device": str(device), "steps": args.steps, "shape": args.shape}
        with open(args.json, "w") as f:
            json.dump({**meta, "threads": torch.get_num_threads(), "gather": rows}, f, indent=1)


if __name__ == "__main__":
    main()
