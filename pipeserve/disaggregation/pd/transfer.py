"""The KV transfer engine of prefill/decode disaggregation (spec 05): the prefill side's
workers send each layer's KV of a prompt chunk as soon as that layer's forward has written
it, straight into pages the decode side reserved; the decode side hears when all of a
request's KV has arrived.

The interface is three objects, one backend (`tcp`: link.py's authenticated, encrypted
messages over TCP; it works between local processes and between machines, and a peer that
dies or restarts breaks nothing beyond its own requests, where a torch.distributed group
spanning both sides would fail for good and tie their start-up together). An RDMA engine
would implement the same three:

- `KVReceiver`, one per decode worker, with two listeners. Its control listener (a Unix
  socket in a directory only this user can enter; across nodes tcp://) takes `open(room,
  slots)` and `close(room)` from its engine process alone, under the control link's key.
  Its data listener (tcp://, letting in only holders of the KV link's key: auth.py, with
  bounded connections: link.py) takes `kv` messages and writes
  each into the room's slots once it has checked it (an open room, a layer of this stage,
  heads of this rank, positions within the room, the exact byte size); anything else is
  dropped and counted, so neither a late message of an aborted request (whose pages went
  to someone else) nor a forged one can write into any request's pages. A room reports done
  once every piece it expects has come, and expires with its request.
- `ReceiverControl`, in the decode engine process: opens and closes a room on every
  decode rank (waiting for each to confirm, so a closed room's pages are safe to reuse)
  and collects the done notices and the ranks' dropped-message counts.
- `KVSender`, one per prefill worker: for a batch's slices that carry a `KVDestination`,
  copies its share of a layer's new KV (`kv_remap.plan`: its layers x heads needed by each
  decode rank) out of the pool, in messages of at most MAX_MESSAGE_POSITIONS positions, and
  queues it to a sender thread, which never blocks the forward. The thread keeps a queue
  per destination and never waits on one: a destination that takes nothing for the
  transfer timeout (dead, cut off, or one that cannot even be connected to) has its rooms
  given up (their messages dropped: bounded memory, nothing stranded) while the others
  flow.

A room is a random 128-bit id the decode side makes: it is also the capability that lets a
prefill worker write into those pages, so it is never logged.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import math
import queue
import secrets
import selectors
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeserve.context_parallel.layout import PageStriping, runs_of
from pipeserve.disaggregation.pd import auth
from pipeserve.disaggregation.pd.kv_remap import (
    ROOM_FORM,
    KVDestination,
    Piece,
    Rank,
    SideLayout,
    plan,
)
from pipeserve.disaggregation.pd.link import PING_S, Channel, LinkClosed, Server, drive
from pipeserve.distributed.channels import private_directory
from pipeserve.distributed.messages import (
    KV_ANSWER,
    KV_CONTROL,
    KV_HEADER,
    AskDropped,
    CloseRoom,
    KVHeader,
    OpenRoom,
    RoomAnswer,
    RoomDone,
)
from pipeserve.distributed.wire import PD_CONTROL_MAX_BYTES, WireError
from pipeserve.layers.attention_parts import gather_index
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.scheduler.batch import Run, ScheduledBatch, runs_prefix

log = logging.getLogger(__name__)

SEND_BYTES = 16 << 20  # encrypted bytes a sender keeps ahead of one destination's socket
CONTROL_TIMEOUT_S = 10.0  # a decode rank must confirm open/close within this
MAX_FAILED_ROOMS = 4096  # given-up rooms a sender remembers (to drop their later messages)
MAX_MESSAGE_POSITIONS = 8192  # positions one kv message carries at most (a chunk's layer)
MAX_CONTROL_BYTES = PD_CONTROL_MAX_BYTES  # an open message lists a request's slot runs
MIN_PART_BYTES = 1 << 20  # a kv message's header may list many runs (context parallelism)
DATA_PEERS, DATA_PENDING = 256, 64  # the data listener's connection limits (link.py)
# handshakes one address may have under way: a prefill host's workers reconnecting at once
DATA_PER_ADDRESS = 16
CONTROL_PEERS, CONTROL_PENDING = 8, 8
DATA_IDLE_S = 90.0  # a sender's connection silent this long is closed (senders ping)
IDLE_SOCKET_S = 60.0  # a sender closes its connection to a destination unused this long
RECONNECT_S = 0.2  # a sender waits this long before connecting again after a failure
STATS_EVERY_S = 1.0  # how often the control asks the ranks for their dropped counts
EXPIRE_EVERY_S = 1.0  # how often a receiver looks for rooms past their time
MAX_ROOM_TTL_S = 7 * 86400.0  # an open asking a room to live longer is refused


def new_room() -> str:
    return secrets.token_hex(16)


def slot_index(runs: list[Run]) -> torch.Tensor:
    """The slot of every position covered by `runs`, in order."""
    return gather_index([runs], torch.device("cpu"))[0][0]


def split_positions(
    positions: list[Run], slots: torch.Tensor, limit: int
) -> list[tuple[list[Run], torch.Tensor]]:
    """`positions` (runs) and their `slots`, cut into parts of at most `limit` positions."""
    parts: list[tuple[list[Run], torch.Tensor]] = []
    runs: list[Run] = []
    taken, start = 0, 0
    for a, n in positions:
        while n:
            k = min(n, limit - taken)
            runs.append((a, k))
            a, n, taken = a + k, n - k, taken + k
            if taken == limit:
                parts.append((runs, slots[start : start + taken]))
                runs, start, taken = [], start + taken, 0
    if runs:
        parts.append((runs, slots[start : start + taken]))
    return parts


# -- the prefill side ------------------------------------------------------------------------


@dataclass
class _Outgoing:
    endpoint: str
    room: str
    frames: list[Any]


@dataclass
class _Destination:
    """The sender thread's view of one decode rank's receiver."""

    channel: Channel | None = None
    queue: collections.deque[_Outgoing] = field(default_factory=collections.deque)
    # rooms with messages on this connection lately: room -> when its last one was queued
    rooms: dict[str, float] = field(default_factory=dict)
    progress_at: float = 0.0  # messages last went out, or the queue last went from empty to not
    warned: bool = False  # a lost connection is logged once even with no room on it
    used_at: float = 0.0
    retry_at: float = 0.0  # no new connection before this (after a failed one)
    unusable: bool = False  # an endpoint that is not tcp://: its rooms fail at once


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
        key: str = "",
    ) -> None:
        """`striping`: under context parallelism, which pages this rank holds (each CP rank
        of a stage sends its own positions, as the stage's TP rank 0 would). `key`: the PD
        key (the KV link's secret is derived from it: auth.kv_link_secret)."""
        self.pool, self.layout, self.me, self.layers = pool, layout, me, layers
        self.timeout_s, self.striping = timeout_s, striping
        self._secret = auth.kv_link_secret(key)
        self._plans: dict[SideLayout, dict[int, list[tuple[int, Piece]]]] = {}
        # per request of the batch: its destination, position runs and their slots here
        self._work: list[tuple[KVDestination, list[Run], torch.Tensor]] = []
        self._out: queue.Queue[_Outgoing | None] = queue.Queue()
        self._failed: dict[str, None] = {}  # rooms given up, oldest first
        self.given_up = 0  # rooms given up since start
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._send_loop, daemon=True, name="kv-sender")
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def before(self, n: int) -> None:
        pass

    def begin(self, batch: ScheduledBatch) -> None:
        """Note which positions of which requests this forward makes KV for: a request's
        first chunk sends from position 0 (the prefix it took from the cache too); under
        context parallelism each rank sends the positions whose pages it holds."""
        if not self.alive:  # fails the worker, so the server reports unhealthy
            raise RuntimeError("the KV sender thread has stopped: no KV can be sent")
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
                endpoint = dest.endpoints[dst_index]
                for part, part_slots in split_positions(positions, slots, MAX_MESSAGE_POSITIONS):
                    frames = self._frames(layer, piece, part_slots)
                    header = KVHeader(dest.room, layer, *piece.heads, part, time.time())
                    message = [KV_HEADER.encode(header), *frames]
                    self._out.put(_Outgoing(endpoint, dest.room, message))

    def _pieces(self, dst: SideLayout) -> dict[int, list[tuple[int, Piece]]]:
        """Per layer of this stage: (decode rank index, piece) this rank sends."""
        if dst not in self._plans:
            index = {rank: i for i, rank in enumerate(dst.ranks())}
            by_layer: dict[int, list[tuple[int, Piece]]] = {}
            for p in plan(self.layout, dst):
                if p.src == self.me:
                    for layer in range(*p.layers):
                        by_layer.setdefault(layer, []).append((index[p.dst], p))
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
        """Move queued messages to their destinations, never waiting on any one of them."""
        dests: dict[str, _Destination] = {}
        running = True
        while running:
            if any(d.queue or (d.channel and d.channel.pending) for d in dests.values()):
                self._wait(0.002)
                running = self._take(dests, wait_s=0.0)
            else:
                running = self._take(dests, wait_s=0.1)
                self._wait(0.0)  # a connection the receiver closed is noticed idle
            now = time.monotonic()
            for endpoint, d in list(dests.items()):
                try:
                    self._flush(endpoint, d, now)
                except LinkClosed as exc:
                    self._lost(endpoint, d, str(exc))
                except Exception:  # whatever went wrong, it stays with this destination
                    log.exception("KV sender: destination %s failed", endpoint)
                    self._drop_destination(endpoint, d)
                self._watch(endpoint, d)
                busy = d.queue or (d.channel and d.channel.pending)
                if not busy and now - d.used_at > IDLE_SOCKET_S:
                    self._disconnect(dests.pop(endpoint))
        for d in dests.values():
            self._disconnect(d)
        self._selector.close()

    def _take(self, dests: dict[str, _Destination], wait_s: float) -> bool:
        """Move what the forward queued into the destinations' queues; False on close()."""
        try:
            item = self._out.get(timeout=wait_s) if wait_s else self._out.get_nowait()
        except queue.Empty:
            return True
        while item is not None:
            if item.room not in self._failed:
                d = dests.setdefault(item.endpoint, _Destination())
                now = time.monotonic()
                if not d.queue:
                    d.progress_at = now
                d.used_at = now
                d.queue.append(item)
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                return True
        return False

    def _wait(self, timeout_s: float) -> None:
        """Until a connection can take bytes or has something to read (its handshake, or
        its end), for at most `timeout_s`."""
        if not self._selector.get_map():
            if timeout_s:
                time.sleep(timeout_s)
            return
        for key, events in self._selector.select(timeout_s):
            endpoint, d = key.data
            channel: Channel | None = d.channel
            if channel is None or key.fileobj is not channel:  # lost meanwhile
                continue
            try:
                if events & selectors.EVENT_READ and channel.readable():
                    raise LinkClosed("the receiver sent a message")
                if events & selectors.EVENT_WRITE:
                    channel.flush()
            except LinkClosed as exc:
                self._lost(endpoint, d, str(exc))

    def _watch(self, endpoint: str, d: _Destination) -> None:
        """Select on the destination's connection for what it needs (`Channel.interest`)."""
        channel = d.channel
        if channel is None:
            return
        try:
            if self._selector.get_key(channel).events != channel.interest:
                self._selector.modify(channel, channel.interest, (endpoint, d))
        except KeyError:
            self._selector.register(channel, channel.interest, (endpoint, d))

    def _flush(self, endpoint: str, d: _Destination, now: float) -> None:
        """Send what the destination takes now; if it has taken nothing for the transfer
        timeout (or its endpoint is unusable), give up every room queued to it."""
        while d.queue and d.queue[0].room in self._failed:
            d.queue.popleft()
        if d.channel is None and d.queue and not d.unusable and now >= d.retry_at:
            try:
                d.channel = Channel.connect(endpoint, self._secret, max_part=0)
            except ValueError as exc:
                log.warning("KV sender: cannot use endpoint %s (%s)", endpoint, exc)
                d.unusable = True
        channel = d.channel
        if channel is not None:
            while channel.ready and d.queue and channel.pending < SEND_BYTES:
                item = d.queue.popleft()
                if item.room not in self._failed:
                    channel.send(item.frames)
                    d.rooms.pop(item.room, None)
                    d.rooms[item.room] = now  # newest last
                    d.used_at = now
            while d.rooms and now - next(iter(d.rooms.values())) > 2 * self.timeout_s:
                del d.rooms[next(iter(d.rooms))]  # long done, or given up by the decode side
            idle = channel.ready and not d.queue and not channel.pending
            if idle and now - channel.sent_at > PING_S:  # keeps the receiver from reaping it
                channel.send([])
            # progress is what an authenticated link takes: a destination that keeps closing
            # its connections (another PD key, its connection limit) is given up in time
            sent = channel.flush() if channel.pending or channel.connecting else 0
            if sent and channel.ready:
                d.progress_at = now
        stuck = d.queue or (channel is not None and channel.pending)
        if stuck and (d.unusable or now - d.progress_at > self.timeout_s):
            log.warning(
                "KV transfer to %s took nothing for %gs; its %d queued room(s) given up",
                endpoint,
                0 if d.unusable else self.timeout_s,
                len({item.room for item in d.queue} | set(d.rooms)),
            )
            self._drop_destination(endpoint, d)

    def _lost(self, endpoint: str, d: _Destination, reason: str) -> None:
        """The connection failed: rooms with messages on it cannot complete (what was in
        flight is gone) and are given up; the queue goes on a new connection later."""
        if d.rooms or not d.warned:
            log.warning("KV sender: connection to %s lost (%s)", endpoint, reason)
            d.warned = True
        for room in d.rooms:
            self._give_up(room)
        self._disconnect(d)
        d.retry_at = time.monotonic() + RECONNECT_S

    def _drop_destination(self, endpoint: str, d: _Destination) -> None:
        for item in d.queue:
            self._give_up(item.room)
        d.queue.clear()
        for room in d.rooms:
            self._give_up(room)
        self._disconnect(d)

    def _give_up(self, room: str) -> None:
        """Drop the room's further messages; the oldest given-up rooms are forgotten."""
        if room in self._failed:
            return
        self._failed[room] = None
        self.given_up += 1
        while len(self._failed) > MAX_FAILED_ROOMS:
            del self._failed[next(iter(self._failed))]

    def _disconnect(self, d: _Destination) -> None:
        if d.channel is not None:
            with contextlib.suppress(KeyError):
                self._selector.unregister(d.channel)
            d.channel.close()
        d.channel, d.rooms = None, {}

    def close(self) -> None:
        self._out.put(None)
        self._thread.join(timeout=5)


# -- the decode side ---------------------------------------------------------------------------


@dataclass
class _Room:
    slots: torch.Tensor  # slot of every position of the request
    expected: int  # layer x head x position units this rank must receive
    owner: Channel  # the control connection that opened it (gets the done notice)
    expires: float  # monotonic time: the room is closed then if nothing closed it before
    arrived: _Arrivals = field(default_factory=lambda: _Arrivals())
    received: int = 0
    nbytes: int = 0
    wire_s: float = 0.0  # time the link spent on this room's messages (arrival gaps)
    last_sent: float = 0.0  # latest send stamp of the prefill side
    last_arrival: float = 0.0


class _Arrivals:
    """The positions of each (layer, head) a room has received, as sorted, merged runs: a
    room is done when every position has arrived exactly once (a repeated piece is refused,
    so it can neither finish a room early nor overwrite what came)."""

    def __init__(self) -> None:
        self._runs: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def has_any(self, layer: int, heads: range, positions: list[Run]) -> bool:
        """Whether any of `positions` of `heads` at `layer` arrived before (or `positions`
        repeat one another)."""
        new = sorted((a, a + n) for a, n in positions)
        if any(b > a2 for (_, b), (a2, _) in zip(new, new[1:], strict=False)):
            return True
        held = [self._runs.get((layer, h), []) for h in heads]
        return not all(_free(runs, a, b) for runs in held for a, b in new)

    def add(self, layer: int, heads: range, positions: list[Run]) -> None:
        """Record `positions` of `heads` at `layer` (`has_any` said none is here)."""
        for h in heads:
            runs = self._runs.setdefault((layer, h), [])
            for a, n in positions:
                _insert(runs, a, a + n)


def _free(runs: list[tuple[int, int]], a: int, b: int) -> bool:
    i = bisect.bisect_right(runs, (a, math.inf))  # the first run starting after a
    return not (i > 0 and runs[i - 1][1] > a) and not (i < len(runs) and runs[i][0] < b)


def _insert(runs: list[tuple[int, int]], a: int, b: int) -> None:
    i = bisect.bisect_right(runs, (a, math.inf))
    if i > 0 and runs[i - 1][1] == a:  # joins the run before
        i -= 1
        a = runs.pop(i)[0]
    if i < len(runs) and runs[i][0] == b:  # and the one after
        b = runs.pop(i)[1]
    runs.insert(i, (a, b))


@dataclass
class RoomStats:
    """What one room's transfer cost on one decode rank (summed over ranks by the control)."""

    nbytes: int = 0
    wire_s: float = 0.0  # link time of its messages: arrival minus max(send, previous arrival)
    exposed_s: float = 0.0  # last arrival after the prefill side's last send (its last layer)


class Dropped(Exception):
    """A kv message the receiver does not take (the reason is counted, not logged per
    message: a flood must not flood the log)."""


class KVReceiver:
    """A decode worker's receiving end: a data listener (tcp on `host`) and a control
    listener, served by one thread."""

    def __init__(
        self,
        pool: KVPool,
        layout: SideLayout,
        me: Rank,
        host: str,
        key: str,
        remote_control: bool = False,
    ) -> None:
        """`key`: the PD key (the data link's secret derives from it; the control link's is
        random, made here, and reaches the engine process only in this worker's ready
        message on the control plane). `remote_control`: the engine process is on another
        node, so the control listener is tcp:// on `host` (else a Unix socket in a private
        directory)."""
        self.pool, self.layout, self.me = pool, layout, me
        self.first_layer, self.end_layer = layout.stage_layers[me[0]]
        self.my_heads = layout.heads(me[1])
        self.units_per_position = (self.end_layer - self.first_layer) * (
            self.my_heads[1] - self.my_heads[0]
        )
        # bytes one position of one layer takes in each target buffer, for all of my heads
        self.row_bytes = [
            (b[0] if b.dim() == 2 else b[:, 0]).numel() * b.element_size()
            for b in self._targets(self.first_layer)
        ]
        self._server = Server()
        max_part = max(max(self.row_bytes) * MAX_MESSAGE_POSITIONS, MIN_PART_BYTES)
        data_secret = auth.kv_link_secret(key)
        self._data = self._server.listen(
            f"tcp://{host}:*",
            data_secret,
            max_part,
            DATA_PEERS,
            DATA_PENDING,
            DATA_IDLE_S,
            DATA_PER_ADDRESS,
        )
        self.endpoint: str = self._data.endpoint
        self._control_dir = None if remote_control else private_directory()
        where = f"ipc://{self._control_dir}/kv-control" if self._control_dir else f"tcp://{host}:*"
        self.control_secret = secrets.token_bytes(32)
        self._control = self._server.listen(
            where, self.control_secret, MAX_CONTROL_BYTES, CONTROL_PEERS, CONTROL_PENDING
        )
        self.control_endpoint: str = self._control.endpoint
        self._rooms: dict[str, _Room] = {}
        self._held = torch.zeros(pool.num_slots, dtype=torch.bool)  # slots of open rooms
        self.dropped: collections.Counter[str] = collections.Counter()
        self.refused_opens: collections.Counter[str] = collections.Counter()
        self._last_arrival = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kv-receiver")
        self._thread.start()

    @property
    def refused(self) -> collections.Counter[str]:
        """Connections the data listener refused or closed, by reason (link.py's limits)."""
        return self._data.refused

    def _serve(self) -> None:
        expired_at = time.monotonic()
        while not self._stop.is_set():
            try:
                got = self._server.poll(0.1)
            except Exception:  # a bug of ours, or the OS's: the next turn serves on
                log.exception("KV receiver: serving its connections failed")
                time.sleep(0.1)
                continue
            for listener, channel, message in got:
                if listener is self._control:
                    self._on_control(channel, message)
                else:
                    self._on_data(message)
            if (now := time.monotonic()) - expired_at > EXPIRE_EVERY_S:
                self._expire(now)
                expired_at = now
        self._server.close()
        if self._control_dir is not None:
            shutil.rmtree(self._control_dir, ignore_errors=True)

    def _on_control(self, channel: Channel, frames: list[bytearray]) -> None:
        """OpenRoom / CloseRoom / AskDropped from the engine process (the only peer of this
        listener)."""
        try:
            if len(frames) != 1:
                raise WireError(f"{len(frames)} frames")
            msg = KV_CONTROL.decode(bytes(frames[0]))
        except WireError as exc:  # a bug of ours: log it, keep serving
            log.error("KV receiver: dropped a malformed control message: %s", exc)
            return
        match msg:
            case OpenRoom():
                self._open(channel, msg)
            case CloseRoom(room):
                self._free(room)
                self._reply(channel, "closed", room)
            case AskDropped():
                self._reply(channel, "dropped", "")

    def _open(self, channel: Channel, msg: OpenRoom) -> None:
        """A room over slots of the pool that no other open room holds, for a finite time;
        anything else is refused (answered `refused`) and counted."""
        room, runs, num_tokens, ttl_s = msg.room, msg.runs, msg.num_tokens, msg.ttl_s
        problem = None
        if not ROOM_FORM.fullmatch(room):
            problem = "a malformed room id"
        elif room in self._rooms:
            problem = "a room that is open already"
        elif not 0 < ttl_s <= MAX_ROOM_TTL_S:
            problem = "a time to live that is not finite and positive"  # NaN fails too
        elif not all(a >= 0 and n > 0 and a + n <= self.pool.num_slots for a, n in runs):
            problem = "slots outside the pool"
        if problem is None:
            slots = slot_index(runs)
            if len(slots) != num_tokens or num_tokens == 0:
                problem = "slot runs that do not cover its tokens"
            elif torch.unique(slots).numel() != len(slots) or bool(self._held[slots].any()):
                problem = "slots another room holds"
        if problem is not None:
            self.refused_opens[problem] += 1
            log.warning("KV receiver: refused to open a room: %s", problem)
            self._reply(channel, "refused", room)
            return
        expected = num_tokens * self.units_per_position
        self._held[slots] = True
        self._rooms[room] = _Room(slots, expected, channel, time.monotonic() + ttl_s)
        self._reply(channel, "opened", room)

    def _free(self, room_id: str) -> None:
        """The room is over (closed, done or expired): its slots may be opened again."""
        room = self._rooms.pop(room_id, None)
        if room is not None:
            self._held[room.slots] = False

    def _reply(self, channel: Channel, answer: str, room: str) -> None:
        msg = RoomAnswer(answer, room, sum(self.dropped.values()))
        self._server.send(channel, [KV_ANSWER.encode(msg)])

    def _on_data(self, frames: list[bytearray]) -> None:
        """One kv message: written if every check passes, else dropped and counted."""
        try:
            if len(frames) < 2:
                raise Dropped("not a kv message")
            self._write(_header(frames[0]), frames[1:])
        except Dropped as exc:
            self.dropped[str(exc)] += 1
        except Exception:  # a bug of ours: the message goes, the receiver keeps serving
            self.dropped["an error while writing"] += 1
            log.exception("KV receiver: a kv message failed to write")

    def _write(self, header: KVHeader, frames: list[bytearray]) -> None:
        room_id, layer, h0, h1 = header.room, header.layer, header.h0, header.h1
        positions, sent = header.positions, header.sent
        room = self._rooms.get(room_id)
        arrival = time.time()
        if room is not None and room.expires < time.monotonic():  # before the next sweep
            self._free(room_id)
            room = None
        if room is None:  # not open here (never, or no more): dropped
            raise Dropped("no such room")
        if not self.first_layer <= layer < self.end_layer:
            raise Dropped("a layer of another stage")
        d0, d1 = self.my_heads
        if not d0 <= h0 < h1 <= d1:
            raise Dropped("heads of another rank")
        count = sum(n for _, n in positions)
        if count == 0:
            raise Dropped("no positions")
        if count > MAX_MESSAGE_POSITIONS:
            raise Dropped("too many positions")
        if not all(a >= 0 and n > 0 and a + n <= len(room.slots) for a, n in positions):
            raise Dropped("positions outside the room")
        targets = self._targets(layer)
        sizes = [row // (d1 - d0) * (h1 - h0) * count for row in self.row_bytes]
        if len(frames) != len(targets) or [len(f) for f in frames] != sizes:
            raise Dropped("the wrong byte size")
        if room.arrived.has_any(layer, range(h0, h1), positions):
            raise Dropped("positions that arrived before")
        slots = room.slots[slot_index(positions)]
        for buf, frame in zip(targets, frames, strict=True):
            data = torch.frombuffer(frame, dtype=buf.dtype)
            if self.layout.latent:
                buf[slots.to(buf.device)] = data.view(len(slots), -1).to(buf.device)
            else:
                view = data.view(h1 - h0, len(slots), -1).to(buf.device)
                buf[h0 - d0 : h1 - d0, slots.to(buf.device)] = view
            room.nbytes += len(frame)
        room.arrived.add(layer, range(h0, h1), positions)  # once written, not before
        room.wire_s += arrival - max(sent, self._last_arrival)
        room.last_sent, room.last_arrival = max(room.last_sent, sent), arrival
        self._last_arrival = arrival
        room.received += (h1 - h0) * count
        if room.received == room.expected:  # every position of every piece, once
            self._free(room_id)
            exposed = max(0.0, room.last_arrival - room.last_sent)
            done = RoomDone(room_id, room.nbytes, room.wire_s, exposed)
            self._server.send(room.owner, [KV_ANSWER.encode(done)])

    def _expire(self, now: float) -> None:
        """Rooms past their time go (their request is over: failed or timed out)."""
        for room_id in [r for r, room in self._rooms.items() if room.expires < now]:
            self._free(room_id)

    def _targets(self, layer: int) -> list[torch.Tensor]:
        if self.layout.latent:
            return [self.pool.latent(layer)] + (
                [self.pool.index_keys(layer)] if self.pool.index_key_bufs else []
            )
        return list(self.pool.buffers(layer))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _header(data: bytearray) -> KVHeader:
    """A kv message's header, decoded (its types checked) with a finite send time."""
    try:
        header = KV_HEADER.decode(bytes(data))
    except WireError:
        raise Dropped("a malformed header") from None
    if not math.isfinite(header.sent):
        raise Dropped("a malformed header")
    return header


class TransferError(RuntimeError):
    pass


class RoomRefused(TransferError):
    """A decode rank refused to open a room (its log says why): that request fails alone."""


@dataclass
class ReceiverControl:
    """The decode engine's handle on its ranks' receivers: `endpoints` are their data
    listeners (told to the prefill side), `controls` their control listeners."""

    endpoints: tuple[str, ...]
    controls: tuple[tuple[str, bytes], ...] = field(repr=False)  # (endpoint, its secret)
    room_ttl_s: float = 3600.0  # a room not closed by then closes itself
    _links: list[Channel] = field(default_factory=list)
    _done: dict[str, list[RoomStats]] = field(default_factory=dict)
    _acks: set[tuple[int, str, str]] = field(default_factory=set)
    _dropped: list[int] = field(default_factory=list)
    _stats_at: float = 0.0

    def __post_init__(self) -> None:
        try:
            for endpoint, secret in self.controls:
                self._links.append(Channel.connect(endpoint, secret, MAX_CONTROL_BYTES))
        except (ValueError, LinkClosed) as exc:
            self.shutdown()
            raise TransferError(f"cannot reach a decode rank's KV receiver: {exc}") from exc
        self._dropped = [0] * len(self._links)
        self._authenticate()

    def _authenticate(self) -> None:
        """The links' handshakes, now (a receiver closes a connection that has not
        authenticated within link.HANDSHAKE_S, whatever the engine loop is doing)."""
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while not all(link.ready for link in self._links):
            if time.monotonic() > deadline:
                self.shutdown()
                raise TransferError("a decode rank's KV receiver did not authenticate")
            self._read(timeout_ms=50)

    def open(self, room: str, runs: list[Run], num_tokens: int) -> None:
        ttl_s = min(self.room_ttl_s, MAX_ROOM_TTL_S)
        ranks = range(len(self._links))
        answers = self._ask(OpenRoom(room, list(runs), num_tokens, ttl_s), room, ranks)
        if "refused" in answers.values():  # the rank's log says why
            opened = [i for i, a in answers.items() if a == "opened"]
            if opened:  # those close it again (the room id may be another's elsewhere)
                self._ask(CloseRoom(room), room, opened)
            raise RoomRefused("a decode rank refused to open the request's room")

    def close(self, room: str) -> None:
        """After this returns no receiver writes into the room's slots any more."""
        self._ask(CloseRoom(room), room, range(len(self._links)))
        self._done.pop(room, None)

    def _ask(self, msg: OpenRoom | CloseRoom, room: str, ranks: Iterable[int]) -> dict[int, str]:
        """Send `msg` to `ranks` and wait for each one's answer about `room`."""
        answers: dict[int, str] = {}
        ranks = list(ranks)
        data = KV_CONTROL.encode(msg)
        for i in ranks:
            self._links[i].send([data])
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while True:
            for i in ranks:
                for answer in ("opened", "closed", "refused"):
                    if (i, answer, room) in self._acks:
                        self._acks.discard((i, answer, room))
                        answers[i] = answer
            if len(answers) == len(ranks):
                return answers
            if time.monotonic() > deadline:
                what = type(msg).__name__
                raise TransferError(f"a decode rank did not answer {what} of a room")
            self._read(timeout_ms=50)

    def poll(self) -> list[tuple[str, RoomStats]]:
        """Rooms whose KV every rank has now received, with their summed costs."""
        now = time.monotonic()
        if now - self._stats_at > STATS_EVERY_S:  # answered whenever: read by later polls
            self._stats_at = now
            ask = KV_CONTROL.encode(AskDropped())
            for link in self._links:
                link.send([ask])
        self._read(timeout_ms=0)
        done = [r for r, got in self._done.items() if len(got) == len(self._links)]
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

    @property
    def dropped(self) -> int:
        """kv messages the ranks dropped (forged, stray, late or malformed), as last heard."""
        return sum(self._dropped)

    def _read(self, timeout_ms: int) -> None:
        try:
            got = drive(self._links, timeout_ms / 1000)
        except LinkClosed as exc:
            raise TransferError(f"the control link to a decode rank failed: {exc}") from exc
        index = {id(link): i for i, link in enumerate(self._links)}
        for link, frames in got:
            i = index[id(link)]
            try:
                msg = KV_ANSWER.decode(bytes(frames[0]))
            except WireError as exc:  # our own receiver's: a bug of ours
                log.error("dropped a malformed answer of decode rank %d: %s", i, exc)
                continue
            match msg:
                case RoomDone(room, nbytes, wire_s, exposed_s):
                    self._done.setdefault(room, []).append(RoomStats(nbytes, wire_s, exposed_s))
                case RoomAnswer(answer, room, dropped):
                    self._dropped[i] = dropped
                    if answer != "dropped":
                        self._acks.add((i, answer, room))

    def shutdown(self) -> None:
        for link in self._links:
            link.close()


def _bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes (on the host), without another copy when it is there already."""
    flat = t.contiguous().view(torch.uint8).flatten()
    return memoryview(flat.cpu().numpy())  # type: ignore[arg-type]
