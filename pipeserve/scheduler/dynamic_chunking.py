"""Dynamic chunking: pick each next prompt chunk so that every chunk costs the same time.

With t(L, x) the cost of a chunk of x tokens after a prefix of L (scheduler/chunk_cost.py)
and C the initial chunk size, the target per-chunk time is the first chunk's, T = t(0, C);
a later chunk gets the x solving t(L, x) = T, smoothed towards C by s (s = 0: fixed chunks
of C exactly; s = 1: the model), floored at the minimum size, aligned down to
max(page_size, 64), then capped by the context room and the prefill budget. The chunk times
the profile measures are the slowest stage's, so T is a pipeline stage time.

Only the scheduler decides chunk sizes; the pipeline stages just run what they are given.
"""

from __future__ import annotations

from collections import deque

from pipeserve.config import DYNAMIC_CHUNKING_MODELS
from pipeserve.scheduler.chunk_cost import (
    COEFFICIENTS,
    MIN_GRID_POINTS,
    ChunkCost,
    Point,
    fit_chunk_cost,
    fit_profile,
)

ONLINE_WINDOW = 256  # chunk-time observations kept for the online refit
ONLINE_MIN_POINTS = 8
ONLINE_REFIT_EVERY = 4
ANCHOR_WEIGHT = 0.1  # a profile point's weight in the online refit, a live chunk's being 1
ALIGN_MIN = 64  # chunk sizes are multiples of max(page_size, ALIGN_MIN)
PREFIX_MODEL_FLOOR_DIVISOR = 8  # prefix-quadratic: default minimum size C // 8
QUADRATIC_FLOOR_DIVISOR = 4  # published: C // 4


