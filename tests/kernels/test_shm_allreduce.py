"""The shared-memory all-reduce among processes of one machine: exact sums in every dtype
the forward uses, tensors larger than a slot, bitwise the same result on every rank, and a
clear error (not a hang) when a rank never arrives."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from pipeserve.kernels import native

pytestmark = [
    pytest.mark.skipif(native() is None, reason="native kernels unavailable"),
    pytest.mark.timeout(120),
]
SLOT = 4096  # bytes: small, so the tensors below go in several slices


def rank_main(name, rank, world, dtype, numel, barrier, results) -> None:
    torch.set_num_threads(1)
    kernels = native()
    if rank == 0:
        comm = kernels.ShmAllReduce(name, 0, world, SLOT, True, 30.0)
    barrier.wait()
    if rank > 0:
        comm = kernels.ShmAllReduce(name, rank, world, SLOT, False, 30.0)
    barrier.wait()
    if rank == 0:
        comm.unlink()
    for step in range(3):  # several calls in a row reuse the segment
        x = contribution(rank, step, dtype, numel)
        comm.all_reduce_(x)
        results.put(
            (rank, step, x.view(torch.uint8 if dtype != torch.float32 else torch.int32).tolist())
        )


def contribution(rank: int, step: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(numel, generator=gen).to(dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_rank_gets_the_exact_sum(world: int, dtype: torch.dtype) -> None:
    numel = 3 * SLOT // 2 + 37  # more than a slot, not a multiple of anything
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    name = f"/pipeserve-test-{os.getpid()}-{world}-{dtype}".replace("torch.", "")
    procs = [
        ctx.Process(target=rank_main, args=(name, r, world, dtype, numel, barrier, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in range(3 * world)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    view = torch.uint8 if dtype != torch.float32 else torch.int32
    for step in range(3):
        exact = sum(contribution(r, step, dtype, numel).float() for r in range(world)).to(dtype)
        outs = [torch.tensor(x, dtype=view) for r, s, x in got if s == step]
        assert len(outs) == world
        for out in outs:
            assert torch.equal(out.view(dtype), exact)  # float32 sum, rounded once


def lonely_rank(name: str, results) -> None:
    kernels = native()
    comm = kernels.ShmAllReduce(name, 0, 2, SLOT, True, 0.5)
    comm.unlink()
    try:
        comm.all_reduce_(torch.ones(8))
    except RuntimeError as exc:
        results.put(str(exc))
    else:
        results.put("returned")


def test_a_rank_that_never_arrives_is_an_error_not_a_hang() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=lonely_rank, args=(f"/pipeserve-test-{os.getpid()}-alone", results))
    proc.start()
    message = results.get(timeout=60)
    proc.join(timeout=30)
    assert "did not arrive" in message
