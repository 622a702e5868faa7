"""The chunk cost model t(L, x) = c + g L + b x + a (2 L x + x^2) without a model: the
published quadratic as its special case, the root solver, the prefix profile grid, and the
non-negative least-squares fit on synthetic timings (exact, noisy, with outliers, with a
coefficient that must be clamped)."""

from __future__ import annotations

import random

import pytest

from pipeserve.scheduler.chunk_cost import (
    ChunkCost,
    CostFit,
    fit_chunk_cost,
    profile_grid,
    profile_lengths,
)

TRUE = {"c": 0.02, "g": 1e-6, "b": 2e-4, "a": 5e-9}  # seconds; prefix terms matter at 16K


def t(L: float, x: float, c: float, g: float, b: float, a: float) -> float:
    return c + g * L + b * x + a * (2 * L * x + x * x)


def test_the_published_chunk_cost_is_the_case_c_g_zero() -> None:
    f = CostFit(1e-6, 1e-3, 0.05)
    cost = ChunkCost(0.0, 0.0, 1e-3, 1e-6)
    for L, x in [(0, 1024), (1024, 512), (10_000, 64), (123, 4567)]:
        assert cost(L, x) == pytest.approx(f(L + x) - f(L), rel=1e-12)


@pytest.mark.parametrize("coef", [TRUE, {**TRUE, "a": 0.0}, {**TRUE, "c": 0.0, "g": 0.0}])
def test_solve_gives_the_chunk_of_the_target_time(coef: dict[str, float]) -> None:
    cost = ChunkCost(**coef)
    target = t(0, 2048, **coef)
    for L in (0, 1000, 8192, 30_000):
        x = cost.solve(L, target)
        assert x is not None and t(L, x, **coef) == pytest.approx(target, rel=1e-9)
    assert cost.solve(0, target) == pytest.approx(2048)


def test_solve_without_a_positive_root() -> None:
    cost = ChunkCost(**TRUE)
    assert cost.solve(1_000_000_000, t(0, 2048, **TRUE)) is None  # the prefix alone costs more
    assert ChunkCost(0.1, 0.0, 0.0, 0.0).solve(0, 1.0) is None  # no growth with x


def test_shrinks_chunks_needs_growth_with_prefix_and_size() -> None:
    assert ChunkCost(**TRUE).shrinks_chunks
    assert ChunkCost(0.1, 0.0, 0.0, 1e-9).shrinks_chunks
    assert ChunkCost(0.1, 1e-6, 1e-4, 0.0).shrinks_chunks
    assert not ChunkCost(0.1, 0.0, 1e-4, 0.0).shrinks_chunks  # no prefix term
    assert not ChunkCost(0.1, 1e-6, 0.0, 0.0).shrinks_chunks  # no chunk-size term


# -- profile plans ----------------------------------------------------------------------------


def test_profile_grid_covers_long_prefixes() -> None:
    points = profile_grid(2048, 32768)
    assert points[0] == points[1]  # the warm-up point, dropped by the fit
    assert sorted({L for L, _ in points}) == [0, 2048, 4096, 8192, 16384, 30720]
    assert {x for _, x in points} == {512, 1024, 2048}
    assert len(points) == 1 + 6 * 3 and max(L + x for L, x in points) == 32768


@pytest.mark.parametrize(
    ("size", "max_len", "prefixes"),
    [(256, 256, [0]), (256, 768, [0, 256, 512]), (256, 1000, [0, 256, 512, 744]),
     (100, 4096, [0, 100, 200, 400, 800, 1600, 3200, 3996])],
)
def test_profile_grid_stays_within_max_len(size: int, max_len: int, prefixes: list[int]) -> None:
    points = profile_grid(size, max_len)
    assert sorted({L for L, _ in points}) == prefixes
    assert all(L + x <= max_len for L, x in points)


@pytest.mark.parametrize("size", range(1, 300, 7))
def test_published_sweep_lengths_are_distinct(size: int) -> None:
    lengths = profile_lengths(size)
    assert len(set(lengths)) == len(lengths) and lengths[0] == int(1.25 * size)
    assert min(lengths) >= 1


# -- the fit ----------------------------------------------------------------------------------


def timings(coef: dict[str, float], noise: float = 0.0, seed: int = 0) -> tuple[list, list]:
    rng = random.Random(seed)
    points = profile_grid(2048, 32768)[1:]
    return points, [t(L, x, **coef) * (1 + rng.uniform(-noise, noise)) for L, x in points]


def test_fit_recovers_exact_coefficients() -> None:
    cost, clamped = fit_chunk_cost(*timings(TRUE))
    assert cost.as_dict() == pytest.approx(TRUE, rel=1e-6)
    assert clamped == []


def test_fit_with_noise_and_outliers() -> None:
    points, seconds = timings(TRUE, noise=0.01, seed=3)
    seconds[4] *= 6  # a stalled measurement
    seconds[11] *= 4
    cost, _ = fit_chunk_cost(points, seconds)
    assert cost.a == pytest.approx(TRUE["a"], rel=0.1)
    assert cost.b == pytest.approx(TRUE["b"], rel=0.1)
    for L, x in [(0, 2048), (16384, 512), (30720, 1024)]:
        assert cost(L, x) == pytest.approx(t(L, x, **TRUE), rel=0.03)


def test_a_negative_coefficient_is_held_at_zero_and_named() -> None:
    """Chunk times that fall slightly with the prefix alone (g < 0): the least-squares fit
    with g >= 0 is the fit without g, and g is reported as clamped."""
    points, seconds = timings({**TRUE, "g": -2e-7})
    cost, clamped = fit_chunk_cost(points, seconds)
    without_g, _ = fit_chunk_cost(points, seconds, free=("c", "b", "a"))
    assert clamped == ["g"] and cost.g == 0.0
    assert cost.as_dict() == pytest.approx(without_g.as_dict(), rel=1e-9)
    assert min(cost.as_dict().values()) >= 0


def test_fixed_coefficients_stay_zero() -> None:
    points, seconds = timings(TRUE)
    cost, _ = fit_chunk_cost(points, seconds, free=("b", "a"))
    assert cost.c == cost.g == 0.0 and cost.a > 0


def test_fit_needs_as_many_timings_as_coefficients() -> None:
    with pytest.raises(ValueError, match="3 chunk timings cannot fit 4 coefficients"):
        fit_chunk_cost([(0, 1), (0, 2), (0, 3)], [1.0, 2.0, 3.0])
