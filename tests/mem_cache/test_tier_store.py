"""A worker's tier buffers: pages copied device -> host -> disk -> device (other pages each
time, in runs and scattered) come back bit for bit, in the per-head K/V layout and MLA's
latent layout with indexer keys; nothing else changes; the disk file is gone once mapped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pipeserve.mem_cache.hicache import DEVICE, DISK, HOST, CacheOp
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.mem_cache.tier_store import TierStore, _paired_runs

PAGE = 4


def pools() -> dict[str, KVPool]:
    kv = KVPool(16 * PAGE, range(2, 4), 2, 8, torch.bfloat16, torch.device("cpu"), PAGE)
    latent = KVPool.latent_layout(
        16 * PAGE, range(0, 3), 12, torch.bfloat16, torch.device("cpu"), PAGE, extra_width=5
    )
    return {"kv": kv, "latent": latent}


def page_rows(pool: KVPool, page: int) -> list[torch.Tensor]:
    return [b.narrow(dim, page * PAGE, PAGE).clone() for b, dim in pool.slot_buffers()]


@pytest.mark.parametrize("layout", ["kv", "latent"])
def test_pages_round_trip_through_host_and_disk(layout, tmp_path) -> None:
    pool = pools()[layout]
    for b, _ in pool.slot_buffers():
        b.copy_(torch.randn(b.shape))
    store = TierStore(pool, PAGE, 10, 12, str(tmp_path), "s0r0")
    assert list(tmp_path.iterdir()) == []  # open, then unlinked
    src = (3, 4, 5, 9, 1)  # a run and two strays
    before = {p: page_rows(pool, p) for p in range(16)}
    store.run([
        CacheOp(DEVICE, HOST, src, (2, 3, 4, 7, 9)),
        CacheOp(HOST, DISK, (2, 3, 4, 7, 9), (11, 1, 2, 3, 5)),
        CacheOp(DISK, DEVICE, (11, 1, 2, 3, 5), (10, 11, 12, 13, 15)),
    ])
    for s, d in zip(src, (10, 11, 12, 13, 15), strict=True):
        for got, want in zip(page_rows(pool, d), before[s], strict=True):
            assert torch.equal(got, want)
    for p in set(range(16)) - {10, 11, 12, 13, 15}:  # no other page moved
        for got, want in zip(page_rows(pool, p), before[p], strict=True):
            assert torch.equal(got, want)


def test_paired_runs_join_pages_consecutive_on_both_sides() -> None:
    assert _paired_runs((3, 4, 5, 9, 1), (2, 3, 4, 7, 9)) == [(3, 2, 3), (9, 7, 1), (1, 9, 1)]
    assert _paired_runs((1, 2, 3), (5, 7, 8)) == [(1, 5, 1), (2, 7, 2)]


def test_a_tier_this_worker_lacks_is_a_clear_error() -> None:
    store = TierStore(pools()["kv"], PAGE, 4, 0, None, "s0r0")
    with pytest.raises(ValueError, match="no such tier"):
        store.copy(CacheOp(HOST, DISK, (1,), (1,)))


def test_closing_gives_the_disk_space_back(tmp_path) -> None:
    store = TierStore(pools()["kv"], PAGE, 4, 8, str(tmp_path), "s0r0")
    held = [t for t in _open_files() if t.startswith(str(tmp_path))]
    assert len(held) == 1 and held[0].endswith("(deleted)")
    store.close()
    assert not [t for t in _open_files() if t.startswith(str(tmp_path))]


def _open_files() -> list[str]:
    out = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            out.append(os.readlink(fd))
        except OSError:
            continue
    return out
