"""Admission and request lifecycle in-process (fake engine): a burst never admits more than
the capacity and every admission is given back however the request ends; 503s carry
Retry-After; aborted requests are counted once in the metrics; /health always names a
cause; the API key's scheme is case-insensitive."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Any

import httpx
import pytest
from fake_engine import (
    NAME,
    call_then_disconnect,
    error_of,
    make_state,
    metric,
    running_app,
    serving,
    wait_until,
)

from pipeserve.server import protocol as P
from pipeserve.server.request_run import RequestRun

pytestmark = pytest.mark.timeout(60)

COMPLETION = {"model": NAME, "prompt": "hello", "max_tokens": 3}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
CAPACITY_FLAGS = {"max_running_requests": 4, "max_queued_requests": 4}
ABORTS = {"name": "pipeserve_requests_total", "finish_reason": "abort"}


def test_burst_never_admits_more_than_the_capacity() -> None:
    state = make_state(**CAPACITY_FLAGS)
    engine: Any = state.client

    async def go() -> list[httpx.Response]:
        engine.gate = asyncio.Event()  # every admitted request runs until the gate opens
        async with serving(state) as http:
            path = ["/v1/completions", "/v1/chat/completions"]
            tasks = [
                asyncio.create_task(http.post(path[i % 2], json=[COMPLETION, CHAT][i % 2]))
                for i in range(30)
            ]
            await wait_until(lambda: engine.running + sum(t.done() for t in tasks) == 30)
            engine.gate.set()
            return await asyncio.gather(*tasks)

    responses = asyncio.run(go())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 8 + [503] * 22, statuses
    assert engine.peak == 8 and state.admission.peak == 8
    assert state.admission.active == 0
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            assert error_of(r)["code"] == "server_busy"


def test_admission_is_given_back_when_a_request_fails_before_the_engine() -> None:
    state = make_state(**CAPACITY_FLAGS)

    async def go() -> None:
        async with serving(state) as http:
            too_long = {**COMPLETION, "prompt": "x" * 5000}  # 5000 tokens > 4096
            bad_token = {**COMPLETION, "prompt": [1, 100000]}
            for body in [too_long, bad_token] * 10:
                assert (await http.post("/v1/completions", json=body)).status_code == 400
            assert state.admission.active == 0
            assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200

    asyncio.run(go())
    assert state.admission.active == 0
    assert metric(state, **ABORTS) == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_gone_mid_request_is_one_abort_and_frees_the_admission(
    path: str, stream: bool
) -> None:
    state = make_state()
    engine: Any = state.client
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), "stream": stream}

    async def go() -> None:
        engine.gate = asyncio.Event()  # never opened: the request runs until the client goes
        gone = asyncio.Event()
        async with running_app(state) as app:
            task = asyncio.create_task(call_then_disconnect(app, path, body, gone))
            await wait_until(lambda: engine.running == 1)
            gone.set()
            await asyncio.wait_for(task, 5)
            await wait_until(lambda: engine.running == 0)
            await asyncio.sleep(0.05)  # a second count would come now

    asyncio.run(go())
    assert metric(state, **ABORTS) == 1
    assert state.admission.active == 0


def test_a_run_whose_deltas_never_start_is_one_abort_when_collected() -> None:
    state = make_state()

    async def go() -> None:
        ticket = state.admission.admit(state.metrics)
        run = RequestRun(state, ticket, [1, 2], {}, False, 0)
        stream = run.stream_completion(P.CompletionRequest(model=NAME, prompt="hi"))
        del run, stream  # the stream was never iterated
        gc.collect()
        await wait_until(lambda: ticket.ended)

    asyncio.run(go())
    assert state.admission.active == 0
    assert metric(state, **ABORTS) == 1


def test_finished_requests_are_counted_once_by_finish_reason() -> None:
    state = make_state()

    async def go() -> None:
        async with serving(state) as http:
            assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200
            r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert r.status_code == 200 and "[DONE]" in r.text

    asyncio.run(go())
    assert metric(state, "pipeserve_requests_total", finish_reason="length") == 2
    assert metric(state, **ABORTS) == 0
    assert state.admission.active == 0


@pytest.mark.parametrize("message", ["worker 1 died", "the server is shutting down"])
def test_engine_failure_during_a_request_is_503_with_retry_after(message: str) -> None:
    state = make_state()
    engine: Any = state.client
    engine.error = (message, "engine")

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with serving(state) as http:
            plain = await http.post("/v1/chat/completions", json=CHAT)
            streamed = await http.post("/v1/completions", json={**COMPLETION, "stream": True})
            assert engine.running == 0  # the engine's streams were closed, not left to the GC
            return plain, streamed

    plain, streamed = asyncio.run(go())
    assert plain.status_code == 503, plain.text
    assert plain.headers["retry-after"] == "5"
    assert message in error_of(plain)["message"]
    events = [json.loads(x[6:]) for x in streamed.text.split("\n\n") if x.startswith("data: {")]
    assert message in events[-1]["error"]["message"]
    assert state.admission.active == 0
    assert metric(state, "pipeserve_requests_total", finish_reason="error") == 2


def test_engine_rejection_stays_400() -> None:
    state = make_state()
    engine: Any = state.client
    engine.error = ("bad sampling parameters", "invalid")

    async def go() -> httpx.Response:
        async with serving(state) as http:
            return await http.post("/v1/completions", json=COMPLETION)

    r = asyncio.run(go())
    assert r.status_code == 400 and "bad sampling" in error_of(r)["message"]


def test_requests_after_an_engine_failure_get_503_with_retry_after() -> None:
    state = make_state()

    async def go() -> list[httpx.Response]:
        async with serving(state) as http:
            state.client.failure = "worker 0 exited with code -9"
            return [
                await http.post("/v1/completions", json=COMPLETION),
                await http.post("/v1/chat/completions", json={**CHAT, "stream": True}),
            ]

    for r in asyncio.run(go()):
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "5"
        assert "worker 0 exited" in error_of(r)["message"]
    assert state.admission.active == 0


def test_unhealthy_health_always_names_a_cause() -> None:
    state = make_state()
    engine: Any = state.client

    async def go() -> list[httpx.Response]:
        async with serving(state) as http:
            healthy = await http.get("/health")
            engine.proc.exitcode = -9  # died; the failure not noticed by the reader yet
            died = await http.get("/health")
            engine.failure = "worker 1 died"
            return [healthy, died, await http.get("/health")]

    healthy, died, failed = asyncio.run(go())
    assert healthy.status_code == 200
    assert died.status_code == 503
    assert died.json()["error"] == "engine process exited with code -9"
    assert failed.json()["error"] == "worker 1 died"


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("Bearer sk-1", 200),
        ("bearer sk-1", 200),
        ("BEARER sk-1", 200),
        ("Bearer sk-2", 401),
        ("Basic sk-1", 401),
        ("sk-1", 401),
        ("", 401),
    ],
)
def test_api_key_scheme_is_case_insensitive(header: str, status: int) -> None:
    state = make_state(api_key="sk-1")

    async def go() -> httpx.Response:
        async with serving(state) as http:
            return await http.get("/v1/models", headers={"authorization": header})

    r = asyncio.run(go())
    assert r.status_code == status, r.text
