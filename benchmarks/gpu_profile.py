"""Where a decode step's time goes on a GPU: host spans, kernel launches and kernel time.

    python benchmarks/gpu_profile.py --model bench --requests 64 --json out.json
    python benchmarks/gpu_profile.py --model bench --requests 1 --attention-backend triton

The prompts are prefilled once (one new token each, so the prefix cache holds them), then the
same prompts run again for --steps new tokens: that run's prefill is one token per request
(a cache hit), so it is almost all decode steps. It runs twice, once timed plain and once
under the profiler, and the report splits one forward (the decode steps and the one
cached-prefill batch, averaged): wall time per forward (the plain run's),
the scheduler's host spans per step (schedule, prepare, process; from the engine's
timeline), the forward's host span, and from the profiled run the GPU kernels per step
(count and summed time) and the kernels that take most of it. Wall minus kernel time is what
the host or the launches cost the step."""

from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pipeserve.engine.engine import Engine
from pipeserve.scheduler.request import Req, SamplingParams


def requests(tag: str, prompts: list[list[int]], new_tokens: int) -> list[Req]:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [Req(f"{tag}-{i}", p, sp) for i, p in enumerate(prompts)]


def host_spans(events: list[Any]) -> dict[str, float]:
    """Seconds per kind of the scheduler's spans (stage -1) and of the forwards."""
    total: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.stage == -1 or e.kind == "forward":
            total[e.kind] += e.end - e.start
    return dict(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    flags = {
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "disable_cuda_graph": args.disable_cuda_graph,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "max_running_requests": max(args.requests, 1),
    }
    with Engine(args.model, **flags) as engine:
        gen = torch.Generator().manual_seed(0)
        vocab = engine.arch.vocab_size
        prompts = [
            torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()
            for _ in range(args.requests)
        ]
        engine.run(requests("fill", prompts, 1))  # the prompts' KV into the prefix cache
        engine.run(requests("warm", prompts, 4))  # kernels compiled, graphs warm
        engine.backend.timeline()
        sync()
        start = time.perf_counter()
        engine.run(requests("timed", prompts, args.steps))
        sync()
        wall = time.perf_counter() - start
        events = engine.backend.timeline()
        spans = host_spans(events)
        forwards = sum(e.kind == "forward" for e in events)
        # GPU activity only: the host ops of a few hundred steps take the profiler minutes
        cuda = args.device == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            engine.run(requests("profiled", prompts, args.steps))
            sync()
        engine.backend.timeline()
        runner = getattr(engine.backend, "runner", None)
        graphs = getattr(runner, "graphs", None)
        loop = engine.backend.stats()["loop"]
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us() / 1e6
    steps = forwards  # the run's forwards: its decode steps and its (cached) prefill batch
    kernel_s = sum(t for _, t in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    report = {
        "model": args.model,
        "requests": args.requests,
        "input_len": args.input_len,
        "new_tokens": args.steps,
        "forwards": forwards,
        "attention_backend": args.attention_backend,
        "cuda_graphs": graphs is not None,
        "graph_replays": None if graphs is None else graphs.replays,
        "loop": loop,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "wall_ms_per_step": 1e3 * wall / steps,
        "tokens_per_s": args.requests * args.steps / wall,
        "host_ms_per_step": {k: 1e3 * v / steps for k, v in spans.items()},
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step": 1e3 * kernel_s / steps,
        "top_kernels": [
            {"name": n[:100], "count_per_step": c / steps, "ms_per_step": 1e3 * t / steps}
            for n, (c, t) in top
        ],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "top_kernels"}, indent=1))
    for k in report["top_kernels"]:
        print(f"  {k['ms_per_step']:8.3f} ms  {k['count_per_step']:6.1f}x  {k['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
