"""Expanded vs absorbed multi-head latent attention per (prefix, chunk): which one a segment of
a given length should take (pipeserve.layers.mla.ABSORB_MAX_QUERIES).

Expanded up-projects every cached latent of the request through kv_b_proj for each chunk (a cost
linear in the prefix, paid once per chunk) and then attends with qk_head_dim keys; absorbed
folds kv_b_proj into the queries and outputs and attends over the latent rows themselves, wider
per (query, key) pair but with no up-projection. One MLA layer of bench-deepseek's shape, random
weights, bf16, on the current thread budget (expanded on the compiled prefill kernel where it
builds, as in the engine); median of a few runs. Prints and saves JSON.

    python benchmarks/mla_paths.py --json out/mla_paths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pipeserve.backends.native_backend import NativeBackend
from pipeserve.device import DTYPES, best_dtype, native_prefill_kernel
from pipeserve.layers.latent_segment import LatentSegment
from pipeserve.layers.mla import MLAttention, Mode
from pipeserve.layers.rotary import RotaryEmbedding
from pipeserve.models.arch import MLAConfig

HIDDEN, HEADS = 1024, 16
MLA = MLAConfig(384, 256, 64, 32, 64, rope_interleave=True)  # bench-deepseek
PREFIXES = (0, 2048, 8192, 32768)
CHUNKS = (1, 4, 16, 64, 256, 2048)


def timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# the dtype the engine computes in here by default (bf16 with native bf16 products, else fp32)
DTYPE = DTYPES[best_dtype(torch.device("cpu"))]


def measure(layer: MLAttention, prefix: int, chunk: int, repeats: int) -> dict[str, float]:
    dtype = DTYPE
    total = prefix + chunk
    cache = torch.randn(total + 1, MLA.kv_lora_rank + MLA.qk_rope_head_dim, dtype=dtype)
    seg = LatentSegment(0, chunk, torch.arange(1, total + 1), runs=((1, total),))
    x = torch.randn(chunk, HIDDEN, dtype=dtype)
    rope = RotaryEmbedding(MLA.qk_rope_head_dim, 10000.0, None).cos_sin(
        torch.arange(prefix, total), dtype
    )
    kernels = NativeBackend().kernels  # as the engine runs expanded chunks on a CPU

    def run(mode: Mode) -> None:
        layer(x, rope, cache, [seg], mode, kernels=kernels)

    return {mode: timed(lambda mode=mode: run(mode), repeats) for mode in ("expanded", "absorbed")}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    layer = MLAttention(HIDDEN, HEADS, MLA, None, DTYPE)
    for p in layer.parameters():
        p.normal_(0.0, 0.02)
    rows = []
    for prefix in PREFIXES:
        for chunk in CHUNKS:
            t = measure(layer, prefix, chunk, args.repeats)
            ratio = t["absorbed"] / t["expanded"]
            rows.append({"prefix": prefix, "chunk": chunk, **t, "absorbed_over_expanded": ratio})
            print(
                f"prefix {prefix:6d} chunk {chunk:5d}  expanded {t['expanded'] * 1e3:9.2f} ms  "
                f"absorbed {t['absorbed'] * 1e3:9.2f} ms  absorbed/expanded {ratio:6.2f}",
                flush=True,
            )
    report = {
        "threads": torch.get_num_threads(),
        "dtype": str(DTYPE),
        "native": native_prefill_kernel(DTYPE) is not None,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
