"""Where requests are executed. The in-process backend runs scheduler and model in the
caller's process (one device); the multi-process backend drives worker processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pipeserve.config import EngineConfig
from pipeserve.device import cpu_cores, set_threads
from pipeserve import envs
from pipeserve.device import ComputeStream
from pipeserve.engine.future_map import FutureMap, SlotRing, ring_size, worker_ring_size
from pipeserve.engine.pipeline_loop import PipelineLoop
from pipeserve.engine.workers import WorkerError, WorkerSet
from pipeserve.engine.overlap_loop import OverlapLoop
from pipeserve.engine.plain_loop import PlainLoop
from pipeserve.models.arch import ArchConfig
from pipeserve.runner.model_runner import ModelRunner, kv_pool_pages
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler
from pipeserve.tokenizer import Tokenizer


class Backend(Protocol):
    def submit(self, req: Req) -> None: ...
    def abort(self, rid: str) -> None: ...
    def step(self) -> list[RequestUpdate]: ...
    def stats(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


def build_scheduler(config: EngineConfig, arch: ArchConfig, tokenizer: Tokenizer,
                    num_pages: int, context_len: int, max_batch_reqs: int | None = None) -> Scheduler:
    kv = KVManager(num_pages, config.cache.page_size, config.cache.disable_radix_cache)
    eos = tuple(sorted(set(arch.eos_token_ids) | set(tokenizer.eos_token_ids)))
    return Scheduler(config.scheduler, kv, context_len, eos, detokenize=tokenizer.decode,
                     max_batch_reqs=max_batch_reqs)


def scheduler_stats(scheduler: Scheduler, loop: str) -> dict[str, Any]:
    kv = scheduler.kv
    return {
        "loop": loop,
        "overlap_schedule": loop == "overlap",
        "kv_pages_total": kv.allocator.capacity,
        "kv_pages_free": kv.allocator.num_free,
        "kv_pages_cached": kv.tree.cached_pages() if kv.tree else 0,
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        "num_retracted": scheduler.decode.num_retracted,
        "prefix_hit_tokens": kv.hit_tokens,
        "prefix_lookup_tokens": kv.lookup_tokens,
    }


class InProcessBackend:
    def __init__(self, config: EngineConfig, arch: ArchConfig, model_path: Path,
                 tokenizer: Tokenizer, context_len: int) -> None:
        threads = config.parallel.threads_per_worker or cpu_cores()
        set_threads(threads)
        num_pages = kv_pool_pages(config, arch, local_workers=1)
        self.runner = ModelRunner(config, arch, model_path, num_pages)
        self.scheduler = build_scheduler(config, arch, tokenizer, num_pages, context_len)
        self.loop: PlainLoop | OverlapLoop = self._make_loop(config, threads, context_len)
        self._aborted: list[RequestUpdate] = []

    def _make_loop(self, config: EngineConfig, threads: int, context_len: int) -> PlainLoop | OverlapLoop:
        s = config.scheduler
        if s.disable_overlap_schedule:
            return PlainLoop(self.scheduler, self.runner)
        size = ring_size(s.max_running_requests, context_len, s.chunk_size)
        return OverlapLoop(self.scheduler, self.runner, ComputeStream(self.runner.device, threads),
                           FutureMap(size, self.runner.device),
                           favour_ttft=envs.disable_consecutive_prefill_overlap())

    def submit(self, req: Req) -> None:
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> None:
        update = self.scheduler.abort(rid)
        if update is not None:
            self._aborted.append(update)

    def step(self) -> list[RequestUpdate]:
        updates, self._aborted = self._aborted, []
        return updates + self.loop.step()

    def stats(self) -> dict[str, Any]:
        return scheduler_stats(self.scheduler, self.loop.name)

    def shutdown(self) -> None:
        self.loop.close()


class WorkerBackend:
    """Scheduler here, model in worker processes (one per stage x TP rank)."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, model_path: Path,
                 tokenizer: Tokenizer, context_len: int) -> None:
        p, s = config.parallel, config.scheduler
        ring = worker_ring_size(config, context_len)
        self.workers = WorkerSet(config, str(model_path), future_ring=ring)
        try:
            info = self.workers.wait_ready()
        except BaseException:
            self.workers.shutdown()
            raise
        num_pages = info[0]["num_pages"]
        self.partition = info[0]["partition"]
        per_batch = max(s.max_running_requests // p.pp_size, 1)
        self.scheduler = build_scheduler(config, arch, tokenizer, num_pages, context_len,
                                         max_batch_reqs=per_batch)
        depth = p.pp_size if p.pp_size > 1 else (2 if ring else 1)
        self.loop = PipelineLoop(self.scheduler, self.workers, depth,
                                 SlotRing(ring) if ring else None)
        self._aborted: list[RequestUpdate] = []

    def submit(self, req: Req) -> None:
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> None:
        update = self.scheduler.abort(rid)
        if update is not None:
            self._aborted.append(update)

    def step(self) -> list[RequestUpdate]:
        updates, self._aborted = self._aborted, []
        try:
            return updates + self.loop.step()
        except WorkerError:
            self.shutdown()
            raise

    def stats(self) -> dict[str, Any]:
        return scheduler_stats(self.scheduler, self.loop.name)

    def shutdown(self) -> None:
        self.loop.close()
