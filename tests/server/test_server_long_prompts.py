"""Long prompts over HTTP. A streamed response that stays silent (a long prompt prefilling)
sends an SSE comment line every --sse-keepalive-interval seconds until its next event, so that
no idle timeout of the client, a proxy or the PD router cuts it; the events themselves are
those of a stream without the wait; a client gone while the comments flow is one abort that
frees its admission; the interval must be positive. A stream asked for
`stream_options.include_progress` gets a `prefill.progress` chunk for each prompt chunk the
engine reports; without it, or unstreamed, the engine's progress changes nothing. A PD
decode server reports on /health how long a request may wait there for its prefill (what the
router adds to its time limit). In-process (fake engine)."""

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


def run(path: str, body: dict[str, Any], progress: list[int]) -> str:
    state = make_state()
    engine: Any = state.client
    engine.progress = progress

    async def go() -> str:
        async with serving(state) as http:
            r = await http.post(path, json=body)
            assert r.status_code == 200
            return r.text

    return asyncio.run(go())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_asked_for_progress_gets_the_prompt_s_progress(path: str) -> None:
    body = COMPLETION if path == "/v1/completions" else CHAT
    plain = events(run(path, body, []))
    asked = {**body, "stream_options": {"include_progress": True, "include_usage": True}}
    got = events(run(path, asked, [2048, 4096]))
    progress = [e for e in got if e["object"] == "prefill.progress"]
    prompt_tokens = got[-1]["usage"]["prompt_tokens"]
    assert [(e["prefilled_tokens"], e["prompt_tokens"]) for e in progress] == [
        (2048, prompt_tokens),
        (4096, prompt_tokens),
    ]
    assert all(e["model"] == NAME for e in progress)
    usage = events(run(path, {**body, "stream_options": {"include_usage": True}}, []))
    assert [e for e in got if e["object"] != "prefill.progress"] == usage
    first_chunk = next(i for i, e in enumerate(got) if e["object"] != "prefill.progress")
    assert path.endswith("chat/completions") or first_chunk == len(progress)
    # not asked for, with logprobs (whose chunks go out even without text), or unstreamed:
    # the progress shows nowhere
    assert events(run(path, body, [2048, 4096])) == plain
    logprobs = {"logprobs": 1} if path == "/v1/completions" else {"logprobs": True}
    with_lps = {**body, **logprobs}
    assert events(run(path, with_lps, [2048])) == events(run(path, with_lps, []))
    unstreamed = {**body, "stream": False}
    whole, quiet = json.loads(run(path, unstreamed, [2048])), json.loads(run(path, unstreamed, []))
    for answer in (whole, quiet):
        answer.pop("id"), answer.pop("created")
    assert whole == quiet


def test_a_pd_decode_server_reports_its_prefill_wait_on_health() -> None:
    """What the PD router adds to its time limit: the prefill timeout and the KV transfer's
    (twice: the room outlives the request's deadline by one); other servers report none."""
    key = "9c41e07a2b5d83f6e1a4c2b9d07f5e38"
    flags = {
        "disaggregation_mode": "decode",
        "disaggregation_auth_key": key,
        "disaggregation_prefill_timeout": 100.0,
        "disaggregation_transfer_timeout": 7.0,
    }
    for state, want in ((make_state(**flags), 114.0), (make_state(), None)):

        async def health(state: Any = state) -> dict[str, Any]:
            async with serving(state) as http:
                return (await http.get("/health")).json()

        body = asyncio.run(health())
        assert body["status"] == "ok" and body.get("prefill_wait_s") == want
