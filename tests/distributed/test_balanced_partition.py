"""`balanced_partition` (the rule behind `--pp-layer-partition auto`) against a brute-force
enumeration of every contiguous split: the slowest stage is as fast as possible; among
those splits the sum of squared stage costs is least; among those, later stages hold as
many layers as possible. Equal costs give the default rule."""

from __future__ import annotations

import itertools
import random

import pytest

from pipeserve.distributed.partition import balanced_partition, default_partition


def all_partitions(n: int, p: int) -> list[list[int]]:
    """Every split of n layers into p non-empty contiguous stages."""
    return [
        [b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
        for cuts in itertools.combinations(range(1, n), p - 1)
    ]


def stage_costs(sizes: list[int], costs: list[float], first: float, last: float) -> list[float]:
    out, lo = [], 0
    for stage, size in enumerate(sizes):
        extra = (first if stage == 0 else 0.0) + (last if stage == len(sizes) - 1 else 0.0)
        out.append(sum(costs[lo : lo + size]) + extra)
        lo += size
    return out


def brute_force_best(costs: list[float], p: int, first: float, last: float,
                     tol: float) -> tuple[float, float, list[list[int]]]:
    """(optimal bottleneck, least sum of squares among bottleneck-optimal splits, the splits
    reaching both), all within `tol`."""
    scored = [(s, stage_costs(s, costs, first, last)) for s in all_partitions(len(costs), p)]
    bottleneck = min(max(c) for _, c in scored)
    optimal = [(s, c) for s, c in scored if max(c) <= bottleneck + tol]
    squares = min(sum(x * x for x in c) for _, c in optimal)
    best = [s for s, c in optimal if sum(x * x for x in c) <= squares + tol * (1 + squares)]
    return bottleneck, squares, best


def random_case(rng: random.Random, integer: bool) -> tuple[list[float], int, float, float]:
    n = rng.randint(1, 10)
    p = rng.randint(1, min(n, 4))
    if integer:  # small integers: many exact ties, so the tie-breaking rules matter
        costs = [float(rng.randint(1, 4)) for _ in range(n)]
        first, last = float(rng.randint(0, 5)), float(rng.randint(0, 5))
    else:
        costs = [rng.uniform(0.1, 3.0) for _ in range(n)]
        first = rng.choice([0.0, rng.uniform(0.0, 4.0)])
        last = rng.choice([0.0, rng.uniform(0.0, 4.0)])
    return costs, p, first, last


@pytest.mark.parametrize("integer", [True, False], ids=["integer-costs", "float-costs"])
def test_matches_brute_force_on_random_cases(integer: bool) -> None:
    rng = random.Random(1234 + integer)
    for _ in range(400):
        costs, p, first, last = random_case(rng, integer)
        got = balanced_partition(costs, p, first_extra=first, last_extra=last)
        case = f"costs={costs} p={p} first={first} last={last}: got {got}"
        assert len(got) == p and sum(got) == len(costs) and min(got) >= 1, case
        tol = 1e-9 * (sum(costs) + first + last)
        bottleneck, squares, best = brute_force_best(costs, p, first, last, tol)
        got_costs = stage_costs(got, costs, first, last)
        assert max(got_costs) == pytest.approx(bottleneck, rel=1e-12, abs=tol), case
        assert sum(x * x for x in got_costs) == pytest.approx(squares, rel=1e-9), case
        # Most layers on later stages: compare from the last stage backwards.
        assert got[::-1] == max(s[::-1] for s in best), case


def test_extras_move_layers_away_from_the_end_stages() -> None:
    # 8 equal layers on 2 stages; the LM head costs 2 layers: the last stage gets 3 layers.
    assert balanced_partition([1.0] * 8, 2, last_extra=2.0) == [5, 3]
    # The embedding costs 2 layers: the first stage gets 3 layers.
    assert balanced_partition([1.0] * 8, 2, first_extra=2.0) == [3, 5]
    # One expensive (MoE) layer in the middle of a dense model.
    assert balanced_partition([1.0, 1.0, 6.0, 1.0, 1.0, 1.0], 3) == [2, 1, 3]


def test_equal_costs_reproduce_the_default_rule() -> None:
    for n in range(1, 25):
        for p in range(1, min(n, 8) + 1):
            for cost in (1.0, 0.37, 2.5):
                assert balanced_partition([cost] * n, p) == default_partition(n, p), (n, p, cost)


def test_more_stages_than_layers_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot split 3 layers over --pp-size 4 stages"):
        balanced_partition([1.0, 1.0, 1.0], 4)
