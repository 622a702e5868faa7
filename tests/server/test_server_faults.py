"""Failures around a PP2 server: a client that hangs up during a long prefill frees all its
KV and leaves the server serving; a worker killed with SIGKILL during a stream fails the
stream with an error event, turns /health to 503, and the whole process tree exits.

One server (--watchdog-timeout 20, --chunked-prefill-size 16 so a 4000-token prefill is a
few hundred micro-batches); the worker-kill test is last because it ends the server."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import Server, drained, engine_and_workers, running_server, wait_for, wait_gone

pytestmark = pytest.mark.timeout(180)

NAME = "tiny"
WATCHDOG_S = 20.0
PROMPT_LEN = 4000


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("faults-server") / "server.log"
    args = [
        "--pp-size",
        "2",
        "--watchdog-timeout",
        str(WATCHDOG_S),
        "--chunked-prefill-size",
        "16",
        "--served-model-name",
        NAME,
    ]
    with running_server(tiny_model, args, log) as srv:
        yield srv


def test_client_disconnect_during_prefill_frees_kv(server: Server) -> None:
    before = server.metrics()
    rng = random.Random(3)
    ids = [rng.randrange(500) for _ in range(PROMPT_LEN)]
    body = {"model": NAME, "prompt": ids, "max_tokens": 8, "temperature": 0, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        time.sleep(0.3)  # the prefill takes seconds: hang up in the middle of it
    after = wait_for(lambda: drained(server), timeout_s=10)
    assert after, server.metrics()
    # The prefill stopped part-way: the prefix cache holds only the chunks scheduled before
    # the abort, and no token was generated or reported for the request.
    cached = after["pipeserve_kv_pages_cached"] - before.get("pipeserve_kv_pages_cached", 0)
    assert 0 <= cached < PROMPT_LEN - 64, cached
    assert after.get("pipeserve_generation_tokens_total", 0) == before.get(
        "pipeserve_generation_tokens_total", 0
    )
    r = server.post(
        "/v1/completions",
        {"model": NAME, "prompt": ids[:100], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert wait_for(lambda: drained(server), timeout_s=10)


def test_killed_worker_fails_the_stream_and_the_server_exits(server: Server) -> None:
    _, workers = engine_and_workers(server)
    tree = server.tree()
    client = openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=WATCHDOG_S
    )
    stream = client.completions.create(
        model=NAME,
        prompt="A long story:",
        max_tokens=3000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received, killed_at = 0, 0.0
    with pytest.raises(openai.APIError) as failure:
        for _chunk in stream:
            received += 1
            if received == 5:
                os.kill(workers[0], signal.SIGKILL)
                killed_at = time.monotonic()
    assert received >= 5
    assert time.monotonic() - killed_at < WATCHDOG_S
    assert "worker" in failure.value.message.lower()

    statuses = []

    def health_503() -> bool:
        try:
            statuses.append(server.get("/health").status_code)
        except httpx.HTTPError:
            statuses.append(None)  # the server has exited already
        return statuses[-1] != 200

    assert wait_for(health_503, timeout_s=5, interval_s=0.02), statuses
    assert 503 in statuses, statuses
    assert server.proc.wait(timeout=20) != 0
    assert not wait_gone(tree, 20), f"left behind: {[p for p in tree if p]}"
