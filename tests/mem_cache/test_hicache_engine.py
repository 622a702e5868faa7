"""HiCache through the engine: prefixes evicted from the device KV pool move to the host (L2)
and disk (L3) tiers and a later hit loads them back.

- Tiny Llama, float32, in process, write-through and write-back: one prompt generated cold,
  again (a device hit: nothing loaded), after fillers evicted it from the device (loaded back
  from host memory, nothing from disk) and after more fillers pushed it out of host memory
  too (loaded back from disk). Every output (fillers included) has the tokens of an engine
  without any prefix cache and its output logprobs within 1e-4 (requests are handed in
  owing no prompt logprobs, which would bypass the cache); the hit counters and the
  request's cached tokens say which tier served each phase.
- The prefetch threshold: a lower-tier hit shorter than it is recomputed (nothing loaded),
  a longer one is loaded; tokens equal either way.
- A mixed workload (both policies): prefixes of every length, several requests at once,
  some recomputing their whole prompt for its logprobs, every tier under pressure; every
  output equals the no-cache engine's.
- PP2 (worker processes, two stages each holding its own layers' tiers): requests sharing
  96, 208 and 320 leading tokens of a prompt that fillers moved to host memory, one at a
  time and then side by side; tokens equal the in-process no-cache reference. Each worker
  holds its own unlinked disk file open.
- MLA (DeepSeek-V3, latent KV layout): cold and host-tier hit give the same tokens.
- The disk tier's file: open and unlinked at start (the storage directory is empty while
  the engine holds it).
- Flags HiCache cannot be combined with are refused with a message naming them.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.engine.engine import Engine
from pipeserve.mem_cache.hicache import HiCache, TierCounters
from pipeserve.scheduler.request import Req, SamplingParams

pytestmark = pytest.mark.timeout(300)

PAGE = 16
# a device pool of 40 pages (640 tokens): two 320-token prompts fill it, so a third evicts
FLAGS: dict[str, Any] = {
    "dtype": "float32",
    "chunked_prefill_size": 64,
    "max_total_tokens": 640,
    "page_size": PAGE,
}
SP = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
LOGPROB_TOL = 1e-4
# the hit of a 320-token prompt: every full page before its last token (304), less a page of
# slack for where the match may stop
FULL_HIT = 288


def _prompts(seed: int, *lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (n,), generator=gen).tolist() for n in lengths]


A, *FILLERS = _prompts(0, *[320] * 11)
B, C = FILLERS[:2]


def _request(prompt: list[int], prompt_logprobs: bool) -> Req:
    """A greedy request returning its output logprobs. One that wants its prompt's logprobs
    computes the whole prompt (no prefix cache); without `prompt_logprobs` it is handed in
    owing none, so it is served from the cache like a plain request (the prompt's own
    logprobs are not what these tests compare)."""
    req = Req(os.urandom(8).hex(), list(prompt), SamplingParams.from_dict(SP), return_logprob=True)
    if not prompt_logprobs:
        req.prompt_logprobs = [0.0] * (len(prompt) - 1)
    return req


def _generate(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    """One request's greedy tokens and output logprobs, the prefix cache serving it."""
    req = _request(prompt, prompt_logprobs=False)
    assert not req.wants_prompt_logprobs
    engine.validate(req)
    return engine.run([req])[0]


def _reference(path: Path, prompts: list[list[int]], **flags: Any) -> dict[tuple, dict]:
    with Engine(str(path), disable_radix_cache=True, **{**FLAGS, **flags}) as engine:
        return {tuple(p): _generate(engine, p) for p in prompts}


