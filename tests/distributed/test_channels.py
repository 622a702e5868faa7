"""The workers' orphan watchdog: a worker waits for a scheduler that starts late (node 0 may
come up well after the other nodes), and exits on its own once a scheduler it heard is gone."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
from ports import free_port

from pipeserve.distributed import channels
from pipeserve.distributed.channels import Endpoints, SchedulerChannels

pytestmark = pytest.mark.timeout(60)


def worker(endpoints: Endpoints, started: Any) -> None:
    channels.FIRST_KEEPALIVE_TIMEOUT_S = 30.0
    channels.WorkerChannels(1, endpoints, None, orphan_timeout_s=1.0)
    started.set()
    time.sleep(60)


def test_a_worker_waits_for_a_late_scheduler_and_exits_after_it() -> None:
    base = free_port(3)  # the scheduler's batch, status and control ports (TP 1)
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    proc = ctx.Process(
        target=worker, args=(Endpoints.tcp("127.0.0.1", base, 1), started), daemon=True
    )
    proc.start()
    try:
        assert started.wait(30)
        time.sleep(2.5)  # more than ORPHAN_TIMEOUT_S without any keepalive
        assert proc.is_alive()
        scheduler = SchedulerChannels("127.0.0.1", 1, base)
        time.sleep(1.5)
        assert proc.is_alive()
        scheduler.close()
        proc.join(timeout=20)
        assert proc.exitcode == 3
    finally:
        if proc.is_alive():
            proc.kill()


def test_heartbeats_keep_coming_during_a_long_forward() -> None:
    """Heartbeats come from a thread of their own: a forward that runs for many heartbeat
    intervals in one native call (here one large matrix product) must not silence them,
    or a long prefill chunk would look like a stalled worker."""
    import torch

    scheduler = SchedulerChannels("127.0.0.1", 1)
    worker_end = channels.WorkerChannels(0, scheduler.endpoints, None, heartbeat_s=0.05)
    try:  # closed at the end, or its orphan watchdog would end this process later
        while scheduler.poll(1000) is None:  # connected
            pass
        while scheduler.poll(0) is not None:
            pass
        a = torch.randn(3072, 3072)
        start = time.monotonic()
        a @ a  # one call of ~0.3-2 s; the GIL is released inside it
        long_forward_s = time.monotonic() - start
        beats = 0
        while scheduler.poll(0) is not None:
            beats += 1
        assert beats >= long_forward_s / 0.05 / 3, f"{beats} heartbeats in {long_forward_s:.1f}s"
    finally:
        worker_end.close()
        scheduler.close()


def test_a_scheduler_that_cannot_bind_closes_what_it_opened(monkeypatch) -> None:
    """A port in use fails the constructor; the sockets it had bound are closed at once, not
    left to the garbage collector, whose term() of the half-made context blocked a later,
    unrelated test until its timeout."""
    import socket

    import zmq

    made: list[zmq.Context] = []

    class Recorded(zmq.Context):  # type: ignore[type-arg]
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(channels.zmq, "Context", Recorded)
    base = free_port(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))  # the status port
        taken.listen()
        with pytest.raises(zmq.ZMQError):
            SchedulerChannels("127.0.0.1", 1, base)
        assert len(made) == 1 and made[0].closed
        free_again = zmq.Context()
        try:  # the batch port it had bound is free again
            free_again.socket(zmq.PUSH).bind(f"tcp://127.0.0.1:{base}")
        finally:
            free_again.destroy(linger=0)
