"""Admission limits and shutdown of a PP2 server with --max-running-requests 2
--max-queued-requests 1: with two requests running and one queued, a fourth gets 503 with a
clear message while the first three complete; SIGTERM with a stream in flight ends the
stream with an error event and the whole process tree exits.

The SIGTERM test is last: it ends the module's server."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import Server, drained, error_message, running_server, wait_for, wait_gone

pytestmark = pytest.mark.timeout(180)

NAME = "tiny"
LONG = 500  # tokens per long request: seconds of decoding on this machine


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("backpressure-server") / "server.log"
    args = [
        "--pp-size",
        "2",
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "1",
        "--served-model-name",
        NAME,
    ]
    with running_server(tiny_model, args, log) as srv:
        yield srv


def long_request(i: int) -> dict[str, Any]:
    return {
        "model": NAME,
        "prompt": f"Story number {i}:",
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def read_stream(
    http: httpx.AsyncClient, body: dict[str, Any], headers: asyncio.Event, first: asyncio.Event
) -> dict[str, Any]:
    """Consume one SSE completion; set `headers` on the response, `first` on the first text."""
    text, finish, usage, errors = "", None, None, []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        headers.set()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                errors.append(event["error"]["message"])
            for choice in event.get("choices", []):
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                first.set()
            usage = event.get("usage") or usage
    return {"text": text, "finish": finish, "usage": usage, "errors": errors}


async def fill_then_overflow(server: Server) -> tuple[list[dict[str, Any]], list[httpx.Response]]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        events = [(asyncio.Event(), asyncio.Event()) for _ in range(3)]
        tasks = []
        for i, (headers, first) in enumerate(events):
            tasks.append(asyncio.create_task(read_stream(http, long_request(i), headers, first)))
            # two run (first text arrives); the third is admitted but must wait for a slot
            await asyncio.wait_for((first if i < 2 else headers).wait(), 60)
        queued = await asyncio.to_thread(
            wait_for, lambda: server.metrics().get("pipeserve_requests_waiting") == 1, 10
        )
        assert queued, server.metrics()
        rejected = [
            await http.post("/v1/completions", json=long_request(3)),
            await http.post("/v1/completions", json={**long_request(4), "stream": False}),
            await http.post(
                "/v1/chat/completions",
                json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]},
            ),
        ]
        done = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return done, rejected


def test_request_beyond_running_plus_queued_gets_503(server: Server) -> None:
    done, rejected = asyncio.run(fill_then_overflow(server))
    for r in rejected:
        assert r.status_code == 503, r.text
        message = error_message(r)
        assert "busy" in message and "retry" in message, message
    for d in done:
        assert d["errors"] == [] and d["finish"] == "length", d
        assert d["usage"]["completion_tokens"] == LONG
    assert wait_for(lambda: drained(server), timeout_s=10), server.metrics()
    r = server.post("/v1/completions", {**long_request(5), "stream": False, "max_tokens": 4})
    assert r.status_code == 200, r.text  # the slots are free again


def test_sigterm_with_a_stream_in_flight_ends_the_process_tree(server: Server) -> None:
    tree = server.tree()
    assert len(tree) >= 4, tree  # server, engine, two workers (and a resource tracker)
    errors, pieces = [], 0
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        timeout=60,
        json={**long_request(9), "max_tokens": 3000},
    ) as r:
        assert r.status_code == 200
        try:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        errors.append(event["error"]["message"])
                    pieces += 1
                    if pieces == 3:
                        server.proc.send_signal(signal.SIGTERM)
        except httpx.HTTPError:
            pass  # the connection may be closed instead of ending with an error event
    assert pieces >= 3
    assert server.proc.wait(timeout=15) is not None
    assert not wait_gone(tree, 10), [p for p in tree]
    assert any("shutting down" in e for e in errors), errors
