"""The scheduler's side of the micro-batch event loop over worker processes.

Up to `depth` micro-batches are in flight; stage workers run them in order and the last
stage reports each one back (a middle prompt chunk's report carries no tokens, only its
id). Consecutive chunks of one long prompt go out as consecutive micro-batches without
waiting for each other, so all stages work on different chunks at once.

- Pipeline parallelism (P stages): depth P + --pp-async-batch-depth (default 1: one more
  micro-batch waits at the first stage while a result travels back, so it never idles
  between chunks); a request is in at most one micro-batch at a time (its next step needs
  the token the last stage returns). The per-micro-batch request cap is
  max(max_running_requests // P, 1), so the running requests spread over the slots.
- Data-parallel attention (--ep-size E): a micro-batch is a group of E batches, one per
  attention rank under one id (`DataParallelScheduler`); each rank reports its own result.
- One stage: depth 2 with future-token placeholders — the CPU/device overlap loop, with
  the worker process as the device. (The two are never combined: under PP the pipeline is
  the overlap.)
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from pipeserve.config import EngineConfig
from pipeserve.engine.future_map import SlotRing
from pipeserve.scheduler.batch import BatchResult
from pipeserve.scheduler.data_parallel import BatchGroup, DataParallelScheduler
from pipeserve.scheduler.scheduler import RequestUpdate
from pipeserve.timeline import Recorder


class Executor(Protocol):
    """What runs the loop's micro-batches: worker processes (engine.workers.WorkerSet) or
    the simulator's stages (sim.executor.SimWorkers)."""

    def send_batch(self, group: BatchGroup) -> None: ...

    def wait_results(self) -> list[BatchResult]: ...

    def shutdown(self) -> None: ...


def pipeline_depth(config: EngineConfig, overlap: bool) -> int:
    """Micro-batches in flight: P + --pp-async-batch-depth under PP; one stage: 2 with the
    overlap loop's future tokens (`overlap`), else 1."""
    p = config.parallel
    if p.pp_size > 1:
        return p.pp_size + p.pp_async_batch_depth
    return 2 if overlap else 1


class PipelineLoop:
    def __init__(
        self,
        scheduler: DataParallelScheduler,
        workers: Executor,
        depth: int,
        future: SlotRing | None,
        cpu: Recorder,
    ) -> None:
        self.scheduler, self.workers, self.depth, self.future = scheduler, workers, depth, future
        self.cpu = cpu
        self.name = "overlap" if future is not None else ("pipeline" if depth > 1 else "plain")
        self.inflight: deque[BatchGroup] = deque()

    def step(self) -> list[RequestUpdate]:
        self._fill()
        if not self.inflight:
            return []
        results = self.workers.wait_results()
        group = self.inflight.popleft()
        with self.cpu.span("process"):
            return self.scheduler.process_result(group, results)

    def _fill(self) -> None:
        max_inflight = 1 if self.future is not None else 0
        while len(self.inflight) < self.depth:
            with self.cpu.span("schedule"):
                group = self.scheduler.schedule(max_inflight=max_inflight)
                if group is None:
                    return
                if self.future is not None:
                    slots = self.future.reserve(group.num_samples)
                    self.scheduler.assign_future_slots(group, slots)
                self.workers.send_batch(group)
            self.inflight.append(group)

    def close(self) -> None:
        self.workers.shutdown()
