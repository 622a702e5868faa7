"""Throughput cost of --enable-deterministic-inference on the bench model: decode with 64
requests and with 1, and one 8192-token prefill, each with and without the flag, in
interleaved rounds (medians). Prints and saves JSON.

    python benchmarks/deterministic_cost.py --rounds 3 --json out/deterministic.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pipeserve.engine.engine import Engine

CASES = {  # name: (prompts, prompt length, new tokens)
    "decode_64": (64, 128, 128),
    "decode_1": (1, 128, 128),
    "prefill_8192": (1, 8192, 1),
}


def run_case(engine: Engine, prompts: int, length: int, new: int) -> float:
    """Output tokens per second (decode cases) or seconds (prefill)."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 8000, (length,), generator=gen).tolist() for _ in range(prompts)]
    sp = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params=sp)
    elapsed = time.perf_counter() - start
    return elapsed if new == 1 else prompts * new / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    flags: dict[str, Any] = {"threads_per_worker": 1, "disable_radix_cache": True}
    engines = {d: Engine(None, enable_deterministic_inference=d, **flags) for d in (False, True)}
    samples: dict[str, dict[bool, list[float]]] = {c: {False: [], True: []} for c in CASES}
    for _ in range(args.rounds):
        for case, spec in CASES.items():
            for d, engine in engines.items():
                samples[case][d].append(run_case(engine, *spec))
    report = {}
    for case, by_mode in samples.items():
        off, on = (statistics.median(by_mode[d]) for d in (False, True))
        unit = "s" if case.startswith("prefill") else "tok/s"
        report[case] = {"unit": unit, "default": off, "deterministic": on, "ratio": on / off}
        print(
            f"{case:14s} default {off:9.2f} {unit}  deterministic {on:9.2f} {unit}  "
            f"ratio {on / off:.3f}"
        )
    for engine in engines.values():
        engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
