"""The sampler's time per decode step (layers/sampler.py `Sampler.sample`) for a batch of rows
over a vocabulary, against the way it sampled before in the same run: the cuts over the whole
vocabulary sorted, then torch.multinomial (which draws one random number per token on a CPU).
Prints and saves JSON; ms per step, the best of --repeats.

    python benchmarks/sampling.py --rows 1 64 --vocab 49152 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeserve.layers.sampler import Sampler
from pipeserve.scheduler.request import SamplingParams

MIXES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top-k 50": {"temperature": 0.8, "top_k": 50},
    "min-p 0.05": {"temperature": 0.8, "min_p": 0.05},
}


def before(logits: torch.Tensor, params: list[SamplingParams], gen: torch.Generator) -> Any:
    """What the sampler did before: no cut, no sort; every row with a top-k, the k best
    (`topk`); else the whole vocabulary sorted; then torch.multinomial."""
    vocab = logits.shape[-1]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)[:, None]

    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / column([p.temperature for p in params]), dim=-1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab or any(p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        kept = max(top_k)
        if kept < vocab:
            sorted_p, order = probs.topk(kept, dim=-1)
        else:
            sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = torch.arange(kept)[None, :] >= column([float(k) for k in top_k])
        top_p = column([p.top_p if p.top_p < 1.0 else float("inf") for p in params])
        drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p
        drop |= sorted_p < sorted_p[:, :1] * column([p.min_p for p in params])
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def case(logits: torch.Tensor, mix: str, repeats: int) -> dict[str, float]:
    rows = logits.shape[0]
    params = [SamplingParams(**MIXES[mix]) for _ in range(rows)]
    sampler, gen = Sampler(0, torch.device("cpu")), torch.Generator().manual_seed(0)
    rids = [f"r{i}" for i in range(rows)]
    now = best_ms(lambda: sampler.sample(logits, params, rids), repeats)
    old = best_ms(lambda: before(logits, params, gen), repeats)
    return {"ms": now, "before_ms": old, "speedup": old / now}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"vocab": args.vocab, "threads": args.threads, "cases": []}
    for rows in args.rows:
        # logits as peaked as a language model's (a few tokens hold most of the mass)
        logits = 4 * torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(0))
        for name in MIXES:
            row = {"rows": rows, "mix": name, **case(logits, name, args.repeats)}
            report["cases"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
