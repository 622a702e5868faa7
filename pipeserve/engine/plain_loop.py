"""The plain event loop: schedule -> forward (wait) -> process results. The simple twin of
the overlap loop, kept for debugging (`--disable-overlap-schedule`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pipeserve.runner.model_runner import ModelRunner
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler
from pipeserve.timeline import Recorder

T = TypeVar("T")


class PlainLoop:
    name = "plain"

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, cpu: Recorder) -> None:
        self.scheduler, self.runner, self.cpu = scheduler, runner, cpu

    def step(self) -> list[RequestUpdate]:
        with self.cpu.span("schedule"):
            batch = self.scheduler.schedule()
        if batch is None:
            return []
        with self.cpu.span("prepare"):
            fb = self.runner.prepare(batch)
        result = self.runner.execute(batch, fb).result
        assert result is not None
        with self.cpu.span("process"):
            return self.scheduler.process_result(batch, result)

    def on_device(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def close(self) -> None:
        pass
