"""Dynamic chunking math without a model: the next chunk size against the spec's formulas
(written out again here, independently of the implementation), the profile sweep, the
least-squares fit and the online refit."""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest

from pipeserve.scheduler.dynamic_chunking import (
    ONLINE_WINDOW,
    ChunkSizePredictor,
    CostFit,
    OnlineRefit,
    fit_profile,
    make_predictor,
    profile_lengths,
)

A, B, C0 = 1e-6, 1e-3, 0.05  # seconds: f(l) = A l^2 + B l + C0


def spec_chunk_size(a: float, b: float, size: int, s: float, page_size: int, prefix: int,
                    room: int | None = None, budget: int | None = None) -> int:
    """Spec 01 section 4, step by step."""
    align = max(page_size, 64)
    if prefix == 0:
        x = size
    else:
        b = max(b, 0.0)
        target = a * size**2 + b * size
        lin = 2 * a * prefix + b
        root = (-lin + math.sqrt(lin**2 + 4 * a * target)) / (2 * a)
        smoothed = size + s * (root - size)
        x = max(int(smoothed), size // 4)
        x = max(x // align * align, align)
    cap = min([c for c in (room, budget) if c is not None], default=None)
    if cap is not None and cap < x:
        x = max(cap // align * align, align) if cap >= align else cap
    return x


PREFIXES = [0, 1, 63, 64, 500, 1024, 2048, 4096, 10_000, 100_000, 1_000_000]


def test_hand_computed_sizes() -> None:
    """C = 1024, a = 1e-6, b = 1e-3: T = 2.072576. At L = 1024,
    x* = (-3.048e-3 + sqrt(3.048e-3^2 + 4e-6 T)) / 2e-6 = 572.46...; s = 1 -> 572 -> 512;
    s = 0.75 -> 1024 - 0.75 * 451.54 = 685.3 -> 640; s = 0.5 -> 798.2 -> 768."""
    p1 = ChunkSizePredictor(A, B, C0, 1024, 1.0)
    assert p1.target_time == pytest.approx(2.072576)
    assert p1.root(1024) == pytest.approx(572.46, abs=0.01)
    assert p1.next_chunk_size(1024) == 512
    assert ChunkSizePredictor(A, B, C0, 1024, 0.75).next_chunk_size(1024) == 640
    assert ChunkSizePredictor(A, B, C0, 1024, 0.5).next_chunk_size(1024) == 768


@pytest.mark.parametrize("size", [256, 1000, 1024, 4096])
@pytest.mark.parametrize("smooth", [0.0, 0.3, 0.75, 1.0])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128, 256])
def test_sizes_follow_the_spec_formulas(size: int, smooth: float, page_size: int) -> None:
    predictor = ChunkSizePredictor(A, B, C0, size, smooth, page_size)
    for prefix in PREFIXES:
        assert predictor.next_chunk_size(prefix) == spec_chunk_size(
            A, B, size, smooth, page_size, prefix), prefix


def test_first_chunk_is_the_initial_size() -> None:
    for size in (64, 100, 1000, 2048):  # even when C is not aligned
        assert ChunkSizePredictor(A, B, C0, size, 0.75, 16).next_chunk_size(0) == size


def test_root_at_zero_prefix_is_the_initial_size() -> None:
    for size in (64, 1000, 4096):
        assert ChunkSizePredictor(A, B, C0, size, 1.0).root(0) == pytest.approx(size)


def test_smooth_factor_zero_is_fixed_chunking() -> None:
    for size in (64, 128, 1024, 8192):
        for page_size in (1, 64):
            predictor = ChunkSizePredictor(A, B, C0, size, 0.0, page_size)
            assert {predictor.next_chunk_size(L) for L in PREFIXES} == {size}


def test_smooth_factor_one_follows_the_root() -> None:
    predictor = ChunkSizePredictor(A, B, C0, 4096, 1.0, 1)
    for prefix in (10, 100, 1000, 3000):
        root = predictor.root(prefix)
        assert predictor.next_chunk_size(prefix) == max(int(root) // 64 * 64, 64)
        # the root costs exactly the target time at this prefix
        f = CostFit(A, B, C0)
        assert f(prefix + root) - f(prefix) == pytest.approx(predictor.target_time, rel=1e-9)
    sizes = [predictor.next_chunk_size(L) for L in range(0, 40_000, 1000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]


def test_floor_is_a_quarter_of_the_initial_size() -> None:
    predictor = ChunkSizePredictor(A, B, C0, 1024, 1.0, 1)
    assert predictor.root(1_000_000) < 10
    assert predictor.next_chunk_size(1_000_000) == 256
    assert ChunkSizePredictor(A, B, C0, 1000, 1.0, 1).next_chunk_size(1_000_000) == 192  # 250


def test_alignment_to_the_page_size_when_larger_than_64() -> None:
    # page 128 > 64: multiples of 128; the floor 384 // 4 = 96 rounds up to one page.
    predictor = ChunkSizePredictor(A, B, C0, 384, 1.0, 128)
    assert predictor.next_chunk_size(1_000_000) == 128
    assert ChunkSizePredictor(A, B, C0, 1024, 0.75, 128).next_chunk_size(1024) == 640
    assert ChunkSizePredictor(A, B, C0, 1024, 0.5, 128).next_chunk_size(1024) == 768
    assert ChunkSizePredictor(A, B, C0, 1024, 1.0, 128).next_chunk_size(1024) == 512
    assert ChunkSizePredictor(A, B, C0, 1024, 1.0, 256).next_chunk_size(1024) == 512
    assert ChunkSizePredictor(A, B, C0, 1024, 0.75, 256).next_chunk_size(1024) == 512
    # page 16 < 64: still multiples of 64
    assert ChunkSizePredictor(A, B, C0, 1024, 0.75, 16).next_chunk_size(1024) == 640
    for prefix in PREFIXES[1:]:
        assert predictor.next_chunk_size(prefix) % 128 == 0


def test_caps_by_room_and_budget() -> None:
    predictor = ChunkSizePredictor(A, B, C0, 1024, 0.75, 1)  # 640 at L = 1024
    assert predictor.next_chunk_size(1024, room=5000, budget=5000) == 640
    assert predictor.next_chunk_size(1024, room=600) == 576  # capped, realigned
    assert predictor.next_chunk_size(1024, budget=600) == 576
    assert predictor.next_chunk_size(1024, room=700, budget=130) == 128
    assert predictor.next_chunk_size(1024, room=50) == 50  # below one alignment unit
    assert predictor.next_chunk_size(0, budget=1000) == 960
    assert predictor.next_chunk_size(0, room=2000, budget=2000) == 1024
    for room, budget in [(600, None), (None, 130), (50, 3000), (70, 65)]:
        assert predictor.next_chunk_size(1024, room, budget) == spec_chunk_size(
            A, B, 1024, 0.75, 1, 1024, room, budget)


def test_negative_b_is_clamped_to_zero() -> None:
    clamped = ChunkSizePredictor(A, -0.5, C0, 1024, 0.75, 1)
    zero = ChunkSizePredictor(A, 0.0, C0, 1024, 0.75, 1)
    assert clamped.fit.b == 0.0
    assert [clamped.next_chunk_size(L) for L in PREFIXES] == [
        zero.next_chunk_size(L) for L in PREFIXES]
    assert [clamped.next_chunk_size(L) for L in PREFIXES] == [
        spec_chunk_size(A, -0.5, 1024, 0.75, 1, L) for L in PREFIXES]
    made = make_predictor(CostFit(A, -0.5, C0), 1024, 0.75, 1)
    assert made is not None and made.fit.b == 0.0


@pytest.mark.parametrize("a", [0.0, -1e-7])
def test_non_positive_a_disables_dynamic_chunking(a: float, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pipeserve.scheduler.dynamic_chunking"):
        assert make_predictor(CostFit(a, B, C0), 1024, 0.75, 1) is None
    assert "dynamic chunking disabled" in caplog.text
    assert "using fixed chunks of 1024" in caplog.text
    with pytest.raises(ValueError, match="<= 0"):
        ChunkSizePredictor(a, B, C0, 1024, 0.75)


@pytest.mark.parametrize("smooth", [-0.1, 1.5])
def test_smooth_factor_out_of_range_is_rejected(smooth: float) -> None:
    with pytest.raises(ValueError, match="must be in"):
        ChunkSizePredictor(A, B, C0, 1024, smooth)


# -- profile sweep and fit ------------------------------------------------------------------


@pytest.mark.parametrize("size", [64, 100, 128, 1000, 2048, 16384])
def test_profile_lengths_follow_the_sweep_formula(size: int) -> None:
    step = (1.25 * size) // 128
    expected = []
    for i in range(128):
        length = int(1.25 * size - i * step)
        if length <= 0:
            break
        expected.append(length)
    got = profile_lengths(size)
    assert got == expected
    assert got[0] == int(1.25 * size) and len(got) <= 128 and min(got) > 0


def test_profile_lengths_hand_values() -> None:
    assert profile_lengths(1024)[:3] == [1280, 1270, 1260]
    assert profile_lengths(1024)[-1] == 10 and len(profile_lengths(1024)) == 128  # 1280 - 127*10
    assert profile_lengths(1000)[:2] == [1250, 1241] and profile_lengths(1000)[-1] == 107
    assert profile_lengths(2048)[:2] == [2560, 2540] and len(profile_lengths(2048)) == 128
    # 1.25 C < 128: the step is 0 and the sweep is one length, 128 times
    assert profile_lengths(64) == [80] * 128


def test_fit_recovers_the_quadratic_and_drops_the_warm_up_sample() -> None:
    lengths = profile_lengths(2048)
    seconds = [A * x * x + B * x + C0 for x in lengths]
    seconds[0] *= 50  # warm-up outlier: must not bend the fit
    fit = fit_profile(lengths, seconds)
    assert fit.a == pytest.approx(A, rel=1e-6)
    assert fit.b == pytest.approx(B, rel=1e-6)
    assert fit.c == pytest.approx(C0, rel=1e-6)


def test_fit_with_noise_is_close() -> None:
    rng = random.Random(0)
    lengths = profile_lengths(4096)
    seconds = [(A * x * x + B * x + C0) * (1 + rng.uniform(-0.01, 0.01)) for x in lengths]
    fit = fit_profile(lengths, seconds)
    assert fit.a == pytest.approx(A, rel=0.05)


def test_fit_needs_eight_points_after_the_warm_up_sample() -> None:
    lengths = [100 * (9 - i) for i in range(9)]
    seconds = [A * x * x + B * x + C0 for x in lengths]
    fit = fit_profile(lengths, seconds)  # 8 points left: enough
    assert fit.a == pytest.approx(A, rel=1e-6)
    with pytest.raises(ValueError, match="at least 8 profile points .* got 7"):
        fit_profile(lengths[:8], seconds[:8])
    with pytest.raises(ValueError, match="at least 8"):
        fit_profile([], [])


# -- online refit ---------------------------------------------------------------------------


def chunk_time(a: float, b: float, prefix: int, n: int) -> float:
    return a * ((prefix + n) ** 2 - prefix**2) + b * n


def test_online_refit_converges_despite_outliers_and_keeps_bounded_memory() -> None:
    true_a, true_b = 2e-6, 4e-3
    predictor = ChunkSizePredictor(5e-7, 1e-3, 0.01, 1024, 1.0)  # a wrong start
    refit = OnlineRefit(predictor)
    rng = random.Random(7)
    for i in range(2000):
        prefix, n = rng.randrange(0, 4000), rng.randrange(64, 1025)
        t = chunk_time(true_a, true_b, prefix, n) * (1 + rng.uniform(-0.02, 0.02))
        if i % 97 == 5:
            t *= 20  # a stalled step
        refit.observe(prefix, n, t)
        assert len(refit.points) <= ONLINE_WINDOW
    assert len(refit.points) == ONLINE_WINDOW
    assert refit.refits > 0
    assert predictor.fit.a == pytest.approx(true_a, rel=0.02)
    assert predictor.fit.b == pytest.approx(true_b, rel=0.05)
    assert predictor.fit.c == 0.01  # c plays no part in chunk costs
    # The predictor now follows the true model.
    truth = ChunkSizePredictor(true_a, true_b, 0.01, 1024, 1.0)
    for prefix in (1024, 4096, 16384):
        assert abs(predictor.root(prefix) - truth.root(prefix)) < 0.03 * truth.root(prefix)


def test_online_refit_ignores_empty_observations_and_needs_points() -> None:
    predictor = ChunkSizePredictor(A, B, C0, 1024, 1.0)
    refit = OnlineRefit(predictor)
    for _ in range(20):
        refit.observe(0, 0, 1.0)
        refit.observe(0, 100, 0.0)
    assert len(refit.points) == 0 and refit.refits == 0
    for i in range(7):  # fewer than the minimum: no refit yet
        refit.observe(100 * i, 100, chunk_time(3e-6, 0.0, 100 * i, 100))
    assert refit.refits == 0 and predictor.fit.a == A


def test_online_refit_never_installs_a_non_positive_a() -> None:
    predictor = ChunkSizePredictor(A, B, C0, 1024, 1.0)
    refit = OnlineRefit(predictor, window=64)
    for i in range(64):  # later chunks get cheaper: the fitted a is negative
        prefix = 100 * i
        refit.observe(prefix, 100, max(1.0 - 1e-4 * prefix, 0.01))
    assert predictor.fit.a == A
    assert np.isfinite(predictor.next_chunk_size(5000))


def test_a_chunk_that_would_leave_a_tiny_tail_takes_the_rest() -> None:
    from pipeserve.scheduler.dynamic_chunking import absorb_tail

    assert absorb_tail(512, 640, floor=512, budget=16384) == 640  # 128 left < floor: merge
    assert absorb_tail(512, 1024, floor=512, budget=16384) == 512  # 512 left: keep
    assert absorb_tail(512, 512, floor=512, budget=16384) == 512  # nothing left anyway
    assert absorb_tail(512, 640, floor=512, budget=600) == 512  # the rest exceeds the budget
