"""The block-scaled FP8 product (`--fp8-weights keep`, pipeserve/kernels/triton_fp8.py) against
torch's bfloat16 matmul on the same weights dequantised, at DeepSeek-V3's linear shapes, one
decode row to a prompt chunk: seconds per product (activation quantisation included), the
ratio taken in one run, and the relative error of each against the float32 block math. Prints
and saves JSON.

    python benchmarks/fp8_gemm.py --json out.json                 # a GPU with fp8 units
    python benchmarks/fp8_gemm.py --device cpu --rows 1 16 --small  # Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if "cpu" in sys.argv and os.environ.get("TRITON_INTERPRET") != "1":  # before triton imports
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})

import torch  # noqa: E402

from pipeserve.kernels.triton_fp8 import fp8_linear, quantize_groups  # noqa: E402
from pipeserve.models.quantization import BLOCK, dequantize_blocks, quantize_blocks  # noqa: E402

SHAPES = {  # (out, in) of DeepSeek-V3's linears
    "q_a + kv_a (2112 x 7168)": (2112, 7168),
    "q_b (24576 x 1536)": (24576, 1536),
    "o_proj (7168 x 16384)": (7168, 16384),
    "shared gate_up (4096 x 7168)": (4096, 7168),
}
SMALL = {"partial blocks (200 x 300)": (200, 300)}


def seconds(fn: Any, device: torch.device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def case(rows: int, out: int, inp: int, device: torch.device, repeats: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rows + out)
    values, grid = quantize_blocks(torch.randn(out, inp, generator=gen) * 0.02)
    x = torch.randn(rows, inp, generator=gen).to(torch.bfloat16)
    a, scales = quantize_groups(x)
    exact = dequantize_blocks(a, scales, (0, 0), (1, 128)).double()
    real = dequantize_blocks(values, grid, (0, 0), BLOCK)
    want = exact @ real.double().T
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    xd, vd, gd = x.to(device, dtype), values.to(device), grid.to(device)
    wd = real.to(device, dtype)
    fp8 = seconds(lambda: fp8_linear(xd, vd, gd), device, repeats)
    plain = seconds(lambda: xd @ wd.T, device, repeats)
    top = want.abs().max().item()
    error = (fp8_linear(xd, vd, gd).double().cpu() - want).abs().max().item() / top
    return {
        "rows": rows,
        "out": out,
        "in": inp,
        "fp8_s": fp8,
        "dequantised_s": plain,
        "fp8_over_dequantised": fp8 / plain,
        "fp8_rel_error": error,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--small", action="store_true", help="one small shape (interpreter)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    results = []
    for name, (out, inp) in (SMALL if args.small else SHAPES).items():
        for rows in args.rows:
            r = {"shape": name, **case(rows, out, inp, device, args.repeats)}
            results.append(r)
            print(
                f"{name:32s} rows {rows:5d}: fp8 {r['fp8_s'] * 1e6:9.1f} us, bf16 "
                f"{r['dequantised_s'] * 1e6:9.1f} us, ratio {r['fp8_over_dequantised']:.2f}, "
                f"error {r['fp8_rel_error']:.1e}"
            )
    report = {"device": str(device), "results": results}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
