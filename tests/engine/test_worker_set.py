"""WorkerSet's message handling without processes: results that arrive while the scheduler
collects a profile or a timeline stay queued for `wait_result`, in order, and every wait has
a deadline."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import pytest

from pipeserve.engine import workers as workers_mod
from pipeserve.engine.workers import WorkerError, WorkerSet
from pipeserve.scheduler.batch import BatchResult

pytestmark = pytest.mark.timeout(30)  # a lost result would make wait_result wait forever


class FakeChannels:
    def __init__(self, inbox: list[tuple[str, int, Any]]) -> None:
        self.inbox = deque(inbox)
        self.sent: list[Any] = []

    def send_batch(self, obj: Any, block: bool = True) -> bool:
        self.sent.append(obj)
        return True

    def poll(self, timeout_ms: int) -> tuple[str, int, Any] | None:
        return self.inbox.popleft() if self.inbox else None


def worker_set(inbox: list[tuple[str, int, Any]], world: int = 2, tp: int = 1) -> WorkerSet:
    ws = WorkerSet.__new__(WorkerSet)  # no processes: only the message handling under test
    ws.world_size, ws.tp_size = world, tp
    ws.step_timeout_s, ws.heartbeat_timeout_s = 300.0, 1e9
    ws.channels = FakeChannels(inbox)  # type: ignore[assignment]
    ws.local, ws.last_seen, ws._pending, ws.info, ws.closed = {}, {}, deque(), {}, False
    return ws


def result(batch_id: int) -> BatchResult:
    return BatchResult(batch_id, [batch_id], [0.0], [[]])


def test_results_arriving_during_a_profile_are_kept_in_order() -> None:
    ws = worker_set(
        [
            ("result", 1, result(7)),
            ("profile", 0, (0, [0.1, 0.2])),
            ("heartbeat", 0, None),
            ("result", 1, result(8)),
            ("profile", 1, (1, [0.3, 0.4])),
        ]
    )
    assert ws.profile_stages([(0, 64), (64, 64)], [(1, 128)]) == [[0.1, 0.2], [0.3, 0.4]]
    assert [ws.wait_result().batch_id for _ in range(2)] == [7, 8]


def test_results_arriving_during_a_timeline_are_kept() -> None:
    ws = worker_set(
        [
            ("timeline", 0, []),
            ("result", 1, result(3)),
            ("timeline", 1, []),
        ]
    )
    assert ws.collect_timeline() == []
    assert ws.wait_result().batch_id == 3


def test_collecting_has_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_mod, "POLL_MS", 1)
    monkeypatch.setattr(workers_mod, "TIMELINE_TIMEOUT_S", 0.05)
    ws = worker_set([("timeline", 0, []), ("result", 1, result(5))])
    start = time.monotonic()
    with pytest.raises(WorkerError, match="the timeline took longer"):
        ws.collect_timeline()  # rank 1 never reports
    assert time.monotonic() - start < 5
    assert ws.wait_result().batch_id == 5  # kept even though the collection failed


def test_a_step_past_the_watchdog_timeout_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = worker_set([])
    ws.step_timeout_s = 0.05
    with pytest.raises(WorkerError, match="watchdog"):
        ws.wait_result()
