"""Setting up the chunk-size policy of a backend: fixed chunks, or dynamic chunking fitted on
a start-up profile of the first stage (cached on disk per model, layout, dtype, threads and
initial size, so repeated runs and `pipeserve tune` do not re-profile)."""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeserve import envs
from pipeserve.config import EngineConfig
from pipeserve.scheduler.dynamic_chunking import (
    CostFit,
    OnlineRefit,
    absorb_tail,
    fit_profile,
    make_predictor,
    profile_lengths,
)
from pipeserve.scheduler.request import Req
from pipeserve.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

Profiler = Callable[[list[int]], list[float]]


@dataclass(frozen=True)
class ChunkPolicy:
    size: int | None  # None: no chunking; with dynamic chunking, the initial size C
    dynamic: bool = False
    smooth_factor: float = 0.75
    online: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> ChunkPolicy:
        s = config.scheduler
        return cls(
            s.chunk_size, s.enable_dynamic_chunking, s.smooth_factor, s.dynamic_chunking_online
        )


def setup_chunking(
    policy: ChunkPolicy, scheduler: Scheduler, profile: Profiler, cache_key: dict[str, Any]
) -> dict[str, Any]:
    """Install the policy on the scheduler; returns a description for logs and benchmarks."""
    size = policy.size
    if size is None:
        scheduler.set_chunking(None)
        return {"mode": "none"}
    if not policy.dynamic:
        scheduler.set_chunking(lambda _: size)
        return {"mode": "fixed", "chunk_size": size}
    lengths = profile_lengths(size)
    seconds = cached_profile(cache_key | {"lengths": lengths}, lambda: profile(lengths))
    info: dict[str, Any] = {
        "mode": "dynamic",
        "initial_size": size,
        "smooth_factor": policy.smooth_factor,
        "online": policy.online,
        "profile_lengths": lengths,
        "profile_seconds": seconds,
    }
    try:
        fit = fit_profile(lengths, seconds)
    except ValueError as exc:
        log.warning("dynamic chunking disabled: %s; using fixed chunks of %d", exc, size)
        fit = CostFit(0.0, 0.0, 0.0)
    info.update(a=fit.a, b=fit.b, c=fit.c)
    predictor = make_predictor(fit, size, policy.smooth_factor, scheduler.kv.page_size)
    if predictor is None:
        scheduler.set_chunking(lambda _: size)
        return info | {"mode": "dynamic-disabled"}
    log.info(
        "dynamic chunking: f(l) = %.4g l^2 + %.4g l + %.4g from %d points; C = %d, s = %.2f",
        fit.a,
        fit.b,
        fit.c,
        len(lengths) - 1,
        size,
        policy.smooth_factor,
    )
    context, budget = scheduler.context_len, scheduler.prefill.max_prefill_tokens
    floor = size // 4

    def sizer(req: Req) -> int:
        x = predictor.next_chunk_size(req.kv_len, context - req.kv_len, budget)
        return absorb_tail(x, req.seq_len - req.kv_len, floor, budget)

    scheduler.set_chunking(sizer, OnlineRefit(predictor) if policy.online else None)
    return info


def cached_profile(key: dict[str, Any], run: Callable[[], list[float]]) -> list[float]:
    if not envs.profile_cache_enabled():
        return run()
    key = key | {"host": platform.node(), "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = envs.cache_dir() / "profiles" / f"{digest}.json"
    if path.is_file():
        return list(json.loads(path.read_text())["seconds"])
    seconds = run()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"key": key, "seconds": seconds}))
    tmp.replace(path)
    return seconds
