"""Dynamic chunking math without a model: the next chunk size against the spec's formulas
(written out again here, independently of the implementation), the profile sweep, the
least-squares fit and the online refit; then the prefix model's sizes (a solver written out
here), the floor, the tail rule, the first chunk after a cached prefix."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from pipeserve.scheduler.chunk_cost import ChunkCost, CostFit, fit_profile, profile_lengths
from pipeserve.scheduler.dynamic_chunking import (
    ONLINE_WINDOW,
    ChunkSizePredictor,
    OnlineRefit,
    balance_tail,
    make_predictor,
)

A, B, C0 = 1e-6, 1e-3, 0.05  # seconds: f(l) = A l^2 + B l + C0


def spec_chunk_size(a: float, b: float, size: int, s: float, page_size: int, prefix: int,
                    room: int | None = None, budget: int | None = None) -> int:
    """Spec 01 section 4, step by step; s = 0 is fixed chunking exactly (the spec says so;
    its formula would align an unaligned C down at s = 0)."""
    align = max(page_size, 64)
    if s == 0:
        return size
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
    p1 = ChunkSizePredictor.published(A, B, C0, 1024, 1.0)
    assert p1.target_time == pytest.approx(2.072576)
    assert p1.root(1024) == pytest.approx(572.46, abs=0.01)
    assert p1.next_chunk_size(1024) == 512
    assert ChunkSizePredictor.published(A, B, C0, 1024, 0.75).next_chunk_size(1024) == 640
    assert ChunkSizePredictor.published(A, B, C0, 1024, 0.5).next_chunk_size(1024) == 768


@pytest.mark.parametrize("size", [256, 1000, 1024, 4096])
@pytest.mark.parametrize("smooth", [0.0, 0.3, 0.75, 1.0])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128, 256])
def test_sizes_follow_the_spec_formulas(size: int, smooth: float, page_size: int) -> None:
    predictor = ChunkSizePredictor.published(A, B, C0, size, smooth, page_size)
    for prefix in PREFIXES:
        assert predictor.next_chunk_size(prefix) == spec_chunk_size(
            A, B, size, smooth, page_size, prefix), prefix


def test_first_chunk_is_the_initial_size() -> None:
    for size in (64, 100, 1000, 2048):  # even when C is not aligned
        assert ChunkSizePredictor.published(A, B, C0, size, 0.75, 16).next_chunk_size(0) == size


def test_root_at_zero_prefix_is_the_initial_size() -> None:
    for size in (64, 1000, 4096):
        assert ChunkSizePredictor.published(A, B, C0, size, 1.0).root(0) == pytest.approx(size)


def test_smooth_factor_zero_is_fixed_chunking() -> None:
    for size in (64, 128, 1024, 8192):
        for page_size in (1, 64):
            predictor = ChunkSizePredictor.published(A, B, C0, size, 0.0, page_size)
            assert {predictor.next_chunk_size(L) for L in PREFIXES} == {size}


def test_smooth_factor_one_follows_the_root() -> None:
    predictor = ChunkSizePredictor.published(A, B, C0, 4096, 1.0, 1)
    for prefix in (10, 100, 1000, 3000):
        root = predictor.root(prefix)
        assert predictor.next_chunk_size(prefix) == max(int(root) // 64 * 64, 64)
        # the root costs exactly the target time at this prefix
        f = CostFit(A, B, C0)
        assert f(prefix + root) - f(prefix) == pytest.approx(predictor.target_time, rel=1e-9)
    sizes = [predictor.next_chunk_size(L) for L in range(0, 40_000, 1000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]


def test_floor_is_a_quarter_of_the_initial_size() -> None:
    predictor = ChunkSizePredictor.published(A, B, C0, 1024, 1.0, 1)
    assert predictor.root(1_000_000) < 10
    assert predictor.next_chunk_size(1_000_000) == 256
    c1000 = ChunkSizePredictor.published(A, B, C0, 1000, 1.0, 1)
    assert c1000.next_chunk_size(1_000_000) == 192  # 250, aligned down


def test_alignment_to_the_page_size_when_larger_than_64() -> None:
    # page 128 > 64: multiples of 128; the floor 384 // 4 = 96 rounds up to one page.
    predictor = ChunkSizePredictor.published(A, B, C0, 384, 1.0, 128)
    assert predictor.next_chunk_size(1_000_000) == 128
    assert ChunkSizePredictor.published(A, B, C0, 1024, 0.75, 128).next_chunk_size(1024) == 640
    assert ChunkSizePredictor.published(A, B, C0, 1024, 0.5, 128).next_chunk_size(1024) == 768
    assert ChunkSizePredictor.published(A, B, C0, 1024, 1.0, 128).next_chunk_size(1024) == 512
    assert ChunkSizePredictor.published(A, B, C0, 1024, 1.0, 256).next_chunk_size(1024) == 512
    assert ChunkSizePredictor.published(A, B, C0, 1024, 0.75, 256).next_chunk_size(1024) == 512
    # page 16 < 64: still multiples of 64
    assert ChunkSizePredictor.published(A, B, C0, 1024, 0.75, 16).next_chunk_size(1024) == 640
    for prefix in PREFIXES[1:]:
        assert predictor.next_chunk_size(prefix) % 128 == 0


def test_caps_by_room_and_budget() -> None:
    predictor = ChunkSizePredictor.published(A, B, C0, 1024, 0.75, 1)  # 640 at L = 1024
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
    clamped = ChunkSizePredictor.published(A, -0.5, C0, 1024, 0.75, 1)
    zero = ChunkSizePredictor.published(A, 0.0, C0, 1024, 0.75, 1)
    assert clamped.cost.b == 0.0
    assert [clamped.next_chunk_size(L) for L in PREFIXES] == [
        zero.next_chunk_size(L) for L in PREFIXES]
    assert [clamped.next_chunk_size(L) for L in PREFIXES] == [
        spec_chunk_size(A, -0.5, 1024, 0.75, 1, L) for L in PREFIXES]
    made, info = make_predictor("quadratic", *sweep(CostFit(A, -0.5, C0), 1024), 1024, 0.75, 1)
    assert made.cost.b == 0.0 and info["clamped"] == ["b"]
    assert info["coefficients"]["b"] == pytest.approx(-0.5)  # as fitted, before the clamp


def sweep(f: CostFit, size: int) -> tuple[list[tuple[int, int]], list[float]]:
    """The published profile's points and seconds for a prefill cost f."""
    points = [(0, n) for n in profile_lengths(size)]
    return points, [f(n) for _, n in points]


