"""Setting up the chunk-size policy of a backend: fixed chunks, or dynamic chunking fitted on
a start-up profile that every pipeline stage times (cached on disk per model, layout, dtype,
threads, cost model and profile points, so repeated runs and `pipeserve tune` do not
re-profile).

How the stages' profiles are combined: each stage times every profile point on its own
layers (one stage after another, so their timings do not disturb each other), and the fit
takes, per point, the slowest stage's seconds: in a pipeline a chunk occupies each stage in
turn, and the slowest stage sets the pace. The scheduler alone decides chunk sizes, so
every rank runs the same sizes from the same fit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipeserve import envs
from pipeserve.config import EngineConfig
from pipeserve.device import min_pipeline_chunk, resolve_device
from pipeserve.scheduler.chunk_cost import (
    AUTO_CHUNK_BUDGET_S,
    COEFFICIENTS,
    PROFILE_BUDGET_S,
    Point,
    profile_grid,
    profile_lengths,
)
from pipeserve.scheduler.dynamic_chunking import (
    ChunkSizePredictor,
    OnlineRefit,
    balance_tail,
    make_predictor,
)
from pipeserve.scheduler.prefill import ChunkSizer
from pipeserve.scheduler.request import Req, Status
from pipeserve.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

# (points, budget_s) -> seconds per point, a list per stage: of the first points, timed in
# order until a stage has spent the budget
Profiler = Callable[[list[Point], float], list[list[float]]]


AUTO_CANDIDATES = (256, 512, 1024, 2048, 4096)
AUTO_SLACK = 0.05  # a chunk within this share of the best per-token time is efficient enough
AUTO_DYNAMIC_FACTOR = 2  # dynamic chunking starts from this multiple of the picked size


@dataclass(frozen=True)
class ChunkPolicy:
    size: int | None  # None: no chunking; with dynamic chunking, the initial size C
    dynamic: bool = False
    auto: bool = False  # pick the size at start-up (a PP/TP layout, no size given)
    pipeline_floor: int = 512  # the smallest size a PP/TP layout picks (min_pipeline_chunk)
    smooth_factor: float = 0.75
    online: bool = False
    model: str = "prefix-quadratic"  # the chunk cost model (--dynamic-chunking-model)
    min_size: int | None = None  # None: the model's default floor
    profile_max_len: int = 32768  # prefix-quadratic: longest prefix + chunk profiled

    @classmethod
    def from_config(cls, config: EngineConfig) -> ChunkPolicy:
        s = config.scheduler
        return cls(
            s.chunk_size,
            s.enable_dynamic_chunking,
            s.chunked_prefill_size is None and config.parallel.world_size > 1,
            min_pipeline_chunk(resolve_device(config.model.device)),
            s.smooth_factor,
            s.dynamic_chunking_online,
            s.dynamic_chunking_model,
            s.dynamic_chunking_min_size,
            s.dynamic_chunking_profile_max_len,
        )


def setup_chunking(
    policy: ChunkPolicy, scheduler: Scheduler, profile: Profiler, cache_key: dict[str, Any] | None
) -> dict[str, Any]:
    """Install the policy on the scheduler; returns a description for logs and benchmarks.
    `cache_key` None: profile every time (the simulator's timings cost nothing)."""
    if policy.auto:
        picked = pick_chunk_size(policy, scheduler, profile, cache_key)
        size = picked["chunk_size"] * (AUTO_DYNAMIC_FACTOR if policy.dynamic else 1)
        return _install(replace(policy, size=size, auto=False), scheduler, profile, cache_key) | {
            "auto": picked
        }
    return _install(policy, scheduler, profile, cache_key)


def _install(
    policy: ChunkPolicy, scheduler: Scheduler, profile: Profiler, cache_key: dict[str, Any] | None
) -> dict[str, Any]:
    size = policy.size
    if size is None:
        scheduler.set_chunking(None)
        return {"mode": "none"}
    if not policy.dynamic:
        scheduler.set_chunking(lambda _: size)
        return {"mode": "fixed", "chunk_size": size}
    info = run_profile(policy, size, scheduler, profile, cache_key)
    try:
        predictor, fit = make_predictor(
            policy.model,
            info["profile_points"],
            info["profile_seconds"],
            size,
            policy.smooth_factor,
            scheduler.kv.page_size,
            policy.min_size,
        )
    except ValueError as exc:
        log.warning("dynamic chunking disabled: %s; using fixed chunks of %d", exc, size)
        scheduler.set_chunking(lambda _: size)
        return info | {"mode": "dynamic-disabled", "reason": str(exc)}
    info |= fit | {"min_size": predictor.min_size, "target_s": predictor.target_time}
    _log_fit(info)
    refit = _online_refit(policy, predictor, info) if policy.online else None
    scheduler.set_chunking(make_sizer(predictor, scheduler), refit)
    return info


def pick_chunk_size(
    policy: ChunkPolicy, scheduler: Scheduler, profile: Profiler, key: dict[str, Any] | None
) -> dict[str, Any]:
    """--chunked-prefill-size for a PP/TP layout when none is given: the smallest candidate
    whose per-token forward time (prefix 0, slowest stage) is within AUTO_SLACK of the best
    candidate's, and at least the device's floor. Small chunks keep the pipeline full (the
    last chunk, which the later stages run alone, is short); below the knee kernels lose
    efficiency. Timed once and cached like the dynamic-chunking profile."""
    free = scheduler.kv.allocator.num_free * scheduler.kv.page_size
    sizes = [n for n in AUTO_CANDIDATES if n <= min(free, scheduler.context_len)] or [free]
    points = [(0, sizes[0]), *((0, n) for n in sizes)]  # the first one twice: a warm-up
    key = _extended(key, auto_chunk_points=points)
    stages = cached_profile(key, lambda: profile(points, AUTO_CHUNK_BUDGET_S))
    _note_budget(len(stages[0]), len(points), AUTO_CHUNK_BUDGET_S, "chunk-size")
    slowest = [max(per_stage) for per_stage in zip(*stages, strict=True)]
    slowest = slowest[1:] or slowest  # past the warm-up, unless the budget allowed no more
    sizes = sizes[: len(slowest)]
    per_token = [t / n for n, t in zip(sizes, slowest, strict=True)]
    best = min(per_token)
    knee = next(n for n, t in zip(sizes, per_token, strict=True) if t <= (1 + AUTO_SLACK) * best)
    floor = policy.pipeline_floor
    size = max(knee, floor)
    log.info(
        "chunked prefill size %d (picked for this layout: per-token forward times %s ms at "
        "chunks of %s; the smallest within %.0f%% of the best is %d, the device's floor %d; "
        "--chunked-prefill-size overrides)",
        size * (AUTO_DYNAMIC_FACTOR if policy.dynamic else 1),
        ", ".join(f"{1e3 * t:.3f}" for t in per_token),
        ", ".join(map(str, sizes)),
        100 * AUTO_SLACK,
        knee,
        floor,
    )
    return {
        "chunk_size": size,
        "sizes": sizes,
        "per_token_s": per_token,
        "knee": knee,
        "floor": floor,
    }


def run_profile(
    policy: ChunkPolicy,
    size: int,
    scheduler: Scheduler,
    profile: Profiler,
    key: dict[str, Any] | None,
) -> dict[str, Any]:
    """Every stage's seconds per profile point (from the cache when the same points were
    timed before), and per point the slowest stage's."""
    points = profile_points(policy, size, scheduler)
    key = _extended(key, cost_model=policy.model, points=points)
    stages = cached_profile(key, lambda: profile(points, PROFILE_BUDGET_S)) if points else [[]]
    _note_budget(len(stages[0]), len(points), PROFILE_BUDGET_S, "dynamic-chunking")
    points = points[: len(stages[0])]
    return {
        "mode": "dynamic",
        "model": policy.model,
        "initial_size": size,
        "smooth_factor": policy.smooth_factor,
        "online": policy.online,
        "profile_points": points,
        "profile_seconds": [max(per_stage) for per_stage in zip(*stages, strict=True)],
        "profile_stage_seconds": stages,
    }


def profile_points(policy: ChunkPolicy, size: int, scheduler: Scheduler) -> list[Point]:
    """The chunks the start-up profile times (the first one twice: a warm-up)."""
    if policy.model == "quadratic":
        return [(0, n) for n in profile_lengths(size)]
    kv = scheduler.kv
    free = kv.allocator.num_free * kv.page_size  # the profile evicts no cached prefix
    return profile_grid(size, min(policy.profile_max_len, scheduler.context_len, free))


def _note_budget(timed: int, planned: int, budget_s: float, what: str) -> None:
    if timed < planned:
        log.warning(
            "the %s profile timed %d of its %d points: a stage spent its %.0f s budget (a slow "
            "device or dtype); the choice rests on those",
            what,
            timed,
            planned,
            budget_s,
        )


def make_sizer(predictor: ChunkSizePredictor, scheduler: Scheduler) -> ChunkSizer:
    """A request's next chunk: the predictor's size, with no tiny last chunk left behind
    (except at s = 0, which is fixed chunking exactly)."""
    context, budget = scheduler.context_len, scheduler.prefill.max_prefill_tokens

    def sizer(req: Req) -> int:
        first = req.status is Status.WAITING  # nothing of this admission computed yet
        size = predictor.next_chunk_size(req.kv_len, context - req.kv_len, budget, first)
        if predictor.smooth_factor == 0:
            return size
        return balance_tail(size, req.seq_len - req.kv_len, predictor.min_size, predictor.align)

    return sizer


def _online_refit(
    policy: ChunkPolicy, predictor: ChunkSizePredictor, info: dict[str, Any]
) -> OnlineRefit:
    if policy.model == "quadratic":  # as published: (a, b) from live chunks alone
        return OnlineRefit(predictor, free=("b", "a"))
    anchors = (info["profile_points"][1:], info["profile_seconds"][1:])  # no warm-up point
    return OnlineRefit(predictor, COEFFICIENTS, anchors)


def _log_fit(info: dict[str, Any]) -> None:
    terms = ", ".join(f"{k} = {v:.4g}" for k, v in info["coefficients"].items())
    log.info(
        "dynamic chunking (%s): %s from %d points%s; C = %d, T = %.4g s, s = %.2f, floor %d",
        info["model"],
        terms,
        len(info["profile_points"]) - 1,
        f" ({', '.join(info['clamped'])} clamped to 0)" if info["clamped"] else "",
        info["initial_size"],
        info["target_s"],
        info["smooth_factor"],
        info["min_size"],
    )


def _extended(key: dict[str, Any] | None, **extra: Any) -> dict[str, Any] | None:
    return None if key is None else key | extra


def cached_profile(
    key: dict[str, Any] | None, run: Callable[[], list[list[float]]]
) -> list[list[float]]:
    """`run()`'s seconds, from the disk cache when the same `key` was timed before (None: no
    cache)."""
    if key is None or not envs.profile_cache_enabled():
        return run()
    key = key | {"host": platform.node(), "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = envs.cache_dir() / "profiles" / f"{digest}.json"
    if path.is_file():
        return [list(stage) for stage in json.loads(path.read_text())["seconds"]]
    seconds = run()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"key": key, "seconds": seconds}))
    tmp.replace(path)
    return seconds
