"""One admitted request's life: its deltas from the engine, the metrics they feed, and its
OpenAI responses (completion and chat, whole or streamed, with logprobs)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

from pipeserve.scheduler.output import StreamDelta
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server import protocol as P
from pipeserve.server.admission import Ticket
from pipeserve.server.engine_client import EngineFailed
from pipeserve.server.errors import ApiError, unavailable
from pipeserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pipeserve.server.state import ServerState


class RequestRun:
    """One admitted request's life: its deltas (it owns the admission ticket from here on:
    the ticket ends when the deltas end, or, if they never start, when the run is
    collected) and the OpenAI response shapes."""

    def __init__(
        self,
        state: ServerState,
        ticket: Ticket,
        ids: list[int],
        params: SamplingParams,
        logprobs: bool,
        top: int,
        prefill_url: str | None = None,
    ) -> None:
        """`prefill_url`: a decode server's request whose prompt that prefill server (one it
        was configured with: http.prefill_target) computes (prefill/decode disaggregation)."""
        self.state, self.ticket, self.ids, self.params = state, ticket, ids, params
        self.logprobs, self.top = logprobs, top
        self.prefill_url = prefill_url
        self.id = P.new_id("cmpl")
        self.created = P.now()
        self.start = time.perf_counter()
        self.last_token_at: float | None = None
        finalizer = weakref.finalize(self, ticket.end_soon, asyncio.get_running_loop())
        finalizer.atexit = False

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        reason = "abort"  # unless the engine says how the request ended
        deltas = self.state.client.generate(
            self.ids, self.params, self.logprobs, self.top, prefill_url=self.prefill_url
        )
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
            "id": self._id(kind),
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
        body: P.CompletionRequest | P.ChatCompletionRequest,
        choice: Callable[[StreamDelta, _Logprobs, int], dict[str, Any]],
    ) -> AsyncIterator[dict[str, Any]]:
        """One chunk per delta that has something to show, then the usage chunk if asked;
        the prompt's progress if asked."""
        lps = _Logprobs(self.state.tokenizer)
        ids_only = self.state.tokenizer is None
        async for d in self.deltas():
            if d.prefilled is not None:  # a prompt chunk done, no token
                if body.include_progress:
                    yield self._progress(kind, d)
                continue
            if not (d.text or d.finish_reason or self.logprobs or (ids_only and d.token_ids)):
                continue  # text held back (a partial character or stop string)
            start = len(lps.ids)
            lps.add(d)
            yield self._envelope(kind, [choice(d, lps, start)])
            if d.finish_reason is not None and body.include_usage:
                yield self._envelope(kind, [], final=d)

    def _id(self, kind: str) -> str:
        return self.id.replace("cmpl", "chatcmpl") if kind.startswith("chat") else self.id

    def _progress(self, kind: str, d: StreamDelta) -> dict[str, Any]:
        """A `prefill.progress` chunk (pipeserve's, asked for by
        `stream_options.include_progress`): the prompt tokens computed so far, of all."""
        return {
            "id": self._id(kind),
            "object": "prefill.progress",
            "created": self.created,
            "model": self.state.model_name,
            "prefilled_tokens": d.prefilled,
            "prompt_tokens": d.prompt_tokens,
        }

    # -- /v1/completions -----------------------------------------------------------------

    async def complete_completion(self) -> dict[str, Any]:
        text, final, lps = await self._collect()
        choice = {
            "index": 0,
            "text": text,
            "finish_reason": _finish(final),
            "logprobs": lps.completion() if self.logprobs else None,
            **self._token_ids(lps.ids),
        }
        return self._envelope("text_completion", [choice], final=final)

    def _token_ids(self, ids: list[int]) -> dict[str, list[int]]:
        """Under --skip-tokenizer-init a completion carries its tokens as ids (a pipeserve
        field beside OpenAI's empty text)."""
        return {"token_ids": list(ids)} if self.state.tokenizer is None else {}

    def stream_completion(self, body: P.CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        def choice(d: StreamDelta, lps: _Logprobs, start: int) -> dict[str, Any]:
            return {
                "index": 0,
                "text": d.text,
                "finish_reason": _finish(d),
                "logprobs": lps.completion(start) if self.logprobs else None,
                **self._token_ids(d.token_ids),
            }

        return self._stream("text_completion", body, choice)

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
        async for chunk in self._stream("chat.completion.chunk", body, choice):
            yield chunk


class _Logprobs:
    """Logprobs of a request's tokens in the OpenAI shapes. Tokens are named by their own
    bytes (a token holding part of a character shows as \\xNN escapes), so alternatives
    never collide; `text_offset` is each token's position in the decoded completion."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer  # None: only ids are collected (logprobs were refused)
        self.ids: list[int] = []
        self.values: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []

    def add(self, d: StreamDelta) -> None:
        self.ids += d.token_ids
        self.values += d.logprobs
        self.tops += d.top_logprobs or [[] for _ in d.token_ids]

    def completion(self, start: int = 0) -> dict[str, Any]:
        assert self.tokenizer is not None
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
        tok = self.tokenizer
        assert tok is not None

        def entry(token: int, value: float) -> dict[str, Any]:
            return {
                "token": tok.token_text(token),
                "logprob": value,
                "bytes": list(tok.token_bytes(token)),
            }

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
    return unavailable(str(d.error))


def _finish(d: StreamDelta) -> str | None:
    if d.finish_reason in (None, "stop", "length"):
        return d.finish_reason
    return "abort" if d.finish_reason == "abort" else d.finish_reason
