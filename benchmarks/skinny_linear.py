"""The native backend's decode-sized linear products (kernels/skinny_linear.cpp through
`NativeLinears`) beside torch's on the same shapes: SmolLM2-135M's layers and LM head, float32
and bfloat16 weights (bfloat16 ones with float32 activations, as a float32 run keeps a
bfloat16 checkpoint's), 1 to 64 rows of activations, in medians of interleaved rounds. The
LM head's bytes per second stand beside `sum` over the same tensor (what one pass over it
costs here). The shapes above repeat one weight, which stays in cache from call to call; a
decode step reads each of its weights once, from memory, so `--step-rows` also times a whole
step's products out of cache (SmolLM2's 30 layers and LM head, every weight its own tensor)
in bytes per second beside `sum` over a tensor of the same bytes. Prints and saves JSON.

    python benchmarks/skinny_linear.py --threads 1 --json out.json

Torch's product of a bfloat16 weight takes bfloat16 activations (it has no mixed product),
so the float32-activation rows compare against float32 weights, what a run without the
narrow weights computes on. `native_bf16` is a bfloat16 run's product (bfloat16 activations
and weights) beside `torch_bf16`: on CPUs with AVX512-BF16 or AMX both run on bf16
instructions (ours on vdpbf16ps; on float32 FMAs elsewhere)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from pipeserve.backends.native_backend import BlockKernels, NativeLinears
from pipeserve.device import native_block_kernels, native_skinny_linear

SHAPES = {  # SmolLM2-135M: [out, in]
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def gguf_q4_1(w: torch.Tensor) -> torch.Tensor:
    """`w` through GGUF's Q4_1 quantiser, kept in its blocks as the native linears keep it."""
    raw = quants.quantize(w.numpy(), GGMLQuantizationType.Q4_1)
    values = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1).copy())
    kept = NativeLinears(lambda *a: a[0], blocks=BlockKernels(*native_block_kernels())).store(
        values
    )
    assert kept.dtype == torch.uint8
    return kept


def seconds(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def step_bandwidth(kernel: Callable[..., torch.Tensor], rows: int, rounds: int) -> dict:
    """A decode step's products of SmolLM2's 30 layers and LM head with every weight read from
    memory (each its own tensor, 0.27-1.1 GB in all): bytes per second for each weight form,
    the layers' small weights alone too, beside `sum` over as many bytes."""
    layers = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")] * 30
    step = [*layers, SHAPES["lm_head"]]
    out: dict[str, float] = {}
    for label, w_dtype, x_dtype in (
        ("f32", torch.float32, torch.float32),
        ("bf16_weight", torch.bfloat16, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),
    ):
        weights = [torch.randn(n, k).to(w_dtype) for n, k in step]
        xs = {k: torch.randn(rows, k).to(x_dtype) for _, k in step}
        total = sum(w.nbytes for w in weights)

        def run(weights=weights, xs=xs) -> None:
            for w in weights:
                kernel(xs[w.shape[1]], w, None)

        def layers(weights=weights[:-1], xs=xs) -> None:  # the small weights alone
            for w in weights:
                kernel(xs[w.shape[1]], w, None)

        best = min(seconds(run, 1) for _ in range(rounds))
        alone = min(seconds(layers, 1) for _ in range(rounds))
        out[f"step_{label}_layers_GBps"] = (total - weights[-1].nbytes) / alone / 1e9
        flat = torch.cat([w.flatten() for w in weights])
        del weights
        summed = min(seconds(flat.sum, 1) for _ in range(rounds))
        out[f"step_{label}_GBps"] = total / best / 1e9
        out[f"sum_{label}_GBps"] = total / summed / 1e9
        out[f"step_{label}_ms"] = best * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-rows", type=int, nargs="*", default=[1])
    ap.add_argument("--json")
    args = ap.parse_args()
    kernel = native_skinny_linear()
    if kernel is None:
        raise SystemExit("the native CPU kernels do not build here")
    torch.set_num_threads(args.threads)
    blocks = native_block_kernels()
    assert blocks is not None
    linears = NativeLinears(kernel, blocks=BlockKernels(*blocks))
    results: list[dict[str, object]] = []
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k).bfloat16().float()  # bfloat16 numbers: narrowing keeps them
        w16 = w32.bfloat16()
        q4_1 = gguf_q4_1(w32)  # the same weight's Q4_1 blocks (other values: same bytes read)
        calls = 5 if name == "lm_head" else 50
        for m in args.rows:
            x = torch.randn(m, k)
            cases = {
                "torch_f32": partial(F.linear, x, w32),
                "native_f32": partial(linears.linear, x, w32),
                "native_bf16_weight": partial(linears.linear, x, w16),
                "torch_bf16": partial(F.linear, x.bfloat16(), w16),
                "native_bf16": partial(linears.linear, x.bfloat16(), w16),
                "native_q4_1": partial(linears.linear, x, q4_1),
            }
            times: dict[str, list[float]] = {c: [] for c in cases}
            for _ in range(args.rounds):
                for case, fn in cases.items():
                    times[case].append(seconds(fn, calls))
            row: dict[str, object] = {"shape": name, "out": n, "in": k, "rows": m}
            row.update({f"{c}_us": statistics.median(t) * 1e6 for c, t in times.items()})
            results.append(row)
            print(
                f"{name:8s} rows {m:3d}  torch f32 {row['torch_f32_us']:9.1f} us  native f32 "
                f"{row['native_f32_us']:9.1f}  native bf16 weight "
                f"{row['native_bf16_weight_us']:9.1f}  torch bf16 {row['torch_bf16_us']:9.1f}  "
                f"native bf16 {row['native_bf16_us']:9.1f}  "
                f"native q4_1 {row['native_q4_1_us']:9.1f}"
            )
    head = {}
    w = torch.randn(*SHAPES["lm_head"])
    x = torch.randn(1, w.shape[1])
    for label, t in (("f32", w), ("bf16", w.bfloat16())):
        ours = statistics.median(seconds(partial(kernel, x, t), 5) for _ in range(args.rounds))
        stream = statistics.median(seconds(t.sum, 5) for _ in range(args.rounds))
        head[f"lm_head_{label}_GBps"] = t.nbytes / ours / 1e9
        head[f"sum_{label}_GBps"] = t.nbytes / stream / 1e9
    print(", ".join(f"{key} {value:.1f}" for key, value in head.items()))
    steps = {}
    for m in args.step_rows:
        steps[m] = step_bandwidth(kernel, m, args.rounds)
        print(
            f"a step's products out of cache, {m} row(s): "
            + ", ".join(f"{key} {value:.1f}" for key, value in steps[m].items())
        )
    out = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "results": results,
        "lm_head_bandwidth": head,
        "step_out_of_cache": steps,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
