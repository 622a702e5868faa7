"""The engine's own scheduling in simulated time: `SimBackend` builds the scheduler, the chunk
policy, the layer partition and the micro-batch loop exactly as a worker layout does
(engine/backend.py), with the discrete-event executor of sim/executor.py in place of worker
processes and the cost model's seconds in place of the start-up chunk profile. Requests are
served by the same `PipelineLoop.step()`; only time is simulated.

Not simulated (refused with a message): attention-FFN disaggregation and prefill/decode
disaggregation, whose transfers have no executor here yet.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pipeserve.batch_overlap.single_batch import SingleBatchOverlap
from pipeserve.config import EngineConfig
from pipeserve.context_parallel.layout import global_pages
from pipeserve.device import min_pipeline_chunk
from pipeserve.distributed.partition import resolve_partition
from pipeserve.engine.backend import Backend, build_pipeline_scheduler
from pipeserve.engine.chunking import ChunkPolicy
from pipeserve.engine.future_map import SlotRing, ring_size, use_overlap_schedule
from pipeserve.engine.pipeline_loop import PipelineLoop, pipeline_depth
from pipeserve.models.arch import ArchConfig
from pipeserve.scheduler.batch import Run
from pipeserve.scheduler.chunk_cost import Point
from pipeserve.scheduler.data_parallel import DataParallelScheduler
from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.sim.cost_model import CostModel, Precision, SimLayout, SliceWork
from pipeserve.sim.executor import SimClock, SimWorkers
from pipeserve.sim.hardware import Hardware
from pipeserve.sim.memory import DeviceMemory, device_memory
from pipeserve.timeline import Event, Recorder

PARTITION_CHUNK = 2048  # tokens of the chunk 'auto' layer partitioning balances


class SimRecorder(Recorder):
    """The scheduler's spans (schedule, process) on the simulated clock."""

    def __init__(self, clock: SimClock) -> None:
        super().__init__(stage=-1)
        self.clock = clock

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(kind, start, self.clock())


