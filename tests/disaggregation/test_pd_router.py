"""The prefill/decode router against fake upstream servers: small FastAPI apps under uvicorn
on free localhost ports (each in a thread), no model. A fake decode server records what it
received and answers as the request's `"fake"` field says."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from starlette.datastructures import Headers
from tls_certs import Certs, make_certs

from pipeserve.disaggregation.pd import auth
from pipeserve.disaggregation.pd.prefill_client import PrefillCall, PrefillClient, PrefillFailed
from pipeserve.disaggregation.pd.router import (
    FORWARDED_HEADERS,
    MAX_EVENT_BYTES,
    PREFILL_HEADER,
    create_router_app,
)
from pipeserve.scheduler.request import SamplingParams

WAIT_S = 10.0  # longest any step may take: a hang fails fast
PIPESERVE = Path(sys.executable).parent / "pipeserve"
PD_KEY = "9c41e07a2b5d83f6e1a4c2b9d07f5e38"
HEALTH_GAUGE = "pipeserve_router_server_healthy"


class ServerThread:
    """An ASGI app served by uvicorn in a daemon thread, on a socket bound before start (so
    no other process can take its port)."""

    def __init__(self, app: FastAPI, certs: Certs | None = None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        scheme = "https" if certs else "http"
        self.url = f"{scheme}://127.0.0.1:{self.sock.getsockname()[1]}"
        tls = {"ssl_certfile": str(certs.cert), "ssl_keyfile": str(certs.key)} if certs else {}
        config = uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1, **tls)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        wait_until(lambda: self.server.started, "the server to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.sock.close()


class FakeDecode:
    """A decode server's HTTP face. `fake` in a request body picks the answer: json (the
    default), sse, sse_gated (the last event waits for `gate`), sse_break (the connection
    breaks after one event), sse_hang (one event, then nothing until the client leaves),
    sse_endless (one event that never ends: `data: ` and 64 KiB pieces until the client
    leaves), json_hang (nothing until the client leaves), json_slow (json after `delay_s`) or
    bad (a 400). Headers are recorded as received, repeats included. /health reports
    `prefill_wait` as its prefill_wait_s where it is set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.healthy = True
        self.prefill_wait: Any = None
        self.delay_s = 0.0
        self.received: list[tuple[Headers, bytes]] = []
        self.gate = threading.Event()
        self.closed = threading.Event()  # an sse_hang stream was cancelled or closed
        self.app = FastAPI()
        self.app.get("/health")(self.health)
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.complete)
        self.app.post("/v1/chat/completions")(self.complete)

    async def health(self) -> Response:
        if not self.healthy:
            return Response(status_code=503)
        if self.prefill_wait is None:
            return Response(status_code=200)
        return JSONResponse({"status": "ok", "prefill_wait_s": self.prefill_wait})

    async def models(self, request: Request) -> dict[str, Any]:
        self.received.append((request.headers, b""))
        return {"object": "list", "data": [{"id": self.name, "object": "model"}]}

    async def complete(self, request: Request) -> Response:
        body = await request.body()
        self.received.append((request.headers, body))
        fake = json.loads(body).get("fake", "json")
        if fake == "bad":
            error = {"error": {"message": "prompt: bad", "type": "invalid_request_error"}}
            return JSONResponse(error, status_code=400)
        if fake == "json":
            return JSONResponse({"server": self.name, "path": request.url.path})
        if fake == "json_hang":
            return await self._until_client_leaves(request)
        if fake == "json_slow":
            await asyncio.sleep(self.delay_s)
            return JSONResponse({"server": self.name, "path": request.url.path})
        if fake == "sse_endless":
            return StreamingResponse(self._endless_event(), media_type="text/event-stream")
        return StreamingResponse(self._events(fake), media_type="text/event-stream")

    async def _endless_event(self) -> AsyncIterator[bytes]:
        """`data: xxx...` without the blank line that would end it, until the client leaves
        (starlette then cancels this) or WAIT_S * 3 passed."""
        deadline = time.monotonic() + WAIT_S * 3
        try:
            yield b"data: "
            while time.monotonic() < deadline:
                yield b"x" * 2**16
                await asyncio.sleep(0)
        finally:
            self.closed.set()

    async def _until_client_leaves(self, request: Request) -> Response:
        """A non-streamed answer that never comes: waits for the client to disconnect."""
        deadline = time.monotonic() + WAIT_S * 3
        while not await request.is_disconnected() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.closed.set()
        return Response(status_code=499)

    async def _events(self, fake: str) -> AsyncIterator[str]:
        yield f"data: {json.dumps({'server': self.name, 'n': 0})}\n\n"
        if fake == "sse_break":
            raise RuntimeError("the decode server died")
        if fake == "sse_hang":
            try:
                await asyncio.sleep(WAIT_S * 3)
            finally:
                self.closed.set()
        if fake == "sse_gated":
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
        yield f"data: {json.dumps({'server': self.name, 'n': 1})}\n\n"
        yield "data: [DONE]\n\n"