def _assert_same(out: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    assert out["meta_info"]["finish_reason"] == "length", what
    assert out["output_ids"] == ref["output_ids"], what
    got, want = out["output_logprobs"], ref["output_logprobs"]
    assert len(got) == len(want) == SP["max_new_tokens"], what
    err = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert err < LOGPROB_TOL, f"{what}: output logprobs differ by {err}"


def _delta(after: TierCounters, before: TierCounters) -> TierCounters:
    return TierCounters(**{k: getattr(after, k) - getattr(before, k) for k in vars(after)})


def _hicache(engine: Engine) -> HiCache:
    """The (only) attention rank's HiCache bookkeeping: the scheduler is in this process,
    also where the model runs in workers."""
    (scheduler,) = engine.backend.schedulers
    assert scheduler.kv.hicache is not None
    return scheduler.kv.hicache


def _counters(engine: Engine) -> TierCounters:
    return TierCounters(**vars(_hicache(engine).counters))


@pytest.fixture(scope="module")
def llama(model_dir) -> Path:
    return model_dir("tiny-llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def llama_ref(llama: Path) -> dict[tuple, dict]:
    shared = [A[:96] + s for s in _prompts(1, 48)]
    return _reference(llama, [A, *FILLERS, *shared])


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_tiers_serve_hits(llama: Path, llama_ref: dict, tmp_path: Path, policy: str) -> None:
    """Cold, device hit, host hit, disk hit: each from the tier it should come from, each
    with the no-cache tokens and logprobs."""
    # host tier: 80 pages, four prompts (write-through copies of the device's two among
    # them); the disk tier: 160 pages
    flags = {
        **FLAGS,
        "enable_hierarchical_cache": True,
        "hicache_write_policy": policy,
        "hicache_ratio": 2.0,
        "hicache_storage_dir": str(tmp_path),
        "hicache_prefetch_threshold": 0,
    }
    with Engine(str(llama), **flags) as engine:
        hicache = _hicache(engine)
        assert hicache.write_through == (policy == "write_through")
        phases = [("cold", [A]), ("device", [A]), ("host", [B, C, A]), ("disk", [*FILLERS[2:], A])]
        for phase, prompts in phases:
            before = _counters(engine)
            for i, p in enumerate(prompts):
                out = _generate(engine, p)
                _assert_same(out, llama_ref[tuple(p)], f"{policy} {phase} prompt {i}")
            got = _delta(_counters(engine), before)
            cached = out["meta_info"]["cached_tokens"]  # of A, the phase's last prompt
            if phase == "cold":
                assert cached == 0
            elif phase == "device":
                assert cached >= FULL_HIT
                assert got.loaded_host_tokens == got.loaded_disk_tokens == 0, got
            elif phase == "host":
                assert cached >= FULL_HIT
                assert got.loaded_host_tokens >= FULL_HIT, got
                assert got.loaded_disk_tokens == 0, got
            else:
                assert cached >= FULL_HIT
                assert got.loaded_disk_tokens >= FULL_HIT, got
            if phase == "device" and policy == "write_through":
                # written through once computed: A's pages are on the host tier already
                assert hicache.counters.backed_up_pages >= FULL_HIT // PAGE
                assert hicache.tokens("host")[0] >= FULL_HIT
            if phase == "device" and policy == "write_back":
                # nothing evicted yet, so nothing copied down
                assert hicache.counters.backed_up_pages == 0
                assert hicache.tokens("host")[0] == 0
            if phase == "disk":
                assert hicache.tokens("disk")[0] > 0
        stats = engine.backend.stats()
        assert stats["hicache_loaded_host_tokens"] == hicache.counters.loaded_host_tokens
        assert stats["hicache_loaded_disk_tokens"] == hicache.counters.loaded_disk_tokens
        assert stats["hicache_host_capacity_tokens"] == 80 * PAGE
        assert stats["hicache_disk_capacity_tokens"] > 0


def test_prefetch_threshold(llama: Path, llama_ref: dict) -> None:
    """A lower-tier hit under the threshold is recomputed, one over it is loaded."""
    shared = A[:96] + _prompts(1, 48)[0]
    flags = {
        **FLAGS,
        "enable_hierarchical_cache": True,
        "hicache_ratio": 4.0,
        "hicache_prefetch_threshold": 128,
    }
    with Engine(str(llama), **flags) as engine:
        for p in (A, B, C):  # A's KV leaves the device for the host tier
            _assert_same(_generate(engine, p), llama_ref[tuple(p)], "fill")
        before = _counters(engine)
        out = _generate(engine, shared)  # 96 tokens of A in the host tier: under 128
        _assert_same(out, llama_ref[tuple(shared)], "under the threshold")
        got = _delta(_counters(engine), before)
        assert got.skipped_loads == 1, got
        assert got.loaded_host_tokens == got.loaded_disk_tokens == 0, got
        assert out["meta_info"]["cached_tokens"] == 0
        before = _counters(engine)
        out = _generate(engine, A)  # its first 96 tokens recomputed, 208 in the host tier
        _assert_same(out, llama_ref[tuple(A)], "over the threshold")
        got = _delta(_counters(engine), before)
        assert got.skipped_loads == 0, got
        assert got.loaded_host_tokens == 208, got
        assert out["meta_info"]["cached_tokens"] == 304


def _mixed_workload(seed: int, steps: int) -> list[list[tuple[list[int], bool]]]:
    """Groups of requests submitted together: prefixes of a few documents (any length, not
    page-aligned) with their own suffixes, some repeated; True marks a request that wants
    its prompt logprobs (it computes its whole prompt, then caches it like any other)."""
    rng = random.Random(seed)
    docs = _prompts(seed, 160, 240, 320, 320)
    suffixes = iter(_prompts(seed + 1, *[rng.randint(0, 40) for _ in range(3 * steps)]))
    seen: list[list[int]] = []
    groups = []
    for _ in range(steps):
        group = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            if seen and rng.random() < 0.2:
                p = rng.choice(seen)
            else:
                doc = rng.choice(docs)
                p = doc[: rng.randint(2, len(doc))] + next(suffixes)
                seen.append(p)
            group.append((p, rng.random() < 0.15))
        groups.append(group)
    return groups


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_mixed_workload(llama: Path, tmp_path: Path, policy: str) -> None:
    """Requests sharing prefixes of every length, several at once, under pressure on every
    tier (a host tier of 50 pages, a disk tier of 20: every counter below moves), some
    recomputing their whole prompt for its logprobs: every output equals the no-cache
    engine's."""
    groups = _mixed_workload(seed=5, steps=30)
    ref = _reference(llama, [p for g in groups for p, _ in g])
    flags = {
        **FLAGS,
        "enable_hierarchical_cache": True,
        "hicache_write_policy": policy,
        "hicache_ratio": 1.25,
        "hicache_storage_dir": str(tmp_path),
        "hicache_storage_ratio": 0.5,
        "hicache_prefetch_threshold": 32,
    }
    with Engine(str(llama), **flags) as engine:
        for i, group in enumerate(groups):
            outs = engine.run([_request(p, full) for p, full in group])
            for (p, _), out in zip(group, outs, strict=True):
                _assert_same(out, ref[tuple(p)], f"{policy} group {i}, {len(p)} tokens")
        counters = _hicache(engine).counters
    assert counters.loaded_host_tokens > 0 and counters.loaded_disk_tokens > 0, counters
    assert counters.skipped_loads > 0 and counters.dropped_pages > 0, counters


def _disk_files(pid: int | str, directory: Path) -> list[str]:
    """The files in `directory` the process holds open that were unlinked."""
    fds = Path(f"/proc/{pid}/fd")
    targets = []
    for fd in fds.iterdir():
        try:
            targets.append(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
    return [t for t in targets if t.startswith(str(directory)) and t.endswith("(deleted)")]


def test_pp2_shared_prefixes(model_dir, tmp_path: Path) -> None:
    """Two stages in worker processes: requests sharing 96, 208 and 320 tokens of a prompt
    whose KV fillers moved to the host tier, one at a time and side by side."""
    path = model_dir("tiny-llama", num_hidden_layers=4)
    suffixes = _prompts(2, *[48] * 6)
    shares = [96, 208, 320]
    one_by_one = [A[:n] + s for n, s in zip(shares, suffixes[:3], strict=True)]
    together = [A[:n] + s for n, s in zip(shares, suffixes[3:], strict=True)]
    ref = _reference(path, [A, B, C, *one_by_one, *together])
    flags = {
        **FLAGS,
        "pp_size": 2,
        "enable_hierarchical_cache": True,
        "hicache_ratio": 4.0,
        "hicache_prefetch_threshold": 0,
        "hicache_storage_dir": str(tmp_path),
    }
    with Engine(str(path), **flags) as engine:
        # one disk file per worker, open and unlinked
        assert list(tmp_path.iterdir()) == []
        pids = [p.pid for p in engine.backend.workers.procs]
        files = [set(_disk_files(pid, tmp_path)) for pid in pids]
        assert [len(f) for f in files] == [1, 1], files
        assert files[0] != files[1]
        hicache = _hicache(engine)
        _assert_same(_generate(engine, A), ref[tuple(A)], "A")
        for n, p in zip(shares, one_by_one, strict=True):
            for f in (B, C):
                _assert_same(_generate(engine, f), ref[tuple(f)], "filler")
            before = _counters(engine)
            out = _generate(engine, p)
            _assert_same(out, ref[tuple(p)], f"sharing {n}")
            assert out["meta_info"]["cached_tokens"] == n
            got = _delta(_counters(engine), before)
            assert got.loaded_host_tokens > 0, got
        for f in (B, C):
            _assert_same(_generate(engine, f), ref[tuple(f)], "filler")
        before = _counters(engine)
        outs = engine.run([_request(p, prompt_logprobs=False) for p in together])
        for n, p, out in zip(shares, together, outs, strict=True):
            _assert_same(out, ref[tuple(p)], f"side by side, sharing {n}")
        assert _delta(_counters(engine), before).loaded_host_tokens > 0
        assert hicache.counters.loaded_disk_tokens == 0
        assert engine.backend.stats()["hicache_loaded_host_tokens"] == (
            hicache.counters.loaded_host_tokens
        )


def test_mla_latent_tiers(model_dir) -> None:
    """DeepSeek-V3's latent KV goes through the host tier and back."""
    path = model_dir("tiny-deepseek-v3", num_hidden_layers=2)
    flags = {
        **FLAGS,
        "enable_hierarchical_cache": True,
        "hicache_ratio": 4.0,
        "hicache_prefetch_threshold": 0,
    }
    with Engine(str(path), **flags) as engine:
        pool = engine.backend.runner.kv_pool
        assert pool.latents and not pool.k  # the latent layout
        cold = _generate(engine, A)
        assert cold["meta_info"]["cached_tokens"] == 0
        for p in (B, C):
            _generate(engine, p)
        before = _counters(engine)
        hit = _generate(engine, A)
        got = _delta(_counters(engine), before)
        assert got.loaded_host_tokens >= FULL_HIT, got
        assert hit["meta_info"]["cached_tokens"] >= FULL_HIT
        _assert_same(hit, cold, "host-tier hit against cold")


def test_disk_file_unlinked(llama: Path, tmp_path: Path) -> None:
    """The disk tier's file is reserved, kept open and unlinked at start."""
    store = tmp_path / "kv"
    flags = {
        **FLAGS,
        "enable_hierarchical_cache": True,
        "hicache_storage_dir": str(store),
        "hicache_storage_ratio": 2.0,
    }
    with Engine(str(llama), **flags) as engine:
        assert store.is_dir() and list(store.iterdir()) == []
        files = _disk_files("self", store)
        assert len(files) == 1, files
        assert "pipeserve-hicache-" in files[0]
        stats = engine.backend.stats()
        assert stats["hicache_disk_capacity_tokens"] == 80 * PAGE
        assert stats["hicache_disk_tokens"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"cp_size": 2}, r"--enable-hierarchical-cache with --cp-size > 1 is not built yet"),
        ({"disable_radix_cache": True}, r"drop --disable-radix-cache"),
        ({"hicache_ratio": 0.0}, r"--hicache-ratio 0.0 must be positive"),
        ({"hicache_write_policy": "write_around"}, r"--hicache-write-policy 'write_around'"),
    ],
)
def test_bad_flags(llama: Path, flags: dict[str, Any], message: str) -> None:
    """Refused before anything starts; the same flags without HiCache are fine."""
    with pytest.raises(ValueError, match=message):
        Engine(str(llama), enable_hierarchical_cache=True, **flags)
    EngineConfig.from_flags(model_path=str(llama), **flags)


def test_metrics_show_each_tier(llama: Path, tmp_path: Path) -> None:
    """/metrics' HiCache gauges follow the engine's stats: tokens held, capacity and tokens
    loaded back per lower tier."""
    from pipeserve.server.metrics import Metrics

    flags = {**FLAGS, "enable_hierarchical_cache": True, "hicache_storage_dir": str(tmp_path)}
    with Engine(str(llama), **flags) as engine:
        for p in (A, B, C, A):
            _generate(engine, p)
        stats = engine.backend.stats()
    metrics = Metrics()
    metrics.update(stats, healthy=True)
    text = metrics.render().decode()
    for tier in ("host", "disk"):
        for name, key in (
            ("pipeserve_hicache_tokens", f"hicache_{tier}_tokens"),
            ("pipeserve_hicache_capacity_tokens", f"hicache_{tier}_capacity_tokens"),
            ("pipeserve_hicache_loaded_tokens", f"hicache_loaded_{tier}_tokens"),
        ):
            assert f'{name}{{tier="{tier}"}} {float(stats[key])}' in text
    assert stats["hicache_loaded_host_tokens"] > 0 and stats["hicache_host_tokens"] > 0
