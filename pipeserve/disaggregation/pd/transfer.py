"""The KV transfer engine of prefill/decode disaggregation (spec 05): the prefill side's
workers send each layer's KV of a prompt chunk as soon as that layer's forward has written
it, straight into pages the decode side reserved; the decode side hears when all of a
request's KV has arrived.

The interface is three objects, one backend (`tcp`, ZeroMQ over TCP: it works between
local processes and between machines, and a peer that dies or restarts breaks nothing
beyond its own requests, where a torch.distributed group spanning both sides would fail
for good and tie their start-up together). An RDMA engine would implement the same three:

- `KVReceiver`, one per decode worker: registers its KV pool, accepts `open(room, slots)`
  and `close(room)` from its engine process, writes arriving KV into the room's slots and
  reports the room done once every piece it expects has come. Data for a room that is not
  open (never, or no longer: an aborted request whose pages went to someone else) is
  dropped, so a late or duplicated message can never write into another request's pages.
- `ReceiverControl`, in the decode engine process: opens and closes a room on every
  decode rank (waiting for each to confirm, so a closed room's pages are safe to reuse)
  and collects the done notices.
- `KVSender`, one per prefill worker: for a batch's slices that carry a `KVDestination`,
  copies its share of a layer's new KV (`kv_remap.plan`: its layers x heads needed by each
  decode rank) out of the pool and queues it to a sender thread, which never blocks the
  forward; a destination that stops taking data is given up after a timeout and the
  request's queued messages are dropped (bounded memory, nothing stranded).

A room is a random 128-bit id the decode side makes: it is also the capability that lets a
prefill worker write into those pages.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import zmq

from pipeserve.context_parallel.layout import PageStriping, runs_of
from pipeserve.disaggregation.pd.kv_remap import KVDestination, Piece, Rank, SideLayout, plan
from pipeserve.layers.attention import gather_index
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.scheduler.batch import Run, ScheduledBatch, runs_prefix

log = logging.getLogger(__name__)

SEND_HWM = 64  # messages queued per destination before a send waits
CONTROL_TIMEOUT_S = 10.0  # a decode rank must confirm open/close within this
MAX_FAILED_ROOMS = 4096  # given-up rooms a sender remembers (to drop their later messages)


def new_room() -> str:
    return secrets.token_hex(16)


def slot_index(runs: list[Run]) -> torch.Tensor:
    """The slot of every position covered by `runs`, in order."""
    return gather_index([runs], torch.device("cpu"))[0][0]


# -- the prefill side ------------------------------------------------------------------------


@dataclass
class _Outgoing:
    endpoint: str
    room: str
    frames: list[Any]


class KVSender:
    """A prefill worker's sends: `begin(batch)` before a forward, then, as the model's layer
    hook, `after(n)` after the stage's n-th layer."""

    def __init__(
        self,
        pool: KVPool,
        layout: SideLayout,
        me: Rank,
        layers: range,
        timeout_s: float,
        striping: PageStriping | None = None,
    ) -> None:
        """`striping`: under context parallelism, which pages this rank holds (each CP rank
        of a stage sends its own positions, as the stage's TP rank 0 would)."""
        self.pool, self.layout, self.me, self.layers = pool, layout, me, layers
        self.timeout_s, self.striping = timeout_s, striping
        self._plans: dict[SideLayout, dict[int, list[tuple[int, Piece]]]] = {}
        # per request of the batch: its destination, position runs and their slots here
        self._work: list[tuple[KVDestination, list[Run], torch.Tensor]] = []
        self._out: queue.Queue[_Outgoing | None] = queue.Queue()
        self._failed: dict[str, None] = {}  # rooms given up, oldest first
        self._thread = threading.Thread(target=self._send_loop, daemon=True, name="kv-sender")
        self._thread.start()

    def before(self, n: int) -> None:
        pass

    def begin(self, batch: ScheduledBatch) -> None:
        """Note which positions of which requests this forward makes KV for: a request's
        first chunk sends from position 0 (the prefix it took from the cache too); under
        context parallelism each rank sends the positions whose pages it holds."""
        self._work = []
        for s in batch.slices:
            if s.kv_dest is None:
                continue
            first = 0 if s.chunk_index == 0 else s.prefix_len
            end = s.prefix_len + s.num_tokens
            if self.striping is None:
                slots = slot_index(runs_prefix(s.kv_runs, end))[first:]
                positions = [(first, end - first)]
            else:
                cpu = torch.device("cpu")
                owned, slots = self.striping.owned(s.kv_runs, first, end, cpu)
                positions = runs_of(owned)
            if positions:
                self._work.append((s.kv_dest, positions, slots))

    def after(self, n: int) -> None:
        if not self._work:
            return
        layer = self.layers[n]
        for dest, positions, slots in self._work:
            for dst_index, piece in self._pieces(dest.layout).get(layer, []):
                frames = self._frames(layer, piece, slots)
                header = [dest.room, layer, *piece.heads, positions, time.time()]
                self._out.put(
                    _Outgoing(dest.endpoints[dst_index], dest.room, [_pack(header), *frames])
                )

    def _pieces(self, dst: SideLayout) -> dict[int, list[tuple[int, Piece]]]:
        """Per layer of this stage: (decode rank index, piece) this rank sends."""
        if dst not in self._plans:
            ranks = dst.ranks()
            by_layer: dict[int, list[tuple[int, Piece]]] = {}
            for p in plan(self.layout, dst):
                if p.src == self.me:
                    for layer in range(*p.layers):
                        by_layer.setdefault(layer, []).append((ranks.index(p.dst), p))
            self._plans[dst] = by_layer
        return self._plans[dst]

    def _frames(self, layer: int, piece: Piece, slots: torch.Tensor) -> list[Any]:
        """The piece's KV of one layer at `slots`, as contiguous byte buffers."""
        if self.layout.latent:
            bufs = [self.pool.latent(layer)]
            if self.pool.index_key_bufs:
                bufs.append(self.pool.index_keys(layer))
            return [_bytes(b.index_select(0, slots.to(b.device))) for b in bufs]
        h0 = self.layout.heads(self.me[1])[0]
        heads = slice(piece.heads[0] - h0, piece.heads[1] - h0)
        return [
            _bytes(b[heads].index_select(1, slots.to(b.device))) for b in self.pool.buffers(layer)
        ]

    def _send_loop(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sockets: dict[str, zmq.Socket] = {}
        while (item := self._out.get()) is not None:
            if item.room in self._failed:
                continue
            sock = sockets.get(item.endpoint)
            if sock is None:
                sock = sockets[item.endpoint] = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(item.endpoint)
            try:
                self._send(sock, item)
            except zmq.ZMQError:  # this room is lost; the thread serves the others
                log.exception("KV transfer to %s failed; room %s given up", *where_of(item))
                self._give_up(item.room)
        for sock in sockets.values():
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket, item: _Outgoing) -> None:
        """Send, waiting at most the transfer timeout for room; a destination that takes
        nothing for that long (dead, or cut off) fails the room: its further messages go."""
        deadline = time.monotonic() + self.timeout_s
        where = where_of(item)
        while True:
            try:
                sock.send_multipart([b"kv", *item.frames], flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if time.monotonic() > deadline:
                    log.warning("KV transfer to %s timed out; room %s given up", *where)
                    self._give_up(item.room)
                    return
                time.sleep(0.01)

    def _give_up(self, room: str) -> None:
        """Drop the room's further messages; the oldest given-up rooms are forgotten."""
        self._failed[room] = None
        while len(self._failed) > MAX_FAILED_ROOMS:
            del self._failed[next(iter(self._failed))]

    def close(self) -> None:
        self._out.put(None)
        self._thread.join(timeout=5)


# -- the decode side ---------------------------------------------------------------------------


@dataclass
class _Room:
    slots: torch.Tensor  # slot of every position of the request
    expected: int  # layer x head x position units this rank must receive
    owner: bytes  # the control socket that opened it (gets the done notice)
    received: int = 0
    nbytes: int = 0
    wire_s: float = 0.0  # time the link spent on this room's messages (arrival gaps)
    last_sent: float = 0.0  # latest send stamp of the prefill side
    last_arrival: float = 0.0


@dataclass
class RoomStats:
    """What one room's transfer cost on one decode rank (summed over ranks by the control)."""

    nbytes: int = 0
    wire_s: float = 0.0  # link time of its messages: arrival minus max(send, previous arrival)
    exposed_s: float = 0.0  # last arrival after the prefill side's last send (its last layer)


class KVReceiver:
    """A decode worker's receiving end: a ZMQ ROUTER on `endpoint`, served by a thread."""

    def __init__(self, pool: KVPool, layout: SideLayout, me: Rank, host: str) -> None:
        self.pool, self.layout, self.me = pool, layout, me
        first, end = layout.stage_layers[me[0]]
        self.units_per_position = (end - first) * (
            1 if layout.latent else layout.heads(me[1])[1] - layout.heads(me[1])[0]
        )
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:*")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._rooms: dict[str, _Room] = {}
        self._last_arrival = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kv-receiver")
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart(copy=False)
            try:
                ident, kind, *rest = frames
                self._handle(ident.bytes, kind.bytes, rest)
            except Exception:  # a malformed message is dropped; the receiver keeps serving
                log.exception("dropped a malformed KV transfer message")
        self._sock.close(linger=0)

    def _handle(self, ident: bytes, kind: bytes, rest: list[Any]) -> None:
        if kind == b"kv":
            self._write(_unpack(rest[0].bytes), rest[1:])
        elif kind == b"open":
            room, runs, num_tokens = _unpack(rest[0].bytes)
            slots = slot_index([(int(a), int(n)) for a, n in runs])
            expected = num_tokens * self.units_per_position
            self._rooms[room] = _Room(slots, expected, ident)
            self._sock.send_multipart([ident, b"opened", room.encode()])
        elif kind == b"close":
            room = _unpack(rest[0].bytes)
            self._rooms.pop(room, None)
            self._sock.send_multipart([ident, b"closed", room.encode()])

    def _write(self, header: list[Any], frames: list[Any]) -> None:
        room_id, layer, h0, h1, positions, sent = header
        room = self._rooms.get(room_id)
        arrival = time.time()
        if room is None:  # not open here (any more): dropped
            return
        slots = room.slots[slot_index([(int(a), int(n)) for a, n in positions])]
        for buf, frame in zip(self._targets(layer), frames, strict=True):
            data = torch.frombuffer(bytearray(frame.buffer), dtype=buf.dtype)
            if self.layout.latent:
                buf[slots.to(buf.device)] = data.view(len(slots), -1).to(buf.device)
            else:
                d0 = self.layout.heads(self.me[1])[0]
                view = data.view(h1 - h0, len(slots), -1).to(buf.device)
                buf[h0 - d0 : h1 - d0, slots.to(buf.device)] = view
            room.nbytes += len(frame.buffer)
        room.wire_s += arrival - max(sent, self._last_arrival)
        room.last_sent, room.last_arrival = max(room.last_sent, sent), arrival
        self._last_arrival = arrival
        room.received += (h1 - h0) * len(slots)
        if room.received >= room.expected:
            del self._rooms[room_id]
            exposed = max(0.0, room.last_arrival - room.last_sent)
            stats = [room.nbytes, room.wire_s, exposed]
            self._sock.send_multipart([room.owner, b"done", _pack([room_id, *stats])])

    def _targets(self, layer: int) -> list[torch.Tensor]:
        if self.layout.latent:
            return [self.pool.latent(layer)] + (
                [self.pool.index_keys(layer)] if self.pool.index_key_bufs else []
            )
        return list(self.pool.buffers(layer))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class TransferError(RuntimeError):
    pass


@dataclass
class ReceiverControl:
    """The decode engine's handle on its ranks' receivers."""

    endpoints: tuple[str, ...]
    _socks: list[zmq.Socket] = field(default_factory=list)
    _done: dict[str, list[RoomStats]] = field(default_factory=dict)
    _acks: set[tuple[int, bytes, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        for e in self.endpoints:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(e)
            self._socks.append(sock)

    def open(self, room: str, runs: list[Run], num_tokens: int) -> None:
        self._ask(b"open", room, [room, [list(r) for r in runs], num_tokens], b"opened")

    def close(self, room: str) -> None:
        """After this returns no receiver writes into the room's slots any more."""
        self._ask(b"close", room, room, b"closed")
        self._done.pop(room, None)

    def _ask(self, kind: bytes, room: str, body: Any, reply: bytes) -> None:
        for sock in self._socks:
            sock.send_multipart([kind, _pack(body)])
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        want = {(i, reply, room) for i in range(len(self._socks))}
        while not want <= self._acks:
            if time.monotonic() > deadline:
                raise TransferError(f"a decode rank did not confirm {kind.decode()} of a room")
            self._read(timeout_ms=50)
        self._acks -= want

    def poll(self) -> list[tuple[str, RoomStats]]:
        """Rooms whose KV every rank has now received, with their summed costs."""
        self._read(timeout_ms=0)
        done = [r for r, got in self._done.items() if len(got) == len(self._socks)]
        out = []
        for room in done:
            parts = self._done.pop(room)
            out.append(
                (
                    room,
                    RoomStats(
                        sum(p.nbytes for p in parts),
                        max(p.wire_s for p in parts),
                        max(p.exposed_s for p in parts),
                    ),
                )
            )
        return out

    def _read(self, timeout_ms: int) -> None:
        for i, sock in enumerate(self._socks):
            while sock.poll(timeout_ms if i == 0 else 0):
                kind, body = sock.recv_multipart()
                if kind == b"done":
                    room, nbytes, wire_s, exposed_s = _unpack(body)
                    self._done.setdefault(room, []).append(RoomStats(nbytes, wire_s, exposed_s))
                else:
                    self._acks.add((i, kind, body.decode()))
                timeout_ms = 0

    def shutdown(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)


def where_of(item: _Outgoing) -> tuple[str, str]:
    return item.endpoint, item.room


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def _bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes (on the host), without another copy when it is there already."""
    flat = t.contiguous().view(torch.uint8).flatten()
    return memoryview(flat.cpu().numpy())  # type: ignore[arg-type]
