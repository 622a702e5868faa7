"""The simulator against real pipeserve runs on this machine.

    python benchmarks/sim_validate.py --measure --out DIR [--calibration FILE]
    python benchmarks/sim_validate.py --out DIR            # re-simulate recorded runs

`--measure` runs `pipeserve bench` for every case below (PP1, PP2, TP2; fixed and dynamic
chunking; 4K-32K prompts; several requests; PP2 across two emulated nodes joined by a
1 Gbit/s link when run as root), saving DIR/CASE.json. Then every layout row of those files is
simulated with the same flags on `--hardware cpu` and the calibration given (default: the
one `pipeserve simulate --calibrate` saved), and the table of measured and simulated TTFT is
printed and saved as DIR/validation.json. None of these runs is used by the calibration,
which fits single chunks timed in-process (sim/calibrate.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeserve.sim.run import SimSpec, simulate

HERE = Path(__file__).resolve().parent
PIPESERVE = str(HERE.parent / ".venv" / "bin" / "pipeserve")


@dataclass(frozen=True)
class Case:
    name: str
    layouts: str
    args: list[str]
    netlab: bool = False  # PP2 across two emulated nodes (needs root)
    sim_flags: dict[str, Any] = field(default_factory=dict)


DYNAMIC = [
    "--enable-dynamic-chunking",
    "--dynamic-chunking-smooth-factor",
    "0.9",
    "--dynamic-chunking-profile-max-len",
    "32768",
]
CASES = [
    Case("8k", "1x1,2x1,1x2", ["--input-len", "8192", "--chunked-prefill-size", "1024"]),
    Case("16k", "1x1,2x1,1x2", ["--input-len", "16384", "--chunked-prefill-size", "2048"]),
    Case(
        "32k-dynamic",
        "2x1",
        ["--input-len", "32768", "--chunked-prefill-size", "2048", *DYNAMIC],
        sim_flags={
            "enable_dynamic_chunking": True,
            "dynamic_chunking_smooth_factor": 0.9,
            "dynamic_chunking_profile_max_len": 32768,
        },
    ),
    Case(
        "4x4k",
        "1x1,2x1",
        ["--input-len", "4096", "--num-prompts", "4", "--chunked-prefill-size", "1024"],
    ),
    Case(
        "netlab-8k",
        "2x1",
        ["--input-len", "8192", "--chunked-prefill-size", "1024", "--threads-per-worker", "1"],
        netlab=True,
        sim_flags={"nnodes": 2, "threads_per_worker": 1},
    ),
]


def measure(case: Case, out: Path, repeat: int) -> None:
    path = out / f"{case.name}.json"
    common = ["--model", "bench", "--output-len", "1", *case.args]  # the default dtype (best)
    if case.netlab:
        if os.geteuid() != 0:
            print(f"skipping {case.name}: needs root for the emulated link", file=sys.stderr)
            return
        cmd = [str(HERE / "netlab.sh"), "--", "--pp-size", "2", *common, "--json", str(path)]
    else:
        cmd = [PIPESERVE, "bench", "--layouts", case.layouts, *common, "--json", str(path)]
        cmd += ["--repeat", str(repeat)]  # interleaved rounds, medians (one run across nodes)
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def rows(case: Case, out: Path) -> list[dict[str, Any]]:
    path = out / f"{case.name}.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    return data.get("layouts") or [data]


def sim_inputs(
    case: Case, row: dict[str, Any], data: dict[str, Any], cal: str | None
) -> tuple[dict[str, Any], SimSpec]:
    """The engine flags and simulation of one measured layout row."""
    flags = {
        "pp_size": row["pp_size"],
        "tp_size": row["tp_size"],
        "chunked_prefill_size": data["chunked_prefill_size"],
        **case.sim_flags,
    }
    spec = SimSpec(
        "bench",
        "cpu",
        cal,
        devices_per_node=1 if case.netlab else None,
        dtype=data["dtype"],  # what the engine computed in
        input_len=data["input_len"],
        output_len=data["output_len"],
        num_prompts=data["num_prompts"],
    )
    return flags, spec


def validate(out: Path, cal: str | None) -> dict[str, Any]:
    table = []
    for case in CASES:
        path = out / f"{case.name}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        for row in data.get("layouts") or [data]:
            flags, spec = sim_inputs(case, row, data, cal)
            sim = simulate(flags, spec)
            measured = row["ttft_mean_s"]
            table.append(
                {
                    "case": case.name,
                    "layout": row["layout"] + (" 2 nodes 1 Gbit/s" if case.netlab else ""),
                    "flags": flags,
                    "spec": {k: v for k, v in asdict(spec).items() if k != "calibration"},
                    "measured_ttft_s": measured,
                    "measured_chunks": row["chunk_sizes"],
                    "simulated_ttft_s": sim["ttft_mean_s"],
                    "simulated_chunks": sim["chunk_sizes"],
                    "error": sim["ttft_mean_s"] / measured - 1,
                }
            )
    errors = [abs(r["error"]) for r in table]
    return {
        "calibration": json.loads(Path(cal).read_text()) if cal else None,
        "rows": table,
        "median_abs_error": statistics.median(errors) if errors else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory of the bench JSON files")
    ap.add_argument("--measure", action="store_true", help="run the real benchmarks first")
    ap.add_argument("--calibration", help="calibration file (default: the saved one)")
    ap.add_argument("--only", help="comma-separated case names to measure")
    ap.add_argument("--repeat", type=int, default=1, help="bench --repeat (not across nodes)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.measure:
        only = set(args.only.split(",")) if args.only else None
        for case in CASES:
            if only is None or case.name in only:
                measure(case, out, args.repeat)
    report = validate(out, args.calibration)
    for r in report["rows"]:
        print(
            f"{r['case']:<12} {r['layout']:<28} measured {r['measured_ttft_s']:8.3f} s  "
            f"simulated {r['simulated_ttft_s']:8.3f} s  error {100 * r['error']:+6.1f}%"
        )
    print(f"median |error| {100 * (report['median_abs_error'] or 0):.1f}%")
    (out / "validation.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
