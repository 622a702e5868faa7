"""Where requests are executed. The in-process backend runs scheduler and model in the
caller's process (one device); the multi-process backend drives worker processes."""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from pipeserve import envs
from pipeserve.backends.registry import run_backend
from pipeserve.batch_overlap.single_batch import SingleBatchOverlap
from pipeserve.config import EngineConfig, ParallelConfig
from pipeserve.context_parallel.layout import global_pages
from pipeserve.device import ComputeStream, set_threads
from pipeserve.distributed.launcher import threads_per_worker
from pipeserve.engine.chunking import ChunkPolicy, setup_chunking
from pipeserve.engine.future_map import (
    FutureMap,
    SlotRing,
    ring_size,
    use_overlap_schedule,
    worker_ring_size,
)
from pipeserve.engine.overlap_loop import OverlapLoop
from pipeserve.engine.pipeline_loop import PipelineLoop, pipeline_depth
from pipeserve.engine.plain_loop import PlainLoop
from pipeserve.engine.workers import WorkerError, WorkerSet
from pipeserve.mem_cache.hicache import DISK, HOST, HiCache
from pipeserve.mem_cache.host_tier import tier_pages
from pipeserve.models.arch import ArchConfig
from pipeserve.runner.kv_layout import kv_pool_pages, stage_kv_bytes_per_token
from pipeserve.runner.model_runner import ModelRunner
from pipeserve.scheduler.batch import Run
from pipeserve.scheduler.chunk_cost import PROFILE_BUDGET_S, Point
from pipeserve.scheduler.data_parallel import DataParallelScheduler
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.request import Req
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler
from pipeserve.timeline import Event, Recorder
from pipeserve.tokenizer import Tokenizer