@pytest.mark.parametrize("a", [-1e-9, -1e-7])
def test_negative_a_is_an_unusable_published_fit(a: float) -> None:
    """setup_chunking turns this error into fixed chunks with a warning."""
    with pytest.raises(ValueError, match="a = .* <= 0"):
        make_predictor("quadratic", *sweep(CostFit(a, B, C0), 1024), 1024, 0.75, 1)
    for bad in (a, 0.0):
        with pytest.raises(ValueError, match="<= 0"):
            ChunkSizePredictor.published(bad, B, C0, 1024, 0.75)


def test_published_model_from_its_profile() -> None:
    made, info = make_predictor("quadratic", *sweep(CostFit(A, B, C0), 1024), 1024, 0.75, 16)
    assert info["coefficients"] == pytest.approx({"a": A, "b": B, "c": C0}, rel=1e-6)
    assert made.min_size == 256 and made.full_first_chunk
    assert [made.next_chunk_size(L) for L in PREFIXES] == [
        spec_chunk_size(A, B, 1024, 0.75, 16, L) for L in PREFIXES]


@pytest.mark.parametrize("smooth", [-0.1, 1.5])
def test_smooth_factor_out_of_range_is_rejected(smooth: float) -> None:
    with pytest.raises(ValueError, match="must be in"):
        ChunkSizePredictor.published(A, B, C0, 1024, smooth)


# -- profile sweep and fit ------------------------------------------------------------------