def prefill_app(state: dict[str, bool]) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state["healthy"] else 503)

    return app


def wait_until(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S} s for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def serving(app: FastAPI, certs: Certs | None = None) -> Iterator[ServerThread]:
    server = ServerThread(app, certs).start()
    try:
        yield server
    finally:
        server.stop()


class Setup:
    """One prefill server, `decodes` fake decode servers, and a router in front of them."""

    def __init__(
        self,
        stack: contextlib.ExitStack,
        decodes: int,
        certs: Certs | None = None,
        prefill_wait: Any = None,
        **router: Any,
    ) -> None:
        """`certs`: the servers behind the router serve HTTPS with them; `prefill_wait`: what
        the decode servers' /health reports as prefill_wait_s (nothing where None)."""
        self.prefill_state = {"healthy": True}
        self.prefill = stack.enter_context(serving(prefill_app(self.prefill_state), certs))
        self.fakes = [FakeDecode(f"d{i}") for i in range(decodes)]
        for fake in self.fakes:
            fake.prefill_wait = prefill_wait
        self.decodes = [stack.enter_context(serving(f.app, certs)) for f in self.fakes]
        urls = [d.url for d in self.decodes]
        router = {"health_interval_s": 0.2, "pd_auth_key": PD_KEY, **router}
        app = create_router_app([self.prefill.url], urls, **router)
        self.router = stack.enter_context(serving(app))
        self.client = stack.enter_context(httpx.Client(base_url=self.router.url, timeout=5.0))

    def complete(self, fake: str = "json", **kw: Any) -> httpx.Response:
        return self.client.post("/v1/completions", json={"prompt": "hi", "fake": fake}, **kw)

    def wait_health(self, role: str, index: int, healthy: bool) -> dict[str, Any]:
        """Waits until /metrics shows the `index`-th server of `role` (un)healthy; /health."""

        def seen() -> bool:
            return self.health_gauges()[role, index] is healthy

        state = "healthy" if healthy else "unhealthy"
        wait_until(seen, f"the router to see {role} server #{index} {state}")
        return self.client.get("/health").json()

    def health_gauges(self) -> dict[tuple[str, int], bool]:
        """The per-server health gauges of /metrics, by (role, index)."""
        text = self.client.get("/metrics").text
        [family] = [f for f in text_string_to_metric_families(text) if f.name == HEALTH_GAUGE]
        return {(m.labels["role"], int(m.labels["index"])): m.value == 1 for m in family.samples}

    def upstream_addresses(self) -> list[str]:
        """host:port of every upstream server: what no client-facing answer may contain."""
        servers = [self.prefill, *self.decodes]
        return [server.url.split("://", 1)[1] for server in servers]


@pytest.fixture
def setup() -> Iterator[Callable[..., Setup]]:
    with contextlib.ExitStack() as stack:
        yield lambda decodes=1, certs=None, **router: Setup(stack, decodes, certs, **router)


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of a streamed response, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


