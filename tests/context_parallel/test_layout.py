"""Page striping of context parallelism's KV cache, and the order of a CP layer's work (the KV
exchange is in flight while the query projection computes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeserve.context_parallel.layout import PageStriping, global_pages, runs_of
from pipeserve.mem_cache.allocator import PageAllocator
from pipeserve.models.arch import ArchConfig
from pipeserve.models.qwen3 import Qwen3Attention


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_global_pages_map_one_to_one_onto_the_ranks_pools(cp: int) -> None:
    local, page = 7, 4
    total = global_pages(local, cp)
    seen = set()
    for g in range(1, total):
        s = PageStriping(cp, 0, page)
        owner = int(s.owners(torch.tensor([g * page]))[0])
        slot = int(s.local_slots(torch.tensor([g * page]))[0])
        assert owner == (g - 1) % cp
        assert int(s.owners(torch.tensor([g * page + 3]))[0]) == owner
        assert slot % page == 0 and 1 <= slot // page < local  # never a rank's padding page
        seen.add((owner, slot // page))
    assert len(seen) == total - 1 == cp * (local - 1)  # every page of every pool, once


def test_a_run_of_pages_is_spread_evenly_and_stays_consecutive_per_rank() -> None:
    cp, page = 2, 16
    alloc = PageAllocator(global_pages(64, cp))
    pages = alloc.alloc(10)
    assert pages is not None
    runs = [(pages[0] * page, 10 * page)]
    held = []
    for rank in range(cp):
        positions, slots = PageStriping(cp, rank, page).owned(runs, 0, 155, torch.device("cpu"))
        held.append(positions)
        assert len(runs_of(slots)) == 1  # its pages of the run are consecutive locally
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(155))
    assert [len(p) for p in held] == [80, 75]  # page by page, alternating


def test_owned_counts_positions_in_range_only() -> None:
    s = PageStriping(2, 1, 4)
    runs = [(8, 8), (40, 4)]  # global pages 2, 3 and 10 -> owners 1, 0, 1
    positions, slots = s.owned(runs, 2, 11, torch.device("cpu"))
    assert positions.tolist() == [2, 3, 8, 9, 10]
    assert slots.tolist() == [6, 7, 20, 21, 22]  # local pages 1 and 5


class _Recorder:
    """A stand-in CP plan that records when the exchange starts and ends."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def launch(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, pool: Any) -> str:
        self.events.append("launch")
        return "exchange"

    def attend(self, attn: Any, q: torch.Tensor, exchange: str, pool: Any) -> torch.Tensor:
        self.events.append("attend")
        return torch.zeros(q.shape[0], attn.num_heads * attn.head_dim)


def test_kv_exchange_starts_before_the_query_projection(tmp_path) -> None:
    """The K/V are projected first and their exchange launched; only then are the queries
    projected (the work the exchange hides behind); the exchange is waited on in attend."""
    from pipeserve.models.presets import make_model

    arch = ArchConfig.load(make_model("tiny-qwen3", tmp_path / "m"))
    layer = Qwen3Attention(arch, 0, torch.float32)
    for p in layer.parameters():
        p.data.normal_()
    events: list[str] = []
    projected = layer.qkv_proj.project

    def project(x: torch.Tensor, start: int, end: int | None) -> torch.Tensor:
        events.append("q" if start == 0 else "kv")
        return projected(x, start, end)

    layer.qkv_proj.project = project  # type: ignore[method-assign]
    fb = type("FB", (), {"cp": _Recorder(events), "kv_pool": None})()
    x = torch.randn(5, arch.hidden_size)
    cos = torch.ones(5, 1, arch.head_dim)
    layer(x, (cos, torch.zeros_like(cos)), fb)
    assert events == ["kv", "launch", "q", "attend"]
