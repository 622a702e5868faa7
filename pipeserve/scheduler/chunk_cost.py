"""The cost model behind dynamic chunking: seconds of one prompt chunk of x tokens after a
prefix of L tokens already in the KV cache,

    t(L, x) = c + g*L + b*x + a*(2*L*x + x^2)

c: the fixed cost of a forward; g: work that grows with the prefix alone (reading its KV,
indexing its slots); b: per-token work (projections, MLP); a: attention, whose x causal
queries see L + x/2 keys on average. Two ways to fit it (`--dynamic-chunking-model`):

- "quadratic", the published rule (SGLang): prefills of a descending length sweep from
  1.25 C at prefix 0, fitted as f(l) = a l^2 + b l + c; a chunk then costs
  f(L + x) - f(L), which is t(L, x) with c = g = 0.
- "prefix-quadratic": chunks timed after prefixes up to the context served (a grid of
  (L, x) points), fitted in (c, g, b, a) by least squares with every coefficient >= 0.

Pure Python and numpy: profile plans, fits, no tensors.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np

Point = tuple[int, int]  # (prefix_len, chunk_len) of one profiled chunk

MIN_PROFILE_POINTS = 8  # the published sweep, after the warm-up sample
MIN_GRID_POINTS = 6  # the prefix grid, after the warm-up sample
GRID_CHUNK_DIVISORS = (4, 2, 1)  # the grid times chunks of C/4, C/2 and C
COEFFICIENTS = ("c", "g", "b", "a")
OUTLIER_MADS = 3.0  # a point this many (normal-scaled) median absolute deviations off is dropped
# Seconds the slowest stage may spend on one start-up profile: points are timed one at a time,
# in order (they grow), until a stage's sum passes the budget, so a slow device or dtype (bf16
# emulated on a CPU without it: ~100x slower) starts in bounded time with the points it had
# time for.
PROFILE_BUDGET_S = 120.0  # the dynamic-chunking profile
AUTO_CHUNK_BUDGET_S = 30.0  # the chunk-size choice of a PP/TP layout


@dataclass(frozen=True)
class ChunkCost:
    """t(L, x) = c + g L + b x + a (2 L x + x^2), seconds."""

    c: float
    g: float
    b: float
    a: float

    def __call__(self, prefix: float, size: float) -> float:
        return self.c + self.g * prefix + self.b * size + self.a * (2 * prefix * size + size**2)

    def solve(self, prefix: float, target: float) -> float | None:
        """The chunk size x > 0 with t(prefix, x) = target, or None when there is none:
        a x^2 + (2aL + b) x + (c + gL - T) = 0."""
        lin = 2 * self.a * prefix + self.b
        const = self.c + self.g * prefix - target
        if self.a > 0:
            disc = lin * lin - 4 * self.a * const
            x = (-lin + math.sqrt(disc)) / (2 * self.a) if disc >= 0 else -1.0
        else:
            x = -const / lin if lin > 0 else -1.0
        return x if x > 0 else None

    @property
    def shrinks_chunks(self) -> bool:
        """Whether chunks later in a prompt must shrink to keep their time: the cost grows
        with the prefix (g or a) and with the chunk size (b or a)."""
        return self.a > 0 or (self.g > 0 and self.b > 0)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# -- the published quadratic ----------------------------------------------------------------


@dataclass(frozen=True)
class CostFit:
    """f(l) = a l^2 + b l + c: seconds of a prefill of l tokens at prefix 0."""

    a: float
    b: float
    c: float

    def __call__(self, length: float) -> float:
        return self.a * length**2 + self.b * length + self.c


def profile_lengths(initial_size: int) -> list[int]:
    """The published sweep: l_i = int(1.25 C - i * (1.25 C // 128)), i = 0..127, while
    l_i > 0. For C < 103 the published step rounds down to 0 (128 equal lengths); a step of
    at least 1 keeps the lengths distinct (1.25 C, 1.25 C - 1, ..., 1)."""
    top = 1.25 * initial_size
    step = max(top // 128, 1.0)
    out = []
    for i in range(128):
        length = int(top - i * step)
        if length <= 0:
            break
        out.append(length)
    return out


def fit_profile(lengths: list[int], seconds: list[float]) -> CostFit:
    """Least-squares fit of [l^2, l, 1] after dropping the first (warm-up) sample."""
    lengths, seconds = lengths[1:], seconds[1:]
    if len(lengths) < MIN_PROFILE_POINTS:
        raise ValueError(
            f"dynamic chunking needs at least {MIN_PROFILE_POINTS} profile points "
            f"after the warm-up sample, got {len(lengths)}"
        )
    if len(set(lengths)) < 3:
        raise ValueError(
            "the profile sweep has fewer than 3 distinct lengths, too few for a quadratic "
            "(use a larger --chunked-prefill-size)"
        )
    x = np.asarray(lengths, dtype=np.float64)
    design = np.stack([x**2, x, np.ones_like(x)], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=np.float64), rcond=None)
    return CostFit(float(a), float(b), float(c))


# -- the prefix grid --------------------------------------------------------------------------


def profile_grid(initial_size: int, max_len: int) -> list[Point]:
    """Chunks of C/4, C/2 and C after prefixes 0, C, 2C, 4C, ... and max_len - C, every
    point within max_len tokens; the first point once more in front, as a warm-up."""
    sizes = sorted({max(initial_size // d, 1) for d in GRID_CHUNK_DIVISORS})
    prefixes, prefix = [0], initial_size
    while prefix + initial_size <= max_len:
        prefixes.append(prefix)
        prefix *= 2
    if max_len - initial_size > prefixes[-1]:
        prefixes.append(max_len - initial_size)
    points = [(p, x) for p in prefixes for x in sizes if p + x <= max_len]
    return points[:1] + points


def fit_chunk_cost(
    points: list[Point],
    seconds: list[float],
    free: tuple[str, ...] = COEFFICIENTS,
    weights: list[float] | None = None,
) -> tuple[ChunkCost, list[str]]:
    """t(L, x) fitted to measured chunks, the coefficients not in `free` held at 0.

    Least squares of the relative error (timing noise grows with the time), each point's
    error times its weight (default 1), every coefficient >= 0; then points off by more than
    OUTLIER_MADS median absolute deviations are dropped and the rest refitted. Returns the
    cost and the coefficients the unconstrained fit would have made negative (held at 0
    instead: a cost cannot fall as a chunk or prefix grows)."""
    weights = [1.0] * len(points) if weights is None else weights
    timed = [(p, t, w) for p, t, w in zip(points, seconds, weights, strict=True) if t > 0 and w > 0]
    if len(timed) < len(free):
        raise ValueError(f"{len(timed)} chunk timings cannot fit {len(free)} coefficients")
    design, target = _weighted_design([p for p, _, _ in timed], [t / w for _, t, w in timed], free)
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    design = design / scale
    raw, *_ = np.linalg.lstsq(design, target, rcond=None)
    keep = np.ones(len(target), dtype=bool)
    for _ in range(2):
        w = non_negative_lstsq(design[keep], target[keep])
        resid = np.abs(design @ w - target)
        mad = 1.4826 * float(np.median(resid[keep]))
        trimmed = resid <= max(OUTLIER_MADS * mad, 1e-9)
        if trimmed.sum() < max(len(free), MIN_GRID_POINTS // 2) or (trimmed == keep).all():
            break
        keep = trimmed
    coef = dict.fromkeys(COEFFICIENTS, 0.0) | {
        k: float(v) for k, v in zip(free, w / scale, strict=True)
    }
    clamped = [k for k, v in zip(free, raw, strict=True) if v < 0]
    return ChunkCost(**coef), clamped


def _weighted_design(
    points: list[Point], seconds: list[float], free: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Rows divided by the measured time (over its weight), so the fit weighs relative
    errors."""
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    L, x = pts[:, 0], pts[:, 1]
    t = np.asarray(seconds, dtype=np.float64)
    columns = {"c": np.ones_like(L), "g": L, "b": x, "a": 2 * L * x + x**2}
    design = np.stack([columns[k] for k in free], axis=1)
    return design / t[:, None], np.ones_like(t)


def non_negative_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin |design w - target| over w >= 0, exactly: the best least-squares fit among the
    column subsets whose solution is non-negative (four columns: at most 15 small solves)."""
    n = design.shape[1]
    best, best_err = np.zeros(n), float(target @ target)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = design[:, list(cols)]
            w, *_ = np.linalg.lstsq(sub, target, rcond=None)
            err = float(np.sum((sub @ w - target) ** 2))
            if (w >= 0).all() and err < best_err:
                best, best_err = np.zeros(n), err
                best[list(cols)] = w
    return best
