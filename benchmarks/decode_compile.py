"""torch.compile (inductor's CPU backend) for the decode step, beside the eager torch ops and
pipeserve's native kernels, on the built-in model: one request, 128 prompt tokens and 128
generated, greedy, the best of three runs after a first one (which compiles).

- `torch`: the torch ops on the float32 weights (`PIPESERVE_NATIVE_KERNELS=0`, the GGUF
  dequantised);
- `torch+compile`: the same, every layer's MLP (gate/up product, SiLU x up, down product: most
  of a step's weight bytes) one compiled function, shared by the layers (static shapes);
- `native`: the native backend (kept Q4_1 blocks, integer products, fused norms and rotary).

The native kernels are opaque calls to torch.compile (each one a graph break), so compiling
the native path buys nothing to measure here. Each case runs in a process of its own. Prints
and saves JSON.

    python benchmarks/decode_compile.py --threads 1 --json out.json"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

CASES = {"torch": ("0", False), "torch+compile": ("0", True), "native": ("1", False)}
PROMPT = list(range(1, 129))
SAMPLING = {"temperature": 0, "max_new_tokens": 128, "ignore_eos": True}


def run_case(case: str, threads: int) -> dict:
    """In this process: the case's runs."""
    import torch
    import torch.nn.functional as F

    from pipeserve.engine.engine import Engine

    native, compiled = CASES[case]
    kept = "keep" if native == "1" else "dequantize"
    with Engine(threads_per_worker=threads, gguf_weights=kept) as engine:
        model = engine.backend.runner.model
        if compiled:

            @torch.compile(dynamic=False)
            def mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
                g, u = F.linear(x, gate_up).chunk(2, -1)
                return F.linear(F.silu(g) * u, down)

            for layer in model.model.layers:
                layer.mlp.forward = partial(
                    mlp, gate_up=layer.mlp.gate_up_proj.weight, down=layer.mlp.down_proj.weight
                )
        start = time.perf_counter()
        engine.generate(input_ids=[PROMPT], sampling_params=SAMPLING)
        first = time.perf_counter() - start
        runs, ids = [], []
        for _ in range(3):
            start = time.perf_counter()
            out = engine.generate(input_ids=[PROMPT], sampling_params=SAMPLING)
            runs.append(time.perf_counter() - start)
            ids = out[0]["output_ids"]
    return {"first_run_s": first, "best_run_s": min(runs), "tok_s": 128 / min(runs), "ids": ids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in a child
    args = ap.parse_args()
    if args.case is not None:
        os.environ["PIPESERVE_NATIVE_KERNELS"] = CASES[args.case][0]
        print(json.dumps(run_case(args.case, args.threads)))
        return
    results = {}
    for case, (native, _) in CASES.items():
        env = {**os.environ, "PIPESERVE_NATIVE_KERNELS": native}
        cmd = [sys.executable, __file__, "--case", case, "--threads", str(args.threads)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        results[case] = json.loads(out.strip().splitlines()[-1])
        print(f"{case:14s} {results[case]['tok_s']:6.1f} tok/s (with the prefill), first run "
              f"{results[case]['first_run_s']:.1f} s")  # fmt: skip
    same = len({tuple(r["ids"]) for r in results.values()}) == 1
    print(f"same greedy tokens in every case: {same}")
    record = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
              "results": results, "same_tokens": same}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
