"""Streams and events between the host and one worker's device (spec 01, "Streams").

Three streams per worker: the compute stream, on which the forward runs (whatever stream
is current where `ModelRunner.execute` runs: `device.ComputeStream`'s own on CUDA), a copy
stream for a batch's inputs, and the host, which waits on events only when it needs
values. Per batch:

    host:    build inputs, pack them into a persistent pinned buffer ─┐
    copy:    one non-blocking host->device copy ──────────────────────┴─ record `ready`
    compute: wait `ready` ── forward ── sample ── device->host into pinned buffers ── record `done`
    host:    ... schedules the next batch ...  wait `done` only when the tokens are needed

The pinned buffers (`StagingRing`) alternate, two of them, so that the next batch is packed
while the last one's copy may still be in flight; a buffer is packed again only after its
last copy's `ready` (an earlier batch's: done by then, as a rule).

A decode step that replays a CUDA graph (runner/cuda_graph.py) is packed the same way, but
when its forward starts, on the compute stream itself (`upload(here=True)`), and into the
graph's persistent input buffer rather than a new one: the previous step, queued before it,
may still be reading that buffer.

On a CPU every op has finished when it returns: no copy stream, no events, and the same
calls cost nothing. CUDA is reached through `CudaApi`, six one-line methods, so that tests
can drive the same protocol with a fake that checks the order of events.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from pipeserve.device import queues_on_streams
from pipeserve.timeline import now


class DeviceApi(Protocol):
    """What the protocol needs of a device runtime (torch.cuda, or a test's fake)."""

    def new_stream(self, device: torch.device) -> Any: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def use_stream(self, stream: Any) -> Any: ...  # a context manager
    def new_event(self, timing: bool) -> Any: ...
    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def pin(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...  # non-blocking H2D


class CudaApi:
    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def new_event(self, timing: bool) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)  # the allocator must not reuse it before `stream` is done

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


ALIGN = 16  # bytes: each tensor's place in a staging buffer (any dtype's view of it)


class StagingRing:
    """A worker's persistent pinned buffers for batch inputs, used in turn; each is packed
    again only once its last copy is done (the upload's `ready`, waited for on the host). A
    buffer whose upload is still being packed (another thread's) is skipped for a one-off
    one."""

    def __init__(self, api: DeviceApi, slots: int = 2) -> None:
        self.api = api
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.copied: list[Any] = [None] * slots  # the event after each one's last copy
        self.busy = [False] * slots  # packed by an upload not yet over
        self.turn = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[int | None, torch.Tensor]:
        """(its slot, a pinned uint8 buffer of at least `nbytes` free to pack); the slot is
        None for a one-off buffer. Give it back with `release`."""
        with self._lock:
            i, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
            if self.busy[i]:
                return None, self.api.pin(torch.empty(nbytes, dtype=torch.uint8))
            self.busy[i], event = True, self.copied[i]
        if event is not None:
            event.synchronize()
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:  # grown, by half again, seldom
            size = max(nbytes + nbytes // 2, 1 << 16)
            buf = self.buffers[i] = self.api.pin(torch.empty(size, dtype=torch.uint8))
        return i, buf

    def release(self, slot: int, copied: Any) -> None:
        """The slot's upload is over; `copied`: the event its copy ends at."""
        with self._lock:
            self.copied[slot], self.busy[slot] = copied, False


class Upload:
    """Inputs of one batch on their way to the device: `move()` takes its host tensors,
    packs them into a staging buffer and queues one copy of them all on the copy stream;
    `ready` (an event, None on a CPU) marks its end. `tensors` lists what was copied, for
    `DeviceStreams.wait`."""

    def __init__(
        self, device: torch.device, api: DeviceApi | None, ring: StagingRing | None = None
    ) -> None:
        self.device, self.api, self.ring = device, api, ring
        self.ready: Any = None
        self.tensors: list[torch.Tensor] = []
        self.slots: list[int] = []  # the staging buffers it packed

    def move(
        self, hosts: Sequence[torch.Tensor], into: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The tensors on the device: views of one buffer filled by one copy. `into`: that
        buffer (uint8, persistent: a CUDA graph's inputs), else a new one; the tensors lie
        in it in order at `places`, so a tensor lies where any list of the same sizes before
        it put it."""
        at, end = places(hosts)
        if into is not None and into.numel() < end:
            raise ValueError(f"{end} bytes of inputs do not fit a buffer of {into.numel()}")
        if self.api is None or self.ring is None:  # a CPU: no copy to make
            if into is None:
                return [h.to(self.device) for h in hosts]
            staging = dest = into
        else:
            slot, staging = self.ring.take(end)
            if slot is not None:
                self.slots.append(slot)
            dest = (
                into
                if into is not None
                else torch.empty(end, dtype=torch.uint8, device=self.device)
            )
        for h, start in zip(hosts, at, strict=True):
            nbytes = h.numel() * h.element_size()
            staging[start : start + nbytes].view(h.dtype).copy_(h.reshape(-1))
        if self.api is not None:
            self.api.upload(dest[:end], staging[:end])
            if into is None:
                self.tensors.append(dest)
        return views(dest, hosts)


def views(buffer: torch.Tensor, hosts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors shaped as `hosts` over uint8 `buffer`, each at its `places` offset."""
    at, _ = places(hosts)
    return [
        buffer[a : a + h.numel() * h.element_size()].view(h.dtype).view(h.shape)
        for h, a in zip(hosts, at, strict=True)
    ]


def places(hosts: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Where `Upload.move` puts each tensor in its buffer (byte offsets, each at an ALIGN
    boundary), and the bytes they take in all."""
    at, end = [], 0
    for h in hosts:
        at.append(end)
        end += -(-h.numel() * h.element_size() // ALIGN) * ALIGN
    return at, end


class HostCopy:
    """Device tensors copied to the host without blocking it; `get()` waits for them (on a
    CPU they are the tensors themselves, ready at once)."""

    def __init__(self, tensors: list[torch.Tensor], done: Any = None) -> None:
        self._tensors, self._done = tensors, done

    def get(self) -> list[torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()  # this batch's copies only, never the whole device
            self._done = None
        return self._tensors


class StageTimer:
    """A forward's duration. On a CPU: wall time (ops are synchronous). On a device: events
    on the compute stream around the forward, read once the host waits for the batch anyway;
    the start is the launch's wall time."""

    def __init__(self, api: DeviceApi | None, stream: Any) -> None:
        self.api, self.stream = api, stream
        self.start_wall = now()
        self.end_wall: float | None = None
        self._events: tuple[Any, Any] | None = None
        if api is not None:
            start = api.new_event(timing=True)
            start.record(stream)
            self._events = (start, api.new_event(timing=True))

    def stop(self) -> None:
        if self._events is None:
            self.end_wall = now()
        else:
            self._events[1].record(self.stream)

    def seconds(self) -> float:
        """The forward's seconds; on a device, waits for the end event."""
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            self.end_wall = self.start_wall + start.elapsed_time(end) / 1000
            self._events = None
        assert self.end_wall is not None, "stop() the timer first"
        return self.end_wall - self.start_wall


class DeviceStreams:
    """One worker's copy stream and the events that order it against the compute stream."""

    def __init__(self, device: torch.device, api: DeviceApi | None = None) -> None:
        if api is None and queues_on_streams(device):
            api = CudaApi()
        self.device, self.api = device, api
        self.copy_stream = api.new_stream(device) if api is not None else None
        self.staging = StagingRing(api) if api is not None else None

    @contextmanager
    def upload(self, here: bool = False) -> Iterator[Upload]:
        """Build a batch's inputs inside: copies (and any device op) go to the copy stream,
        whose `ready` event is recorded on the way out. `here`: on the current stream
        instead, ordered after what was queued there (what a CUDA graph's persistent
        buffers need: the last step may still read them); nothing then has to wait for
        `ready`, which only frees the staging buffer."""
        up = Upload(self.device, self.api, self.staging)
        if self.api is None:
            yield up
            return
        stream = self.api.current_stream(self.device) if here else self.copy_stream
        with self.api.use_stream(stream):
            try:
                yield up
            finally:  # also when preparing failed: a copy may be in flight
                up.ready = self.api.new_event(timing=False)
                up.ready.record(stream)
                for slot in up.slots:
                    assert self.staging is not None
                    self.staging.release(slot, up.ready)

    def wait(self, ready: Any, tensors: Sequence[torch.Tensor] = ()) -> None:
        """The compute (current) stream waits for an upload's copies; without blocking the
        host. Its tensors are marked in use by the compute stream until it is past them."""
        if self.api is None or ready is None:
            return
        compute = self.api.current_stream(self.device)
        compute.wait_event(ready)
        for t in tensors:
            self.api.keep_for(t, compute)

    def timer(self) -> StageTimer:
        stream = self.api.current_stream(self.device) if self.api is not None else None
        return StageTimer(self.api, stream)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """Queue device->host copies of `tensors` on the compute stream, into pinned buffers,
        and record the event `HostCopy.get` waits on."""
        if self.api is None:
            return HostCopy(list(tensors))
        compute = self.api.current_stream(self.device)
        out = []
        for t in tensors:
            host = self.api.pin(torch.empty(t.shape, dtype=t.dtype))
            host.copy_(t, non_blocking=True)
            out.append(host)
        done = self.api.new_event(timing=False)
        done.record(compute)
        return HostCopy(out, done)
