"""The prefill/decode disaggregation router (`pipeserve router`): one OpenAI-API address in
front of separate prefill servers and decode servers.

For each completion the router picks a healthy decode server and a healthy prefill server
(round-robin each) and forwards the request, its body bytes untouched, to the decode server
with the prefill server's URL in `X-Pipeserve-Prefill` and the internal credential (derived
from the PD key, see `auth`) in `X-Pipeserve-Internal`; the decode server follows the prefill
header only with that credential, and a client's own copies of either header are never
passed on. The decode server has that prefill server compute the prompt's KV and send it
over, so the router never talks to a prefill server about a request. The answer streams
back as it arrives: the client sees one stream.

The router checks only what is cheap (the API key, the body size); the decode server
validates the request, and whatever status it answers is relayed as is. Every server is
probed on `/health` in the background; one that fails a probe, or refuses a connection,
gets no requests until a probe succeeds again.

What a client can read names no backend: /health and /metrics count servers or number them
by their place in --prefill/--decode, and errors say "decode server #1"; the URLs are in the
log only. The API docs (/docs, /redoc, /openapi.json) are off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from typing import TypeVar

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from pipeserve.disaggregation.pd import auth
from pipeserve.server.body_limit import BodySizeLimit
from pipeserve.server.connection_guard import (
    ConnectionLimits,
    GuardedServer,
    client_tls,
    uvicorn_options,
)
from pipeserve.server.protocol import error_body

log = logging.getLogger(__name__)

PREFILL_HEADER = "X-Pipeserve-Prefill"  # the decode server has this prefill server compute KV
MAX_REQUEST_BYTES = 64 * 2**20
CONNECT_TIMEOUT_S = 5.0
MIN_PROBE_TIMEOUT_S = 0.5
# below uvicorn's 5 s keep-alive timeout, so the router never reuses a connection that the
# server is closing (that request would fail and the server be marked unhealthy for nothing)
KEEPALIVE_EXPIRY_S = 2.0
RETRY_OTHER_SERVER_S = 1  # Retry-After when one decode server failed: others may be healthy
GRACEFUL_SHUTDOWN_S = 3
CLIENT_GONE = 499  # status of a request whose client disconnected (never seen by it)
# the client's headers passed on; never PREFILL_HEADER or auth.INTERNAL_HEADER, which only
# the router may set
FORWARDED_HEADERS = ("authorization", "content-type")
RELAYED_HEADERS = ("content-type", "retry-after", "cache-control")
SSE_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
LONGEST_EVENT_END = max(len(end) for end in SSE_EVENT_ENDS)
MAX_EVENT_BYTES = 4 * 2**20  # one event larger than this ends the relay (bounds its buffer)
MAX_PREFILL_WAIT_S = 7 * 86400.0  # a decode server's reported prefill bound beyond: ignored

T = TypeVar("T")


class Upstream:
    """One prefill or decode server as the router sees it: the `index`-th of its role's list.
    `healthy` is None until the first probe answers; unknown counts as unhealthy."""

    def __init__(self, role: str, index: int, url: str) -> None:
        self.role, self.index, self.url = role, index, url
        self.healthy: bool | None = None
        # a decode server's bound on a request's wait for its prefill (its /health says)
        self.prefill_wait_s = 0.0

    @property
    def name(self) -> str:
        """How clients hear of it: by its place in --prefill/--decode, never its URL."""
        return f"{self.role} server #{self.index}"

    @property
    def up(self) -> bool:
        return self.healthy is True

    def mark(self, healthy: bool, why: str) -> None:
        """Record a probe's (or a failed request's) verdict; only changes are logged, not
        every probe."""
        if healthy == self.healthy:
            return
        if healthy:
            log.info("%s server %s is healthy", self.role, self.url)
        else:
            log.warning("%s server %s is unhealthy: %s", self.role, self.url, why)
        self.healthy = healthy


class Pool:
    """The servers of one role, handed out round-robin, skipping the unhealthy ones."""

    def __init__(self, role: str, urls: list[str]) -> None:
        self.role = role
        self.servers = [Upstream(role, i, url) for i, url in enumerate(urls)]
        self._next = 0

    def pick(self) -> Upstream | None:
        n = len(self.servers)
        for i in range(n):
            server = self.servers[(self._next + i) % n]
            if server.up:
                self._next = (self._next + i + 1) % n
                return server
        return None

    def any_up(self) -> bool:
        return any(server.up for server in self.servers)

    def n_up(self) -> int:
        return sum(server.up for server in self.servers)

    def status(self) -> dict[str, int]:
        """Counts only: which server is where is no business of a client's."""
        return {"healthy": self.n_up(), "total": len(self.servers)}