@pytest.mark.timeout(60)
def test_json_completion_is_relayed_with_the_prefill_url(setup: Callable[..., Setup]) -> None:
    s = setup(health_interval_s=30.0)  # only the startup probe: the router routes at once
    body = b'{"prompt":  "h\\u00e9llo",\n "fake": "json"}'
    headers = {"Content-Type": "application/json", "Authorization": "Bearer upstream-key"}
    answer = s.client.post("/v1/chat/completions", content=body, headers=headers)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {"server": "d0", "path": "/v1/chat/completions"}
    [(received_headers, received_body)] = s.fakes[0].received
    assert received_body == body
    assert received_headers[PREFILL_HEADER.lower()] == s.prefill.url
    assert received_headers["authorization"] == "Bearer upstream-key"
    assert received_headers["content-type"] == "application/json"


@pytest.mark.timeout(60)
def test_sse_is_relayed_event_by_event(setup: Callable[..., Setup]) -> None:
    s = setup()
    body = {"prompt": "hi", "fake": "sse_gated"}
    with s.client.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = sse_events(answer)
        # the fake holds its last event back until the gate opens: a router that buffered
        # the body would let this read time out
        assert json.loads(next(events)) == {"server": "d0", "n": 0}
        s.fakes[0].gate.set()
        assert [json.loads(e) if e != "[DONE]" else e for e in events] == [
            {"server": "d0", "n": 1},
            "[DONE]",
        ]


@pytest.mark.timeout(60)
def test_decode_servers_take_turns(setup: Callable[..., Setup]) -> None:
    s = setup(decodes=2)
    assert [s.complete().json()["server"] for _ in range(4)] == ["d0", "d1", "d0", "d1"]
    assert all(h[PREFILL_HEADER.lower()] == s.prefill.url for f in s.fakes for h, _ in f.received)


@pytest.mark.timeout(60)
def test_a_server_failing_its_health_probe_is_skipped(setup: Callable[..., Setup]) -> None:
    s = setup(decodes=2)
    s.fakes[1].healthy = False
    health = s.wait_health("decode", 1, False)
    assert health["status"] == "ok"
    assert health["decode"] == {"healthy": 1, "total": 2}
    assert [s.complete().json()["server"] for _ in range(3)] == ["d0"] * 3
    s.fakes[1].healthy = True
    s.wait_health("decode", 1, True)
    assert {s.complete().json()["server"] for _ in range(2)} == {"d0", "d1"}


@pytest.mark.timeout(60)
def test_no_healthy_decode_server_is_a_503(setup: Callable[..., Setup]) -> None:
    s = setup()
    s.fakes[0].healthy = False
    s.wait_health("decode", 0, False)
    health = s.client.get("/health")
    assert health.status_code == 503
    assert health.json() == {
        "status": "unhealthy",
        "prefill": {"healthy": 1, "total": 1},
        "decode": {"healthy": 0, "total": 1},
    }
    answer = s.complete()
    assert answer.status_code == 503
    assert int(answer.headers["retry-after"]) >= 1
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "no healthy decode server (0 of 1)" in error["message"]
    assert "prefill" not in error["message"]
    assert not any(address in answer.text for address in s.upstream_addresses())
    assert s.fakes[0].received == []


@pytest.mark.timeout(60)
def test_no_healthy_prefill_server_is_a_503(setup: Callable[..., Setup]) -> None:
    s = setup()
    s.prefill_state["healthy"] = False
    s.wait_health("prefill", 0, False)
    answer = s.complete()
    assert answer.status_code == 503
    assert "no healthy prefill server" in answer.json()["error"]["message"]
    assert s.fakes[0].received == []


@pytest.mark.timeout(60)
def test_an_unreachable_decode_server_leaves_the_rotation_at_once(
    setup: Callable[..., Setup],
) -> None:
    s = setup(decodes=2, health_interval_s=30.0)  # no probe will notice: the request must
    s.decodes[0].stop()
    answer = s.complete()
    assert answer.status_code == 503
    assert "retry-after" in answer.headers
    assert "decode server #0 cannot be reached" in answer.json()["error"]["message"]
    assert not any(address in answer.text for address in s.upstream_addresses())
    assert s.health_gauges()["decode", 0] is False
    assert [s.complete().json()["server"] for _ in range(2)] == ["d1", "d1"]


