"""A PP2 server between requests: it must stay usable however long it idles, and /health
must notice a worker that dies or stalls while nothing is running. Each test gets a fresh
server (a failure ends it)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import (
    Server,
    engine_and_workers,
    running_server,
    wait_for,
    wait_gone,
    worker_pids,
)

pytestmark = pytest.mark.timeout(120)

NAME = "tiny"
HEARTBEAT_TIMEOUT_S = 3  # a loaded 2-core machine must not stall an idle worker this long
REQUEST = {"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def server(tiny_model: Path, tmp_path: Path) -> Iterator[Server]:
    args = ["--pp-size", "2", "--served-model-name", NAME]
    with running_server(tiny_model, args, tmp_path / "server.log") as srv:
        yield srv


def test_health_notices_a_worker_killed_while_idle(server: Server) -> None:
    assert server.get("/health").status_code == 200
    workers = worker_pids(server.proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)

    def unhealthy() -> bool:
        try:
            return server.get("/health").status_code == 503
        except httpx.HTTPError:
            return True  # the server already exited: also not reporting healthy

    assert wait_for(unhealthy, timeout_s=8, interval_s=0.1)


def test_workers_exit_within_2s_of_an_engine_sigkill(server: Server) -> None:
    """Workers end when their engine process dies (they watch its pid: they are forked by the
    engine's fork server, their OS parent; they used to wait 15 s for missing keepalives)."""
    engine, workers = engine_and_workers(server)
    tree = {pid: start for pid, start in server.tree()}
    os.kill(engine, signal.SIGKILL)
    left = wait_gone([(w, tree[w]) for w in workers], timeout_s=2.0)
    assert left == [], f"workers {left} outlived their engine process by 2 s"


@pytest.fixture
def fast_heartbeat_server(tiny_model: Path, tmp_path: Path) -> Iterator[Server]:
    args = ["--pp-size", "2", "--served-model-name", NAME]
    args += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]
    with running_server(tiny_model, args, tmp_path / "server.log") as srv:
        yield srv


def test_an_idle_server_serves_and_a_stopped_worker_is_noticed_within_the_timeout(
    fast_heartbeat_server: Server,
) -> None:
    """Idle past the heartbeat timeout (nothing to assert on time), the server still serves;
    then a worker stopped while idle is noticed within that timeout (one server for both:
    the second half ends it)."""
    server = fast_heartbeat_server
    assert server.post("/v1/completions", REQUEST).status_code == 200
    time.sleep(HEARTBEAT_TIMEOUT_S + 2)
    r = server.post("/v1/completions", REQUEST)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] == 4
    os.kill(worker_pids(server.proc.pid)[-1], signal.SIGSTOP)

    def unhealthy() -> bool:
        try:
            r = server.get("/health")
        except httpx.HTTPError:
            return True
        return r.status_code == 503 and "heartbeat" in r.text

    assert wait_for(unhealthy, timeout_s=HEARTBEAT_TIMEOUT_S + 3, interval_s=0.1)
