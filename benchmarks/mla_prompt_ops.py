"""MLA's expanded prompt chunks of one batch, per layer: the aten ops dispatched (each one a
kernel launch on a GPU) when the chunks run one at a time (`expanded_chunks` called chunk by
chunk: what the layer did before, a gather, an up-projection, the keys' concatenation and the
attention calls per chunk, less the old code's own differences) against
all at once (`MLAttention.expanded_chunks`: one gather, one up-projection, then the torch
path's attention calls per chunk, or the Triton backend's one launch). Counts, not times: a
CPU shows what a GPU would launch. One MLA layer of bench-deepseek's shape, random weights,
bfloat16; chunks of `--chunk` tokens, every other one after a cached prefix of as many. On a
GPU the torch backend runs the chunks in one call of PyTorch's packed varlen flash kernel,
counted here through a stand-in that only counts its launches.

    python benchmarks/mla_prompt_ops.py --json out/mla_prompt_ops.json
    TRITON_INTERPRET=1 python benchmarks/mla_prompt_ops.py   # the Triton path's counts too
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeserve.backends.base import AttentionPlan
from pipeserve.backends.torch_backend import TorchBackend
from pipeserve.layers.latent_segment import LatentSegment
from pipeserve.layers.mla import MLAttention
from pipeserve.models.arch import MLAConfig

HIDDEN, HEADS = 1024, 16
MLA = MLAConfig(384, 256, 64, 32, 64, rope_interleave=True)  # bench-deepseek
VIEWS = {  # ops that make views: no kernel
    *("view", "_unsafe_view", "split", "split_with_sizes", "slice", "select", "t"),
    *("transpose", "expand", "alias", "unsqueeze", "squeeze", "unbind", "permute", "detach"),
}


class Ops(TorchDispatchMode):
    """Counts the aten ops dispatched, less views (no kernel), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def counted(fn: Any) -> Counter[str]:
    with torch.no_grad(), Ops() as mode:
        fn()
    return mode.ops


def batch(requests: int, chunk: int) -> list[LatentSegment]:
    """`requests` prompt chunks of `chunk` tokens, every other one after a prefix of as many,
    each request's positions one run of slots."""
    segments, row, slot = [], 0, 0
    for i in range(requests):
        length = chunk * (1 + i % 2)
        segments.append(LatentSegment(row, chunk, runs=((slot, length),)))
        row, slot = row + chunk, slot + length
    return segments


def triton_plan() -> AttentionPlan | None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    from pipeserve.backends.triton_backend import TritonBackend

    backend = TritonBackend()
    return AttentionPlan(backend, backend.latent_plan([], torch.device("cpu")))


def torch_varlen_ops(
    layer: MLAttention,
    q: torch.Tensor,
    cache: torch.Tensor,
    segments: list[LatentSegment],
    out: torch.Tensor,
) -> dict[str, int]:
    """The torch backend's path on a GPU (PyTorch's packed varlen flash kernel, here a
    stand-in that only counts its launches): its ops and launches, the second layer's."""
    launches = []

    def kernel(q: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        launches.append(1)
        return (q,)

    backend = TorchBackend("cpu", varlen=kernel)
    plan = AttentionPlan(backend, backend.latent_plan([], torch.device("cpu")))
    layer.expanded_chunks(q, cache, segments, out, None, plan)  # the first layer
    launches.clear()
    ops = counted(lambda: layer.expanded_chunks(q, cache, segments, out, None, plan))
    return {"ops_at_once_torch_varlen": sum(ops.values()), "launches_torch_varlen": len(launches)}


def triton_ops(
    layer: MLAttention,
    q: torch.Tensor,
    cache: torch.Tensor,
    segments: list[LatentSegment],
    out: torch.Tensor,
    plan: AttentionPlan,
) -> dict[str, int]:
    """The Triton path's torch ops and kernel launches, the launch itself not run (the
    interpreter's own tensor work is not a GPU's); the second layer's, which reads the
    first's tables."""
    from pipeserve.kernels import triton_attention

    launches = []
    real = triton_attention.expanded_extend
    triton_attention.expanded_extend = lambda *args: launches.append(1)
    try:
        layer.expanded_chunks(q, cache, segments, out, None, plan)  # the first layer
        launches.clear()
        ops = counted(lambda: layer.expanded_chunks(q, cache, segments, out, None, plan))
    finally:
        triton_attention.expanded_extend = real
    return {"ops_at_once_triton": sum(ops.values()), "launches_triton": len(launches)}


def measure(layer: MLAttention, n: int, chunk: int, plan: AttentionPlan | None) -> dict[str, Any]:
    """One batch of `n` chunks: its counts, one chunk at a time and at once."""
    segments = batch(n, chunk)
    for seg in segments:  # on a device, slices of one table expanded per batch
        assert seg.slots is not None
    tokens = n * chunk
    bf16 = torch.bfloat16
    cache = torch.randn(sum(s.length for s in segments), MLA.kv_lora_rank + 32, dtype=bf16)
    q = torch.randn(tokens, HEADS, MLA.qk_nope_head_dim + MLA.qk_rope_head_dim, dtype=bf16)
    out = q.new_empty(tokens, HEADS, MLA.v_head_dim)

    def alone() -> None:
        for seg in segments:
            layer.expanded_chunks(q, cache, [seg], out)

    row: dict[str, Any] = {"requests": n, "tokens": tokens}
    row["ops_one_at_a_time"] = sum(counted(alone).values())
    at_once = counted(lambda: layer.expanded_chunks(q, cache, segments, out))
    row["ops_at_once_torch"] = sum(at_once.values())
    row["up_projections_at_once"] = at_once["mm"] + at_once["addmm"]
    row.update(torch_varlen_ops(layer, q, cache, segments, out))
    if plan is not None:
        row.update(triton_ops(layer, q, cache, segments, out, plan))
    print(row)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    layer = MLAttention(HIDDEN, HEADS, MLA, None, torch.bfloat16)
    for param in layer.parameters():
        param.data.normal_(0, 0.05)
    plan = triton_plan()
    rows = [measure(layer, n, args.chunk, plan) for n in args.requests]
    result = {
        "what": "MLA expanded prompt chunks per layer: aten ops dispatched (views excluded; each "
        "a launch on a GPU), one chunk at a time vs all at once; bench-deepseek's MLA, "
        f"chunks of {args.chunk}, every other after a prefix; counts, not times",
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
