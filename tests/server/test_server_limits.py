"""Work bounds in-process (fake engine): bodies over --max-request-bytes get 413 (by
Content-Length or while a chunked body arrives); tokenization and chat templates run off the
event loop (/health answers while a prompt is being tokenized), at most
TOKENIZE_CONCURRENCY at once; an oversized prompt is rejected without being tokenized."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fake_engine import NAME, error_of, make_state, serving, wait_until

from pipeserve.config import ServerConfig
from pipeserve.server.state import ServerState

pytestmark = pytest.mark.timeout(60)

LIMIT = 4096
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": NAME, "prompt": "hello", "max_tokens": 2},
}
BLOCK_S = 5.0  # how long a blocked tokenizer waits at most (a test that fails, fails fast)


def sized_body(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes."""
    base = {"model": NAME, "prompt": "", "max_tokens": 1}
    pad = size - len(json.dumps(base))
    return json.dumps({**base, "prompt": "x" * pad}).encode()


async def chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def post_bytes(state: ServerState, data: bytes, chunked: bool) -> httpx.Response:
    async def go() -> httpx.Response:
        async with serving(state) as http:
            content: Any = chunks(data) if chunked else data
            headers = {"content-type": "application/json"}
            return await http.post("/v1/completions", content=content, headers=headers)

    return asyncio.run(go())


def test_max_request_bytes_default_is_64_mib() -> None:
    assert ServerConfig().max_request_bytes == 64 * 2**20


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_limit_is_413_with_an_error_body(chunked: bool) -> None:
    state = make_state(max_request_bytes=LIMIT)
    r = post_bytes(state, sized_body(LIMIT + 1), chunked)
    assert r.status_code == 413, r.text
    assert "--max-request-bytes" in error_of(r)["message"]
    assert not state.client.requests  # type: ignore[attr-defined]


@pytest.mark.parametrize("chunked", [False, True])
def test_body_at_the_limit_is_served(chunked: bool) -> None:
    r = post_bytes(make_state(max_request_bytes=LIMIT), sized_body(LIMIT), chunked)
    assert r.status_code == 200, r.text


def test_streamed_responses_pass_the_body_limit() -> None:
    async def go() -> httpx.Response:
        async with serving(make_state(max_request_bytes=LIMIT)) as http:
            return await http.post("/v1/chat/completions", json={**CHAT, "stream": True})

    r = asyncio.run(go())
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")


class BlockingTokenizer:
    """Wraps the fake tokenizer: the chat template (or encode) blocks until released."""

    def __init__(self, state: ServerState, method: str) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.finished = threading.Event()
        self.inside = self.peak = 0
        self._lock = threading.Lock()
        original = getattr(state.tokenizer, method)

        def blocking(arg: Any) -> Any:
            with self._lock:
                self.inside += 1
                self.peak = max(self.peak, self.inside)
            self.entered.set()
            self.release.wait(BLOCK_S)  # on the event loop, this would stall every request
            with self._lock:
                self.inside -= 1
            self.finished.set()
            return original(arg)

        setattr(state.tokenizer, method, blocking)


@pytest.mark.parametrize(
    ("path", "method"),
    [("/v1/chat/completions", "apply_chat_template"), ("/v1/completions", "encode")],
)
def test_health_answers_while_a_prompt_is_tokenized(path: str, method: str) -> None:
    state = make_state()
    slow = BlockingTokenizer(state, method)

    async def go() -> tuple[httpx.Response, bool, httpx.Response]:
        async with serving(state) as http:
            request = asyncio.create_task(http.post(path, json=BODIES[path]))
            await wait_until(slow.entered.is_set)
            health = await http.get("/health")
            tokenizing = not slow.finished.is_set()  # /health answered in the meantime
            slow.release.set()
            return health, tokenizing, await request

    health, tokenizing, r = asyncio.run(go())
    assert health.status_code == 200
    assert tokenizing, "/health waited for the tokenizer: it ran on the event loop"
    assert r.status_code == 200, r.text


def test_tokenization_concurrency_is_bounded() -> None:
    state = make_state()
    state.tokenize_slots = asyncio.Semaphore(2)
    slow = BlockingTokenizer(state, "apply_chat_template")

    async def go() -> list[httpx.Response]:
        async with serving(state) as http:
            chat = "/v1/chat/completions"
            tasks = [asyncio.create_task(http.post(chat, json=CHAT)) for _ in range(3)]
            await wait_until(lambda: slow.inside == 2)
            await asyncio.sleep(0.2)  # a third would have entered by now
            inside = slow.inside
            slow.release.set()
            assert inside == 2
            return await asyncio.gather(*tasks)

    assert [r.status_code for r in asyncio.run(go())] == [200] * 3
    assert slow.peak == 2


def test_ten_megabyte_prompt_is_400_without_tokenizing_it() -> None:
    state = make_state()

    async def go() -> httpx.Response:
        async with serving(state) as http:
            body = {"model": NAME, "prompt": "x" * 10_000_000, "max_tokens": 1}
            return await http.post("/v1/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 400
    assert error_of(r)["code"] == "context_length_exceeded"
    assert state.tokenizer.encoded == []  # type: ignore[attr-defined]
