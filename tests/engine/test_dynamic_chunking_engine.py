"""Dynamic chunking end to end (float32, prompts of about 1000 tokens, initial size 256) on
the tiny model, PP1 and PP2.

With a real start-up profile, dynamic chunking runs (it may not fall back): every stage
timed the profile chunks, and the chunk sizes are the ones the recorded fit gives by the
formulas written out here (not by the implementation's predictor): they shrink with the
prefix, each costs about the first chunk's time under the fit, and the greedy tokens are
fixed chunking's. With synthetic profiles (the backend's profiler replaced in the test
process, where the fit is made) the sizes are exactly the formulas', for both cost models.
An unusable or too small profile falls back to fixed chunks. No page leaks.

C = 256 rather than 64: sizes are aligned to 64, so with C = 64 every chunk is 64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeserve.engine.chunking import ChunkPolicy
from pipeserve.engine.engine import Engine

pytestmark = pytest.mark.timeout(150)

C = 256
ALIGN = 64
VOCAB = 512
FLAGS: dict[str, Any] = {"dtype": "float32", "chunked_prefill_size": C,
                         "disable_radix_cache": True, "max_total_tokens": 8192}
DYNAMIC: dict[str, Any] = {"enable_dynamic_chunking": True,
                           "dynamic_chunking_smooth_factor": 1.0}
PROMPT_LENS = [1000, 1100, 70]
NEW_TOKENS = [6, 4, 9]
SAMPLING = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in NEW_TOKENS]
GROWING_A, GROWING_B = 1e-7, 2e-4  # synthetic published profile: f(l) = a l^2 + b l + 0.01
PREFIX = {"c": 0.002, "g": 1e-6, "b": 1e-5, "a": 5e-9}  # synthetic t(L, x)

Coefficients = dict[str, float]


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


def chunk_sizes(out: list[dict[str, Any]]) -> list[list[int]]:
    return [o["meta_info"]["chunk_sizes"] for o in out]


# -- the formulas, written out again ------------------------------------------------------------


def t(coef: Coefficients, L: float, x: float) -> float:
    """t(L, x) = c + g L + b x + a (2 L x + x^2)."""
    return coef["c"] + coef["g"] * L + coef["b"] * x + coef["a"] * (2 * L * x + x * x)


def root(coef: Coefficients, L: int) -> float:
    """x with t(L, x) = t(0, C); 0 when the prefix alone costs more, C when nothing grows."""
    a, lin = coef["a"], 2 * coef["a"] * L + coef["b"]
    const = coef["c"] + coef["g"] * L - t(coef, 0, C)
    if a > 0:
        return max((-lin + math.sqrt(lin * lin - 4 * a * const)) / (2 * a), 0.0)
    return max(-const / lin, 0.0) if lin > 0 else float(C)


def model_size(coef: Coefficients, L: int, s: float, floor: int) -> int:
    if L == 0:
        return C
    x = max(int(C + s * (root(coef, L) - C)), floor)
    return max(x // ALIGN * ALIGN, ALIGN)


def published(a: float, b: float) -> Coefficients:
    """The published chunk cost f(L + x) - f(L): c = g = 0, b clamped at 0."""
    return {"c": 0.0, "g": 0.0, "b": max(b, 0.0), "a": a}


def split(lens: list[int], size_at: Callable[[int], int], floor: int) -> list[list[int]]:
    """Chunk sizes of prompts of these lengths, scheduled first come first served, when the
    chunk at prefix L may hold size_at(L) tokens, a chunk that would leave fewer than `floor`
    tokens leaves two about equal ones instead, and each batch holds at most the first
    request's next chunk: a prompt that follows a finishing one fills the rest of that
    batch."""

    def size(i: int) -> int:
        x, left = size_at(prefix[i]), lens[i] - prefix[i]
        if 0 < left - x < floor:  # of the aligned sizes leaving at most x, the nearest half
            options = [k * ALIGN for k in range(1, x // ALIGN + 1) if left - k * ALIGN <= x]
            x = min(options, key=lambda y: (abs(left - 2 * y), -y)) if options else x
        return x

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


def expected_sizes(coef: Coefficients, s: float, floor: int) -> list[list[int]]:
    return split(PROMPT_LENS, lambda L: model_size(coef, L, s, floor), floor)


# -- engines ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(model_dir) -> Path:
    return model_dir("tiny-qwen3")


@pytest.fixture(scope="module")
def reference(model: Path) -> list[dict[str, Any]]:
    with Engine(str(model), **FLAGS) as engine:
        out = run(engine)
    assert chunk_sizes(out) == split(PROMPT_LENS, lambda _: C, 0)
    return out


@pytest.fixture(scope="module")
def pp2(model: Path) -> Iterator[Engine]:
    """A PP2 engine started with dynamic chunking on a fresh (uncached) profile."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPESERVE_PROFILE_CACHE", "0")
        with Engine(str(model), **FLAGS, **DYNAMIC, pp_size=2) as engine:
            yield engine