def build_scheduler(
    config: EngineConfig,
    arch: ArchConfig,
    tokenizer: Tokenizer | None,
    num_pages: int,
    context_len: int,
    max_batch_reqs: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    token_bytes: int | None = None,
) -> Scheduler:
    """One attention rank's scheduler. No tokenizer (the simulator): end-of-sequence ids from
    the model config alone, no stop strings. `token_bytes`: a token's cache on the workers'
    largest stage, which HiCache's host tier is sized by (None: not capped, as in the
    simulator)."""
    c = config.cache
    hicache = None
    if c.enable_hierarchical_cache:
        host, disk = tier_pages(c, num_pages, token_bytes)
        write_through = c.hicache_write_policy == "write_through"
        hicache = HiCache(c.page_size, host, disk, write_through, c.hicache_prefetch_threshold)
    kv = KVManager(num_pages, c.page_size, c.disable_radix_cache, hicache)
    eos = set(arch.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
    return Scheduler(
        config.scheduler,
        kv,
        context_len,
        tuple(sorted(eos)),
        tokenizer=tokenizer,
        max_batch_reqs=max_batch_reqs,
        clock=clock,
    )


def build_pipeline_scheduler(
    config: EngineConfig,
    arch: ArchConfig,
    tokenizer: Tokenizer | None,
    num_pages: int,
    context_len: int,
    clock: Callable[[], float] = time.perf_counter,
    token_bytes: int | None = None,
) -> DataParallelScheduler:
    """The scheduling side of a worker layout (and of the simulator, which runs the same):
    --max-running-requests split over the attention ranks, a rank's share over the
    micro-batch slots of the pipeline; one scheduler per attention rank under one front with
    the two-batch, single-batch and AFD micro-batch rules."""
    p, s = config.parallel, config.scheduler
    per_rank = max(s.max_running_requests // p.attention_ranks, 1)
    rank_config = replace(config, scheduler=replace(s, max_running_requests=per_rank))
    per_batch = max(per_rank // p.pp_size, 1)
    schedulers = [
        build_scheduler(
            rank_config, arch, tokenizer, num_pages, context_len, per_batch, clock, token_bytes
        )
        for _ in range(p.attention_ranks)
    ]
    tbo = p.tbo_token_distribution_threshold if p.enable_two_batch_overlap else None
    sbo = SingleBatchOverlap.from_config(p)
    return DataParallelScheduler(
        schedulers,
        tbo,
        (sbo.down_blocks, p.single_batch_overlap_min_tokens),
        p.two_batch_overlap_min_tokens,
        p.afd_micro_batches if p.afd_enabled else 1,
    )


log = logging.getLogger(__name__)


def _tier_stats(kvs: list[KVManager]) -> dict[str, int]:
    """HiCache's tiers summed over the attention ranks: tokens held and capacity per lower
    tier, prefix tokens loaded back from each (none without HiCache)."""
    out = {}
    tiers = [kv.hicache for kv in kvs if kv.hicache is not None]
    for tier in (HOST, DISK):
        used = [t.tokens(tier) for t in tiers]
        out[f"hicache_{tier}_tokens"] = sum(u for u, _ in used)
        out[f"hicache_{tier}_capacity_tokens"] = sum(c for _, c in used)
    out["hicache_loaded_host_tokens"] = sum(t.counters.loaded_host_tokens for t in tiers)
    out["hicache_loaded_disk_tokens"] = sum(t.counters.loaded_disk_tokens for t in tiers)
    out["hicache_backed_up_pages"] = sum(t.counters.backed_up_pages for t in tiers)
    return out


class Backend:
    """Owns the scheduler and a loop that executes its batches; the engine front end talks
    to this interface only."""

    scheduler: Scheduler | DataParallelScheduler  # takes the requests
    schedulers: list[Scheduler]  # one per attention rank (several under data-parallel attention)
    loop: PlainLoop | OverlapLoop | PipelineLoop
    partition: list[int]  # layers per pipeline stage
    # what a chunk-time profile of the stages depends on (None: nothing to cache)
    _profile_key: dict[str, Any] | None

    def __init__(self) -> None:
        self._aborted: list[RequestUpdate] = []
        self.cpu = Recorder(stage=-1)  # the scheduler's own work: schedule, prepare, process

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
        """Counts summed over the attention ranks (each has its own KV pool)."""
        kvs = [s.kv for s in self.schedulers]
        busy = [s.stage_busy for s in self.schedulers]
        return {
            "loop": self.loop.name,
            "overlap_schedule": self.loop.name == "overlap",
            "attention_ranks": len(self.schedulers),
            "kv_pages_total": sum(kv.allocator.capacity for kv in kvs),
            "kv_pages_free": sum(kv.allocator.num_free for kv in kvs),
            "kv_pages_cached": sum(kv.tree.cached_pages() if kv.tree else 0 for kv in kvs),
            "kv_pages_evictable": sum(kv.tree.evictable_pages if kv.tree else 0 for kv in kvs),
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_retracted": sum(s.decode.num_retracted for s in self.schedulers),
            "prefix_hit_tokens": sum(kv.hit_tokens for kv in kvs),
            "prefix_lookup_tokens": sum(kv.lookup_tokens for kv in kvs),
            # forward seconds per stage (of the busiest attention rank)
            "stage_busy_s": [max(t) for t in itertools.zip_longest(*busy, fillvalue=0.0)],
            **_tier_stats(kvs),
        }

    def timeline(self) -> list[Event]:
        raise NotImplementedError

    def kv_endpoints(self) -> tuple[str, ...]:
        """Decode side of disaggregation: every rank's KV receiver, in (stage, TP rank)
        order."""
        raise NotImplementedError

    def kv_controls(self) -> tuple[tuple[str, bytes], ...]:
        """Decode side of disaggregation: every rank's KV receiver's control socket and its
        secret, in the same order."""
        raise NotImplementedError

    def expert_bytes_per_rank(self) -> int:
        """Bytes of routed-expert weights on the rank that holds most."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if the executor can no longer run batches (a worker died)."""

    def profile_stages(self, points: list[Point], runs: list[list[Run]]) -> list[list[float]]:
        """Seconds of one chunk per (prefix_len, chunk_len) point, timed by every pipeline
        stage on its own layers: a list per stage, in stage order. `runs`: per attention
        rank, the KV slots lent for the profile."""
        raise NotImplementedError

    def set_chunk_policy(self, policy: ChunkPolicy) -> dict[str, Any]:
        """Install a chunk-size policy (profiling the stages for dynamic chunking) on every
        attention rank's scheduler (they share one sizer and one online refit)."""
        lead = self.schedulers[0]
        self.chunking = setup_chunking(policy, lead, self.profile_chunks, self._profile_key)
        for s in self.schedulers[1:]:
            s.set_chunking(lead.prefill.chunk_sizer, lead.refit)
        return self.chunking

    def profile_chunks(
        self, points: list[Point], budget_s: float = PROFILE_BUDGET_S
    ) -> list[list[float]]:
        """Every stage's seconds of one chunk per (prefix_len, chunk_len) point (the chunk
        policy's profiler; the simulator's calibration times with it too), for the first
        points: they are timed one at a time, in order, until a stage has spent `budget_s`
        (every rank runs the same points: TP ranks and attention-FFN pairs step together).
        Profile chunks write their KV into slots lent by the allocators, so cached prefixes
        and running requests are never touched."""
        tokens = max(p + n for p, n in points)
        lent = []
        try:
            for s in self.schedulers:
                lent.append(s.kv.lend(tokens))
            runs = [r for r, _ in lent]
            stages: list[list[float]] = []
            for point in points:
                times = self.profile_stages([point], runs)
                stages = [a + b for a, b in zip(stages, times, strict=True)] if stages else times
                if max(sum(s) for s in stages) > budget_s:
                    break
            return stages
        finally:
            for _, give_back in lent:
                give_back()

    def shutdown(self) -> None:
        self.loop.close()


class InProcessBackend(Backend):
    """Scheduler and model in the caller's process (one device)."""

    def __init__(
        self,
        config: EngineConfig,
        arch: ArchConfig,
        model_path: Path,
        tokenizer: Tokenizer | None,
        context_len: int,
    ) -> None:
        super().__init__()
        threads = threads_per_worker(config)
        set_threads(threads)
        backend = run_backend(config, arch)  # chosen once: it sizes the pool and runs
        num_pages = kv_pool_pages(config, arch, 1, None, backend)
        self.runner = ModelRunner(config, arch, model_path, num_pages, backend)
        self.partition = [arch.num_layers]
        token_bytes = stage_kv_bytes_per_token(config, arch, self.partition)
        self.scheduler = build_scheduler(
            config, arch, tokenizer, num_pages, context_len, token_bytes=token_bytes
        )
        self.schedulers = [self.scheduler]
        self.loop: PlainLoop | OverlapLoop = self._make_loop(config, threads, context_len)
        log.info(
            "event loop: %s",
            "overlap (forwards on a compute thread, the next batch scheduled meanwhile)"
            if self.loop.name == "overlap"
            else "plain"
            + (
                " (the default in-process on a CPU, where the overlap loop measures slower; "
                "--enable-overlap-schedule forces it)"
                if not config.scheduler.disable_overlap_schedule
                else ""
            ),
        )
        self._profile_key = profile_key(config, model_path, threads, [arch.num_layers])
        self.set_chunk_policy(ChunkPolicy.from_config(config))

    def _make_loop(
        self, config: EngineConfig, threads: int, context_len: int
    ) -> PlainLoop | OverlapLoop:
        s = config.scheduler
        if not use_overlap_schedule(config, in_process=True):
            return PlainLoop(self.schedulers[0], self.runner, self.cpu)
        # The compute stream gets the thread budget; this thread only schedules and builds
        # small tensors (two full OpenMP pools on the same cores would fight each other).
        set_threads(1)
        size = ring_size(s.max_running_requests, context_len, s.chunk_size)
        return OverlapLoop(
            self.schedulers[0],
            self.runner,
            ComputeStream(self.runner.device, threads),
            FutureMap(size, self.runner.device),
            favour_ttft=envs.disable_consecutive_prefill_overlap(),
            cpu=self.cpu,
        )

    def timeline(self) -> list[Event]:
        return self.cpu.take() + self.runner.recorder.take()

    def kv_endpoints(self) -> tuple[str, ...]:
        assert self.runner.kv_receiver is not None, "not a decode server"
        return (self.runner.kv_receiver.endpoint,)

    def kv_controls(self) -> tuple[tuple[str, bytes], ...]:
        receiver = self.runner.kv_receiver
        assert receiver is not None, "not a decode server"
        return ((receiver.control_endpoint, receiver.control_secret),)

    def shutdown(self) -> None:
        super().shutdown()
        self.runner.close()

    def expert_bytes_per_rank(self) -> int:
        return self.runner.expert_bytes()

    def profile_stages(self, points: list[Point], runs: list[list[Run]]) -> list[list[float]]:
        return [self.loop.on_device(self.runner.profile_prefill, points, runs[0])]


class WorkerBackend(Backend):
    """Scheduler here, model in worker processes (one per stage x TP rank)."""

    def __init__(
        self,
        config: EngineConfig,
        arch: ArchConfig,
        model_path: Path,
        tokenizer: Tokenizer | None,
        context_len: int,
    ) -> None:
        super().__init__()
        p = config.parallel
        ring = worker_ring_size(config, context_len)
        self.workers = WorkerSet(config, str(model_path), future_ring=ring)
        try:
            info = self.workers.wait_ready()
        except BaseException:
            self.workers.shutdown()
            raise
        num_pages = info[0].num_pages  # per rank; under CP the ranks' pages are striped
        num_pages = global_pages(num_pages, p.cp_size) if p.cp_size > 1 else num_pages
        self.partition = info[0].partition
        log.info(
            "pipeline layer partition: %s%s",
            ",".join(map(str, self.partition)),
            " (balanced on measured layer costs)" if p.layer_partition == "auto" else "",
        )
        if p.tp_size > 1:
            kinds = sorted({i.tp_all_reduce for i in info.values()})
            log.info("TP all-reduce: %s", ", ".join(kinds))
        token_bytes = stage_kv_bytes_per_token(config, arch, self.partition)
        self.scheduler = build_pipeline_scheduler(
            config, arch, tokenizer, num_pages, context_len, token_bytes=token_bytes
        )
        self.schedulers = self.scheduler.ranks
        depth = pipeline_depth(config, overlap=bool(ring))
        self.loop = PipelineLoop(
            self.scheduler, self.workers, depth, SlotRing(ring) if ring else None, self.cpu
        )
        log.info(
            "event loop: %s over %d worker process(es), %d micro-batch(es) in flight%s%s",
            self.loop.name,
            p.world_size,
            depth,
            _data_parallel_words(p),
            "; the pipeline itself is the CPU/device overlap (the overlap loop is not "
            "combined with PP)"
            if p.pp_size > 1
            else "",
        )
        self._profile_key = profile_key(
            config, model_path, threads_per_worker(config), self.partition
        )
        try:
            self.set_chunk_policy(ChunkPolicy.from_config(config))
        except BaseException:
            self.shutdown()
            raise

    def step(self) -> list[RequestUpdate]:
        try:
            return super().step()
        except WorkerError:
            self._stop_failed_workers()
            raise

    def timeline(self) -> list[Event]:
        return self.cpu.take() + self.workers.collect_timeline()

    def kv_endpoints(self) -> tuple[str, ...]:
        return tuple(self.workers.info[r].kv_endpoint for r in sorted(self.workers.info))

    def kv_controls(self) -> tuple[tuple[str, bytes], ...]:
        info = [self.workers.info[r] for r in sorted(self.workers.info)]
        return tuple((i.kv_control, bytes.fromhex(i.kv_control_secret)) for i in info)

    def expert_bytes_per_rank(self) -> int:
        return max(i.expert_bytes for i in self.workers.info.values())

    def check_health(self) -> None:
        try:
            self.workers.check_health()
        except WorkerError:
            self._stop_failed_workers()
            raise

    def _stop_failed_workers(self) -> None:
        """A failed pipeline cannot finish anything: kill this node's workers at once (a
        stopped or stuck one would not answer a polite shutdown) and close the channels."""
        self.workers.kill()
        self.shutdown()

    def profile_stages(self, points: list[Point], runs: list[list[Run]]) -> list[list[float]]:
        return self.workers.profile_stages(points, runs)


def _data_parallel_words(p: ParallelConfig) -> str:
    if p.afd_enabled:
        return (
            f"; attention-FFN disaggregation: {p.afd_attention_size} attention worker(s), each "
            f"with its own requests and KV cache, and {p.afd_ffn_size} FFN worker(s) in "
            f"{p.afd_ffn_nodes} node(s) holding the routed experts ({p.afd_dispatch_mode} "
            f"dispatch, {p.afd_micro_batches} micro-batch(es) per step)"
        )
    if p.ep_size > 1:
        return (
            f"; {p.ep_size} data-parallel attention ranks per stage, each with its own "
            "requests and KV cache, the routed experts split over them"
        )
    return ""


def source_digest(root: Path) -> str:
    """A digest of the Python and C++ sources under `root` (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h"):
            digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:16]


@cache
def code_fingerprint() -> str:
    """A digest of pipeserve's own source files."""
    return source_digest(Path(__file__).resolve().parent.parent)


def profile_key(
    config: EngineConfig, model_path: Path, threads: int, partition: list[int]
) -> dict[str, Any]:
    """What a chunk-time profile of the stages depends on (the code too: a new kernel makes
    an old profile wrong)."""
    return {
        "code": code_fingerprint(),
        "attention_backend": config.model.attention_backend,
        "model": str(Path(model_path).resolve()),
        "config": (Path(model_path) / "config.json").read_text(),
        "dtype": config.model.dtype,
        "device": config.model.device,
        "threads": threads,
        "tp": config.parallel.tp_size,
        "ep": config.parallel.ep_size,
        "afd": [
            config.parallel.afd_attention_size,
            config.parallel.afd_ffn_size,
            config.parallel.afd_ffn_nodes,
            config.parallel.afd_dispatch_mode,
            config.parallel.afd_micro_batches,
        ],
        "partition": partition,
        "page_size": config.cache.page_size,
    }