def default_min_size(model: str, initial_size: int, page_size: int) -> int:
    """The published rule floors at C // 4, which stops chunks from shrinking where attention
    dominates. The prefix model is fitted at those prefixes, so it is trusted further, down
    to C // 8 (aligned, at least one alignment unit): that still keeps a chunk's matmuls at
    a few hundred rows for the usual C of 2-4K. A judgement, not a measurement: the flag
    --dynamic-chunking-min-size moves it."""
    if model == "quadratic":
        return initial_size // QUADRATIC_FLOOR_DIVISOR
    align = max(page_size, ALIGN_MIN)
    return max(initial_size // PREFIX_MODEL_FLOOR_DIVISOR // align * align, align)


class ChunkSizePredictor:
    """Next chunk size of a request whose prefix (tokens already in the KV cache) is L."""

    def __init__(
        self,
        cost: ChunkCost,
        initial_size: int,
        smooth_factor: float,
        page_size: int = 1,
        min_size: int | None = None,
        full_first_chunk: bool = False,
    ) -> None:
        """`full_first_chunk`: a request's first chunk is C even after a cached prefix (the
        published rule); otherwise only at prefix 0, and a first chunk after a cached prefix
        of L gets the model's size at L (a C-sized one would cost t(L, C) > T)."""
        if not 0.0 <= smooth_factor <= 1.0:
            raise ValueError(f"smooth factor {smooth_factor} must be in [0, 1]")
        self.cost = cost
        self.initial_size = initial_size
        self.smooth_factor = smooth_factor
        self.align = max(page_size, ALIGN_MIN)
        self.min_size = initial_size // QUADRATIC_FLOOR_DIVISOR if min_size is None else min_size
        self.full_first_chunk = full_first_chunk

    @classmethod
    def published(
        cls,
        a: float,
        b: float,
        c: float,
        initial_size: int,
        smooth_factor: float,
        page_size: int = 1,
        min_size: int | None = None,
    ) -> ChunkSizePredictor:
        """The published rule on f(l) = a l^2 + b l + c: b < 0 clamped to 0, c plays no part
        (a chunk costs f(L + x) - f(L)), floor C // 4, the first chunk always C."""
        if a <= 0:
            raise ValueError(
                f"fitted a = {a:.3g} <= 0 (prefill cost does not grow quadratically on this "
                "profile)"
            )
        cost = ChunkCost(0.0, 0.0, max(b, 0.0), a)
        return cls(cost, initial_size, smooth_factor, page_size, min_size, full_first_chunk=True)

    @property
    def target_time(self) -> float:
        """T = t(0, C), the first chunk's time."""
        return self.cost(0, self.initial_size)

    def root(self, prefix_len: int) -> float:
        """x* solving t(L, x) = T. Without a positive root: 0 where the prefix alone costs
        more than T (the smallest chunk is best), else C (the published fallback)."""
        x = self.cost.solve(prefix_len, self.target_time)
        if x is not None:
            return x
        return 0.0 if self.cost(prefix_len, 0) >= self.target_time else float(self.initial_size)

    def next_chunk_size(
        self,
        prefix_len: int,
        room: int | None = None,
        budget: int | None = None,
        first_chunk: bool = False,
    ) -> int:
        """The model's size (C for a request's first chunk at prefix 0), then capped by the
        remaining context room and the prefill budget (and realigned). s = 0 is fixed chunking
        exactly: C, which the batch budget caps as it caps fixed chunks."""
        if self.smooth_factor == 0:
            return self.initial_size
        size = self.model_size(prefix_len, first_chunk)
        caps = [c for c in (room, budget) if c is not None]
        if caps and min(caps) < size:
            cap = min(caps)
            size = self._aligned(cap) if cap >= self.align else cap
        return size

    def model_size(self, prefix_len: int, first_chunk: bool = False) -> int:
        size = self.initial_size
        if prefix_len == 0 or (first_chunk and self.full_first_chunk):
            return size
        smoothed = size + self.smooth_factor * (self.root(prefix_len) - size)
        if smoothed >= size:
            return size
        return min(self._aligned(max(int(smoothed), self.min_size)), size)

    def _aligned(self, x: int) -> int:
        return max(x // self.align * self.align, self.align)


def balance_tail(size: int, remaining: int, floor: int, align: int) -> int:
    """This chunk's size such that no tiny last chunk is left: when taking `size` tokens
    would leave fewer than `floor` (but some), this chunk and the last share the rest about
    equally (this one aligned, the last at most `size`). Never more than `size`, the
    model's size for this chunk."""
    tail = remaining - size
    if tail <= 0 or tail >= floor:
        return size
    middle = (remaining + align) // (2 * align) * align  # the multiple nearest remaining / 2
    least = -(-tail // align) * align  # the last chunk must hold at most `size`
    return min(max(middle, least), size)


def make_predictor(
    model: str,
    points: list[Point],
    seconds: list[float],
    initial_size: int,
    smooth_factor: float,
    page_size: int,
    min_size: int | None = None,
) -> tuple[ChunkSizePredictor, dict[str, object]]:
    """The predictor fitted on a start-up profile (its first point is the warm-up sample) and
    a description of the fit; ValueError when the profile gives no usable model."""
    floor = default_min_size(model, initial_size, page_size) if min_size is None else min_size
    if model == "quadratic":
        fit = fit_profile([x for _, x in points], seconds)
        predictor = ChunkSizePredictor.published(
            fit.a, fit.b, fit.c, initial_size, smooth_factor, page_size, floor
        )
        coefficients = {"a": fit.a, "b": fit.b, "c": fit.c}
        return predictor, {"coefficients": coefficients, "clamped": ["b"] if fit.b < 0 else []}
    if model == "prefix-quadratic":
        cost, clamped = _fit_prefix_model(points, seconds)
        predictor = ChunkSizePredictor(cost, initial_size, smooth_factor, page_size, floor)
        return predictor, {"coefficients": cost.as_dict(), "clamped": clamped}
    raise ValueError(
        f"unknown dynamic chunking model {model!r} (one of {', '.join(DYNAMIC_CHUNKING_MODELS)})"
    )


def _fit_prefix_model(points: list[Point], seconds: list[float]) -> tuple[ChunkCost, list[str]]:
    if len(points) - 1 < MIN_GRID_POINTS:
        raise ValueError(
            f"the prefix profile has {len(points) - 1} points, fewer than {MIN_GRID_POINTS} "
            "(raise --dynamic-chunking-profile-max-len or the KV pool)"
        )
    cost, clamped = fit_chunk_cost(points[1:], seconds[1:])
    if not cost.shrinks_chunks:
        raise ValueError(
            f"the fitted chunk cost {cost.as_dict()} does not grow with the prefix, so no "
            "chunk would shrink"
        )
    return cost, clamped


class OnlineRefit:
    """Refines the predictor's chunk cost from chunk times measured while serving (a
    micro-batch holding one prompt chunk: its prefix, its size, the slowest stage's seconds).
    Keeps a bounded window of them; each refit is fit_chunk_cost on the window plus the
    `anchors` (the start-up profile's points) at a small weight: chunks sized to equal times
    are nearly collinear in (1, L, x, 2Lx + x^2), so a stretch of them alone may leave the
    split of T between the coefficients poorly determined; the anchors settle it, the live
    chunks decide wherever they reach. Non-negative and robust to outliers (a stalled step,
    a noisy neighbour) as fit_chunk_cost is. A refit that would not shrink chunks is not
    installed."""

    def __init__(
        self,
        predictor: ChunkSizePredictor,
        free: tuple[str, ...] = COEFFICIENTS,
        anchors: tuple[list[Point], list[float]] = ([], []),
        window: int = ONLINE_WINDOW,
    ) -> None:
        self.predictor = predictor
        self.free = free
        self.anchors = anchors
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
        points = self.anchors[0] + [(L, x) for L, x, _ in self.points]
        seconds = self.anchors[1] + [t for _, _, t in self.points]
        weights = [ANCHOR_WEIGHT] * len(self.anchors[0]) + [1.0] * len(self.points)
        cost, _ = fit_chunk_cost(points, seconds, self.free, weights)
        if cost.shrinks_chunks:
            self.predictor.cost = cost
            self.refits += 1
