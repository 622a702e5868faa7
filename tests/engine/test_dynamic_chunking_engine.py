"""Dynamic chunking end to end (float32, prompts of about 1000 tokens, initial size 256):
the same greedy tokens as fixed chunking and as one process, with PP1 and PP2, whether the
start-up profile fits a usable cost model or falls back to fixed chunks; every request's
chunk sizes are the ones its policy prescribes; no page leaks.

C = 256 rather than 64: sizes are floored at C // 4 and aligned to 64, so with C = 64 every
chunk is 64 whatever the fit. A real profile of a tiny model on a CPU may fit a <= 0 (the
feature then falls back to fixed chunks, which is allowed); a synthetic profile (the
backend's profiler replaced in the test process, where the fit is made) makes the sizes
vary for certain.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.engine.chunking import ChunkPolicy
from pipeserve.engine.engine import Engine
from pipeserve.scheduler.dynamic_chunking import ChunkSizePredictor

pytestmark = pytest.mark.timeout(150)

C = 256
VOCAB = 512
FLAGS: dict[str, Any] = {"dtype": "float32", "chunked_prefill_size": C,
                         "disable_radix_cache": True, "max_total_tokens": 8192}
PROMPT_LENS = [1000, 1100, 70]
NEW_TOKENS = [6, 4, 9]
SAMPLING = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in NEW_TOKENS]
GROWING_A, GROWING_B = 1e-7, 2e-4  # synthetic profile: f(l) = a l^2 + b l + 0.01


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def run(engine: Engine) -> list[dict[str, Any]]:
    out = engine.generate(input_ids=prompts(), sampling_params=SAMPLING)
    assert isinstance(out, list)
    stats = engine.backend.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]  # no radix cache: all free
    return out


def split(lens: list[int], size_at: Any, tail_floor: int = 0) -> list[list[int]]:
    """Chunk sizes of prompts of these lengths, scheduled first come first served, when the
    chunk at prefix L may hold size_at(L) tokens (a chunk that would leave fewer than
    `tail_floor` tokens takes the rest), and each batch holds at most the first request's
    next chunk: a prompt that follows a finishing one fills the rest of that batch."""

    def size(i: int) -> int:
        x, left = size_at(prefix[i]), lens[i] - prefix[i]
        return left if 0 < left - x < tail_floor else x

    sizes: list[list[int]] = [[] for _ in lens]
    prefix, i = [0] * len(lens), 0
    while i < len(lens):
        budget = size(i)
        while budget > 0 and i < len(lens):
            x = min(lens[i] - prefix[i], size(i), budget)
            sizes[i].append(x)
            prefix[i] += x
            budget -= x
            if prefix[i] < lens[i]:
                break
            i += 1
    return sizes


def prescribed_sizes(engine: Engine) -> list[list[int]]:
    """The chunk sizes the installed policy (engine.backend.chunking) prescribes."""
    info = engine.backend.chunking
    if info["mode"] in ("fixed", "dynamic-disabled"):
        return split(PROMPT_LENS, lambda _: C)
    assert info["mode"] == "dynamic"
    predictor = ChunkSizePredictor(info["a"], info["b"], info["c"], C, info["smooth_factor"],
                                   engine.config.cache.page_size)
    context = engine.context_len
    budget = engine.config.scheduler.max_prefill_tokens
    return split(PROMPT_LENS, lambda L: predictor.next_chunk_size(L, context - L, budget), C // 4)


def spec_size(a: float, b: float, prefix: int, s: float) -> int:
    """Spec 01 section 4 for page size 1 (alignment 64)."""
    if prefix == 0:
        return C
    target = a * C * C + b * C
    lin = 2 * a * prefix + b
    root = (-lin + math.sqrt(lin * lin + 4 * a * target)) / (2 * a)
    x = max(int(C + s * (root - C)), C // 4)
    return max(x // 64 * 64, 64)


def synthetic(a: float, b: float) -> Any:
    def profile(lengths: list[int], runs: object = None) -> list[float]:
        return [a * n * n + b * n + 0.01 for n in lengths]
    return profile


@pytest.fixture(scope="module")
def model(model_dir) -> Path:
    return model_dir("tiny-qwen3")


@pytest.fixture(scope="module")
def reference(model: Path) -> list[dict[str, Any]]:
    with Engine(str(model), **FLAGS) as engine:
        out = run(engine)
    assert [o["meta_info"]["chunk_sizes"] for o in out] == split(PROMPT_LENS, lambda _: C)
    return out


@pytest.fixture(scope="module")
def pp2(model: Path) -> Iterator[Engine]:
    """A PP2 engine started with dynamic chunking on a fresh (uncached) profile."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPESERVE_PROFILE_CACHE", "0")
        with Engine(str(model), **FLAGS, pp_size=2, enable_dynamic_chunking=True) as engine:
            yield engine


