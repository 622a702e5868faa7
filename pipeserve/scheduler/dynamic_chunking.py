"""Dynamic chunking: pick each next prompt chunk so that every chunk costs the same time.

Cumulative prefill time of l tokens is modelled as f(l) = a*l^2 + b*l + c (attention makes
later chunks dearer). With C the initial chunk size, the target per-chunk time is
T = f(C) - f(0); a continuation chunk at prefix L gets the x solving f(L + x) - f(L) = T,
smoothed towards C, floored at C // 4 and aligned to max(page_size, 64).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

MIN_PROFILE_POINTS = 8
ONLINE_WINDOW = 256  # chunk-time observations kept for the online refit
ONLINE_MIN_POINTS = 8
ONLINE_REFIT_EVERY = 4


def profile_lengths(initial_size: int) -> list[int]:
    """The start-up sweep: l_i = int(1.25 C - i * (1.25 C // 128)), i = 0..127, while l_i > 0."""
    top = 1.25 * initial_size
    step = top // 128
    out = []
    for i in range(128):
        length = int(top - i * step)
        if length <= 0:
            break
        out.append(length)
    return out


@dataclass(frozen=True)
class CostFit:
    a: float
    b: float
    c: float

    def __call__(self, length: float) -> float:
        return self.a * length**2 + self.b * length + self.c


def fit_profile(lengths: list[int], seconds: list[float]) -> CostFit:
    """Least-squares fit of [l^2, l, 1] after dropping the first (warm-up) sample."""
    lengths, seconds = lengths[1:], seconds[1:]
    if len(lengths) < MIN_PROFILE_POINTS:
        raise ValueError(
            f"dynamic chunking needs at least {MIN_PROFILE_POINTS} profile points "
            f"after the warm-up sample, got {len(lengths)}"
        )
    if len(set(lengths)) < 3:  # e.g. C < 103: the sweep's step rounds down to 0
        raise ValueError(
            "the profile sweep has fewer than 3 distinct lengths, too few for a quadratic "
            "(use a larger --chunked-prefill-size)"
        )
    x = np.asarray(lengths, dtype=np.float64)
    design = np.stack([x**2, x, np.ones_like(x)], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=np.float64), rcond=None)
    return CostFit(float(a), float(b), float(c))


class ChunkSizePredictor:
    """Next chunk size for a request whose prefix (tokens already cached) is L."""

    def __init__(
        self,
        a: float,
        b: float,
        c: float,
        initial_size: int,
        smooth_factor: float,
        page_size: int = 1,
    ) -> None:
        if a <= 0:
            raise ValueError(f"quadratic coefficient a = {a:g} <= 0: the cost model is unusable")
        if not 0.0 <= smooth_factor <= 1.0:
            raise ValueError(f"smooth factor {smooth_factor} must be in [0, 1]")
        self.fit = CostFit(a, max(b, 0.0), c)
        self.initial_size = initial_size
        self.smooth_factor = smooth_factor
        self.align = max(page_size, 64)

    @property
    def target_time(self) -> float:
        """T = f(C) - f(0)."""
        a, b, size = self.fit.a, self.fit.b, self.initial_size
        return a * size**2 + b * size

    def root(self, prefix_len: int) -> float:
        """x* solving a x^2 + (2aL + b) x - T = 0 (C when there is no positive root)."""
        a, b = self.fit.a, self.fit.b
        lin = 2 * a * prefix_len + b
        disc = lin * lin + 4 * a * self.target_time
        x = (-lin + math.sqrt(disc)) / (2 * a) if disc >= 0 else -1.0
        return x if x > 0 else float(self.initial_size)

    def next_chunk_size(
        self, prefix_len: int, room: int | None = None, budget: int | None = None
    ) -> int:
        """The first chunk (L = 0) always uses C; later ones follow the smoothed root, floored
        at C // 4 and aligned down to max(page_size, 64); then capped by the remaining
        context room and the prefill budget (and realigned)."""
        size = self.initial_size
        if prefix_len > 0:
            smoothed = size + self.smooth_factor * (self.root(prefix_len) - size)
            size = self._aligned(max(int(smoothed), self.initial_size // 4))
        caps = [c for c in (room, budget) if c is not None]
        if caps and min(caps) < size:
            cap = min(caps)
            size = self._aligned(cap) if cap >= self.align else cap
        return size

    def _aligned(self, x: int) -> int:
        return max(x // self.align * self.align, self.align)


def absorb_tail(size: int, remaining: int, floor: int, budget: int) -> int:
    """Take the rest of the prompt now when the chunk would leave less than `floor` tokens:
    a tiny last chunk costs a whole pipeline pass for almost no work (and the last chunk is
    the one every later stage waits for)."""
    if 0 < remaining - size < floor and remaining <= budget:
        return remaining
    return size


def make_predictor(
    fit: CostFit, initial_size: int, smooth_factor: float, page_size: int
) -> ChunkSizePredictor | None:
    """The predictor, or None (fixed chunks, with a warning) when the fit is unusable."""
    if fit.a <= 0:
        log.warning(
            "dynamic chunking disabled: fitted a = %.3g <= 0 (prefill cost does not grow "
            "quadratically on this profile); using fixed chunks of %d",
            fit.a,
            initial_size,
        )
        return None
    if fit.b < 0:
        log.info("dynamic chunking: fitted b = %.3g < 0 clamped to 0", fit.b)
    return ChunkSizePredictor(fit.a, fit.b, fit.c, initial_size, smooth_factor, page_size)


class OnlineRefit:
    """Refines (a, b) from the chunk times measured while serving. A chunk of x tokens at
    prefix L costs f(L + x) - f(L) = a (2Lx + x^2) + b x, linear in (a, b). Keeps a bounded
    window; each refit drops points whose residual exceeds 3 median absolute deviations
    (outliers: a stalled step, a noisy neighbour) and solves least squares on the rest."""

    def __init__(self, predictor: ChunkSizePredictor, window: int = ONLINE_WINDOW) -> None:
        self.predictor = predictor
        self.points: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._since_fit = 0
        self.refits = 0

    def observe(self, prefix_len: int, chunk_len: int, seconds: float) -> None:
        if chunk_len <= 0 or seconds <= 0:
            return
        self.points.append((prefix_len, chunk_len, seconds))
        self._since_fit += 1
        if len(self.points) >= ONLINE_MIN_POINTS and self._since_fit >= ONLINE_REFIT_EVERY:
            self._refit()

    def _refit(self) -> None:
        self._since_fit = 0
        pts = np.asarray(self.points, dtype=np.float64)
        L, x, t = pts[:, 0], pts[:, 1], pts[:, 2]
        design = np.stack([2 * L * x + x**2, x], axis=1)
        keep = np.ones(len(t), dtype=bool)
        for _ in range(2):
            (a, b), *_ = np.linalg.lstsq(design[keep], t[keep], rcond=None)
            resid = np.abs(design @ np.array([a, b]) - t)
            mad = np.median(resid[keep]) + 1e-12
            keep = resid <= 3 * 1.4826 * mad
            if keep.sum() < ONLINE_MIN_POINTS:
                return
        if a > 0:
            old = self.predictor.fit
            self.predictor.fit = CostFit(float(a), max(float(b), 0.0), old.c)
            self.refits += 1