@pytest.mark.parametrize("size", [64, 100, 128, 1000, 2048, 16384])
def test_profile_lengths_follow_the_sweep_formula(size: int) -> None:
    step = max((1.25 * size) // 128, 1)
    expected = []
    for i in range(128):
        length = int(1.25 * size - i * step)
        if length <= 0:
            break
        expected.append(length)
    got = profile_lengths(size)
    assert got == expected
    assert got[0] == int(1.25 * size) and len(got) <= 128 and min(got) > 0
    assert len(set(got)) == len(got)  # distinct, also where the published step is 0


def test_profile_lengths_hand_values() -> None:
    assert profile_lengths(1024)[:3] == [1280, 1270, 1260]
    assert profile_lengths(1024)[-1] == 10 and len(profile_lengths(1024)) == 128  # 1280 - 127*10
    assert profile_lengths(1000)[:2] == [1250, 1241] and profile_lengths(1000)[-1] == 107
    assert profile_lengths(2048)[:2] == [2560, 2540] and len(profile_lengths(2048)) == 128
    # 1.25 C < 128: the published step rounds to 0 (one length, 128 times); a step of 1
    # gives distinct lengths
    assert profile_lengths(64) == list(range(80, 0, -1))
    assert profile_lengths(100) == list(range(125, 0, -1))


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
    predictor = ChunkSizePredictor.published(5e-7, 1e-3, 0.01, 1024, 1.0)  # a wrong start
    refit = OnlineRefit(predictor, free=("b", "a"))  # the published model's refit
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
    assert predictor.cost.a == pytest.approx(true_a, rel=0.02)
    assert predictor.cost.b == pytest.approx(true_b, rel=0.05)
    assert predictor.cost.c == predictor.cost.g == 0.0  # not part of the published chunk cost
    # The predictor now follows the true model.
    truth = ChunkSizePredictor.published(true_a, true_b, 0.01, 1024, 1.0)
    for prefix in (1024, 4096, 16384):
        assert abs(predictor.root(prefix) - truth.root(prefix)) < 0.03 * truth.root(prefix)


def test_online_refit_ignores_empty_observations_and_needs_points() -> None:
    predictor = ChunkSizePredictor.published(A, B, C0, 1024, 1.0)
    refit = OnlineRefit(predictor, free=("b", "a"))
    for _ in range(20):
        refit.observe(0, 0, 1.0)
        refit.observe(0, 100, 0.0)
    assert len(refit.points) == 0 and refit.refits == 0
    for i in range(7):  # fewer than the minimum: no refit yet
        refit.observe(100 * i, 100, chunk_time(3e-6, 0.0, 100 * i, 100))
    assert refit.refits == 0 and predictor.cost.a == A


def test_online_refit_never_installs_a_non_positive_a() -> None:
    predictor = ChunkSizePredictor.published(A, B, C0, 1024, 1.0)
    refit = OnlineRefit(predictor, free=("b", "a"), window=64)
    for i in range(64):  # later chunks get cheaper: the fitted a is negative
        prefix = 100 * i
        refit.observe(prefix, 100, max(1.0 - 1e-4 * prefix, 0.01))
    assert predictor.cost.a == A
    assert np.isfinite(predictor.next_chunk_size(5000))


# -- the prefix model -----------------------------------------------------------------------

# Prefix-dominated: at L = 16 C the prefix terms (g L + 2 a L x) are several times the
# chunk's own work (b x), so equal-time chunks must shrink a lot.
PREFIX = {"c": 0.01, "g": 2e-6, "b": 1e-4, "a": 4e-9}
SIZE = 2048


def t(L: float, x: float) -> float:
    c, g, b, a = PREFIX["c"], PREFIX["g"], PREFIX["b"], PREFIX["a"]
    return c + g * L + b * x + a * (2 * L * x + x * x)


def solved(L: int) -> float:
    """x with t(L, x) = t(0, C), by the quadratic formula written out here; 0 where even an
    empty chunk after L costs more than t(0, C)."""
    c, g, b, a = PREFIX["c"], PREFIX["g"], PREFIX["b"], PREFIX["a"]
    lin, const = 2 * a * L + b, c + g * L - t(0, SIZE)
    return max((-lin + math.sqrt(lin * lin - 4 * a * const)) / (2 * a), 0.0)


def expected_size(L: int, s: float, floor: int, align: int = 64) -> int:
    if s == 0 or L == 0:
        return SIZE
    x = max(int(SIZE + s * (solved(L) - SIZE)), floor)
    return max(x // align * align, align)


def prefix_predictor(s: float = 1.0, page_size: int = 1,
                     min_size: int | None = None) -> ChunkSizePredictor:
    return ChunkSizePredictor(ChunkCost(**PREFIX), SIZE, s, page_size, min_size)


LONG_PREFIXES = [0, 64, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


@pytest.mark.parametrize("s", [1.0, 0.75, 0.3])
def test_prefix_model_sizes_follow_the_solver(s: float) -> None:
    predictor = prefix_predictor(s, min_size=128)
    assert predictor.target_time == pytest.approx(t(0, SIZE))
    sizes = [predictor.next_chunk_size(L) for L in LONG_PREFIXES]
    assert sizes == [expected_size(L, s, 128) for L in LONG_PREFIXES]
    assert sizes == sorted(sizes, reverse=True)
    # far out the prefix alone exceeds T: the smallest chunk smoothing allows, (1 - s) C
    assert sizes[-1] == max(int((1 - s) * SIZE), 128) // 64 * 64


def test_prefix_model_chunks_cost_the_first_chunks_time() -> None:
    """s = 1: each chunk is the largest aligned size within T (one more alignment unit would
    exceed it), wherever the floor does not bind."""
    predictor = prefix_predictor(1.0, min_size=64)
    target = t(0, SIZE)
    for L in range(SIZE, 40 * SIZE, 1500):
        x = predictor.next_chunk_size(L)
        assert x % 64 == 0
        if x > 64:
            assert t(L, x) <= target < t(L, x + 64), L


def test_smooth_factor_zero_is_fixed_chunking_for_every_model() -> None:
    for size, page in [(2048, 1), (1000, 16), (100, 64)]:
        for predictor in (
            ChunkSizePredictor(ChunkCost(**PREFIX), size, 0.0, page),
            ChunkSizePredictor.published(A, B, C0, size, 0.0, page),
        ):
            for L in LONG_PREFIXES:
                for first in (False, True):
                    assert predictor.next_chunk_size(L, 10**9, 10**9, first) == size
                    assert predictor.next_chunk_size(L, 50, 50, first) == size  # budget: caller's


def test_the_floor_flag_bounds_chunks_and_lowering_it_lets_them_shrink() -> None:
    high, low = prefix_predictor(min_size=512), prefix_predictor(min_size=128)
    far = [10**5, 10**6, 10**7]
    assert {high.next_chunk_size(L) for L in far} == {512}
    assert {low.next_chunk_size(L) for L in far} == {128}
    for L in LONG_PREFIXES:
        assert high.next_chunk_size(L) >= 512 and low.next_chunk_size(L) >= 128
        assert low.next_chunk_size(L) <= high.next_chunk_size(L)


def test_default_floors() -> None:
    from pipeserve.scheduler.dynamic_chunking import default_min_size

    assert default_min_size("quadratic", 2048, 1) == 512  # C // 4, as published
    assert default_min_size("prefix-quadratic", 2048, 1) == 256  # C // 8
    assert default_min_size("prefix-quadratic", 2000, 1) == 192  # C // 8 = 250, aligned
    assert default_min_size("prefix-quadratic", 256, 1) == 64  # at least one unit
    assert default_min_size("prefix-quadratic", 4096, 256) == 512
    assert prefix_predictor().min_size == 512  # the class default: C // 4


def test_prefix_model_alignment_and_caps() -> None:
    predictor = prefix_predictor(1.0, page_size=128, min_size=128)
    for L in LONG_PREFIXES[1:]:
        assert predictor.next_chunk_size(L) % 128 == 0
    L = 8192
    model = predictor.next_chunk_size(L)
    assert model == expected_size(L, 1.0, 128, align=128) and model > 300
    assert predictor.next_chunk_size(L, room=300) == 256  # capped, realigned
    assert predictor.next_chunk_size(L, budget=300) == 256
    assert predictor.next_chunk_size(L, room=100, budget=10**6) == 100  # below one unit
    assert predictor.next_chunk_size(L, room=10**6, budget=10**6) == model


def test_first_chunk_after_a_cached_prefix() -> None:
    """Published: a request's first chunk is C wherever it starts. Prefix model: C at
    prefix 0; after a cached prefix of L, the model's size at L (C there would cost
    t(L, C) > T and be the slowest micro-batch of the pipeline)."""
    prefix = prefix_predictor(0.75, min_size=128)
    assert prefix.next_chunk_size(0, first_chunk=True) == SIZE
    for L in (4096, 16384):
        assert prefix.next_chunk_size(L, first_chunk=True) == prefix.next_chunk_size(L) < SIZE
        assert t(L, SIZE) > prefix.target_time
    published = ChunkSizePredictor.published(A, B, C0, 1024, 0.75, 1)
    assert published.next_chunk_size(4096, first_chunk=True) == 1024
    assert published.next_chunk_size(4096) == spec_chunk_size(A, B, 1024, 0.75, 1, 4096) < 1024


def test_make_predictor_for_the_prefix_model() -> None:
    from pipeserve.scheduler.chunk_cost import profile_grid

    points = profile_grid(SIZE, 32768)
    predictor, info = make_predictor(
        "prefix-quadratic", points, [t(L, x) for L, x in points], SIZE, 0.75, 1)
    assert info["coefficients"] == pytest.approx(PREFIX, rel=1e-6)
    assert predictor.min_size == SIZE // 8 and not predictor.full_first_chunk
    assert [predictor.next_chunk_size(L) for L in LONG_PREFIXES] == [
        expected_size(L, 0.75, SIZE // 8) for L in LONG_PREFIXES]


def test_make_predictor_rejects_a_cost_that_does_not_grow_with_the_prefix() -> None:
    from pipeserve.scheduler.chunk_cost import profile_grid

    points = profile_grid(SIZE, 32768)
    flat = [0.01 + 1e-4 * x for _, x in points]
    with pytest.raises(ValueError, match="does not grow with the prefix"):
        make_predictor("prefix-quadratic", points, flat, SIZE, 0.75, 1)
    with pytest.raises(ValueError, match="fewer than 6"):
        make_predictor("prefix-quadratic", points[:5], flat[:5], SIZE, 0.75, 1)


# -- the tail rule --------------------------------------------------------------------------


def test_a_tiny_tail_is_balanced_into_two_chunks() -> None:
    assert balance_tail(512, 640, floor=256, align=64) == 320  # 128 left < floor: 320 + 320
    assert balance_tail(512, 650, floor=256, align=64) == 320  # 320 + 330
    assert balance_tail(512, 1024, floor=256, align=64) == 512  # 512 left: keep
    assert balance_tail(512, 768, floor=256, align=64) == 512  # 256 left = floor: keep
    assert balance_tail(512, 512, floor=256, align=64) == 512  # the last chunk anyway
    assert balance_tail(512, 300, floor=256, align=64) == 512  # (the caller takes 300)
    assert balance_tail(128, 232, floor=128, align=64) == 128  # 64 + 168 would need 3 chunks
    assert balance_tail(64, 100, floor=64, align=64) == 64  # nothing to balance below 2 units
    for size, remaining, floor in [(512, 700, 256), (256, 300, 128), (2048, 2100, 512),
                                   (1024, 1500, 512), (192, 250, 128)]:
        x = balance_tail(size, remaining, floor, 64)
        assert x <= size and x % 64 == 0  # never more than the model's size
        assert remaining - x <= size  # the rest is the last chunk
        assert abs(remaining - 2 * x) <= 64  # the two about equal


# -- the online refit of the prefix model ---------------------------------------------------


def test_online_refit_of_the_prefix_model_follows_live_chunks() -> None:
    """Live attention three times dearer than profiled: the refit (live chunks sized to equal
    times, nearly collinear; the profile's points as anchors) moves the sizes to the live
    model's."""
    from pipeserve.scheduler.chunk_cost import profile_grid

    points = profile_grid(SIZE, 32768)[1:]
    predictor = prefix_predictor(1.0, min_size=64)
    refit = OnlineRefit(predictor, anchors=(points, [t(L, x) for L, x in points]))
    live = ChunkCost(**{**PREFIX, "a": 3 * PREFIX["a"]})
    truth = ChunkSizePredictor(live, SIZE, 1.0, 1, 64)
    probes = [4096, 8192, 16384, 24576]
    assert any(abs(predictor.next_chunk_size(L) - truth.next_chunk_size(L)) > 128 for L in probes)
    L, rng = 0, random.Random(5)
    for _ in range(300):
        x = predictor.next_chunk_size(L)
        refit.observe(L, x, live(L, x) * (1 + rng.uniform(-0.02, 0.02)))
        L = L + x if L + x < 30000 else 0
    assert refit.refits > 0
    for L in probes:
        assert abs(predictor.next_chunk_size(L) - truth.next_chunk_size(L)) <= 64, L
