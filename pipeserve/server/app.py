"""`pipeserve serve`: an OpenAI-compatible HTTP API over the engine process.

The event loop here only parses JSON, tokenizes prompts (in a thread), and relays deltas
(text is detokenized in the engine process). Bad input is answered with an OpenAI-style
error body and never reaches the engine; a client that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )


class ServerState:
    def __init__(self, config: EngineConfig, flags: dict[str, Any], model_path: Path) -> None:
        self.config = config
        self.client = EngineClient(flags)
        self.tokenizer = Tokenizer(model_path)
        self.model_name = config.server.served_model_name or model_path.name
        self.metrics = Metrics()
        self.context_len = 0
        self.vocab_size = 0
        self.on_failure: Any = None  # set by the launcher: asks the HTTP server to exit

    @property
    def capacity(self) -> int:
        return self.config.scheduler.max_running_requests + self.config.server.max_queued_requests


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
    _install_error_handlers(app)

    async def authorize(request: Request) -> None:
        key = state.config.server.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {key}".encode()):
            raise ApiError(
                401,
                "invalid or missing API key (use 'Authorization: Bearer <key>')",
                "authentication_error",
                code="invalid_api_key",
            )

    @app.get("/health")
    async def health() -> Response:
        if state.client.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "error": state.client.failure}, status_code=503)

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

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        if isinstance(body.prompt, str):
            ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt)
        else:
            ids = list(body.prompt)
        max_new = _max_new_tokens(state, body, len(ids), COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
        top = body.logprobs or 0
        run = _Run(state, ids, body.sampling(max_new), body.logprobs is not None, top)
        if body.stream:
            return _sse(run.stream_completion(body))
        return JSONResponse(await _until_done(request, run.complete_completion()))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: P.ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = state.tokenizer.apply_chat_template(messages)
        ids = await asyncio.to_thread(state.tokenizer.encode, text)
        max_new = _max_new_tokens(state, body, len(ids), None, "messages")
        top = body.top_logprobs or 0 if body.logprobs else 0
        run = _Run(state, ids, body.sampling(max_new), body.logprobs, top)
        if body.stream:
            return _sse(run.stream_chat(body))
        return JSONResponse(await _until_done(request, run.complete_chat()))

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return JSONResponse(
            P.error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith("application/json"):
            message = (
                "the request body must be JSON (Content-Type: application/json), "
                f"got Content-Type {content_type!r}"
            )
            return JSONResponse(P.error_body(message), status_code=400)
        # the deepest location is the most specific (a union reports every branch)
        first: dict[str, Any] = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
        if first.get("type") == "json_invalid":
            at = first.get("loc", ("body", "?"))[-1]
            reason = first.get("ctx", {}).get("error", first.get("msg"))
            message = f"malformed JSON at byte {at}: {reason}"
            return JSONResponse(P.error_body(message), status_code=400)
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = (
            f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg"))
        )
        return JSONResponse(P.error_body(message, param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(P.error_body(str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(EngineFailed)
    async def engine_failed(_: Request, exc: EngineFailed) -> Response:
        return JSONResponse(
            P.error_body(f"engine unavailable: {exc}", "server_error"), status_code=503
        )


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise ApiError(
            404,
            f"model {name!r} not found; this server serves {state.model_name!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _max_new_tokens(
    state: ServerState, body: P._Request, prompt_len: int, default: int | None, prompt_param: str
) -> int:
    """The request's token budget, checked against the context before it reaches the engine."""
    ctx = state.context_len
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if prompt_len >= ctx:
        raise ApiError(
            400,
            f"this model's maximum context length is {ctx} tokens, but the "
            f"prompt has {prompt_len} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
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
    """One request's life: admission, deltas, and the OpenAI response shapes."""

    def __init__(
        self, state: ServerState, ids: list[int], params: dict[str, Any], logprobs: bool, top: int
    ) -> None:
        if state.client.num_active >= state.capacity:
            raise ApiError(
                503,
                f"server busy: {state.client.num_active} requests are running or "
                "queued; retry later",
                "server_error",
                code="server_busy",
            )
        vocab = state.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        self.state, self.ids, self.params, self.logprobs, self.top = (
            state,
            ids,
            params,
            logprobs,
            top,
        )
        self.id = P.new_id("cmpl")
        self.created = P.now()
        self.start = time.perf_counter()
        self.last_token_at: float | None = None

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        m = self.state.metrics
        async for d in self.state.client.generate(self.ids, self.params, self.logprobs, self.top):
            if d.error is not None:
                raise ApiError(
                    400 if d.error_kind == "invalid" else 500,
                    d.error,
                    "invalid_request_error" if d.error_kind == "invalid" else "server_error",
                )
            now = time.perf_counter()
            if d.token_ids:
                if self.last_token_at is None:
                    m.ttft.observe(now - self.start)
                else:
                    m.itl.observe((now - self.last_token_at) / len(d.token_ids))
                self.last_token_at = now
                m.generation_tokens.inc(len(d.token_ids))
            if d.finish_reason is not None:
                m.prompt_tokens.inc(d.prompt_tokens)
                m.requests.labels(finish_reason=d.finish_reason).inc()
            yield d

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
        except ApiError as exc:
            body = P.error_body(exc.message, exc.kind, exc.param, exc.code)
            yield f"data: {json.dumps(body)}\n\n"
        except EngineFailed as exc:
            body = P.error_body(f"engine unavailable: {exc}", "server_error")
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


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