def assert_same_tokens(out: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert [len(o["output_ids"]) for o in out] == NEW_TOKENS


def assert_ran_on_the_real_profile(engine: Engine, stages: int) -> list[list[int]]:
    """Dynamic chunking ran on a profile that every stage timed, and the sizes are the ones
    its recorded fit gives; returns them."""
    info = engine.backend.chunking
    assert info["mode"] == "dynamic" and info["model"] == "prefix-quadratic"
    points, seconds = info["profile_points"], info["profile_seconds"]
    assert max(L + x for L, x in points) == engine.context_len  # prefixes up to the context
    assert len(info["profile_stage_seconds"]) == stages
    assert seconds == [max(per) for per in zip(*info["profile_stage_seconds"], strict=True)]
    assert all(s > 0 for per in info["profile_stage_seconds"] for s in per)
    coef, floor = info["coefficients"], info["min_size"]
    assert min(coef.values()) >= 0 and floor == ALIGN  # C // 8 = 32, aligned up to one unit
    assert t(coef, 0, C) == pytest.approx(info["target_s"])
    out = run(engine)
    sizes = chunk_sizes(out)
    assert sizes == expected_sizes(coef, 1.0, floor)
    first = sizes[0]
    assert first[0] == C and first[:-1] == sorted(first[:-1], reverse=True)
    assert len(set(first[:-1])) > 1  # they vary with the prefix
    prefix = C
    for x in first[1:-2]:  # each model-sized chunk is the largest within T (s = 1)
        assert x == ALIGN or t(coef, prefix, x) <= info["target_s"] < t(coef, prefix, x + ALIGN)
        prefix += x
    return [o["output_ids"] for o in out]


# -- real profiles ------------------------------------------------------------------------------


def test_pp1_dynamic_chunking_with_a_real_profile(model, reference, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    with Engine(str(model), **FLAGS, **DYNAMIC) as engine:
        tokens = assert_ran_on_the_real_profile(engine, stages=1)
    assert tokens == [r["output_ids"] for r in reference]


def test_pp2_dynamic_chunking_with_a_real_profile(pp2, reference) -> None:
    tokens = assert_ran_on_the_real_profile(pp2, stages=2)
    assert tokens == [r["output_ids"] for r in reference]


def test_pp2_published_model_with_a_real_profile(pp2, reference, monkeypatch) -> None:
    """The published sweep also goes through every stage; its fit may be unusable on a tiny
    model (then fixed chunks); the tokens never change."""
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    info = pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True, model="quadratic"))
    assert [L for L, _ in info["profile_points"]] == [0] * len(info["profile_points"])
    lengths = [x for _, x in info["profile_points"]]
    assert lengths[0] == int(1.25 * C) and len(set(lengths)) == len(lengths)
    assert len(info["profile_stage_seconds"]) == 2
    assert_same_tokens(run(pp2), reference)


def test_pp2_fixed_chunking(pp2, reference) -> None:
    assert pp2.backend.set_chunk_policy(ChunkPolicy(C)) == {"mode": "fixed", "chunk_size": C}
    out = run(pp2)
    assert_same_tokens(out, reference)
    assert chunk_sizes(out) == split(PROMPT_LENS, lambda _: C, 0)


# -- synthetic profiles -------------------------------------------------------------------------


def synthetic_prefix(*scales: float) -> Callable[..., list[list[float]]]:
    def profile(points: list[tuple[int, int]], runs: object = None) -> list[list[float]]:
        return [[k * t(PREFIX, L, x) for L, x in points] for k in scales]
    return profile


def synthetic_published(a: float, b: float) -> Callable[..., list[list[float]]]:
    def profile(points: list[tuple[int, int]], runs: object = None) -> list[list[float]]:
        assert all(L == 0 for L, _ in points)
        return [[a * n * n + b * n + 0.01 for _, n in points]]
    return profile


