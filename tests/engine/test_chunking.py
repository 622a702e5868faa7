"""The chunk policy installed on a real scheduler, without a model: every batch is answered
by a stub, the profile is synthetic. Dynamic chunking at s = 0 is fixed chunking exactly;
the prefix model shrinks the chunks of a long prompt as a solver written out here predicts;
the first chunk after a cached prefix; no tiny last chunk; the slowest stage's time per
profile point is what gets fitted; the profile cache keys on the profile points."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import pytest
import torch

from pipeserve.config import SchedulerConfig
from pipeserve.device import min_pipeline_chunk
from pipeserve.engine.chunking import ChunkPolicy, setup_chunking
from pipeserve.scheduler.batch import BatchResult
from pipeserve.scheduler.chunk_cost import AUTO_CHUNK_BUDGET_S, PROFILE_BUDGET_S, profile_grid
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.scheduler.scheduler import Scheduler

EOS = 10**6
C = 2048
PREFIX = {"c": 0.01, "g": 2e-6, "b": 1e-4, "a": 4e-9}  # prefix-dominated beyond ~8 C
Profiler = Callable[[list[tuple[int, int]], float], list[list[float]]]


@pytest.fixture(autouse=True)
def no_profile_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "0")


def t(L: float, x: float, coef: dict[str, float] = PREFIX) -> float:
    return coef["c"] + coef["g"] * L + coef["b"] * x + coef["a"] * (2 * L * x + x * x)


def synthetic(*scales: float) -> Profiler:
    """One stage per scale, each timing t(L, x) times its scale."""
    return lambda points, budget_s: [[k * t(L, x) for L, x in points] for k in scales or (1.0,)]


def make_scheduler(tokens: int = 1 << 17, page_size: int = 1, radix: bool = False) -> Scheduler:
    kv = KVManager(tokens // page_size + 1, page_size, not radix)
    return Scheduler(SchedulerConfig(), kv, tokens, (EOS,))


def serve(sched: Scheduler, prompts: list[list[int]]) -> list[list[int]]:
    """Chunk sizes of each prompt, all prompts queued at once, prefill only."""
    reqs = [
        Req(f"r{len(sched._released)}-{i}", p, SamplingParams(max_new_tokens=1))
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        sched.add_request(req)
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        n = sum(s.sample for s in batch.slices)
        sched.process_result(
            batch, BatchResult(batch.batch_id, [1] * n, [0.0] * n, [[] for _ in batch.slices])
        )
    return [req.chunk_sizes for req in reqs]


def prompt(n: int, start: int = 2) -> list[int]:
    return [start + i % 1000 for i in range(n)]


def sizes_with(policy: ChunkPolicy, lens: list[int], page_size: int = 1) -> list[list[int]]:
    sched = make_scheduler(page_size=page_size)
    setup_chunking(policy, sched, synthetic(), {})
    return serve(sched, [prompt(n) for n in lens])


# -- s = 0 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["prefix-quadratic", "quadratic"])
@pytest.mark.parametrize(("size", "page"), [(2048, 1), (1000, 16), (100, 64)])
def test_smooth_factor_zero_is_fixed_chunking(model: str, size: int, page: int) -> None:
    lens = [9000, 2100, 70, size + 1, 3 * size]
    fixed = sizes_with(ChunkPolicy(size), lens, page_size=page)
    dynamic = sizes_with(
        ChunkPolicy(size, dynamic=True, smooth_factor=0.0, model=model), lens, page_size=page
    )
    assert dynamic == fixed
    assert set(fixed[0][:-1]) == {size}  # (a later prompt may first fill the previous batch)


# -- the prefix model on a long prompt --------------------------------------------------------


def model_size(L: int, s: float, floor: int) -> int:
    """The prefix model's next chunk by the formulas, written out here."""
    if L == 0:
        return C
    a, lin = PREFIX["a"], 2 * PREFIX["a"] * L + PREFIX["b"]
    const = PREFIX["c"] + PREFIX["g"] * L - t(0, C)
    root = max((-lin + math.sqrt(lin * lin - 4 * a * const)) / (2 * a), 0.0)
    x = max(int(C + s * (root - C)), floor)
    return max(x // 64 * 64, 64)


def balanced(x: int, rest: int, floor: int) -> int:
    """When x would leave fewer than `floor` tokens (but some): of the aligned sizes that
    leave at most x for one last chunk, the one nearest rest / 2."""
    if not 0 < rest - x < floor:
        return x
    options = [k * 64 for k in range(1, x // 64 + 1) if rest - k * 64 <= x]
    return min(options, key=lambda y: (abs(rest - 2 * y), -y)) if options else x


def walk(length: int, s: float, floor: int, start: int = 0) -> list[int]:
    """Chunk sizes of one prompt: the model's sizes, no tiny last chunk."""
    sizes, done = [], start
    while done < length:
        rest = length - done
        sizes.append(min(balanced(model_size(done, s, floor), rest, floor), rest))
        done += sizes[-1]
    return sizes


@pytest.mark.parametrize(("s", "floor"), [(1.0, 128), (0.75, 256), (0.9, 64)])
def test_prefix_model_chunks_shrink_as_predicted(s: float, floor: int) -> None:
    policy = ChunkPolicy(C, dynamic=True, smooth_factor=s, min_size=floor)
    (sizes,) = sizes_with(policy, [60000])
    assert sizes == walk(60000, s, floor)
    assert sizes[0] == C and sizes[:-1] == sorted(sizes[:-1], reverse=True)
    assert min(sizes[:-1]) < C // 2  # they really shrink


def test_the_default_floor_of_the_prefix_model_is_an_eighth() -> None:
    policy = ChunkPolicy(C, dynamic=True, smooth_factor=1.0)
    (sizes,) = sizes_with(policy, [120000])
    assert sizes == walk(120000, 1.0, C // 8)
    assert min(sizes[:-2]) == C // 8  # (the last two may share less than 2 floors)


def test_no_tiny_last_chunk() -> None:
    policy = ChunkPolicy(C, dynamic=True, smooth_factor=1.0, min_size=256)
    for length in (C + 100, 4000, 12345, 30001):
        (sizes,) = sizes_with(policy, [length])
        assert sum(sizes) == length
        assert sizes[-1] >= 256 or abs(sizes[-1] - sizes[-2]) <= 64  # or the last two balanced
        assert sizes == walk(length, 1.0, 256)


# -- the first chunk after a cached prefix ----------------------------------------------------


@pytest.mark.parametrize("model", ["prefix-quadratic", "quadratic"])
def test_first_chunk_after_a_cached_prefix(model: str) -> None:
    sched = make_scheduler(radix=True)
    policy = ChunkPolicy(C, dynamic=True, smooth_factor=1.0, model=model, min_size=128)
    info = setup_chunking(policy, sched, synthetic(), {})
    shared = prompt(20000)
    serve(sched, [shared])
    (sizes,) = serve(sched, [shared + prompt(5000, start=3)])
    cached = 25000 - sum(sizes)
    assert cached >= 19000  # served from the prefix cache
    if model == "quadratic":  # published: the first chunk is C wherever it starts
        assert sizes[0] == C
    else:  # the model's size at the cached prefix: about T, not t(L, C) > T
        assert sizes[0] == model_size(cached, 1.0, 128) < C
        assert t(cached, sizes[0]) <= info["target_s"] < t(cached, C)


# -- the profile: every stage, the slowest counts ---------------------------------------------


def test_the_slowest_stage_per_point_is_fitted() -> None:
    sched = make_scheduler()
    info = setup_chunking(ChunkPolicy(C, dynamic=True), sched, synthetic(1.0, 1.5), {})
    assert info["mode"] == "dynamic" and info["model"] == "prefix-quadratic"
    assert len(info["profile_stage_seconds"]) == 2
    stage0, stage1 = info["profile_stage_seconds"]
    assert info["profile_seconds"] == [max(a, b) for a, b in zip(stage0, stage1, strict=True)]
    assert info["coefficients"] == pytest.approx({k: 1.5 * v for k, v in PREFIX.items()})
    assert info["target_s"] == pytest.approx(1.5 * t(0, C))


def test_stages_slowest_at_different_points() -> None:
    """Stage 0 dearer per token, stage 1 dearer with the prefix: the max of both."""
    heavy_prefix = {**PREFIX, "g": 3 * PREFIX["g"], "a": 3 * PREFIX["a"]}
    heavy_tokens = {**PREFIX, "b": 3 * PREFIX["b"]}

    def profile(points: list[tuple[int, int]], budget_s: float) -> list[list[float]]:
        return [
            [t(L, x, heavy_tokens) for L, x in points],
            [t(L, x, heavy_prefix) for L, x in points],
        ]

    info = setup_chunking(ChunkPolicy(C, dynamic=True), make_scheduler(), profile, {})
    for (L, x), s in zip(info["profile_points"], info["profile_seconds"], strict=True):
        assert s == max(t(L, x, heavy_tokens), t(L, x, heavy_prefix))


def test_profile_points_fit_in_free_kv_and_context() -> None:
    sched = make_scheduler(tokens=10000, radix=True)
    serve(sched, [prompt(3000)])  # cached now: the profile must not evict it
    free = sched.kv.allocator.num_free
    info = setup_chunking(ChunkPolicy(C, dynamic=True), sched, synthetic(), {})
    assert max(L + x for L, x in info["profile_points"]) == free
    policy = ChunkPolicy(C, dynamic=True, profile_max_len=5000)
    info = setup_chunking(policy, make_scheduler(), synthetic(), {})
    assert max(L + x for L, x in info["profile_points"]) == 5000


def test_an_unusable_profile_falls_back_to_fixed_chunks(caplog: pytest.LogCaptureFixture) -> None:
    def flat(points: list[tuple[int, int]], budget_s: float) -> list[list[float]]:
        return [[0.01 + 1e-4 * x for _, x in points]]

    sched = make_scheduler()
    with caplog.at_level(logging.WARNING, logger="pipeserve.engine.chunking"):
        info = setup_chunking(ChunkPolicy(C, dynamic=True), sched, flat, {})
    assert info["mode"] == "dynamic-disabled" and "does not grow" in info["reason"]
    assert "dynamic chunking disabled" in caplog.text and f"fixed chunks of {C}" in caplog.text
    assert serve(sched, [prompt(5000)]) == [[C, C, 5000 - 2 * C]]


def test_the_profile_cache_keys_on_the_points(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PIPESERVE_PROFILE_CACHE", "1")
    monkeypatch.setenv("PIPESERVE_CACHE_DIR", str(tmp_path))
    calls: list[list[tuple[int, int]]] = []

    def profile(points: list[tuple[int, int]], budget_s: float) -> list[list[float]]:
        calls.append(points)
        return synthetic(1.0, 1.2)(points, budget_s)

    policies = [
        ChunkPolicy(C, dynamic=True),
        ChunkPolicy(C, dynamic=True, smooth_factor=0.5),
        ChunkPolicy(C, dynamic=True, profile_max_len=8192),
        ChunkPolicy(C, dynamic=True, model="quadratic"),
    ]
    infos = [setup_chunking(p, make_scheduler(), profile, {"model": "m"}) for p in policies]
    assert len(calls) == 3  # the smoothing factor does not change the profile
    assert infos[1]["profile_stage_seconds"] == infos[0]["profile_stage_seconds"]
    assert len(infos[1]["profile_stage_seconds"]) == 2  # every stage's list, from the cache


def test_no_room_to_profile_falls_back_to_fixed_chunks() -> None:
    sched = make_scheduler(tokens=400)  # less free KV than a quarter chunk
    info = setup_chunking(ChunkPolicy(C, dynamic=True), sched, synthetic(), {})
    assert info["mode"] == "dynamic-disabled" and info["profile_points"] == []


# -- the size picked for a PP/TP layout when none is given ----------------------------------


def per_token_profile(per_token: dict[int, float]) -> Profiler:
    """Prefix-0 chunks of n tokens cost n * per_token[n] on each of two stages (the second
    a little slower: the slowest stage counts)."""
    return lambda points, budget_s: [[x * per_token[x] * k for _, x in points] for k in (1.0, 1.1)]


FLAT = {256: 1e-4, 512: 1e-4, 1024: 0.99e-4, 2048: 1e-4, 4096: 1.02e-4}  # a CPU: no knee
STEEP = {256: 8e-4, 512: 4e-4, 1024: 2e-4, 2048: 1.1e-4, 4096: 1e-4}  # kernels fill at ~4K


@pytest.mark.parametrize(
    ("device", "per_token", "expected"),
    [
        ("cpu", FLAT, 512),  # the knee is at the first candidate: the CPU floor decides
        ("cuda", FLAT, 2048),  # the accelerator floor
        ("cpu", STEEP, 4096),  # 2048 is 10% slower per token than 4096: beyond the 5% slack
        ("cuda", {**STEEP, 2048: 1.04e-4}, 2048),  # within the slack: the smaller one
    ],
)
def test_a_layout_without_a_size_gets_the_rule_s_pick(
    device: str, per_token: dict[int, float], expected: int
) -> None:
    sched = make_scheduler()
    floor = min_pipeline_chunk(torch.device(device))
    info = setup_chunking(
        ChunkPolicy(2048, auto=True, pipeline_floor=floor), sched, per_token_profile(per_token), {}
    )
    assert info["mode"] == "fixed" and info["chunk_size"] == expected
    assert info["auto"]["chunk_size"] == expected
    assert serve(sched, [prompt(3 * expected + 5)]) == [[expected] * 3 + [5]]


def test_dynamic_chunking_without_a_size_starts_at_twice_the_pick() -> None:
    sched = make_scheduler()
    info = setup_chunking(
        ChunkPolicy(2048, dynamic=True, auto=True), sched, per_token_profile(FLAT), {}
    )
    assert info["auto"]["chunk_size"] == 512 and info["initial_size"] == 1024


def test_profile_cache_key_names_the_code_that_ran(tmp_path) -> None:
    """A profile timed by other kernels (an upgrade) must not be reused: the key holds a
    digest of pipeserve's sources, and the attention backend."""
    from pipeserve.config import EngineConfig
    from pipeserve.engine.backend import code_fingerprint, profile_key, source_digest

    src = tmp_path / "src"
    (src / "kernels").mkdir(parents=True)
    (src / "kernels" / "attention.cpp").write_text("int f() { return 1; }")
    before = source_digest(src)
    (src / "kernels" / "attention.cpp").write_text("int f() { return 2; }")
    assert source_digest(src) != before
    (tmp_path / "config.json").write_text("{}")
    config = EngineConfig.from_flags(attention_backend="torch")
    key = profile_key(config, tmp_path, 1, [4])
    assert key["code"] == code_fingerprint() and len(key["code"]) == 16
    assert key["attention_backend"] == "torch"
    assert profile_key(EngineConfig.from_flags(), tmp_path, 1, [4]) != key


# -- bounded start-up profiles ----------------------------------------------------------------


def budgeted(per_point: Callable[[int, int], float]) -> Profiler:
    """One stage timing points in order until its seconds pass the budget (as
    Backend.profile_chunks stops), in simulated seconds."""

    def profile(points: list[tuple[int, int]], budget_s: float) -> list[list[float]]:
        times: list[float] = []
        for L, x in points:
            times.append(per_point(L, x))
            if sum(times) > budget_s:
                break
        return [times]

    return profile


def test_a_slow_device_s_dynamic_profile_stops_at_its_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """100x slower than PREFIX's device: the grid's points are timed until the budget is
    spent, and the fit rests on those (here too few: fixed chunks, with a warning)."""
    slow = budgeted(lambda L, x: 100 * t(L, x))
    with caplog.at_level(logging.WARNING, logger="pipeserve.engine.chunking"):
        info = setup_chunking(ChunkPolicy(C, dynamic=True), make_scheduler(), slow, {})
    timed = info["profile_points"]
    spent = sum(100 * t(L, x) for L, x in timed)
    assert 0 < len(timed) < len(profile_grid(C, ChunkPolicy(C).profile_max_len))
    assert spent - 100 * t(*timed[-1]) <= PROFILE_BUDGET_S < spent  # stopped on passing it
    assert f"timed {len(timed)} of its" in caplog.text


def test_a_slow_device_picks_among_the_chunk_sizes_it_timed() -> None:
    """Per-token time falls to 4096 (STEEP), but only the warm-up and 256..1024 fit the
    budget (each of those takes 1/3.75 of it): the pick is the best of those, never an
    untimed size."""
    scale = AUTO_CHUNK_BUDGET_S / 3.75 / (256 * STEEP[256])
    profile = budgeted(lambda L, x: scale * x * STEEP[x])
    sched = make_scheduler()
    info = setup_chunking(ChunkPolicy(2048, auto=True), sched, profile, {})
    assert info["auto"]["sizes"] == [256, 512, 1024]
    assert info["chunk_size"] == 1024


def test_backend_profiles_one_point_at_a_time_until_a_stage_passes_the_budget() -> None:
    """Backend.profile_chunks: every stage gets the same points (TP ranks and attention-FFN
    pairs step together); it stops once the slowest stage's sum passes the budget."""
    from types import SimpleNamespace

    from pipeserve.engine.backend import Backend

    given_back: list[bool] = []
    kv = SimpleNamespace(lend=lambda tokens: ([(0, tokens)], lambda: given_back.append(True)))
    sent: list[list[tuple[int, int]]] = []

    def profile_stages(points, runs):
        sent.append(points)
        return [[1.0], [3.0]]  # stage 1 is the slow one: 3 s a point

    fake = SimpleNamespace(schedulers=[SimpleNamespace(kv=kv)], profile_stages=profile_stages)
    points = [(0, 256 * (i + 1)) for i in range(10)]
    stages = Backend.profile_chunks(fake, points, budget_s=10.0)  # type: ignore[arg-type]
    assert sent == [[p] for p in points[:4]]  # 3 + 3 + 3 + 3 > 10 after the fourth
    assert stages == [[1.0] * 4, [3.0] * 4]
    assert given_back == [True]  # the lent slots are returned