class RouterMetrics:
    """Prometheus metrics of the router, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.healthy = Gauge(
            "pipeserve_router_server_healthy",
            "1 while the server's last health probe succeeded",
            ["role", "index"],  # the index in --prefill/--decode, not the URL
            registry=r,
        )
        self.requests = Counter(
            "pipeserve_router_requests",
            "completion requests received (with a valid API key)",
            registry=r,
        )
        self.errors = Counter(
            "pipeserve_router_errors",
            "completion requests the router failed: no healthy server, decode server "
            "unreachable or timed out, or its stream broke off",
            registry=r,
        )

    def render(self, pools: list[Pool]) -> bytes:
        for server in (server for pool in pools for server in pool.servers):
            labels = self.healthy.labels(role=server.role, index=str(server.index))
            labels.set(1 if server.up else 0)
        return generate_latest(self.registry)


class RouterState:
    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        health_interval_s: float,
        request_timeout_s: float,
        api_key: str | None,
        pd_key: str,
        ca_certs: str | None = None,
    ) -> None:
        self.prefill = Pool("prefill", prefill_urls)
        self.decode = Pool("decode", decode_urls)
        self.health_interval_s = health_interval_s
        self.probe_timeout_s = max(health_interval_s, MIN_PROBE_TIMEOUT_S)
        self.retry_after_s = max(1, math.ceil(health_interval_s))  # until the next probe
        self.request_timeout_s = request_timeout_s
        self.api_key = api_key.encode() if api_key is not None else None
        self.credential = auth.InternalCredential(pd_key)
        self.metrics = RouterMetrics()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S),
            trust_env=False,  # the servers are addressed directly, never through a proxy
            verify=client_tls(ca_certs),  # https:// servers' certificates
        )

    @property
    def pools(self) -> list[Pool]:
        return [self.prefill, self.decode]


def create_router_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    health_interval_s: float = 1.0,
    request_timeout_s: float = 600.0,
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    pd_auth_key: str | None = None,
    ssl_ca_certs: str | None = None,
) -> FastAPI:
    """The router as a FastAPI app. Its startup probes every server once, so a router
    started against running servers routes at once. `pd_auth_key` is the PD key (else env
    PIPESERVE_PD_AUTH_KEY; ValueError if neither): the decode servers act only on requests
    that carry its internal credential."""
    _check_settings(
        prefill_urls, decode_urls, health_interval_s, request_timeout_s, max_request_bytes
    )
    state = RouterState(
        [u.rstrip("/") for u in prefill_urls],
        [u.rstrip("/") for u in decode_urls],
        health_interval_s,
        request_timeout_s,
        api_key,
        auth.pd_key(pd_auth_key),
        ssl_ca_certs,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await probe_all(state)
        prober = asyncio.create_task(_probe_forever(state))
        try:
            yield
        finally:
            prober.cancel()
            with suppress(asyncio.CancelledError):
                await prober
            await state.client.aclose()

    # no API docs: they would only tell a stranger what there is to try
    app = FastAPI(
        title="pipeserve router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.router = state
    app.add_middleware(BodySizeLimit, limit=max_request_bytes)
    _install_error_handlers(app)
    _add_info_routes(app, state)
    _add_completion_routes(app, state)
    return app


def _check_settings(
    prefill_urls: list[str], decode_urls: list[str], interval_s: float, timeout_s: float, limit: int
) -> None:
    for flag, urls in (("--prefill", prefill_urls), ("--decode", decode_urls)):
        if not urls:
            raise ValueError(f"{flag} needs at least one server URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{flag} {url!r} is not a URL: write it as http://HOST:PORT")
    for flag, value in (
        ("--health-interval", interval_s),
        ("--request-timeout", timeout_s),
        ("--max-request-bytes", limit),
    ):
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")


def run_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    host: str = "127.0.0.1",
    port: int = 30000,
    health_interval_s: float = 1.0,
    request_timeout_s: float = 600.0,
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    pd_auth_key: str | None = None,
    limits: ConnectionLimits | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    ssl_ca_certs: str | None = None,
) -> None:
    """Serve the router with uvicorn until SIGINT/SIGTERM (HTTPS with a certificate; https://
    servers verified against `ssl_ca_certs`, else the system's CAs)."""
    app = create_router_app(
        prefill_urls,
        decode_urls,
        health_interval_s,
        request_timeout_s,
        api_key,
        max_request_bytes,
        pd_auth_key=pd_auth_key,
        ssl_ca_certs=ssl_ca_certs,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **uvicorn_options(limits or ConnectionLimits(), ssl_certfile, ssl_keyfile),
    )
    _RouterServer(config).run()


class _RouterServer(GuardedServer):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # after the lifespan's first probe round
            scheme = "https" if self.config.ssl_certfile else "http"
            url = f"{scheme}://{self.config.host}:{self.config.port}"
            print(f"pipeserve router ready on {url}", flush=True)


# -- health ---------------------------------------------------------------------------------


async def probe_all(state: RouterState) -> None:
    servers = [server for pool in state.pools for server in pool.servers]
    await asyncio.gather(*(_probe(state, server) for server in servers))


async def _probe(state: RouterState, server: Upstream) -> None:
    try:
        answer = await state.client.get(f"{server.url}/health", timeout=state.probe_timeout_s)
    except httpx.HTTPError as exc:
        server.mark(False, f"GET /health failed: {_describe(exc)}")
        return
    server.mark(answer.status_code == 200, f"GET /health answered {answer.status_code}")
    if answer.status_code == 200 and server.role == "decode":
        server.prefill_wait_s = _prefill_wait(server, answer)


def _prefill_wait(server: Upstream, answer: httpx.Response) -> float:
    """The `prefill_wait_s` a decode server's /health reports (0 where it has none); a value
    that is no number of seconds up to MAX_PREFILL_WAIT_S is ignored with a warning."""
    try:
        value = answer.json().get("prefill_wait_s", 0.0)
    except (ValueError, AttributeError):
        return 0.0  # not a JSON object: a server that reports no bound
    if type(value) in (int, float) and 0 <= value <= MAX_PREFILL_WAIT_S:
        return float(value)
    log.warning("decode server %s reported prefill_wait_s %r: ignored", server.url, value)
    return 0.0


async def _probe_forever(state: RouterState) -> None:
    while True:
        await asyncio.sleep(state.health_interval_s)
        await probe_all(state)


# -- routes ---------------------------------------------------------------------------------


def _add_info_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health() -> Response:
        body = {"prefill": state.prefill.status(), "decode": state.decode.status()}
        if state.prefill.any_up() and state.decode.any_up():
            return JSONResponse({"status": "ok", **body})
        headers = {"Retry-After": str(state.retry_after_s)}
        return JSONResponse({"status": "unhealthy", **body}, status_code=503, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = state.metrics.render(state.pools)
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        denied = _check_key(state, request)
        if denied is not None:
            return denied
        decode = state.decode.pick()
        if decode is None:
            return _no_server(state, [state.decode])
        headers = _pass(state, request)
        if isinstance(headers, Response):
            return headers
        headers |= state.credential.headers("GET", "/v1/models", b"")
        try:
            answer = await state.client.get(f"{decode.url}/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            return _upstream_failed(state, decode, exc)
        return Response(answer.content, answer.status_code, _relayed_headers(answer))


def _add_completion_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(state, request, "/v1/chat/completions")


async def forward(state: RouterState, request: Request, path: str) -> Response:
    """Send one completion request to a decode server (naming the prefill server it is to
    use) and stream its answer back."""
    denied = _check_key(state, request)
    if denied is not None:
        return denied
    state.metrics.requests.inc()
    passed = _pass(state, request)
    if isinstance(passed, Response):
        return passed
    prefill, decode = state.prefill.pick(), state.decode.pick()
    if prefill is None or decode is None:
        picked = ((state.prefill, prefill), (state.decode, decode))
        return _no_server(state, [pool for pool, server in picked if server is None])
    try:
        body = await request.body()
    except ClientDisconnect:  # gone, or its body passed the size limit (413 already sent)
        return Response(status_code=CLIENT_GONE)
    headers = {
        **passed,
        PREFILL_HEADER: prefill.url,
        **state.credential.headers("POST", path, body, prefill.url),
    }
    # the decode server may wait for the prompt's prefill (its bound, from its /health) and
    # then stay silent for up to --request-timeout
    wait = httpx.Timeout(state.request_timeout_s + decode.prefill_wait_s, connect=CONNECT_TIMEOUT_S)
    sent = state.client.build_request(
        "POST", decode.url + path, content=body, headers=headers, timeout=wait
    )
    try:
        upstream = await _unless_client_leaves(request, state.client.send(sent, stream=True))
    except httpx.HTTPError as exc:
        return _upstream_failed(state, decode, exc)
    if upstream is None:
        return Response(status_code=CLIENT_GONE)
    return _relay(state, decode, upstream)


def _pass(state: RouterState, request: Request) -> dict[str, str] | Response:
    """The headers of a call of a decode server: the client's that it needs (FORWARDED_HEADERS
    only) and identity encoding, so that the bytes relayed are the bytes received (the
    caller adds the internal credential made for the call). A 400 where a client's header to
    forward is not ASCII (HTTP clients send header values as ASCII; httpx would refuse to)."""
    headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
    for name, value in headers.items():
        if not value.isascii():
            return _error(400, f"the {name} header must be ASCII")
    return {**headers, "accept-encoding": "identity"}


def _check_key(state: RouterState, request: Request) -> Response | None:
    """401 unless the request has `Authorization: Bearer <key>` (the scheme in any case, RFC
    7235), compared in constant time; the header is forwarded as is."""
    if state.api_key is None:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # header values arrive decoded as latin-1: encoding them back gives the raw bytes
    same = secrets.compare_digest(token.strip().encode("latin-1"), state.api_key)
    if same and scheme.lower() == "bearer":
        return None
    message = "invalid or missing API key (use 'Authorization: Bearer <key>')"
    return _error(401, message, "authentication_error", "invalid_api_key")


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelled (None) if the client disconnects first: a decode server sends
    a non-streamed completion only when it is done, and should not finish one nobody will
    read. Cancelling the request drops its connection, which aborts it there."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # until its connection is closed
    return None if task.cancelled() else task.result()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- relaying the answer ---------------------------------------------------------------------


class _UpstreamResponse(StreamingResponse):
    """A StreamingResponse that closes its upstream response however it ends: the stream
    finishes, the client disconnects (starlette then cancels the stream) or sending fails.
    Closing an unfinished upstream response drops its connection, which is how the decode
    server learns that the client went away."""

    def __init__(self, upstream: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
        super().__init__(chunks, upstream.status_code, _relayed_headers(upstream))
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()


def _relay(state: RouterState, decode: Upstream, upstream: httpx.Response) -> Response:
    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    chunks = _relay_events if sse else _relay_body
    return _UpstreamResponse(upstream, chunks(state, decode, upstream))


def _relayed_headers(upstream: httpx.Response) -> dict[str, str]:
    return {name: upstream.headers[name] for name in RELAYED_HEADERS if name in upstream.headers}


async def _relay_body(
    state: RouterState, decode: Upstream, upstream: httpx.Response
) -> AsyncIterator[bytes]:
    """The upstream body as it arrives. A break cannot change the status already sent: the
    body just ends (and the break is logged)."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        _stream_broke(state, decode, exc)


async def _relay_events(
    state: RouterState, decode: Upstream, upstream: httpx.Response
) -> AsyncIterator[bytes]:
    """The upstream server-sent events as they arrive, whole events only. On a break, or an
    event over MAX_EVENT_BYTES (the buffer of a half event is bounded), the client gets an
    error event and `[DONE]`: a stream that ends the way a failed pipeserve stream ends, with
    no half event before it."""
    pending = bytearray()  # the start of an event; never holds a whole one between chunks
    try:
        async for chunk in upstream.aiter_raw():
            pending += chunk
            whole = _whole_events(pending, len(pending) - len(chunk))
            if whole:
                yield bytes(pending[:whole])
                del pending[:whole]
            if len(pending) > MAX_EVENT_BYTES:
                yield _event_too_large(state, decode)
                return
    except httpx.HTTPError as exc:
        yield _stream_broke(state, decode, exc)
        return
    if pending:
        yield bytes(pending)


def _whole_events(buffer: bytearray, new: int) -> int:
    """The length of the start of `buffer` made of whole events (each ends in a blank line),
    given that no event ended before its `new`-th byte: only the new bytes are searched, so
    relaying a long event costs linear time."""
    start = max(0, new - LONGEST_EVENT_END + 1)
    whole = 0
    for end in SSE_EVENT_ENDS:
        at = buffer.rfind(end, start)
        if at >= 0:
            whole = max(whole, at + len(end))
    return whole


def _stream_broke(state: RouterState, decode: Upstream, exc: httpx.HTTPError) -> bytes:
    state.metrics.errors.inc()
    log.warning("the stream from decode server %s broke off: %s", decode.url, _describe(exc))
    message = (
        f"{decode.name} broke off the stream ({type(exc).__name__}); the completion is "
        "incomplete: retry the request"
    )
    return _final_error_event(message, "upstream_stream_broken")


def _event_too_large(state: RouterState, decode: Upstream) -> bytes:
    state.metrics.errors.inc()
    log.warning(
        "decode server %s sent an event of over %d bytes: relay stopped",
        decode.url,
        MAX_EVENT_BYTES,
    )
    message = (
        f"{decode.name} sent an event of over {MAX_EVENT_BYTES} bytes; the completion is "
        "incomplete: retry the request"
    )
    return _final_error_event(message, "upstream_event_too_large")


def _final_error_event(message: str, code: str) -> bytes:
    body = error_body(message, "server_error", code=code)
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


# -- errors ---------------------------------------------------------------------------------


def _error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    retry_after: int | None = None,
) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(message, kind, code=code), status_code=status, headers=headers)


def _no_server(state: RouterState, empty: list[Pool]) -> Response:
    state.metrics.errors.inc()
    what = " and ".join(
        f"no healthy {pool.role} server ({pool.n_up()} of {len(pool.servers)})" for pool in empty
    )
    message = f"{what}: retry after the next health check"
    return _error(503, message, "server_error", "no_healthy_server", state.retry_after_s)


def _upstream_failed(state: RouterState, decode: Upstream, exc: httpx.HTTPError) -> Response:
    """Before any answer: a timeout is the decode server being slow (504; the health probe
    judges it); anything else (refused, reset, closed) means it is gone, so it leaves the
    rotation at once (503). Not retried elsewhere: the request may have started there. The
    client hears only the error's type: its text may name the server's address."""
    state.metrics.errors.inc()
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        log.warning("decode server %s timed out: %s", decode.url, _describe(exc))
        waited = state.request_timeout_s + decode.prefill_wait_s
        message = (
            f"{decode.name} did not answer within {waited:g} s (--request-timeout "
            f"{state.request_timeout_s:g} s after the {decode.prefill_wait_s:g} s it may wait "
            "for a prefill)"
        )
        return _error(504, message, "server_error", "upstream_timeout")
    decode.mark(False, _describe(exc))
    message = (
        f"{decode.name} cannot be reached ({type(exc).__name__}); it gets no requests until "
        "its health check passes: retry the request"
    )
    return _error(503, message, "server_error", "upstream_unavailable", RETRY_OTHER_SERVER_S)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(  # keeps e.g. a 405's Allow header
            error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )
