"""In-process HTTP tests: the real FastAPI app over a fake engine client and a fake
tokenizer, driven through httpx's ASGI transport (no processes; each test takes
milliseconds)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import FastAPI

from pipeserve.config import EngineConfig
from pipeserve.distributed.messages import EngineReady
from pipeserve.scheduler.output import StreamDelta
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server.app import create_app
from pipeserve.server.engine_client import EngineFailed
from pipeserve.server.state import ServerState

NAME = "tiny"


class FakeTokenizer:
    """One token per UTF-8 byte; records the length of every text it encodes."""

    eos_token_ids = (0,)

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return [1 + b % 200 for b in text.encode("utf-8")]  # raises on a lone surrogate

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def decode(self, ids: list[int]) -> str:
        return "a" * len(ids)

    def token_bytes(self, token_id: int) -> bytes:
        return b"a"

    def token_text(self, token_id: int) -> str:
        return "a"


class FakeProc:
    def __init__(self) -> None:
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None


class FakeEngine:
    """Stands in for EngineClient. A request gets a progress delta for each of `progress`,
    waits for `gate` (when there is one), then gets `tokens` one-token deltas, or one error
    delta when `error` = (message, kind)."""

    def __init__(self, context_len: int = 4096, vocab_size: int = 512) -> None:
        self.info = EngineReady(context_len, vocab_size, "fake")
        self.failure: str | None = None
        self.stats: dict[str, Any] = {}
        self.proc = FakeProc()
        self.tokens = 3
        self.progress: list[int] = []  # prompt tokens done after each prompt chunk but the last
        self.gate: asyncio.Event | None = None
        self.error: tuple[str, str] | None = None
        self.requests: list[list[int]] = []
        self.streams: list[AsyncGenerator[StreamDelta, None]] = []
        self.running = 0  # generators started and not ended (EngineClient.num_active)
        self.peak = 0

    @property
    def healthy(self) -> bool:
        return self.failure is None and self.proc.is_alive() and self.info is not None

    @property
    def num_active(self) -> int:
        return self.running

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def fail_all(self, message: str) -> None:
        pass

    def generate(
        self,
        ids: list[int],
        sampling: SamplingParams,
        logprobs: bool,
        top: int,
        transfer: Any = None,
        prefill_url: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """A request's deltas. The fake keeps every stream: only closing it, never the
        garbage collector, ends it (as with a server that holds on to it)."""
        stream = self._generate(ids)
        self.streams.append(stream)
        return stream

    async def _generate(self, ids: list[int]) -> AsyncGenerator[StreamDelta, None]:
        if self.failure is not None:
            raise EngineFailed(self.failure)
        self.requests.append(ids)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            for done in self.progress:
                yield StreamDelta("r", prompt_tokens=len(ids), prefilled=done)
            if self.gate is not None:
                await self.gate.wait()
            for d in self._deltas(len(ids)):
                yield d
                await asyncio.sleep(0)
        finally:
            self.running -= 1

    def _deltas(self, prompt_tokens: int) -> list[StreamDelta]:
        if self.error is not None:
            message, kind = self.error
            return [StreamDelta("r", finish_reason="error", error=message, error_kind=kind)]
        return [
            StreamDelta(
                "r",
                text="a",
                token_ids=[97],
                logprobs=[-0.5],
                finish_reason="length" if i == self.tokens - 1 else None,
                prompt_tokens=prompt_tokens,
                completion_tokens=i + 1,
            )
            for i in range(self.tokens)
        ]


def make_state(**flags: Any) -> ServerState:
    config = EngineConfig.from_flags(served_model_name=NAME, **flags)
    return ServerState(config, FakeEngine(), FakeTokenizer(), NAME)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_app(state: ServerState) -> AsyncIterator[FastAPI]:
    """The app over `state`, its lifespan entered."""
    app = create_app(state)
    async with app.router.lifespan_context(app):
        yield app


@contextlib.asynccontextmanager
async def serving(state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the running app over `state`."""
    async with running_app(state) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pipeserve") as http:
            yield http


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0) -> None:
    """Yield to the loop until `predicate()` holds (fails after `timeout_s`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {predicate}"
        await asyncio.sleep(0.01)


async def call_then_disconnect(
    app: FastAPI, path: str, body: dict[str, Any], disconnect: asyncio.Event
) -> list[dict[str, Any]]:
    """Drive the app with raw ASGI: send `body`, then report the client gone once
    `disconnect` is set; the messages the app sent back."""
    data = json.dumps(body).encode()
    pending = [{"type": "http.request", "body": data, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))],
        "server": ("pipeserve", 80),
        "client": ("client", 1234),
    }
    with contextlib.suppress(asyncio.CancelledError):
        await app(scope, receive, send)
    return sent


def metric(state: ServerState, name: str, **labels: str) -> float:
    value = state.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The `error` object of an OpenAI-style error body."""
    body = r.json()
    assert isinstance(body.get("error"), dict), body
    return body["error"]