@pytest.mark.parametrize("smooth", [1.0, 0.5])
def test_pp2_published_model_sizes(pp2, reference, monkeypatch, smooth: float) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(pp2.backend, "profile_stages", synthetic_published(GROWING_A, GROWING_B))
    policy = ChunkPolicy(C, dynamic=True, smooth_factor=smooth, model="quadratic")
    info = pp2.backend.set_chunk_policy(policy)
    assert info["mode"] == "dynamic" and info["model"] == "quadratic"
    assert info["coefficients"] == pytest.approx({"a": GROWING_A, "b": GROWING_B, "c": 0.01},
                                                 rel=1e-4)
    out = run(pp2)
    assert_same_tokens(out, reference)
    sizes = chunk_sizes(out)
    fit = info["coefficients"]  # (the exact values may sit on an alignment boundary)
    assert sizes == expected_sizes(published(fit["a"], fit["b"]), smooth, C // 4)
    assert sizes[0][0] == C and len(set(sizes[0][:-1])) > 1  # later chunks are smaller


@pytest.mark.parametrize("smooth", [1.0, 0.75])
def test_pp2_prefix_model_sizes(pp2, reference, monkeypatch, smooth: float) -> None:
    """The second stage is 1.3 times slower: its times are the ones fitted."""
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(pp2.backend, "profile_stages", synthetic_prefix(1.0, 1.3))
    info = pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True, smooth_factor=smooth,
                                                    min_size=128))
    assert info["mode"] == "dynamic"
    assert info["coefficients"] == pytest.approx({k: 1.3 * v for k, v in PREFIX.items()},
                                                 rel=1e-6)
    out = run(pp2)
    assert_same_tokens(out, reference)
    sizes = chunk_sizes(out)
    assert sizes == expected_sizes(info["coefficients"], smooth, 128)
    assert sizes[0][0] == C and len(set(sizes[0][:-1])) > 1


def test_pp2_online_refit_keeps_tokens(pp2, reference, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(pp2.backend, "profile_stages", synthetic_prefix(1.0))
    pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True, smooth_factor=1.0, online=True,
                                             min_size=128))
    refit = pp2.backend.schedulers[0].refit
    assert refit is not None
    for _ in range(2):
        out = run(pp2)
        assert_same_tokens(out, reference)
    assert len(refit.points) > 0  # single-chunk micro-batches were measured
    first = chunk_sizes(out)[0]
    assert first[0] == C and all(x % ALIGN == 0 and x >= 128 for x in first[1:-2])


@pytest.mark.parametrize("model_name", ["prefix-quadratic", "quadratic"])
def test_pp2_unusable_fit_falls_back_to_fixed_chunks(pp2, reference, monkeypatch, caplog,
                                                     model_name: str) -> None:
    """A profile that gets cheaper with length or prefix: fixed chunks of C, with a warning."""
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    monkeypatch.setattr(pp2.backend, "profile_stages", lambda points, runs=None: [
        [1.0 - 1e-6 * (L + n) ** 2 + 1e-5 * n for L, n in points]])
    info = pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True, model=model_name))
    assert info["mode"] == "dynamic-disabled"
    assert "dynamic chunking disabled" in caplog.text
    out = run(pp2)
    assert_same_tokens(out, reference)
    assert chunk_sizes(out) == split(PROMPT_LENS, lambda _: C, 0)


def test_too_few_profile_points_fall_back_to_fixed_chunks(pp2, reference, monkeypatch) -> None:
    """A profile capped at C tokens has no prefix to time: fixed chunks, chunking stays."""
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    info = pp2.backend.set_chunk_policy(ChunkPolicy(C, dynamic=True, profile_max_len=C))
    assert info["mode"] == "dynamic-disabled" and "fewer than 6" in info["reason"]
    out = run(pp2)
    assert_same_tokens(out, reference)
    assert chunk_sizes(out) == split(PROMPT_LENS, lambda _: C, 0)


def test_profiling_on_a_live_engine_keeps_the_prefix_cache_valid(model, monkeypatch) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")
    ids = prompts()[0][:300]
    sp = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(str(model), dtype="float32", chunked_prefill_size=128,
                max_total_tokens=4096) as engine:
        before = engine.generate(input_ids=ids, sampling_params=sp)
        info = engine.backend.set_chunk_policy(ChunkPolicy(128, dynamic=True))
        after = engine.generate(input_ids=ids, sampling_params=sp)
    assert info["mode"] == "dynamic"
    assert isinstance(before, dict) and isinstance(after, dict)
    assert after["meta_info"]["cached_tokens"] == len(ids) - 1  # served from the cache
    assert after["output_ids"] == before["output_ids"]