def sim_layout(config: EngineConfig, hw: Hardware, devices_per_node: int | None) -> SimLayout:
    """Where the ranks sit. CPU: a device is a worker with --threads-per-worker threads
    (default: the node's cores over its workers, as the engine picks), a node holds
    `devices_per_node` workers (default: all of a one-node layout's, else the cores)."""
    p = config.parallel
    spread = -(-p.world_size // p.nnodes)  # --nnodes given: the ranks spread over them
    per_node = devices_per_node or (
        hw.devices_per_node if hw.kind == "gpu" and p.nnodes == 1 else spread
    )
    threads = 1
    if hw.kind == "cpu":
        threads = p.threads_per_worker or max(1, hw.cores_per_node // min(per_node, p.world_size))
    return SimLayout(
        p.tp_size, p.pp_size, p.ep_size, p.cp_size, per_node, threads, p.enable_sharded_cp
    )


class SimBackend(Backend):
    """A worker layout's scheduling side over simulated stages."""

    scheduler: DataParallelScheduler
    loop: PipelineLoop

    def __init__(
        self,
        config: EngineConfig,
        arch: ArchConfig,
        hw: Hardware,
        precision: Precision,
        clock: SimClock,
        context_len: int,
        devices_per_node: int | None = None,
        stage_profile: list[list[float]] | None = None,
    ) -> None:
        """`stage_profile`: seconds per stage and profile point to fit dynamic chunking on
        instead of the cost model's (a real engine's profile: the same fit, the same chunks)."""
        super().__init__()
        _check_supported(config)
        self.config, self.arch, self.hw, self.clock = config, arch, hw, clock
        self.stage_profile = stage_profile
        self._profiled = 0  # points of `stage_profile` handed out (the profile asks one by one)
        self.layout = sim_layout(config, hw, devices_per_node)
        self._init_cost(precision)
        self._init_scheduling(context_len)
        device = torch.device("cuda" if hw.kind == "gpu" else "cpu")
        floor = min_pipeline_chunk(device)
        self.chunking = self.set_chunk_policy(
            replace(ChunkPolicy.from_config(config), pipeline_floor=floor)
        )

    def _init_cost(self, precision: Precision) -> None:
        """The layer partition (`auto`: balanced on the cost model's layer times), the
        cost model, the memory per device."""
        p, arch, lay = self.config.parallel, self.arch, self.layout
        full = CostModel(arch, self.hw, replace(lay, pp=1), precision, [arch.num_layers])
        self.partition = resolve_partition(
            p.layer_partition, arch.num_layers, p.pp_size, lambda: _layer_costs(full)
        )
        shared_overlap = SingleBatchOverlap.from_config(p).shared_after is not None
        self.cost = CostModel(arch, self.hw, lay, precision, self.partition, shared_overlap)
        workers = min(lay.devices_per_node, lay.world)  # on a node, as the engine counts them
        self.memory = device_memory(self.cost, self.config.cache.mem_fraction_static, workers)

    def _init_scheduling(self, context_len: int) -> None:
        """The engine's scheduler over the KV pool, the simulated stages, the loop."""
        self.scheduler = build_pipeline_scheduler(
            self.config, self.arch, None, self._pool_pages(), context_len, self.clock
        )
        self.schedulers = self.scheduler.ranks
        self.workers = SimWorkers(self.cost, self.clock, self.hw.host_overhead_s)
        self.cpu = SimRecorder(self.clock)
        self.loop = self._make_loop(context_len)
        self._profile_key = None  # the cost model's timings: nothing to cache

    def _pool_pages(self) -> int:
        c, p = self.config.cache, self.config.parallel
        if c.max_total_tokens is not None:
            pages = c.max_total_tokens // c.page_size + 1
        else:
            tokens = self.memory.kv_tokens
            if tokens < 4 * c.page_size:
                raise ValueError(_no_room(self.memory, self.hw))
            pages = tokens // c.page_size + 1
        return global_pages(pages, p.cp_size) if p.cp_size > 1 else pages

    def _make_loop(self, context_len: int) -> PipelineLoop:
        """The loop the engine would run: P + async depth under PP; one stage: the overlap
        loop's depth 2 with future tokens where the engine defaults to it (on a GPU, or in a
        worker process), else the plain loop's 1."""
        p, s = self.config.parallel, self.config.scheduler
        in_process = not p.uses_workers
        device = torch.device("cuda" if self.hw.kind == "gpu" else "cpu")
        overlap = p.pp_size == 1 and use_overlap_schedule(self.config, in_process, device)
        ring = (
            SlotRing(ring_size(s.max_running_requests, context_len, s.chunk_size))
            if overlap
            else None
        )
        return PipelineLoop(
            self.scheduler, self.workers, pipeline_depth(self.config, overlap), ring, self.cpu
        )

    def profile_stages(self, points: list[Point], runs: list[list[Run]]) -> list[list[float]]:
        """The start-up profile, from the cost model: each stage's seconds of a lone chunk,
        the stages timed one after another (on a CPU: alone on the machine)."""
        if self.stage_profile is not None:
            start, end = self._profiled, self._profiled + len(points)
            if any(len(stage) < end for stage in self.stage_profile):
                raise ValueError(
                    f"the given profile has fewer than the {end} points this chunk policy profiles"
                )
            self._profiled = end
            return [list(stage[start:end]) for stage in self.stage_profile]
        alone = self.cost.alone()
        return [
            [alone.forward(stage, [[SliceWork(L, x)]]).total for L, x in points]
            for stage in range(self.layout.pp)
        ]

    def timeline(self) -> list[Event]:
        return self.cpu.take() + self.workers.events


def _layer_costs(full: CostModel) -> tuple[list[float], float, float]:
    """Per-layer seconds of a PARTITION_CHUNK chunk (for --pp-layer-partition auto), the
    embedding's (free) and the LM head's."""
    chunk = [SliceWork(0, PARTITION_CHUNK)]
    per_layer = [full.layer_s(layer, chunk) for layer in range(full.arch.num_layers)]
    return per_layer, 0.0, full.lm_head_s(1)


def _check_supported(config: EngineConfig) -> None:
    p, d = config.parallel, config.disaggregation
    if p.afd_enabled:
        raise ValueError(
            "the simulator does not model attention-FFN disaggregation (--afd-*) yet: its "
            "executor has no FFN workers"
        )
    if d.disaggregation_mode != "null":
        raise ValueError("the simulator runs co-located serving only (--disaggregation-mode null)")


def _no_room(mem: DeviceMemory, hw: Hardware) -> str:
    return (
        f"no memory left for the KV cache on {hw.name}: {mem.weight_bytes / 1e9:.1f} GB of "
        f"weights per device against a budget of {mem.budget_bytes / 1e9:.1f} GB; use more "
        "devices (--tp-size/--pp-size/--ep-size), raise --mem-fraction-static or set "
        "--max-total-tokens"
    )


# -- running requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class SimRequest:
    rid: str
    input_len: int
    output_len: int
    arrival_s: float = 0.0


@dataclass
class SimOutcome:
    rid: str
    input_len: int
    output_len: int
    arrival_s: float
    ttft_s: float | None = None
    finish_s: float | None = None
    chunk_sizes: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def make_requests(
    num: int, input_len: int, output_len: int, rate: float = float("inf"), seed: int = 0
) -> list[SimRequest]:
    """`num` requests, all at time 0 or Poisson arrivals at `rate` per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(num):
        out.append(SimRequest(f"sim-{i}", input_len, output_len, t))
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return out


def serve(backend: SimBackend, requests: list[SimRequest]) -> list[SimOutcome]:
    """Submit each request at its arrival time and step the loop until all have finished."""
    vocab = backend.arch.vocab_size
    pending = sorted(requests, key=lambda r: r.arrival_s)
    outcomes = {r.rid: SimOutcome(r.rid, r.input_len, r.output_len, r.arrival_s) for r in pending}
    clock, left, i = backend.clock, len(pending), 0
    while left:
        while i < len(pending) and pending[i].arrival_s <= clock.now:
            backend.submit(_req(pending[i], vocab, i))
            i += 1
        launched = backend.workers.forwards
        updates = backend.step()
        if backend.workers.forwards == launched and not backend.loop.inflight and not updates:
            if i == len(pending):
                raise RuntimeError(_stuck(backend))
            clock.advance_to(pending[i].arrival_s)
        for u in updates:
            o = outcomes[u.rid]
            if u.ttft is not None:
                o.ttft_s = u.ttft
            if u.finish_reason is not None:
                o.finish_s, o.finish_reason = clock.now - o.arrival_s, u.finish_reason
                o.chunk_sizes = list(u.chunk_sizes or [])
                left -= 1
    return [outcomes[r.rid] for r in requests]


def _req(r: SimRequest, vocab: int, index: int) -> Req:
    """A prompt whose first token is the request's index: no two prompts share a prefix, so
    the radix cache finds nothing, as for distinct real prompts (token values cost nothing
    in simulated time)."""
    ids = [index % vocab] + [0] * (r.input_len - 1)
    sp = SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
    req = Req(r.rid, ids, sp)
    req.arrival_time = r.arrival_s
    return req


def _stuck(backend: SimBackend) -> str:
    s = backend.scheduler
    return (
        f"the scheduler holds {s.num_waiting} waiting and {s.num_running} running requests but "
        "schedules nothing (is the KV pool too small for them?)"
    )


def summary(outcomes: list[SimOutcome]) -> dict[str, Any]:
    """TTFT and throughput as `pipeserve bench` reports them: the prefill span ends when the
    last request has its first token."""
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    first = min(o.arrival_s for o in outcomes)
    prefill_end = max(o.arrival_s + (o.ttft_s or 0.0) for o in outcomes)
    end = max(o.arrival_s + (o.finish_s or 0.0) for o in outcomes)
    inputs = sum(o.input_len for o in outcomes)
    decode_tokens = sum(max(o.output_len - 1, 0) for o in outcomes)
    decode_s = end - prefill_end
    return {
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_max_s": max(ttfts),
        "prefill_s": prefill_end - first,
        "total_s": end - first,
        "input_throughput_tok_s": inputs / (prefill_end - first),
        "output_throughput_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
    }
