"""The overlap event loop: the CPU schedules and processes results while the device runs.

    device: [ forward N-1 ][ forward N    ][ forward N+1 ]
    cpu:       [process N-2][sched N+1 ...]
    step:  schedule N -> launch N -> process N-1 (waits for N-1, while N runs)

Batch N+1 is scheduled before N's tokens exist: each of them is a placeholder resolved on
the compute stream (see future_map.py). A request that finishes in N may already be in
N+1; that one wasted slot is all overlap costs — its token is dropped when N+1's result
finds the request gone. Under pipeline parallelism the pipeline loop is the overlap
mechanism instead; the two are not combined.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pipeserve.device import ComputeStream
from pipeserve.engine.future_map import FutureMap
from pipeserve.runner.model_runner import ModelRunner
from pipeserve.runner.stage_output import StageOutput
from pipeserve.scheduler.batch import ScheduledBatch
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler
from pipeserve.timeline import Recorder

T = TypeVar("T")


class OverlapLoop:
    name = "overlap"

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        stream: ComputeStream,
        future: FutureMap,
        favour_ttft: bool,
        cpu: Recorder,
    ) -> None:
        """favour_ttft: between two prefill batches, process the first one's results before
        launching the second (PIPESERVE_DISABLE_CONSECUTIVE_PREFILL_OVERLAP)."""
        self.scheduler, self.runner, self.stream, self.future = scheduler, runner, stream, future
        self.cpu = cpu
        self.favour_ttft = favour_ttft
        self.inflight: deque[tuple[ScheduledBatch, Future[StageOutput]]] = deque()

    def step(self) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        with self.cpu.span("schedule"):
            batch = self.scheduler.schedule(max_inflight=1)
        if batch is not None:
            if self.favour_ttft and self._consecutive_prefill(batch):
                updates += self._process_oldest()
            self._launch(batch)
        if len(self.inflight) > (batch is not None):
            updates += self._process_oldest()
        return updates

    def on_device(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the compute stream (after everything queued there) and wait for it."""
        return self.stream.submit(fn, *args).result()

    def close(self) -> None:
        self.stream.close()

    def _consecutive_prefill(self, batch: ScheduledBatch) -> bool:
        return bool(self.inflight) and not batch.is_decode and not self.inflight[-1][0].is_decode

    def _launch(self, batch: ScheduledBatch) -> None:
        with self.cpu.span("prepare"):  # on this thread, while the previous batch runs
            self.scheduler.assign_future_slots(batch, self.future.reserve(batch.num_samples))
            fb = self.runner.prepare(batch)
        done = self.stream.submit(self.runner.execute, batch, fb, future=self.future)
        self.inflight.append((batch, done))  # keeps batch and its tensors alive until processed

    def _process_oldest(self) -> list[RequestUpdate]:
        batch, done = self.inflight.popleft()
        result = done.result().result
        assert result is not None
        with self.cpu.span("process"):
            return self.scheduler.process_result(batch, result)