@pytest.mark.timeout(60)
def test_a_stream_that_breaks_ends_with_an_error_event(setup: Callable[..., Setup]) -> None:
    s = setup()
    with s.client.stream("POST", "/v1/completions", json={"fake": "sse_break"}) as answer:
        assert answer.status_code == 200
        events = list(sse_events(answer))
    assert json.loads(events[0]) == {"server": "d0", "n": 0}
    message = json.loads(events[1])["error"]["message"]
    assert "decode server #0 broke off" in message
    assert not any(address in message for address in s.upstream_addresses())
    assert events[2:] == ["[DONE]"]
    metrics = s.client.get("/metrics").text
    assert "pipeserve_router_errors_total 1.0" in metrics


@pytest.mark.timeout(60)
def test_a_client_that_leaves_closes_the_upstream_stream(setup: Callable[..., Setup]) -> None:
    s = setup()
    with s.client.stream("POST", "/v1/completions", json={"fake": "sse_hang"}) as answer:
        assert json.loads(next(sse_events(answer))) == {"server": "d0", "n": 0}
    assert s.fakes[0].closed.wait(WAIT_S), "the decode server's stream was never closed"


@pytest.mark.timeout(60)
def test_a_client_that_leaves_before_the_answer_aborts_the_upstream_request(
    setup: Callable[..., Setup],
) -> None:
    s = setup()
    with pytest.raises(httpx.ReadTimeout):
        s.complete("json_hang", timeout=0.5)
    assert s.fakes[0].closed.wait(WAIT_S), "the decode server never saw the client leave"


@pytest.mark.timeout(60)
def test_the_api_key_is_checked_and_forwarded(setup: Callable[..., Setup]) -> None:
    s = setup(api_key="secret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic secret"}):
        answer = s.complete(headers=headers)
        assert answer.status_code == 401
        assert answer.json()["error"]["type"] == "authentication_error"
    assert s.client.get("/v1/models").status_code == 401
    assert s.fakes[0].received == []
    assert s.complete(headers={"Authorization": "bearer secret"}).status_code == 200
    assert s.fakes[0].received[0][0]["authorization"] == "bearer secret"


@pytest.mark.timeout(60)
def test_an_upstream_error_is_relayed_as_is(setup: Callable[..., Setup]) -> None:
    s = setup()
    answer = s.complete("bad")
    assert answer.status_code == 400
    assert answer.json() == {"error": {"message": "prompt: bad", "type": "invalid_request_error"}}


@pytest.mark.timeout(60)
def test_a_body_over_the_limit_is_a_413(setup: Callable[..., Setup]) -> None:
    s = setup(max_request_bytes=1000)
    answer = s.client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "request_too_large"
    assert s.fakes[0].received == []


@pytest.mark.timeout(60)
def test_models_are_proxied_and_metrics_rendered(setup: Callable[..., Setup]) -> None:
    s = setup()
    models = s.client.get("/v1/models", headers={"Authorization": "Bearer k"})
    assert models.json()["data"][0]["id"] == "d0"
    assert s.fakes[0].received[0][0]["authorization"] == "Bearer k"
    s.complete()
    assert s.health_gauges() == {("prefill", 0): True, ("decode", 0): True}
    metrics = s.client.get("/metrics").text
    assert "pipeserve_router_requests_total 1.0" in metrics
    assert "pipeserve_router_errors_total 0.0" in metrics


@pytest.mark.timeout(60)
def test_bad_settings_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="--decode 'localhost:1' is not a URL"):
        create_router_app(["http://127.0.0.1:1"], ["localhost:1"])
    with pytest.raises(ValueError, match="--prefill needs at least one"):
        create_router_app([], ["http://127.0.0.1:1"])