def assert_same_tokens(out: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert [len(o["output_ids"]) for o in out] == NEW_TOKENS


def test_pp1_dynamic_chunking_with_a_real_profile(model, reference, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    with Engine(str(model), **FLAGS, enable_dynamic_chunking=True) as engine:
        info = engine.backend.chunking
        assert info["mode"] in ("dynamic", "dynamic-disabled")
        assert info["profile_lengths"][0] == int(1.25 * C)
        assert len(info["profile_seconds"]) == len(info["profile_lengths"])
        out = run(engine)
    assert_same_tokens(out, reference)
    assert [o["meta_info"]["chunk_sizes"] for o in out] == prescribed_sizes(engine)


def test_pp2_dynamic_chunking_with_a_real_profile(pp2, reference) -> None:
    info = pp2.backend.chunking
    assert info["mode"] in ("dynamic", "dynamic-disabled")
    assert all(t > 0 for t in info["profile_seconds"])  # measured on the first stage
    out = run(pp2)
    assert_same_tokens(out, reference)
    assert [o["meta_info"]["chunk_sizes"] for o in out] == prescribed_sizes(pp2)


def test_pp2_fixed_chunking(pp2, reference) -> None:
    assert pp2.backend.set_chunk_policy(ChunkPolicy(C)) == {"mode": "fixed", "chunk_size": C}
    out = run(pp2)
    assert_same_tokens(out, reference)
    assert [o["meta_info"]["chunk_sizes"] for o in out] == split(PROMPT_LENS, lambda _: C)


@pytest.mark.parametrize("smooth", [1.0, 0.5])
def test_pp2_dynamic_chunking_sizes_vary_and_tokens_do_not(pp2, reference, monkeypatch,
                                                          smooth: float) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(pp2.backend, "profile_first_stage", synthetic(GROWING_A, GROWING_B))
    info = pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True, smooth_factor=smooth))
    assert info["mode"] == "dynamic"
    assert info["a"] == pytest.approx(GROWING_A, rel=1e-4)
    assert info["b"] == pytest.approx(GROWING_B, rel=1e-4)
    out = run(pp2)
    assert_same_tokens(out, reference)
    sizes = [o["meta_info"]["chunk_sizes"] for o in out]
    expected = split(PROMPT_LENS, lambda L: spec_size(GROWING_A, GROWING_B, L, smooth), C // 4)
    assert sizes == expected
    assert sizes[0][0] == C and len(set(sizes[0][:-1])) > 1  # later chunks are smaller
    # aligned and floored, except last chunks and a prompt's first chunk filling the rest of
    # the batch where the previous prompt ended
    middle = sizes[0][:-1] + [x for s in sizes[1:] for x in s[1:-1]]
    assert all(x % 64 == 0 and x >= C // 4 for x in middle)


def test_pp2_online_refit_keeps_tokens(pp2, reference, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(pp2.backend, "profile_first_stage", synthetic(GROWING_A, GROWING_B))
    pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True, smooth_factor=1.0, online=True))
    refit = pp2.backend.scheduler.refit
    assert refit is not None
    for _ in range(2):
        out = run(pp2)
        assert_same_tokens(out, reference)
    assert len(refit.points) > 0  # single-chunk micro-batches were measured
    assert all(x % 64 == 0 and x >= C // 4
               for o in out for x in o["meta_info"]["chunk_sizes"][:-1])


def test_pp2_unusable_fit_falls_back_to_fixed_chunks(pp2, reference, monkeypatch,
                                                     caplog) -> None:
    """A profile that gets cheaper with length fits a < 0: fixed chunks of C, with a warning."""
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(pp2.backend, "profile_first_stage",
                        lambda lengths, runs=None: [1.0 - 1e-6 * n * n for n in lengths])
    info = pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True, smooth_factor=0.75))
    assert info["mode"] == "dynamic-disabled" and info["a"] <= 0
    assert "dynamic chunking disabled" in caplog.text
    out = run(pp2)
    assert_same_tokens(out, reference)
    assert [o["meta_info"]["chunk_sizes"] for o in out] == split(PROMPT_LENS, lambda _: C)


def test_too_few_profile_points_fall_back_to_fixed_chunks(pp2, reference, monkeypatch) -> None:
    """A profile that fails to fit (fewer than 8 points) must not disable chunking."""
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(pp2.backend, "profile_first_stage",
                        lambda lengths, runs=None: [1.0] * len(lengths))
    monkeypatch.setattr("pipeserve.engine.chunking.profile_lengths", lambda size: [size] * 5)
    info = pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True))
    assert info["mode"] == "dynamic-disabled"
    out = run(pp2)
    assert_same_tokens(out, reference)
    assert [o["meta_info"]["chunk_sizes"] for o in out] == split(PROMPT_LENS, lambda _: C)


def test_profiling_on_a_live_engine_keeps_the_prefix_cache_valid(model, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    ids = prompts()[0][:300]
    sp = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(str(model), dtype="float32", chunked_prefill_size=128,
                max_total_tokens=4096) as engine:
        before = engine.generate(input_ids=ids, sampling_params=sp)
        engine.backend.set_chunk_policy(ChunkPolicy(128, dynamic=True))
        after = engine.generate(input_ids=ids, sampling_params=sp)
    assert isinstance(before, dict) and isinstance(after, dict)
    assert after["meta_info"]["cached_tokens"] == len(ids) - 1  # served from the cache
    assert after["output_ids"] == before["output_ids"]
