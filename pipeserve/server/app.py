"""`pipeserve serve`: an OpenAI-compatible HTTP API over the engine process.

The event loop here only parses JSON and relays deltas (text is detokenized in the engine
process); prompts are tokenized and chat templates rendered in worker threads. Bad input is
answered with an OpenAI-style error body before any tokenization or engine work; a request
is admitted (counted against the capacity) before it is tokenized; a client that goes away
aborts its request.

This module assembles the FastAPI app: the server state, routes, error handlers and SSE.
The parts live beside it: `admission` (the capacity count), `body_limit` (the 413
middleware), `checks` (request checks), `request_run` (one request's deltas and responses)
and `errors` (`ApiError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeserve.disaggregation.pd.http import add_prefill_route, prefill_target
from pipeserve.server import protocol as P
from pipeserve.server.admission import Ticket
from pipeserve.server.body_limit import BodySizeLimit
from pipeserve.server.checks import (
    check_engine,
    check_model,
    check_prompt_chars,
    check_prompt_size,
    check_vocab,
    max_new_tokens,
    sampling_params,
)
from pipeserve.server.engine_client import EngineClient, EngineFailed
from pipeserve.server.errors import RETRY_UNAVAILABLE_S, ApiError, error_response, unavailable
from pipeserve.server.request_run import RequestRun
from pipeserve.server.responses import until_done
from pipeserve.server.state import ServerState
from pipeserve.tokenizer import ChatTemplateMissing, Tokenizer

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FAILURE_GRACE_S = 2.0  # after an engine failure: time to answer clients before exiting


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.client.start()
        assert state.client.info is not None  # started
        state.context_len = state.client.info.context_len
        state.vocab_size = state.client.info.vocab_size
        watcher = asyncio.create_task(_watch_failure(state))
        try:
            yield
        finally:
            watcher.cancel()
            await state.client.shutdown()

    docs = state.config.server.enable_api_docs  # off: they map the API for anyone
    app = FastAPI(
        title="pipeserve",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.pipeserve = state
    app.add_middleware(BodySizeLimit, limit=state.config.server.max_request_bytes)
    _install_error_handlers(app)
    authorize = _authorizer(state.config.server.api_key)
    _add_info_routes(app, state, authorize)
    _add_generation_routes(app, state, authorize)
    if state.config.disaggregation.disaggregation_mode == "prefill":
        add_prefill_route(app, state)
    app.openapi = lambda: _openapi_schema(app)  # type: ignore[method-assign]
    return app


ERROR_STATUSES = {  # what the API answers besides 200 (never FastAPI's 422: bad input is 400)
    "400": "invalid request (OpenAI error body)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "body over --max-request-bytes",
    "503": "busy, shutting down or engine failed (Retry-After)",
}


def _openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with the statuses this server really answers: 422 replaced by the
    error statuses above on every operation that takes a body, and /metrics as text."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error = {"content": {"application/json": {"schema": {"type": "object"}}}}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if responses.pop("422", None) is not None or path.startswith("/v1/"):
                    for status, text in ERROR_STATUSES.items():
                        responses[status] = {"description": text, **error}
        metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]
        metrics["content"] = {"text/plain": {"schema": {"type": "string"}}}
        app.openapi_schema = schema
    return app.openapi_schema


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
    d = state.config.disaggregation
    ok: dict[str, Any] = {"status": "ok"}
    if d.disaggregation_mode == "decode":
        # the longest a request may wait here for its prompt's prefill on a prefill server
        # and its KV (the router's time limit for an answer adds this to its own)
        ok["prefill_wait_s"] = d.prefill_wait_s

    @app.get("/health")
    async def health() -> Response:
        if state.client.healthy:
            return JSONResponse(ok)
        body = {"status": "unhealthy", "error": _unhealthy_cause(state.client)}
        return error_response(503, body, RETRY_UNAVAILABLE_S)

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
    if client.info is None:
        return "engine starting"
    if not client.proc.is_alive():
        return f"engine process exited with code {client.proc.exitcode}"
    return "engine unhealthy"


def _add_generation_routes(
    app: FastAPI, state: ServerState, authorize: Callable[[Request], Awaitable[None]]
) -> None:
    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        check_model(state, body.model)
        prefill = await prefill_target(state, request)
        check_prompt_size(state, body.prompt)
        check_engine(state)
        ticket = state.admission.admit(state.metrics)
        with _ended_on_error(ticket):
            if isinstance(body.prompt, str):
                tokenizer = _text_tokenizer(state, "prompt")
                ids = await _off_loop(state, tokenizer.encode, body.prompt)
            else:
                ids = list(body.prompt)
            _check_logprobs(state, body.logprobs is not None)
            default = COMPLETION_DEFAULT_MAX_TOKENS
            max_new = max_new_tokens(state, body, len(ids), default, "prompt")
            check_vocab(state, ids)
            top = body.logprobs or 0
            run = RequestRun(
                state,
                ticket,
                ids,
                sampling_params(body, max_new),
                body.logprobs is not None,
                top,
                prefill,
            )
        if body.stream:
            return _sse(run.stream_completion(body), state.config.server.sse_keepalive_interval)
        return await until_done(request, run.complete_completion())

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: P.ChatCompletionRequest, request: Request) -> Response:
        check_model(state, body.model)
        prefill = await prefill_target(state, request)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_prompt_chars(state, sum(len(m["content"]) for m in messages), "messages")
        check_engine(state)
        ticket = state.admission.admit(state.metrics)
        with _ended_on_error(ticket):
            tokenizer = _text_tokenizer(state, "messages")
            ids = await _off_loop(state, _render_and_encode, tokenizer, messages)
            max_new = max_new_tokens(state, body, len(ids), None, "messages")
            check_vocab(state, ids)
            top = body.top_logprobs or 0 if body.logprobs else 0
            run = RequestRun(
                state, ticket, ids, sampling_params(body, max_new), body.logprobs, top, prefill
            )
        if body.stream:
            return _sse(run.stream_chat(body), state.config.server.sse_keepalive_interval)
        return await until_done(request, run.complete_chat())


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


def _text_tokenizer(state: ServerState, param: str) -> Tokenizer:
    if state.tokenizer is None:
        raise ApiError(
            400,
            "the server runs with --skip-tokenizer-init: send the prompt as token ids (a list "
            "of integers) to /v1/completions",
            param=param,
        )
    return state.tokenizer


def _check_logprobs(state: ServerState, wanted: bool) -> None:
    if wanted and state.tokenizer is None:
        raise ApiError(
            400,
            "logprobs name tokens by their text, which needs the tokenizer "
            "(--skip-tokenizer-init is on)",
            param="logprobs",
        )


def _render_and_encode(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    try:
        return tokenizer.encode_chat(messages)
    except ChatTemplateMissing as exc:
        raise ApiError(400, str(exc), param="messages") from None
    except jinja2.TemplateError as exc:
        raise ApiError(
            400, f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(  # keeps e.g. a 405's Allow header
            P.error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(EngineFailed)
    async def engine_failed(_: Request, exc: EngineFailed) -> Response:
        return unavailable(exc).response()


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


KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients and proxies read it, nobody shows it


def _sse(events: AsyncIterator[dict[str, Any]], keepalive_s: float) -> StreamingResponse:
    """Server-sent events; an error after the stream started becomes an `error` event. While
    the next event takes longer than `keepalive_s` (a long prompt prefilling) a comment line
    goes out every `keepalive_s`, so no idle timeout on the way cuts the stream."""

    async def body() -> AsyncIterator[str]:
        it = aiter(events)
        pending: asyncio.Future[dict[str, Any]] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(it))
                done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
                if not done:
                    yield KEEPALIVE
                    continue
                ready, pending = pending, None
                try:
                    event = ready.result()
                except StopAsyncIteration:
                    break
                yield f"data: {json.dumps(event)}\n\n"
        except (ApiError, EngineFailed) as exc:
            yield _error_event(exc)
        finally:  # the client went away: the request's own clean-up runs before this ends
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _error_event(exc: ApiError | EngineFailed) -> str:
    error = exc if isinstance(exc, ApiError) else unavailable(exc)
    body = P.error_body(error.message, error.kind, error.param, error.code)
    return f"data: {json.dumps(body)}\n\n"


async def _watch_failure(state: ServerState) -> None:
    """After the engine fails: answer for a moment (health says 503), then shut down."""
    while state.client.failure is None:
        await asyncio.sleep(0.2)
    log.error("engine failed: %s", state.client.failure.splitlines()[0])
    await asyncio.sleep(FAILURE_GRACE_S)
    if state.on_failure is not None:
        state.on_failure()
