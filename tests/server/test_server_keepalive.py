"""A streamed response that stays silent (a long prompt prefilling) sends an SSE comment line
every --sse-keepalive-interval seconds until its next event, so that no idle timeout of the
client, a proxy or the PD router cuts it; the events themselves are those of a stream without
the wait; a client gone while the comments flow is one abort that frees its admission; the
interval must be positive. In-process (fake engine)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from fake_engine import (
    NAME,
    call_then_disconnect,
    make_state,
    metric,
    running_app,
    serving,
    wait_until,
)

from pipeserve.config import EngineConfig, SettingsError
from pipeserve.server.app import KEEPALIVE

pytestmark = pytest.mark.timeout(60)

COMPLETION = {"model": NAME, "prompt": "hello", "max_tokens": 3, "stream": True}
CHAT = {
    "model": NAME,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "stream": True,
}
INTERVAL = 0.05
WAIT = 0.4  # the "prefill": at least 4 intervals without an event


def events(text: str) -> list[dict[str, Any]]:
    """The data events of an SSE body, ids and timestamps dropped."""
    out = []
    for part in text.split("\n\n"):
        if part.startswith("data: {"):
            event = json.loads(part[6:])
            event.pop("id"), event.pop("created")
            out.append(event)
    return out


def stream(path: str, body: dict[str, Any], wait_s: float) -> str:
    """The body of one streamed request whose engine holds it for `wait_s` seconds."""
    state = make_state(sse_keepalive_interval=INTERVAL)
    engine: Any = state.client

    async def go() -> str:
        engine.gate = asyncio.Event()
        async with serving(state) as http:
            asyncio.get_running_loop().call_later(wait_s, engine.gate.set)
            r = await http.post(path, json=body)
            assert r.status_code == 200
            return r.text

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_a_silent_stream_sends_comments_until_its_events(path: str, body: dict) -> None:
    quick = stream(path, body, 0.0)
    slow = stream(path, body, WAIT)
    assert KEEPALIVE not in quick
    parts = [p + "\n\n" for p in slow.split("\n\n") if p]
    kinds = "".join("c" if p == KEEPALIVE else "d" for p in parts)
    # comments while the engine holds the request (after a chat's opening event), then the
    # events; one every 0.05 s of a 0.4 s wait (a loaded machine may send fewer, never none)
    opening = "d" if path == "/v1/chat/completions" else ""
    assert re.fullmatch(opening + r"c+d+", kinds), kinds
    assert 2 <= kinds.count("c") <= WAIT / INTERVAL + 1
    assert events(slow) == events(quick) and slow.endswith("data: [DONE]\n\n")


def test_a_client_gone_while_comments_flow_is_one_abort() -> None:
    state = make_state(sse_keepalive_interval=INTERVAL)
    engine: Any = state.client

    async def go() -> list[dict[str, Any]]:
        engine.gate = asyncio.Event()  # never opened: the request runs until the client goes
        gone = asyncio.Event()
        async with running_app(state) as app:
            task = asyncio.create_task(
                call_then_disconnect(app, "/v1/completions", COMPLETION, gone)
            )
            await wait_until(lambda: engine.running == 1)
            await asyncio.sleep(WAIT)
            gone.set()
            sent = await asyncio.wait_for(task, 5)
            await wait_until(lambda: engine.running == 0)
            await asyncio.sleep(0.05)  # a second count would come now
            return sent

    sent = asyncio.run(go())
    bodies = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    assert bodies.count(KEEPALIVE.encode()) >= 2
    assert metric(state, "pipeserve_requests_total", finish_reason="abort") == 1
    assert state.admission.active == 0


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(SettingsError, match="--sse-keepalive-interval must be positive"):
        EngineConfig.from_flags(sse_keepalive_interval=0)
