"""The Triton attention kernels' tiles (keys a step, warps, pipeline stages) timed on a GPU at
the presets' shapes: each case's default (`decode_tiles` / `extend_tiles`, chosen offline so
that nothing spills: benchmarks/triton_compile.py), the tiles every launch had before (64
keys, 4 warps, 3 stages) and neighbours of both. Each candidate's output must equal the
default's (to the dtype's rounding). Prints and saves JSON: per case, each tile's time, the
fastest, and the default's time over the fastest.

    python benchmarks/triton_tiles.py --json out.json      # on a GPU, bfloat16
    python benchmarks/triton_tiles.py --device cpu          # Triton's interpreter, toy sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if "cpu" in sys.argv and os.environ.get("TRITON_INTERPRET") != "1":  # before triton imports
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})

import torch  # noqa: E402

from pipeserve.backends.base import ExpandedSpan  # noqa: E402
from pipeserve.backends.triton_backend import expanded_tables  # noqa: E402
from pipeserve.kernels import triton_attention as ta  # noqa: E402

BEFORE = (64, 4, 3)  # what every launch took before the tile rules
NEIGHBOURS = [(64, 4, 3), (64, 8, 3), (32, 4, 3), (32, 8, 3), (16, 8, 3), (32, 8, 2)]


@dataclass(frozen=True)
class Shape:
    """A layer's attention on one GPU: `kv_heads` KV heads of `group` query heads, head dim
    `d` (MLA: query heads over one latent row of `d` + `rope`; expanded: k_nope `d`, rope
    `rope`, values `dv`)."""

    kind: str  # "decode", "extend", "mla_decode", "mla_expanded"
    kv_heads: int
    group: int
    d: int
    rope: int = 0
    dv: int = 0


CASES = {
    "bench decode": Shape("decode", 4, 3, 64),
    "qwen3-0.6b decode": Shape("decode", 8, 2, 128),
    "bench prefill": Shape("extend", 4, 3, 64),
    "qwen3-0.6b prefill": Shape("extend", 8, 2, 128),
    "qwen3-235b tp4 prefill": Shape("extend", 1, 16, 128),
    "bench-deepseek decode": Shape("mla_decode", 1, 16, 256, 32),
    "deepseek-v3 tp8 decode": Shape("mla_decode", 1, 16, 512, 64),
    "deepseek-v3 tp1 decode": Shape("mla_decode", 1, 128, 512, 64),
    "bench-deepseek prefill": Shape("mla_expanded", 1, 16, 64, 32, 64),
    "deepseek-v3 tp8 prefill": Shape("mla_expanded", 1, 16, 128, 64, 128),
}


@dataclass(frozen=True)
class Sizes:
    requests: int  # decode steps
    context: int  # keys of each
    chunks: int  # prompt chunks
    chunk: int  # rows of each (no prefix)


GPU = Sizes(64, 4096, 8, 1024)
TOY = Sizes(2, 70, 2, 40)


def launcher(shape: Shape, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Any:
    """(tiles -> output) for the case, over random inputs made once, and its default tiles."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g).to(device, dtype)

    hk, group, d = shape.kv_heads, shape.group, shape.d
    if shape.kind in ("decode", "mla_decode"):
        b, n = sizes.requests, sizes.context
        width = d + shape.rope
        q = rand(b, hk, group, width)
        rows = rand(hk, b * n, width)
        indptr = (torch.arange(b + 1) * n).to(device, torch.int32)
        indices = torch.randperm(b * n, generator=g).to(device, torch.int32)
        default = ta.decode_launch(group, d, dtype)[2]

        def decode(tiles: ta.Tiles) -> torch.Tensor:
            return ta.paged_decode(
                q, rows, rows, indptr, indices, 0.1, splits=1, rope=shape.rope, tiles=tiles
            )

        return decode, default
    c, n = sizes.chunks, sizes.chunk
    chunks = torch.tensor([(i * n, n, 0) for i in range(c)], dtype=torch.int32)
    if shape.kind == "extend":
        q, pool = rand(c * n, hk * group, d), rand(hk, c * n, d)
        indptr = (torch.arange(c + 1) * n).to(device, torch.int32)
        indices = torch.arange(c * n).to(device, torch.int32)
        blocks = [t.to(device) for t in ta.extend_blocks([n] * c)]
        table = chunks.to(device)
        default = ta.extend_launch(group, d, d, 0, ta.EXTEND_BLOCK_M, dtype)[2]

        def extend(tiles: ta.Tiles) -> torch.Tensor:
            return ta.paged_extend(q, pool, pool, indptr, indices, table, *blocks, 0.1, tiles=tiles)

        return extend, default
    heads, rope, dv = group, shape.rope, shape.dv
    up = rand(c * n, heads, d + dv)
    k_nope, v = up.split([d, dv], -1)
    latents = rand(c * n, 32 + rope)
    q = rand(c * n, heads, d + rope)
    out = torch.empty(c * n, heads, dv, dtype=dtype, device=device)
    spans = tuple(ExpandedSpan(i * n, n, 0, i * n) for i in range(c))
    block_m = ta.expanded_block_m(dtype)
    tables = expanded_tables(spans, c * n, device, block_m)
    default = ta.extend_launch(1, d, dv, rope, block_m, dtype)[2]

    def expanded(tiles: ta.Tiles) -> torch.Tensor:
        ta.expanded_extend(q, k_nope, latents[:, 32:], v, tables, 0.1, out, tiles=tiles)
        return out.clone()

    return expanded, default


def seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The median of `repeats` timed runs, after one untimed (its compile)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(name: str, shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = GPU if device.type == "cuda" else TOY
    run, default = launcher(shape, sizes, dtype, device)
    want = run(default).float()
    top = want.abs().max().item() or 1.0
    rows = []
    for tiles in dict.fromkeys([default, BEFORE, *NEIGHBOURS]):
        try:
            got = run(tiles).float()
            error = (got - want).abs().max().item() / top
            row = {
                "tiles": list(tiles),
                "seconds": seconds(lambda t=tiles: run(t), device, args.repeats),
            }
            row["rel_diff"] = error
        except Exception as e:  # a tile the compiler or the GPU refuses
            row = {"tiles": list(tiles), "seconds": None, "error": f"{type(e).__name__}: {e}"[:200]}
        rows.append(row)
    timed = [r for r in rows if r["seconds"] is not None]
    if not timed:
        raise RuntimeError(f"{name}: no tile ran: {rows}")
    best = min(timed, key=lambda r: r["seconds"])
    result = {
        "case": name,
        "shape": shape.__dict__,
        "default": list(default),
        "tiles": rows,
        "fastest": best["tiles"],
        "default_over_fastest": rows[0]["seconds"] / best["seconds"]
        if rows[0]["seconds"]
        else None,
        "outputs_agree": all(r.get("rel_diff", 1.0) <= args.tolerance for r in timed),
        "errors": [r for r in rows if "error" in r],
    }
    print(
        f"{name:<26} default {tuple(default)} {rows[0]['seconds'] or float('nan'):.6f} s, "
        f"fastest {tuple(best['tiles'])} {best['seconds']:.6f} s"
        + ("" if result["outputs_agree"] else "  OUTPUTS DIFFER")
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", nargs="*", default=None, help="names of CASES (default: all)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=2e-2, help="relative, of the largest")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cpu":
        args.repeats = min(args.repeats, 1)
    results: list[dict[str, Any]] = []
    report = {"what": __doc__.split("\n\n")[0], "device": args.device, "cases": results}
    for name in args.cases or list(CASES):  # saved after each case: a run cut short keeps it
        results.append(measure(name, CASES[name], args))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    if not all(r["outputs_agree"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