@pytest.mark.timeout(60)
def test_decode_calls_carry_the_internal_credential_and_not_the_clients(
    setup: Callable[..., Setup],
) -> None:
    s = setup()
    assert not {auth.INTERNAL_HEADER.lower(), PREFILL_HEADER.lower()} & set(FORWARDED_HEADERS)
    forged = {auth.INTERNAL_HEADER: "forged", PREFILL_HEADER: "http://attacker.invalid:1"}
    assert s.complete(headers=forged).status_code == 200
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert s.client.post("/v1/chat/completions", json=body, headers=forged).status_code == 200
    assert s.client.get("/v1/models", headers=forged).status_code == 200
    [completion, chat, models] = s.fakes[0].received
    calls = [
        ("POST", "/v1/completions", *completion, s.prefill.url),
        ("POST", "/v1/chat/completions", *chat, s.prefill.url),
        ("GET", "/v1/models", *models, ""),
    ]
    check = auth.InternalCredential(PD_KEY)  # a decode server's
    for method, path, headers, body, target in calls:
        assert len(headers.getlist(auth.INTERNAL_HEADER)) == 1
        assert check.problem(method, path, body, headers, target) is None
        assert check.problem(method, path, body, headers, target) == (
            "an internal credential used before"
        )
    # made per call: a value seen once opens no other call
    completion_headers, completion_body = completion
    for method, path, body, target in [
        ("POST", "/v1/chat/completions", completion_body, s.prefill.url),
        ("POST", "/v1/completions", completion_body + b" ", s.prefill.url),
        ("POST", "/v1/completions", completion_body, "http://attacker.invalid:1"),
    ]:
        fresh = auth.InternalCredential(PD_KEY)  # one that never saw it
        problem = fresh.problem(method, path, body, completion_headers, target)
        assert problem == "an internal credential that does not verify"
    for headers, _ in (completion, chat):
        assert headers.getlist(PREFILL_HEADER) == [s.prefill.url]
    assert PREFILL_HEADER not in models[0]


@pytest.mark.timeout(60)
def test_the_router_needs_the_pd_key(
    setup: Callable[..., Setup], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PIPESERVE_PD_AUTH_KEY", raising=False)
    with pytest.raises(ValueError, match="PIPESERVE_PD_AUTH_KEY"):
        create_router_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    monkeypatch.setenv("PIPESERVE_PD_AUTH_KEY", "e7a2c95b1f4d08e63b7a1c5f9d2e84b0")
    s = setup(pd_auth_key=None)
    assert s.complete().status_code == 200
    [(headers, body)] = s.fakes[0].received
    check = auth.InternalCredential("e7a2c95b1f4d08e63b7a1c5f9d2e84b0")
    assert check.problem("POST", "/v1/completions", body, headers, s.prefill.url) is None
    monkeypatch.setenv("PIPESERVE_PD_AUTH_KEY", "summer2024")  # a word-list key: refused
    with pytest.raises(ValueError, match="at least 32 hex digits"):
        create_router_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])


@pytest.mark.timeout(60)
def test_health_and_metrics_count_servers_and_name_none(setup: Callable[..., Setup]) -> None:
    s = setup(decodes=2)
    s.fakes[1].healthy = False
    s.wait_health("decode", 1, False)
    health = s.client.get("/health")
    assert health.json() == {
        "status": "ok",
        "prefill": {"healthy": 1, "total": 1},
        "decode": {"healthy": 1, "total": 2},
    }
    metrics = s.client.get("/metrics").text
    for text in (health.text, metrics):
        assert not any(address in text for address in s.upstream_addresses())
        assert "127.0.0.1" not in text
    assert s.health_gauges() == {("prefill", 0): True, ("decode", 0): True, ("decode", 1): False}


@pytest.mark.timeout(60)
def test_the_api_docs_are_off(setup: Callable[..., Setup]) -> None:
    s = setup()
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert s.client.get(path).status_code == 404, path


