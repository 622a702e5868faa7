#!/usr/bin/env python3
"""Time `pipeserve bench` on two versions of the code, interleaved in one command.

    python benchmarks/compare_commits.py --base HEAD~1 --rounds 3 -- \\
        --input-len 8192 --output-len 1 --threads-per-worker 1

Each version runs from a git worktree of its own (--head defaults to the working tree as it
is, uncommitted changes included) with the same interpreter; rounds alternate base, head,
base, head, ... so a machine whose speed drifts slows both alike. Prints every round's TTFT
and decode throughput of the first layout and the median ratios head/base; --json saves it
all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worktree(rev: str, root: Path) -> Path:
    path = root / rev.replace("/", "_").replace("~", "-").replace("^", "-")
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), rev], check=True
    )
    return path


def run_bench(tree: Path, bench_args: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "pipeserve.cli", "bench", *bench_args, "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--head", help="git revision (default: the working tree as it is)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="save the rounds and the ratio here")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench flags")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="pipeserve-compare-") as tmp:
        root = Path(tmp)
        trees = {"base": worktree(args.base, root)}
        trees["head"] = worktree(args.head, root) if args.head else REPO
        try:
            rounds = run_rounds(trees, bench_args, args.rounds, root)
        finally:
            for tree in trees.values():
                if tree != REPO:
                    subprocess.run(
                        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                        check=False,
                    )
    ttft, decode = rounds["ttft_mean_s"], rounds["output_throughput_tok_s"]
    ratio = statistics.median(ttft["head"]) / statistics.median(ttft["base"])
    report = {
        "base": args.base,
        "head": args.head or "working tree",
        "bench_args": bench_args,
        **rounds,
        "ratio_head_to_base": ratio,
    }
    print(f"TTFT base {ttft['base']}  head {ttft['head']}")
    print(f"median TTFT ratio head/base: {ratio:.3f} (below 1: head faster)")
    if all(decode["base"]) and all(decode["head"]):
        rate = statistics.median(decode["head"]) / statistics.median(decode["base"])
        report["decode_ratio_head_to_base"] = rate
        print(f"decode tok/s base {decode['base']}  head {decode['head']}")
        print(f"median decode throughput ratio head/base: {rate:.3f} (above 1: head faster)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def run_rounds(
    trees: dict[str, Path], bench_args: list[str], count: int, root: Path
) -> dict[str, dict[str, list[float]]]:
    """Per measure (TTFT, decode throughput), per version, every round's figure."""
    keys = ("ttft_mean_s", "output_throughput_tok_s")
    rounds: dict[str, dict[str, list[float]]] = {k: {name: [] for name in trees} for k in keys}
    for i in range(count):
        for name, tree in trees.items():
            row = run_bench(tree, bench_args, root / f"{name}-{i}.json")["layouts"][0]
            for k in keys:
                rounds[k][name].append(row[k])
            print(
                f"round {i} {name}: TTFT {row['ttft_mean_s']:.3f} s, decode "
                f"{row['output_throughput_tok_s']:.1f} tok/s",
                flush=True,
            )
    return rounds


if __name__ == "__main__":
    sys.exit(main())
