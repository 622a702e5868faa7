"""The decode engine's prefill calls run as tasks on a loop of their own thread: a finished
call's first token (or failure) is collected once; a call that raises something else fails
its request alone; a cancelled call's task is cancelled (its connection would close: the
prefill server aborts the prompt); shutdown ends the thread."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pipeserve.disaggregation.pd.prefill_client import (
    First,
    PrefillCall,
    PrefillCalls,
    PrefillFailed,
)
from pipeserve.scheduler.request import SamplingParams

pytestmark = pytest.mark.timeout(30)


class FakeClient:
    """Answers by the destination's "do": "token", "refuse", "break" or "hang"."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def call(self, call: PrefillCall, destination: dict[str, Any]) -> First:
        match destination["do"]:
            case "token":
                return (len(call.input_ids), -0.5, [])
            case "refuse":
                raise PrefillFailed("refused", invalid=True)
            case "break":
                raise RuntimeError("a bug")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.append(destination["room"])
            raise
        raise AssertionError("not cancelled")


def collect(calls: PrefillCalls, n: int) -> dict[str, First | PrefillFailed]:
    out: dict[str, First | PrefillFailed] = {}
    deadline = time.monotonic() + 10
    while len(out) < n:
        assert time.monotonic() < deadline, out
        out.update(calls.done())
        time.sleep(0.01)
    return out


def test_calls_end_cancel_and_shut_down() -> None:
    client = FakeClient()
    calls = PrefillCalls(client)  # type: ignore[arg-type]
    call = PrefillCall("http://p:1", [1, 2, 3], SamplingParams(), False, 0)
    for rid in ("ok", "refused", "broken", "slow"):
        do = {"ok": "token", "refused": "refuse", "broken": "break", "slow": "hang"}[rid]
        calls.start(rid, call, {"do": do, "room": rid})
    got = collect(calls, 3)
    assert got["ok"] == (3, -0.5, [])
    refused, broken = got["refused"], got["broken"]
    assert isinstance(refused, PrefillFailed) and refused.invalid
    assert isinstance(broken, PrefillFailed) and not broken.invalid and "a bug" in str(broken)
    assert calls.done() == [] and list(calls.calls) == ["slow"]  # each collected once
    calls.cancel("slow")
    deadline = time.monotonic() + 10
    while client.cancelled != ["slow"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert calls.done() == []  # a cancelled call is nobody's answer
    calls.shutdown()
    assert not calls._thread.is_alive()
