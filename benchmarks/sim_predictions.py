"""What the simulator, calibrated on the two published H20 points only (spec 06), predicts
for layouts nobody here has measured: DeepSeek-V3.1 and Qwen3-235B-A22B-FP8 at 128K tokens
under PP and TP, and Qwen3-235B at PP8 TP4 from 32K to 1M tokens, weights in fp8 as the
published runs computed (what pipeserve holds with --fp8-weights keep; by default it
dequantises them).

    python benchmarks/sim_predictions.py [--json OUT] [--throughput-prompts 16]

TTFT: one prompt alone. Throughput: --throughput-prompts prompts queued at once (the
pipeline saturated), input tokens over the time until the last one's first token. Speedup is
that throughput over PP1's, strong-scaling efficiency the speedup over the device ratio.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from pipeserve.sim.run import SimSpec, simulate

L128K = 131072
DEEPSEEK = [  # (name, flags): PP1 TP8 is the calibration point
    ("PP1 TP8 fixed 4K", {"tp_size": 8, "chunked_prefill_size": 4096}),
    ("PP2 TP8 fixed 4K", {"tp_size": 8, "pp_size": 2, "chunked_prefill_size": 4096}),
    ("PP2 TP8 dynamic C 12K s 0.65", {"tp_size": 8, "pp_size": 2, "dynamic": (12288, 0.65)}),
    ("PP4 TP8 fixed 4K", {"tp_size": 8, "pp_size": 4, "chunked_prefill_size": 4096}),
    ("PP4 TP8 dynamic C 12K s 0.65", {"tp_size": 8, "pp_size": 4, "dynamic": (12288, 0.65)}),
    ("PP1 TP32 fixed 4K", {"tp_size": 32, "chunked_prefill_size": 4096}),
]
QWEN = [
    ("PP1 TP4 fixed 6K", {"tp_size": 4, "chunked_prefill_size": 6144}),
    *[
        item
        for pp in (2, 4, 8)
        for item in (
            (f"PP{pp} TP4 fixed 6K", {"tp_size": 4, "pp_size": pp, "chunked_prefill_size": 6144}),
            (
                f"PP{pp} TP4 dynamic C 18K s 0.8",
                {"tp_size": 4, "pp_size": pp, "dynamic": (18432, 0.8)},
            ),
        )
    ],
]
LENGTHS = [32768, 65536, 131072, 262144, 524288, 1048576]


def engine_flags(flags: dict[str, Any], input_len: int) -> dict[str, Any]:
    """The engine flags of a setting: dynamic chunking profiled up to the prompt's length,
    and a prefill budget that lets the first chunk be C (the default 16384 would cap C 18K)."""
    out = {k: v for k, v in flags.items() if k != "dynamic"}
    if "dynamic" in flags:
        c, s = flags["dynamic"]
        out |= {
            "chunked_prefill_size": c,
            "max_prefill_tokens": max(c, 16384),
            "enable_dynamic_chunking": True,
            "dynamic_chunking_smooth_factor": s,
            "dynamic_chunking_profile_max_len": input_len,
        }
    return out


def devices(flags: dict[str, Any]) -> int:
    return flags.get("tp_size", 1) * flags.get("pp_size", 1)


def layout_rows(model: str, layouts: list[tuple[str, dict[str, Any]]], prompts: int) -> list[dict]:
    spec = SimSpec(model, "h20", dtype="fp8", input_len=L128K)  # as the published runs
    rows = []
    for name, flags in layouts:
        f = engine_flags(flags, L128K)
        one = simulate(f, spec)
        many = simulate(f, replace(spec, num_prompts=prompts))
        rows.append(
            {
                "layout": name,
                "devices": devices(flags),
                "ttft_s": one["ttft_mean_s"],
                "chunks": len(one["chunk_sizes"][0]),
                "bubble_ratio": one["bubble_ratio"],
                "throughput_tok_s": many["input_throughput_tok_s"],
            }
        )
    base = rows[0]
    for r in rows:
        r["throughput_speedup"] = r["throughput_tok_s"] / base["throughput_tok_s"]
        r["strong_scaling_efficiency"] = r["throughput_speedup"] / (r["devices"] / base["devices"])
        r["ttft_speedup"] = base["ttft_s"] / r["ttft_s"]
    return rows


def length_rows() -> list[dict]:
    rows = []
    for n in LENGTHS:
        row: dict[str, Any] = {"input_len": n}
        for name, flags in (
            ("fixed 6K", {"tp_size": 4, "pp_size": 8, "chunked_prefill_size": 6144}),
            ("dynamic C 18K s 0.8", {"tp_size": 4, "pp_size": 8, "dynamic": (18432, 0.8)}),
        ):
            spec = SimSpec("qwen3-235b-a22b", "h20", dtype="fp8", input_len=n)
            r = simulate(engine_flags(flags, n), spec)
            row[name] = r["ttft_mean_s"]
        rows.append(row)
    return rows


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print("| layout | GPUs | TTFT s | throughput tok/s | speedup vs PP1 | strong-scaling eff. |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['layout']} | {r['devices']} | {r['ttft_s']:.1f} | {r['throughput_tok_s']:.0f} "
            f"| {r['throughput_speedup']:.2f} | {r['strong_scaling_efficiency']:.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="save the tables here")
    ap.add_argument("--throughput-prompts", type=int, default=16)
    args = ap.parse_args()
    report = {
        "deepseek-v3.1": layout_rows("deepseek-v3.1", DEEPSEEK, args.throughput_prompts),
        "qwen3-235b-a22b": layout_rows("qwen3-235b-a22b", QWEN, args.throughput_prompts),
        "qwen3-235b-a22b PP8 TP4 by length": length_rows(),
    }
    print_rows("DeepSeek-V3.1 (FP8) on H20, 128K tokens", report["deepseek-v3.1"])
    print_rows("Qwen3-235B-A22B-FP8 on H20, 128K tokens", report["qwen3-235b-a22b"])
    print("\nQwen3-235B-A22B-FP8, PP8 TP4 (32 H20): TTFT by input length")
    print("| input tokens | fixed 6K | dynamic C 18K s 0.8 |")
    print("| --- | --- | --- |")
    for r in report["qwen3-235b-a22b PP8 TP4 by length"]:
        print(f"| {r['input_len']} | {r['fixed 6K']:.1f} s | {r['dynamic C 18K s 0.8']:.1f} s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
