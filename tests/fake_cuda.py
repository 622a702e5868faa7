"""A stand-in for torch.cuda's streams and events (`pipeserve.streams.DeviceApi`), so that
the host/device protocol can be driven and checked on a CPU. Tensors stay on the CPU (every
op has finished when it returns); what the fake checks is the order of the protocol:

- an event is waited on (by a stream or the host) only after it was recorded;
- every wait, record and pin is logged as a tuple, in order, in `FakeApi.log`:
  ("record", event, stream), ("stream_wait", stream, event), ("host_wait", event),
  ("keep", stream), ("pin",), ("upload", bytes, stream) (a host-to-device copy).

Streams are named: "copy" for one made with `new_stream` (a worker's copy stream), and
"default:<thread name>" for a thread's own current stream (the compute stream is the one
current where the forward runs)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class FakeStream:
    name: str
    api: FakeApi

    def wait_event(self, event: FakeEvent) -> None:
        assert event.stream is not None, f"{self.name} waits on an event never recorded"
        self.api.log.append(("stream_wait", self.name, event.id))


@dataclass(eq=False)
class FakeEvent:
    id: int
    timing: bool
    api: FakeApi
    stream: str | None = None
    at: float = 0.0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.at = stream.name, time.perf_counter()
        self.api.log.append(("record", self.id, stream.name))

    def synchronize(self) -> None:
        assert self.stream is not None, "the host waits on an event never recorded"
        self.api.log.append(("host_wait", self.id))

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing, "elapsed_time needs timing events"
        assert self.stream is not None and end.stream is not None, "record both events first"
        return (end.at - self.at) * 1000


@dataclass(eq=False)
class FakeApi:
    log: list[tuple[Any, ...]] = field(default_factory=list)
    events: dict[int, FakeEvent] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _local: threading.local = field(default_factory=threading.local)

    def new_stream(self, device: torch.device) -> FakeStream:
        return FakeStream("copy", self)

    def current_stream(self, device: torch.device) -> FakeStream:
        current = getattr(self._local, "stream", None)
        return current or FakeStream(f"default:{threading.current_thread().name}", self)

    @contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def new_event(self, timing: bool) -> FakeEvent:
        event = FakeEvent(next(self._ids), timing, self)
        self.events[event.id] = event
        return event

    def keep_for(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("keep", stream.name))

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        self.log.append(("pin",))
        return tensor

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream(dst.device)
        self.log.append(("upload", src.numel() * src.element_size(), stream.name))
        dst.copy_(src)