@pytest.mark.timeout(60)
def test_an_endless_event_ends_the_stream_with_an_error_event(
    setup: Callable[..., Setup],
) -> None:
    s = setup()
    # the router buffers at most MAX_EVENT_BYTES of one event: if it kept reading, this
    # stream would never end (the fake sends until the router leaves)
    with s.client.stream("POST", "/v1/completions", json={"fake": "sse_endless"}) as answer:
        assert answer.status_code == 200
        events = list(sse_events(answer))
    error = json.loads(events[0])["error"]
    assert error["code"] == "upstream_event_too_large"
    assert f"decode server #0 sent an event of over {MAX_EVENT_BYTES} bytes" in error["message"]
    assert events[1:] == ["[DONE]"]
    assert s.fakes[0].closed.wait(WAIT_S), "the router never closed the endless stream"
    assert "pipeserve_router_errors_total 1.0" in s.client.get("/metrics").text


@pytest.mark.timeout(60)
def test_a_header_that_cannot_be_forwarded_is_a_400(setup: Callable[..., Setup]) -> None:
    """A non-ASCII value in a header the router forwards (latin-1 bytes on the wire) is the
    client's error, a 400 naming the header, not a 500; nothing reaches a decode server."""
    s = setup(health_interval_s=30.0)
    for path in ("/v1/completions", "/v1/models"):
        headers = [(b"content-type", "application/json; charset=\xe9".encode("latin-1"))]
        if path == "/v1/models":
            answer = s.client.get(path, headers=headers)
        else:
            answer = s.client.post(path, content=b'{"prompt": "hi"}', headers=headers)
        assert answer.status_code == 400, answer.text
        assert "content-type header must be ASCII" in answer.json()["error"]["message"]
    assert s.fakes[0].received == []
    assert s.complete().status_code == 200  # the router still serves


@pytest.mark.timeout(60)
def test_servers_behind_the_router_speak_https_verified_by_the_ca_given(
    setup: Callable[..., Setup], tmp_path: Path
) -> None:
    """With --ssl-ca-certs the router reaches https:// servers whose certificates chain to
    it, the internal credential inside TLS; without it (the system's CAs) it reaches none."""
    certs = make_certs(tmp_path)
    s = setup(certs=certs, ssl_ca_certs=str(certs.ca))
    assert s.decodes[0].url.startswith("https://")
    assert s.complete().status_code == 200
    [(headers, body)] = s.fakes[0].received
    check = auth.InternalCredential(PD_KEY)
    assert check.problem("POST", "/v1/completions", body, headers, s.prefill.url) is None
    untrusting = setup(certs=certs)  # verifies against the system's CAs: no server is up
    r = untrusting.complete()
    assert r.status_code == 503, r.text
    assert untrusting.fakes[0].received == []


