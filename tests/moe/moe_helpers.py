"""Real gloo groups on localhost for the expert-parallel tests: every rank runs a module-level
function of (rank, world, out_dir) in its own spawned process and the test process gets back
what each returned. A rank's error is raised in the test process; a hang fails at a deadline."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

DEADLINE_S = 100
multi_process = pytest.mark.timeout(2 * DEADLINE_S)

RankFn = Callable[[int, int, str], Any]


def run_ranks(fn: RankFn, world: int, out_dir: Path) -> list[Any]:
    """Spawn `world` gloo ranks running `fn`; its results, by rank."""
    ctx = mp.start_processes(_rank_main, args=(fn, world, str(out_dir)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{world} ranks did not finish in {DEADLINE_S} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def _rank_main(rank: int, fn: RankFn, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    from pipeserve.distributed.netif import interface_with_address

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_with_address("127.0.0.1") or "lo")
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    results = fn(rank, world, out_dir)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
