"""Time to first token of an engine's first request against the same request repeated.

    python benchmarks/first_request.py [--model M] [--repeats 5] [--json out.json] [-- flags]

Builds an engine as `pipeserve generate` does (default flags: the built-in SmolLM2 model,
`--dtype best`), sends the chat prompt "What is the capital of France?" once, then the
same request `--repeats` more times, one after another; prints each TTFT, the first over
the median of the rest, and saves JSON. The repeats hit the prefix cache (all but the last
prompt token cached) unless `-- --disable-radix-cache` is passed."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pipeserve.device import cpu_native_bf16
from pipeserve.engine.engine import Engine

PROMPT = "What is the capital of France?"


def parse_flags(items: list[str]) -> dict[str, Any]:
    """`--foo-bar 3 --baz` -> {"foo_bar": 3, "baz": True} (numbers as int/float)."""
    flags: dict[str, Any] = {}
    key = None
    for item in items:
        if item.startswith("--"):
            key = item[2:].replace("-", "_")
            flags[key] = True
            continue
        assert key is not None, f"flag value {item!r} without a flag"
        for kind in (int, float):
            try:
                flags[key] = kind(item)
                break
            except ValueError:
                flags[key] = item
    return flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("flags", nargs="*", help="engine flags after --")
    args = ap.parse_args()
    start = time.perf_counter()
    with Engine(args.model, **parse_flags(args.flags)) as engine:
        ready = time.perf_counter() - start
        tok = engine.tokenizer
        assert tok is not None
        ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
        sp = {"max_new_tokens": 8, "temperature": 0.0}
        ttfts = []
        for _ in range(1 + args.repeats):
            out = engine.generate(input_ids=ids, sampling_params=sp)
            assert isinstance(out, dict)
            ttfts.append(out["meta_info"]["ttft_s"])
        dtype = engine.config.model.dtype
    rest = statistics.median(ttfts[1:])
    report = {
        "model": str(engine.model_path),
        "dtype": dtype,
        "cpu_native_bf16": cpu_native_bf16(),
        "prompt_tokens": len(ids),
        "engine_start_s": ready,
        "ttft_s": ttfts,
        "first_ttft_s": ttfts[0],
        "median_next_ttft_s": rest,
        "first_over_median_next": ttfts[0] / rest,
    }
    print(
        f"{len(ids)}-token prompt, {dtype}: engine ready in {ready:.1f} s; TTFT first "
        f"{1e3 * ttfts[0]:.1f} ms, next {', '.join(f'{1e3 * t:.1f}' for t in ttfts[1:])} ms; "
        f"first / median of the next {ttfts[0] / rest:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
