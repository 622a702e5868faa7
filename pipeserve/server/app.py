"""`pipeserve serve`: an OpenAI-compatible HTTP API over the engine process.

The event loop here only parses JSON and relays deltas (text is detokenized in the engine
process); prompts are tokenized and chat templates rendered in worker threads. Bad input is
answered with an OpenAI-style error body before any tokenization or engine work; a request
is admitted (counted against the capacity) before it is tokenized; a client that goes away
aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeserve.config import EngineConfig
from pipeserve.server import protocol as P
from pipeserve.server.engine_client import EngineClient, EngineFailed
from pipeserve.server.metrics import Metrics
from pipeserve.server.streams import StreamDelta
from pipeserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FAILURE_GRACE_S = 2.0  # after an engine failure: time to answer clients before exiting
DISCONNECT_POLL_S = 0.25
RETRY_BUSY_S = 1  # Retry-After of a 503 from a full server
RETRY_UNAVAILABLE_S = 5  # Retry-After of a 503 from a server shutting down or failed
TOKENIZE_CONCURRENCY = 2 * (os.cpu_count() or 1)  # prompts tokenized at once


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.retry_after = param, code, retry_after

    def response(self) -> JSONResponse:
        return _error_response(
            self.status,
            P.error_body(self.message, self.kind, self.param, self.code),
            self.retry_after,
        )


def _error_response(status: int, body: dict[str, Any], retry_after: int | None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def _unavailable(exc: EngineFailed | str) -> ApiError:
    return ApiError(
        503, f"engine unavailable: {exc}", "server_error", retry_after=RETRY_UNAVAILABLE_S
    )


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


class ServerState:
    def __init__(
        self, config: EngineConfig, client: EngineClient, tokenizer: Tokenizer, model_name: str
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = Metrics()
        capacity = config.scheduler.max_running_requests + config.server.max_queued_requests
        self.admission = Admission(capacity)
        self.tokenize_slots = asyncio.Semaphore(TOKENIZE_CONCURRENCY)
        self.context_len = 0
        self.vocab_size = 0
        self.on_failure: Callable[[], None] | None = None  # set by the launcher: asks to exit

    @classmethod
    def for_model(
        cls, config: EngineConfig, flags: dict[str, Any], model_path: Path
    ) -> ServerState:
        name = config.server.served_model_name or model_path.name
        return cls(config, EngineClient(flags), Tokenizer(model_path), name)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.client.start()
        state.context_len = state.client.info["context_len"]
        state.vocab_size = state.client.info["vocab_size"]
        watcher = asyncio.create_task(_watch_failure(state))
        try:
            yield
        finally:
            watcher.cancel()
            await state.client.shutdown()

    app = FastAPI(title="pipeserve", lifespan=lifespan)
    app.state.pipeserve = state
    app.add_middleware(BodySizeLimit, limit=state.config.server.max_request_bytes)
    _install_error_handlers(app)
    authorize = _authorizer(state.config.server.api_key)
    _add_info_routes(app, state, authorize)
    _add_generation_routes(app, state, authorize)
    return app


def _authorizer(key: str | None) -> Callable[[Request], Awaitable[None]]:
    """Checks `Authorization: Bearer <key>` (the scheme in any case, RFC 7235) in constant
    time."""
    expected = key.encode() if key is not None else None

    async def authorize(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # header values arrive decoded as latin-1: encoding them back gives the raw bytes
        same = secrets.compare_digest(token.strip().encode("latin-1"), expected)
        if not (same and scheme.lower() == "bearer"):
            raise ApiError(
                401,
                "invalid or missing API key (use 'Authorization: Bearer <key>')",
                "authentication_error",
                code="invalid_api_key",
            )

    return authorize


def _add_info_routes(
    app: FastAPI, state: ServerState, authorize: Callable[[Request], Awaitable[None]]
) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.client.healthy:
            return JSONResponse({"status": "ok"})
        body = {"status": "unhealthy", "error": _unhealthy_cause(state.client)}
        return _error_response(503, body, RETRY_UNAVAILABLE_S)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.update(state.client.stats, state.client.healthy)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": P.now(),
                    "owned_by": "pipeserve",
                }
            ],
        }


def _unhealthy_cause(client: EngineClient) -> str:
    if client.failure is not None:
        return client.failure
    if not client.info:
        return "engine starting"
    if not client.proc.is_alive():
        return f"engine process exited with code {client.proc.exitcode}"
    return "engine unhealthy"


def _add_generation_routes(
    app: FastAPI, state: ServerState, authorize: Callable[[Request], Awaitable[None]]
) -> None:
    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        _check_prompt_size(state, body.prompt)
        _check_engine(state)
        ticket = state.admission.admit(state.metrics)
        with _ended_on_error(ticket):
            if isinstance(body.prompt, str):
                ids = await _off_loop(state, state.tokenizer.encode, body.prompt)
            else:
                ids = list(body.prompt)
            default = COMPLETION_DEFAULT_MAX_TOKENS
            max_new = _max_new_tokens(state, body, len(ids), default, "prompt")
            _check_vocab(state, ids)
            top = body.logprobs or 0
            run = _Run(state, ticket, ids, body.sampling(max_new), body.logprobs is not None, top)
        if body.stream:
            return _sse(run.stream_completion(body))
        return JSONResponse(await _until_done(request, run.complete_completion()))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: P.ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        _check_prompt_chars(state, sum(len(m["content"]) for m in messages), "messages")
        _check_engine(state)
        ticket = state.admission.admit(state.metrics)
        with _ended_on_error(ticket):
            ids = await _off_loop(state, _render_and_encode, state.tokenizer, messages)
            max_new = _max_new_tokens(state, body, len(ids), None, "messages")
            _check_vocab(state, ids)
            top = body.top_logprobs or 0 if body.logprobs else 0
            run = _Run(state, ticket, ids, body.sampling(max_new), body.logprobs, top)
        if body.stream:
            return _sse(run.stream_chat(body))
        return JSONResponse(await _until_done(request, run.complete_chat()))


@contextlib.contextmanager
def _ended_on_error(ticket: Ticket) -> Iterator[None]:
    """Give the admission back if the request fails before its run owns the ticket."""
    try:
        yield
    except BaseException:
        ticket.end()
        raise


async def _off_loop(state: ServerState, work: Callable[..., list[int]], *args: Any) -> list[int]:
    """Tokenize in a worker thread; at most TOKENIZE_CONCURRENCY prompts at once."""
    async with state.tokenize_slots:
        return await asyncio.to_thread(work, *args)


def _render_and_encode(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages)
    except jinja2.TemplateError as exc:
        raise ApiError(
            400, f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from None
    return tokenizer.encode(text)


class BodySizeLimit:
    """Pure ASGI middleware (streamed responses pass through untouched): a request body over
    `limit` bytes gets 413, at once when its Content-Length says so, else as soon as the
    chunks received pass the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif _content_length(scope) > self.limit:
            await _send_too_large(send, self.limit)
        else:
            await _LimitedBody(self.limit, receive, send).run(self.app, scope)


