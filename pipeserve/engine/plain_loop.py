"""The plain event loop: schedule -> forward (wait) -> process results. The simple twin of
the overlap loop, kept for debugging (`--disable-overlap-schedule`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pipeserve.runner.model_runner import ModelRunner
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler

T = TypeVar("T")


class PlainLoop:
    name = "plain"

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler, self.runner = scheduler, runner

    def step(self) -> list[RequestUpdate]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        result = self.runner.forward(batch).result
        assert result is not None
        return self.scheduler.process_result(batch, result)

    def on_device(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def close(self) -> None:
        pass
