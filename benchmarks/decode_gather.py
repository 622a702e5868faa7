"""Decode steps on the torch backend: gathered per group (one call for all the steps, their
keys and values copied into one padded tensor) against in place (a call per step over a view
of its keys), per step and context length: where the torch backend's GATHER_MAX_BYTES should
stand on this device (the bytes a step's gather moves, printed beside each length).

--shape: bench-deepseek's MLA (absorbed: 16 heads over 288-value latent rows), DeepSeek-V3's
MLA at TP8 (16 heads over 576-value rows), or the bench preset's GQA (16 heads over 8 KV heads
of 64). The engine's dtype for the device, each step's keys one run of the pool; median of a
few runs, timed with the device synchronised. Prints and saves JSON.

    python benchmarks/decode_gather.py --json out/decode_gather.json
    python3 benchmarks/decode_gather.py --device cuda --steps 64 --lengths 1024 16384 65536
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pipeserve.backends.torch_backend import TorchBackend, gathered_steps
from pipeserve.backends.torch_ops import gathered_latent_attention, latent_over_parts
from pipeserve.device import DTYPES, best_dtype
from pipeserve.layers.attention_parts import VIEW_MIN_TOKENS

LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
# MLA: (heads, kv_lora_rank, qk_rope_head_dim); GQA: (heads, kv_heads, head_dim)
SHAPES = {
    "bench-deepseek": ("mla", (16, 256, 32)),
    "v3-tp8": ("mla", (16, 512, 64)),
    "bench": ("gqa", (12, 4, 64)),
}


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


def mla_steps(
    length: int, steps: int, shape: tuple[int, int, int], device: torch.device
) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    """(gathered, in place, bytes a position's row takes) for MLA's absorbed steps."""
    heads, rank, rope = shape
    dtype = DTYPES[best_dtype(device)]
    width = rank + rope
    cache = torch.randn(steps * length, width, dtype=dtype, device=device)
    q = torch.randn(steps, heads, width, dtype=dtype, device=device)
    slots = torch.arange(steps * length, device=device).view(steps, length)
    scale = width**-0.5

    def gathered() -> None:
        gathered_latent_attention(q, cache, slots, rank, scale)

    def in_place() -> None:  # as the backend's in-place steps: a run this short is gathered
        for i in range(steps):
            short = length < VIEW_MIN_TOKENS
            part = cache[slots[i]] if short else cache[i * length : (i + 1) * length]
            latent_over_parts(q[i : i + 1], [part], scale)

    return gathered, in_place, width * cache.element_size()


def gqa_steps(
    length: int, steps: int, shape: tuple[int, int, int], device: torch.device
) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    """(gathered, in place, bytes a position's keys and values take) for GQA's steps."""
    heads, kv_heads, d = shape
    dtype = DTYPES[best_dtype(device)]
    k_cache, v_cache = (
        torch.randn(kv_heads, steps * length, d, dtype=dtype, device=device) for _ in range(2)
    )
    q = torch.randn(steps, kv_heads, heads // kv_heads, d, dtype=dtype, device=device)
    slots = torch.arange(steps * length, device=device).view(steps, length)
    dense, scale = TorchBackend(device).dense, d**-0.5

    def gathered() -> None:
        gathered_steps(q, k_cache, v_cache, slots, scale, dense)

    def in_place() -> None:  # as the backend's in-place steps: a run this short is gathered
        for i in range(steps):
            if length >= VIEW_MIN_TOKENS:
                run = slice(i * length, (i + 1) * length)
                k, v = k_cache[:, run], v_cache[:, run]
            else:
                k, v = k_cache[:, slots[i]], v_cache[:, slots[i]]
            dense(q[i : i + 1], k[None], v[None], False, scale)

    return gathered, in_place, 2 * kv_heads * d * k_cache.element_size()


def measure(
    length: int, steps: int, shape_name: str, device: torch.device, repeats: int
) -> dict[str, float]:
    kind, shape = SHAPES[shape_name]
    make = mla_steps if kind == "mla" else gqa_steps
    gathered, in_place, row_bytes = make(length, steps, shape, device)
    g = timed(gathered, device, repeats) / steps
    p = timed(in_place, device, repeats) / steps
    return {
        "length": length,
        "step_bytes": length * row_bytes,
        "gathered_us": g * 1e6,
        "in_place_us": p * 1e6,
        "ratio": p / g,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=16, help="decode steps in the group")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument(
        "--shape", choices=list(SHAPES), nargs="+", default=["bench-deepseek", "bench"]
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="save the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{args.steps} steps, {best_dtype(device)}, {device}, {torch.get_num_threads()} threads")
    print("us per step; in place / gathered (above 1: gathering pays)")
    rows = []
    with torch.no_grad():
        for shape in args.shape:
            print(f"{shape} {SHAPES[shape]}")
            for length in args.lengths:
                row = {"shape": shape, **measure(length, args.steps, shape, device, args.repeats)}
                rows.append(row)
                print(
                    f"  {length:>7} ({row['step_bytes'] / 1024:8.0f} KiB): gathered "
                    f"{row['gathered_us']:9.1f}  in place {row['in_place_us']:9.1f}  "
                    f"ratio {row['ratio']:.2f}"
                )
    if args.json:
        meta = {"device": str(device), "steps": args.steps, "threads": torch.get_num_threads()}
        with open(args.json, "w") as f:
            json.dump({**meta, "gather": rows}, f, indent=1)


if __name__ == "__main__":
    main()