class _LimitedBody:
    """One request under BodySizeLimit. Past the limit the client gets 413 (unless a
    response already started), the app sees the client disconnect, and whatever the app
    answers then is dropped."""

    def __init__(self, limit: int, receive: Receive, send: Send) -> None:
        self.limit, self._receive, self._send = limit, receive, send
        self.received, self.rejected, self.started = 0, False, False

    async def run(self, app: ASGIApp, scope: Scope) -> None:
        await app(scope, self.receive, self.send)

    async def receive(self) -> Message:
        if self.rejected:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.rejected = True
                if not self.started:
                    await _send_too_large(self._send, self.limit)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.rejected:
            return
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


async def _send_too_large(send: Send, limit: int) -> None:
    message = f"the request body is larger than {limit} bytes (the server's --max-request-bytes)"
    body = json.dumps(P.error_body(message, code="request_too_large")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(P.error_body(str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(EngineFailed)
    async def engine_failed(_: Request, exc: EngineFailed) -> Response:
        return _unavailable(exc).response()


def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("application/json"):
        message = (
            "the request body must be JSON (Content-Type: application/json), "
            f"got Content-Type {content_type!r}"
        )
        return JSONResponse(P.error_body(message), status_code=400)
    # the deepest location is the most specific (a union reports every branch)
    first: dict[str, Any] = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
    error = first.get("ctx", {}).get("error")
    if isinstance(error, P.FieldError):
        return JSONResponse(P.error_body(error.message, param=error.param), status_code=400)
    if first.get("type") == "json_invalid":
        at = first.get("loc", ("body", "?"))[-1]
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        message = f"malformed JSON at byte {at}: {reason}"
        return JSONResponse(P.error_body(message), status_code=400)
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg"))
    return JSONResponse(P.error_body(message, param=where or None), status_code=400)


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise ApiError(
            404,
            f"model {name!r} not found; this server serves {state.model_name!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _check_engine(state: ServerState) -> None:
    if state.client.failure is not None:
        raise _unavailable(state.client.failure)


def _check_prompt_size(state: ServerState, prompt: str | list[int]) -> None:
    """Reject a prompt that cannot fit the context before tokenizing or admitting it."""
    if isinstance(prompt, str):
        _check_prompt_chars(state, len(prompt), "prompt")
    elif len(prompt) >= state.context_len:
        raise _context_exceeded(state, len(prompt), "prompt")


def _check_prompt_chars(state: ServerState, chars: int, param: str) -> None:
    limit = P.MAX_PROMPT_CHARS_PER_TOKEN * state.context_len
    if chars > limit:
        raise ApiError(
            400,
            f"the prompt has {chars} characters; this model's maximum context length is "
            f"{state.context_len} tokens, which no text over {limit} characters fits "
            f"({P.MAX_PROMPT_CHARS_PER_TOKEN} characters per token)",
            param=param,
            code="context_length_exceeded",
        )


def _context_exceeded(state: ServerState, prompt_len: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"this model's maximum context length is {state.context_len} tokens, but the "
        f"prompt has {prompt_len} tokens",
        param=param,
        code="context_length_exceeded",
    )


def _check_vocab(state: ServerState, ids: list[int]) -> None:
    vocab = state.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
        )


def _max_new_tokens(
    state: ServerState, body: P._Request, prompt_len: int, default: int | None, prompt_param: str
) -> int:
    """The request's token budget, checked against the context before it reaches the engine."""
    ctx = state.context_len
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if prompt_len >= ctx:
        raise _context_exceeded(state, prompt_len, prompt_param)
    asked = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if asked is None:
        return min(default, ctx - prompt_len) if default is not None else ctx - prompt_len
    if prompt_len + asked > ctx:
        raise ApiError(
            400,
            f"this model's maximum context length is {ctx} tokens; the prompt has "
            f"{prompt_len} and max_tokens asks for {asked} more",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked


class _Run:
    """One admitted request's life: its deltas (it owns the admission ticket from here on:
    the ticket ends when the deltas end, or, if they never start, when the run is
    collected) and the OpenAI response shapes."""

    def __init__(
        self,
        state: ServerState,
        ticket: Ticket,
        ids: list[int],
        params: dict[str, Any],
        logprobs: bool,
        top: int,
    ) -> None:
        self.state, self.ticket, self.ids, self.params = state, ticket, ids, params
        self.logprobs, self.top = logprobs, top
        self.id = P.new_id("cmpl")
        self.created = P.now()
        self.start = time.perf_counter()
        self.last_token_at: float | None = None
        finalizer = weakref.finalize(self, ticket.end_soon, asyncio.get_running_loop())
        finalizer.atexit = False

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        reason = "abort"  # unless the engine says how the request ended
        deltas = self.state.client.generate(self.ids, self.params, self.logprobs, self.top)
        gen = cast(AsyncGenerator[StreamDelta, None], deltas)  # an async generator function
        try:
            # closed here, not when collected: its finally drops the request from the engine
            async with contextlib.aclosing(gen):
                async for d in gen:
                    if d.error is not None:
                        reason = "error"
                        raise _delta_error(d)
                    self._observe(d)
                    reason = d.finish_reason or reason
                    yield d
        except EngineFailed:
            reason = "error"
            raise
        finally:
            self.ticket.end(reason)

    def _observe(self, d: StreamDelta) -> None:
        m, now = self.state.metrics, time.perf_counter()
        if d.token_ids:
            if self.last_token_at is None:
                m.ttft.observe(now - self.start)
            else:
                m.itl.observe((now - self.last_token_at) / len(d.token_ids))
            self.last_token_at = now
            m.generation_tokens.inc(len(d.token_ids))
        if d.finish_reason is not None:
            m.prompt_tokens.inc(d.prompt_tokens)

    def _envelope(
        self, kind: str, choices: list[dict[str, Any]], final: StreamDelta | None = None
    ) -> dict[str, Any]:
        """An OpenAI response object of `kind`; with `final`, the request's usage counts."""
        out = {
            "id": self.id.replace("cmpl", "chatcmpl") if kind.startswith("chat") else self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }
        if final is not None:
            out["usage"] = P.usage(
                final.prompt_tokens, final.completion_tokens, final.cached_tokens
            )
        return out

    async def _collect(self) -> tuple[str, StreamDelta, _Logprobs]:
        """All of a non-streamed request: its text, last delta and logprobs."""
        text, final, lps = "", None, _Logprobs(self.state.tokenizer)
        async for d in self.deltas():
            text += d.text
            lps.add(d)
            final = d
        assert final is not None
        return text, final, lps

    async def _stream(
        self,
        kind: str,
        include_usage: bool,
        choice: Callable[[StreamDelta, _Logprobs, int], dict[str, Any]],
    ) -> AsyncIterator[dict[str, Any]]:
        """One chunk per delta that has something to show, then the usage chunk if asked."""
        lps = _Logprobs(self.state.tokenizer)
        async for d in self.deltas():
            if not (d.text or d.finish_reason or self.logprobs):
                continue  # text held back (a partial character or stop string)
            start = len(lps.ids)
            lps.add(d)
            yield self._envelope(kind, [choice(d, lps, start)])
            if d.finish_reason is not None and include_usage:
                yield self._envelope(kind, [], final=d)

    # -- /v1/completions -----------------------------------------------------------------

    async def complete_completion(self) -> dict[str, Any]:
        text, final, lps = await self._collect()
        choice = {
            "index": 0,
            "text": text,
            "finish_reason": _finish(final),
            "logprobs": lps.completion() if self.logprobs else None,
        }
        return self._envelope("text_completion", [choice], final=final)

    def stream_completion(self, body: P.CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        def choice(d: StreamDelta, lps: _Logprobs, start: int) -> dict[str, Any]:
            return {
                "index": 0,
                "text": d.text,
                "finish_reason": _finish(d),
                "logprobs": lps.completion(start) if self.logprobs else None,
            }

        return self._stream("text_completion", body.include_usage, choice)

    # -- /v1/chat/completions ------------------------------------------------------------

    async def complete_chat(self) -> dict[str, Any]:
        text, final, lps = await self._collect()
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": _finish(final),
            "logprobs": lps.chat() if self.logprobs else None,
        }
        return self._envelope("chat.completion", [choice], final=final)

    async def stream_chat(self, body: P.ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        def choice(d: StreamDelta, lps: _Logprobs, start: int) -> dict[str, Any]:
            return {
                "index": 0,
                "delta": {"content": d.text} if d.text else {},
                "finish_reason": _finish(d),
                "logprobs": lps.chat(start) if self.logprobs else None,
            }

        opening = {"role": "assistant", "content": ""}
        yield self._envelope(
            "chat.completion.chunk",
            [{"index": 0, "delta": opening, "finish_reason": None, "logprobs": None}],
        )
        async for chunk in self._stream("chat.completion.chunk", body.include_usage, choice):
            yield chunk


class _Logprobs:
    """Logprobs of a request's tokens in the OpenAI shapes. Tokens are named by their own
    bytes (a token holding part of a character shows as \\xNN escapes), so alternatives
    never collide; `text_offset` is each token's position in the decoded completion."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.values: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []

    def add(self, d: StreamDelta) -> None:
        self.ids += d.token_ids
        self.values += d.logprobs
        self.tops += d.top_logprobs or [[] for _ in d.token_ids]

    def completion(self, start: int = 0) -> dict[str, Any]:
        text = self.tokenizer.token_text
        return {
            "tokens": [text(t) for t in self.ids[start:]],
            "token_logprobs": self.values[start:],
            "top_logprobs": [{text(t): v for t, v in top} for top in self.tops[start:]],
            "text_offset": [
                len(self.tokenizer.decode(self.ids[:i])) for i in range(start, len(self.ids))
            ],
        }

    def chat(self, start: int = 0) -> dict[str, Any]:
        def entry(token: int, value: float) -> dict[str, Any]:
            raw = self.tokenizer.token_bytes(token)
            return {"token": self.tokenizer.token_text(token), "logprob": value, "bytes": list(raw)}

        rows = zip(self.ids[start:], self.values[start:], self.tops[start:], strict=True)
        return {
            "content": [
                {**entry(t, v), "top_logprobs": [entry(a, b) for a, b in top]} for t, v, top in rows
            ]
        }


def _delta_error(d: StreamDelta) -> ApiError:
    """The error a request's failed delta answers with: 400 for a request the engine
    rejected, 503 when the engine failed or the server is shutting down."""
    if d.error_kind == "invalid":
        return ApiError(400, str(d.error))
    return _unavailable(str(d.error))


def _finish(d: StreamDelta) -> str | None:
    if d.finish_reason in (None, "stop", "length"):
        return d.finish_reason
    return "abort" if d.finish_reason == "abort" else d.finish_reason


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events; an error after the stream started becomes an `error` event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except (ApiError, EngineFailed) as exc:
            yield _error_event(exc)
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _error_event(exc: ApiError | EngineFailed) -> str:
    error = exc if isinstance(exc, ApiError) else _unavailable(exc)
    body = P.error_body(error.message, error.kind, error.param, error.code)
    return f"data: {json.dumps(body)}\n\n"


async def _until_done(request: Request, work: Any) -> dict[str, Any]:
    """Await a non-streamed response; abort it if the client disconnects meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
    return task.result()


async def _watch_failure(state: ServerState) -> None:
    """After the engine fails: answer for a moment (health says 503), then shut down."""
    while state.client.failure is None:
        await asyncio.sleep(0.2)
    log.error("engine failed: %s", state.client.failure.splitlines()[0])
    await asyncio.sleep(FAILURE_GRACE_S)
    if state.on_failure is not None:
        state.on_failure()