@pytest.mark.timeout(120)
def test_the_router_serves_https_with_a_certificate(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    port = free_port()
    dead = f"https://127.0.0.1:{free_port()}"
    cmd = [str(PIPESERVE), "router", "--prefill", dead, "--decode", dead, "--port", str(port)]
    cmd += ["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)]
    cmd += ["--ssl-ca-certs", str(certs.ca)]
    env = {**os.environ, "PIPESERVE_PD_AUTH_KEY": PD_KEY}
    with (tmp_path / "router.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until(
                lambda: b"ready on https://" in (tmp_path / "router.log").read_bytes(),
                "the router to start",
            )
            with httpx.Client(verify=ssl.create_default_context(cafile=certs.ca)) as client:
                r = client.get(f"https://127.0.0.1:{port}/health")
            assert r.status_code == 503  # reached over TLS; no server behind it is up
            with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        finally:
            proc.terminate()
            proc.wait(timeout=20)


@pytest.mark.timeout(60)
def test_a_decode_server_calls_https_prefill_servers_verified_by_its_ca(tmp_path: Path) -> None:
    """The decode server's leg to a prefill server (`PrefillClient.call`, run by its engine):
    over TLS to a certificate chaining to --ssl-ca-certs, its credential made for the call;
    without the CA the call fails and nothing reaches the prefill server; nor is a prefill
    server it was not started with ever called."""
    certs = make_certs(tmp_path)
    seen: list[tuple[Headers, bytes]] = []
    app = FastAPI()

    @app.post("/pd/prefill")
    async def prefill(request: Request) -> Response:
        seen.append((request.headers, await request.body()))
        return JSONResponse({"token": 3, "logprob": -0.5, "top": []})

    def client(ca: Path | None, url: str) -> PrefillClient:
        credential = auth.InternalCredential(PD_KEY)
        return PrefillClient(credential, str(ca) if ca else None, 10.0, 10, (url,))

    with serving(app, certs) as server:
        call = PrefillCall(server.url, [1, 2, 3], SamplingParams(), True, 0)
        assert asyncio.run(client(certs.ca, server.url).call(call, {"room": "x"})) == (
            3,
            -0.5,
            [],
        )
        [(headers, body)] = seen
        check = auth.InternalCredential(PD_KEY)  # the prefill server's
        assert check.problem("POST", "/pd/prefill", body, headers) is None
        with pytest.raises(PrefillFailed):
            asyncio.run(client(None, server.url).call(call, {"room": "x"}))
        with pytest.raises(PrefillFailed, match="not a prefill server"):
            asyncio.run(client(certs.ca, "https://elsewhere:1").call(call, {"room": "x"}))
        assert len(seen) == 1


def test_the_internal_credential_is_checked_head_first_and_taken_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stranger is refused on the head alone (before a body is read); a credential is
    taken once; past MAX_NONCES remembered, stamps not newer than the last forgotten one
    are refused (they could be replays of it)."""
    sign, check = auth.InternalCredential(PD_KEY), auth.InternalCredential(PD_KEY)
    body = b'{"x": 1}'
    made = sign.headers("POST", "/pd/prefill", body)
    headers = {**made, "content-length": str(len(body))}
    assert check.head_problem("POST", "/pd/prefill", headers) is None
    wrong = auth.InternalCredential("1" + PD_KEY[1:]).headers("POST", "/pd/prefill", body)
    assert check.head_problem("POST", "/pd/prefill", {**wrong, "content-length": "8"})
    assert check.head_problem("POST", "/pd/prefill", {**made, "content-length": "9"})
    assert check.problem("POST", "/pd/prefill", b'{"x": 2}', made) is not None  # another body
    assert check.problem("POST", "/pd/prefill", body, made) is None
    assert check.problem("POST", "/pd/prefill", body, made) == "an internal credential used before"
    monkeypatch.setattr(auth, "MAX_NONCES", 2)
    made_now = []
    for _ in range(3):
        time.sleep(0.001)  # stamps a millisecond apart
        made_now.append(sign.headers("GET", "/v1/models", b""))
    first = made_now[0]
    for h in made_now:
        assert check.problem("GET", "/v1/models", b"", h) is None
    # `made` and `first` were forgotten: a credential as old as them is refused
    late = {auth.INTERNAL_HEADER: first[auth.INTERNAL_HEADER]}
    assert check.problem("GET", "/v1/models", b"", late) == "an internal credential used before"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("reported", "status"),
    [(2.0, 200), (None, 504), (-1, 504), ("forever", 504), (1e12, 504)],
)
def test_a_decode_server_s_prefill_wait_extends_the_router_s_time_limit(
    setup: Callable[..., Setup], reported: Any, status: int
) -> None:
    """A decode server whose answer takes longer than --request-timeout is waited for when it
    reported on /health that a request may wait that long for its prefill; a report that is no
    sane number of seconds counts as none (504, the wait named)."""
    # the startup probe only: it reads the report
    s = setup(health_interval_s=30.0, request_timeout_s=0.3, prefill_wait=reported)
    s.fakes[0].delay_s = 0.8
    r = s.complete("json_slow")
    assert r.status_code == status, r.text
    if status == 504:
        assert "did not answer within 0.3 s" in r.json()["error"]["message"]
    else:
        assert r.json()["server"] == "d0"
