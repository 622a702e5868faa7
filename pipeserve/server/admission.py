"""Admission counting: `Admission` admits a request against the capacity (running plus
queued) in one step, and each admitted request holds a `Ticket` that is ended exactly
once."""

from __future__ import annotations

import asyncio

from pipeserve.server.errors import ApiError
from pipeserve.server.metrics import Metrics

RETRY_BUSY_S = 1  # Retry-After of a 503 from a full server


class Ticket:
    """An admitted request's place in the admission count. Ended exactly once, however the
    request ends; a request that reached the engine is counted in the metrics then."""

    def __init__(self, admission: Admission, metrics: Metrics) -> None:
        self.admission, self.metrics = admission, metrics
        self.ended = False

    def end(self, finish_reason: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        self.admission.active -= 1
        if finish_reason is not None:
            self.metrics.requests.labels(finish_reason=finish_reason).inc()

    def end_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """For a finalizer, which may run in any thread at any moment: end as an abort, on
        the loop's thread (where every other change of the count happens)."""
        if self.ended:
            return
        try:
            loop.call_soon_threadsafe(self.end, "abort")
        except RuntimeError:  # the loop is closed: nothing can race with us any more
            self.end("abort")


class Admission:
    """Requests admitted and not yet ended. The capacity check and the count happen in one
    step (no await between), so a burst cannot pass the check together."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.active = 0
        self.peak = 0

    def admit(self, metrics: Metrics) -> Ticket:
        if self.active >= self.capacity:
            raise ApiError(
                503,
                f"server busy: {self.active} requests are running or queued; retry later",
                "server_error",
                code="server_busy",
                retry_after=RETRY_BUSY_S,
            )
        self.active += 1
        self.peak = max(self.peak, self.active)
        return Ticket(self, metrics)
