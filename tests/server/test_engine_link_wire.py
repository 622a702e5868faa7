"""The HTTP server <-> engine process link decodes with the fixed msgpack schema: garbage and
a pickle (which would run code if unpickled) arriving on the engine's inbox are dropped with
a warning and change nothing, and the next valid message is still served."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import zmq

from pipeserve.distributed.messages import TO_ENGINE, Abort, StopEngine
from pipeserve.server.engine_process import EngineLoop

pytestmark = pytest.mark.timeout(60)


class Marker:
    """Unpickling this creates a file: the proof that bytes were unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


class FakeBackend:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def test_garbage_and_pickles_on_the_engine_inbox_are_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = zmq.Context()
    inbox, sender = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind("inproc://engine-inbox")
    sender.connect("inproc://engine-inbox")
    loop = EngineLoop.__new__(EngineLoop)  # only the intake under test
    loop.inbox, loop.backend, loop.streams, loop.running = inbox, FakeBackend(), {}, True
    loop.transfers = None  # not a decode server
    marker = tmp_path / "unpickled"
    try:
        sender.send(b"\x00\xffnot msgpack")
        sender.send(pickle.dumps(Marker(str(marker))))
        sender.send(pickle.dumps(StopEngine()))  # a valid message, pickled: still refused
        sender.send(TO_ENGINE.encode(Abort("r1")))
        with caplog.at_level(logging.WARNING):
            loop._intake(block=True)
        assert not marker.exists(), "a message was unpickled"
        assert loop.running, "a pickled shutdown was obeyed"
        assert loop.backend.aborted == ["r1"]  # the valid message after them still served
        assert sum("dropped a malformed message" in r.message for r in caplog.records) == 3
    finally:
        ctx.destroy(linger=0)
