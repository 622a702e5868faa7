"""HiCache's host tier follows the machine (pipeserve/mem_cache/host_tier.py): capped by the
memory free where the run starts (less this run's pools on a CPU device and a tenth of RAM,
per worker), decided once and carried in the flags; a setting that cannot fit is refused
with what fits; and an engine with default flags starts with its host tier lazily touched
(before: 2x a pool sized to half of RAM, zero-filled, and the kernel's OOM killer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeserve.config import EngineConfig, SettingsError
from pipeserve.engine.engine import Engine
from pipeserve.mem_cache import host_tier
from pipeserve.mem_cache.hicache import HOST
from pipeserve.mem_cache.host_reservations import Reservation, claimed_bytes
from pipeserve.mem_cache.host_tier import GIB, claim_bytes, tier_pages, with_host_memory
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.mem_cache.tier_store import TierStore


def machine(monkeypatch: pytest.MonkeyPatch, ram_gib: float, free_gib: float) -> None:
    monkeypatch.setattr(host_tier, "total_memory", lambda device: int(ram_gib * GIB))
    monkeypatch.setattr(host_tier, "available_memory", lambda: int(free_gib * GIB))


def config(**flags) -> EngineConfig:
    return EngineConfig.from_flags(device="cpu", enable_hierarchical_cache=True, **flags)


def test_the_cap_is_what_is_free_less_the_cpu_pools_and_a_margin(monkeypatch) -> None:
    machine(monkeypatch, ram_gib=100, free_gib=90)
    # 90 free - 50 for the CPU pools (--mem-fraction-static 0.5) - 10 kept free = 30
    assert with_host_memory(config()).cache.hicache_size == pytest.approx(30)
    assert with_host_memory(config(mem_fraction_static=0.3)).cache.hicache_size == pytest.approx(50)
    two = with_host_memory(config(pp_size=2)).cache.hicache_size  # two workers on the node
    assert two == pytest.approx(15)
    machine(monkeypatch, ram_gib=100, free_gib=40)  # another process holds 60
    assert with_host_memory(config()).cache.hicache_size == 0
    plain = EngineConfig.from_flags(device="cpu")
    assert with_host_memory(plain) is plain  # no HiCache: nothing decided


def test_a_size_over_what_is_free_is_refused_with_what_fits(monkeypatch) -> None:
    machine(monkeypatch, ram_gib=100, free_gib=90)
    assert with_host_memory(config(hicache_size=30.0)).cache.hicache_size == 30.0
    with pytest.raises(SettingsError, match=r"--hicache-size 31 GiB .* use --hicache-size 30.0"):
        with_host_memory(config(hicache_size=31.0))


def test_other_runs_claims_shrink_the_cpu_pools_and_the_tier(monkeypatch) -> None:
    """RAM 100 GiB, 90 free (the other runs' pools are untouched yet): a run that claims 50
    leaves 100 - 10 kept - 50 = 40 for this one's CPU pools (0.4 of RAM instead of 0.5); its
    host tier gets min(90, 100 - 50) - 40 - 10 = 0; a run sized by --max-total-tokens keeps
    its flags; when less than 2 GiB would be left, the start is refused naming the claim."""
    machine(monkeypatch, ram_gib=100, free_gib=90)
    plain = EngineConfig.from_flags(device="cpu")
    assert with_host_memory(plain) is plain  # nobody else: unchanged
    assert claim_bytes(plain) == 50 * GIB
    other = Reservation(50 * GIB, "serve tiny-llama")
    assert claimed_bytes()[0] == 50 * GIB
    assert with_host_memory(plain).cache.mem_fraction_static == pytest.approx(0.4)
    assert with_host_memory(config()).cache.hicache_size == 0
    tokens = EngineConfig.from_flags(device="cpu", max_total_tokens=4096)
    assert with_host_memory(tokens) is tokens and claim_bytes(tokens) == 0
    more = Reservation(39 * GIB, "serve bench")
    with pytest.raises(
        SettingsError,
        match=r"other pipeserve runs on this host claim 89.0 of "
        r"100.0 GiB \(50.0 GiB by pid \d+ \(serve tiny-llama\), 39.0 GiB",
    ):
        with_host_memory(plain)
    more.release()
    other.release()
    assert claimed_bytes()[0] == 0
    assert with_host_memory(plain) is plain


def test_a_killed_runs_claim_counts_for_nothing() -> None:
    """A process that dies holding a claim (no shutdown, no exit handlers) leaves a file that
    the next reader drops."""
    code = (
        "import os, signal\n"
        "from pipeserve.mem_cache.host_reservations import Reservation\n"
        "r = Reservation(7 * 2**30, 'killed')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert done.returncode == -signal.SIGKILL
    folder = Path(os.environ["PIPESERVE_RESERVATIONS_DIR"])
    assert len(list(folder.glob("*.claim.json"))) == 1  # left behind
    assert claimed_bytes() == (0, [])
    assert not list(folder.glob("*.claim.json"))


def test_tier_pages_takes_the_ratio_up_to_the_cap() -> None:
    page = 1 << 20  # 1 MiB per host page
    c = config(hicache_size=1.0).cache  # 1024 pages
    assert tier_pages(c, 301, page) == (600, 0)  # default ratio 2 of 300 usable pages
    assert tier_pages(c, 1001, page) == (1024, 0)  # 2000 wanted: the cap
    assert tier_pages(config().cache, 1001, page) == (2000, 0)  # no cap decided (simulator)
    assert tier_pages(c, 1001, None) == (2000, 0)
    assert tier_pages(config(hicache_size=1.0, hicache_ratio=1.0).cache, 1001, page) == (1000, 0)
    with pytest.raises(ValueError, match=r"--hicache-ratio 1.5 .* use --hicache-ratio 1.02"):
        tier_pages(config(hicache_size=1.0, hicache_ratio=1.5).cache, 1001, page)
    with pytest.raises(ValueError, match="no host memory for HiCache's tier"):
        tier_pages(config(hicache_size=0.0001).cache, 1001, page)


def rss() -> int:
    """This process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_host_tier_is_not_touched_at_start() -> None:
    """2 GiB of host tier cost no resident memory until copies land in it (before: zeroed)."""
    pool = KVPool(64, range(1), 1, 64, torch.float32, torch.device("cpu"), 16)
    pages = (2 * GIB) // (2 * 64 * 4 * 16)  # K and V, one head of 64 floats, 16 slots a page
    before = rss()
    store = TierStore(pool, 16, pages, 0, None, "s0r0")
    assert sum(t.nbytes for t, _ in store.tiers[HOST]) >= 2 * GIB
    assert rss() - before < GIB // 8


def test_an_engine_with_default_flags_starts_and_serves(model_dir) -> None:
    """The real machine: --enable-hierarchical-cache and nothing else starts (the host tier
    capped by free memory), serves, and keeps its host tier within the cap."""
    with Engine(str(model_dir("tiny-llama")), enable_hierarchical_cache=True) as engine:
        stats = engine.backend.stats()
        cap = engine.config.cache.hicache_size
        out = engine.generate(
            input_ids=[[5, 6, 7, 8], [9, 10]], sampling_params={"max_new_tokens": 3}
        )
        a = engine.arch
        per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim  # K and V values
        per_token *= 4 if engine.config.model.dtype == "float32" else 2
    assert cap is not None and cap > 0
    assert 0 < stats["hicache_host_capacity_tokens"] * per_token <= cap * GIB
    assert all(len(o["output_ids"]) == 3 for o in out)


def test_a_second_engine_on_the_host_takes_what_the_first_left(model_dir) -> None:
    """The real machine: an engine with default flags claims --mem-fraction-static (0.5) of
    RAM; a second one started beside it takes 0.9 - 0.5 = 0.4 of RAM; the first's claim goes
    when it shuts down."""
    path = str(model_dir("tiny-llama"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with Engine(path, device="cpu") as first:
        assert claimed_bytes()[0] == int(ram * 0.5)
        with Engine(path, device="cpu") as second:
            assert second.config.cache.mem_fraction_static == pytest.approx(0.4, abs=1e-3)
            out = second.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
            assert isinstance(out, dict) and len(out["output_ids"]) == 2
        assert first.config.cache.mem_fraction_static == 0.5
    assert claimed_bytes() == (0, [])
