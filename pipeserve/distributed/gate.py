"""The multi-node control plane's front door: the scheduler's ZMQ sockets listen on loopback
only, and what other machines reach are pipeserve's own bounded, authenticated link
listeners (disaggregation/pd/link.py), each spliced to one of them.

ZeroMQ accepts every TCP connection it sees and can neither cap nor drop one, so a stranger
who reaches its ports holds a file descriptor per connection for the handshake's time, as
many as it opens: at a 1024-descriptor limit a flood left the scheduler unable to open files
and a worker's first connection waited seconds. Through the gate:

- node 0 (`Gate`): one link listener per scheduler port (`host:port`, what workers are
  told). A connection must prove the gate's secret (derived from --dist-auth-key) in the
  link handshake before anything is connected on its behalf; the listener caps handshakes
  per address (PER_ADDRESS) and in all (PENDING, evicting only connections without a valid
  hello), closes a handshake after link.HANDSHAKE_S and keeps at most PEERS authenticated.
  Then the gate opens a plain connection to the ZMQ socket on loopback and copies bytes
  both ways.
- every worker (`Tunnel`): a Unix socket per scheduler port in a directory only this user
  can enter; the worker's ZMQ socket connects there, and the tunnel carries each such
  connection to the gate over a link channel of its own. The scheduler's ZMQ sockets are
  Unix sockets in its private directory too, so no other local user reaches either hop.
- each direction of a splice stops reading while the other side has BACKLOG bytes queued,
  so a stalled reader stalls its sender (ZeroMQ's queue limits and send timeouts still
  apply) instead of growing a buffer here; a closing side's queued bytes are written first.

ZeroMQ's CURVE stays on inside (keys from the same --dist-auth-key), so what crosses the
network is encrypted twice; the link adds the bounds and forward secrecy. One thread per
gate and per tunnel moves the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import socket
import threading
import time
from collections.abc import Callable

from pipeserve.disaggregation.pd.link import Channel, LinkClosed, Listener, Server, derive

log = logging.getLogger(__name__)

CHUNK = 1 << 18  # bytes read from a plain socket at a time (one link message)
BACKLOG = 4 * CHUNK  # queued bytes past which the other side of a splice stops reading
DRAIN_S = 1.0  # a closing tunnel still moves what is queued or arriving for this long
PEERS = 1024  # authenticated connections per scheduler port (a worker makes one)
PENDING, PER_ADDRESS = 64, 16  # handshakes under way, in all and from one address
POLL_S = 0.05


def gate_secret(auth_key: str) -> bytes:
    """The link secret of the control plane's gate (unrelated to the PD key's links')."""
    return derive(auth_key, "control plane gate")


class _Plain:
    """The plain end of a splice: a non-blocking socket and the bytes it still owes."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.out = bytearray()

    def interest(self, link_backlog: int) -> int:
        """Read unless the link it feeds has BACKLOG bytes queued; write while it owes."""
        read = selectors.EVENT_READ if link_backlog < BACKLOG else 0
        return read | (selectors.EVENT_WRITE if self.out else 0)

    def read(self) -> bytes:
        """What arrived (ConnectionError once the other end closed)."""
        try:
            data = self.sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return b""
        if not data:
            raise ConnectionError("closed")
        return data

    def write(self, data: bytes | bytearray = b"") -> None:
        self.out += data
        while self.out:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return
            del self.out[:n]


class Gate:
    """Node 0's public ports, each spliced to a scheduler socket on loopback."""

    def __init__(self, secret: bytes, routes: dict[str, str]) -> None:
        """`routes`: public `tcp://HOST:PORT` -> the Unix socket path of its ZMQ socket."""
        self._server = Server()
        self._targets: dict[Listener, str] = {}
        try:
            for public, target in routes.items():
                listener = self._server.listen(
                    public, secret, CHUNK, PEERS, PENDING, per_address=PER_ADDRESS
                )
                self._targets[listener] = target
        except OSError:
            self._server.close()
            raise
        self._plains: dict[Channel, _Plain] = {}
        self._handlers: dict[Channel, Callable[[int], None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="control-gate")
        self._thread.start()

    @property
    def listeners(self) -> list[Listener]:
        return list(self._targets)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                for listener, channel, message in self._server.poll(POLL_S):
                    self._to_plain(listener, channel, message)
                self._pair_new()
                self._unpair_gone()
                for channel, plain in self._plains.items():  # reading resumes as links drain
                    self._watch(channel, plain)
            except Exception:  # a bug of ours, or the OS's: the next turn serves on
                log.exception("control gate: serving its connections failed")
        for channel in list(self._plains):
            self._close(channel)
        self._server.close()

    def _pair_new(self) -> None:
        for listener in self._targets:
            for channel in listener.authenticated - self._plains.keys():
                self._pair(listener, channel)

    def _pair(self, listener: Listener, channel: Channel) -> _Plain | None:
        """The plain connection to the scheduler socket of an authenticated channel."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(5)
            sock.connect(self._targets[listener])
        except OSError as exc:
            sock.close()
            log.warning("control gate: cannot reach the scheduler socket: %s", exc)
            self._server.drop(channel)
            return None
        plain = _Plain(sock)
        self._plains[channel] = plain
        self._handlers[channel] = self._handler(channel, plain)
        self._watch(channel, plain)
        return plain

    def _watch(self, channel: Channel, plain: _Plain) -> None:
        handler = self._handlers.get(channel)
        if handler is None:
            return
        self._server.pause(channel, len(plain.out) >= BACKLOG)  # the scheduler reads slowly
        events = plain.interest(channel.pending)
        if events:
            self._server.watch(plain.sock, events, handler)
        else:  # paused: its link is backed up and it owes nothing
            self._server.unwatch(plain.sock)

    def _unpair_gone(self) -> None:
        live: set[Channel] = set()
        for listener in self._targets:
            live |= listener.authenticated
        for channel in [c for c in self._plains if c not in live]:
            self._close(channel)

    def _handler(self, channel: Channel, plain: _Plain) -> Callable[[int], None]:
        def on_events(events: int) -> None:
            try:
                if events & selectors.EVENT_WRITE:
                    plain.write()
                data = plain.read() if events & selectors.EVENT_READ else b""
                if data and not self._server.send(channel, [data]):
                    raise ConnectionError("the link is gone")
            except Exception:  # the connection ends (ConnectionError: the other end closed)
                self._close(channel)
                return
            self._watch(channel, plain)

        return on_events

    def _to_plain(self, listener: Listener, channel: Channel, message: list[bytearray]) -> None:
        # bytes may come in the same read as the handshake's end: pair the channel now
        plain = self._plains.get(channel) or self._pair(listener, channel)
        if plain is None:
            return
        try:
            for part in message:
                plain.write(part)
        except OSError:
            self._close(channel)
            return
        self._watch(channel, plain)

    def _close(self, channel: Channel) -> None:
        """End a splice; what its plain side still owes is written if the socket takes it
        now, and the link's queued records are sent by Server.drop as far as they go."""
        plain = self._plains.pop(channel, None)
        self._handlers.pop(channel, None)
        with contextlib.suppress(LinkClosed, OSError):
            channel.flush()
        self._server.drop(channel)
        if plain is not None:
            self._server.unwatch(plain.sock)
            with contextlib.suppress(OSError):
                plain.sock.setblocking(True)
                plain.sock.settimeout(0.5)
                plain.write()
            plain.sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Tunnel:
    """A worker's loopback ports: each connection to one is carried to its gate port."""

    def __init__(self, secret: bytes, gates: list[str], directory: str) -> None:
        """`gates`: the public `tcp://HOST:PORT`s; `local[gate]` is where to connect, an
        ipc:// socket in `directory` (one only this user can enter: channels'
        `private_directory`), which the tunnel owns and removes when it closes."""
        self._secret = secret
        self._selector = selectors.DefaultSelector()
        self._listening: dict[socket.socket, str] = {}
        self.local: dict[str, str] = {}
        self._directory = directory
        for i, gate in enumerate(dict.fromkeys(gates)):
            path = os.path.join(self._directory, f"gate-{i}")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            sock.listen(16)
            sock.setblocking(False)
            self._listening[sock] = gate
            self.local[gate] = f"ipc://{path}"
            self._selector.register(sock, selectors.EVENT_READ, None)
        self._pairs: dict[Channel, _Plain] = {}
        self._waiting: dict[Channel, bytearray] = {}  # bytes read before the handshake ended
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="control-tunnel")
        self._thread.start()

    def _serve(self) -> None:
        drain_until = None
        while True:
            if self._stop.is_set() and drain_until is None:
                drain_until = time.monotonic() + DRAIN_S
            ready = self._selector.select(POLL_S if drain_until is None else 0.01)
            for key, events in ready:
                try:
                    self._on(key, events)
                except Exception:  # a bug of ours: the next turn serves on
                    log.exception("control tunnel: serving a connection failed")
            if drain_until is not None:  # closing: until nothing moves or DRAIN_S passed
                owed = any(c.pending or p.out for c, p in self._pairs.items())
                if (not ready and not owed) or time.monotonic() > drain_until:
                    break
        for channel in list(self._pairs):
            self._close(channel)
        for sock in self._listening:
            sock.close()
        self._selector.close()
        shutil.rmtree(self._directory, ignore_errors=True)

    def _on(self, key: selectors.SelectorKey, events: int) -> None:
        if key.fileobj in self._listening:
            self._accept(key.fileobj)
            return
        channel = key.data
        plain = self._pairs.get(channel)
        if plain is None:
            return
        try:
            if isinstance(key.fileobj, Channel):
                if events & selectors.EVENT_WRITE:
                    channel.flush()
                if events & selectors.EVENT_READ:
                    try:
                        messages = channel.readable()
                    except LinkClosed as exc:  # what came before the close still goes out
                        for message in exc.messages:
                            plain.write(b"".join(message))
                        raise
                    for message in messages:
                        for part in message:
                            plain.write(part)
                if channel.ready and channel in self._waiting:
                    early = self._waiting.pop(channel)
                    for start in range(0, len(early), CHUNK):
                        channel.send([early[start : start + CHUNK]])
                if channel.pending:
                    channel.flush()
            else:
                if events & selectors.EVENT_WRITE:
                    plain.write()
                if events & selectors.EVENT_READ and (data := plain.read()):
                    if channel.ready:
                        channel.send([data])
                        channel.flush()
                    else:
                        self._waiting[channel] += data
        except (LinkClosed, OSError):
            self._close(channel)
            return
        self._interest(channel, plain)

    def _interest(self, channel: Channel, plain: _Plain) -> None:
        """Each side reads only while the other has under BACKLOG bytes queued (a side
        with nothing to wait for is left out of the selector until it has)."""
        link = channel.interest
        if len(plain.out) >= BACKLOG:
            link &= ~selectors.EVENT_READ
        backlog = channel.pending + len(self._waiting.get(channel, b""))
        self._set(channel, link, channel)
        self._set(plain.sock, plain.interest(backlog), channel)

    def _set(self, obj: Channel | socket.socket, events: int, channel: Channel) -> None:
        try:
            self._selector.get_key(obj)
            registered = True
        except KeyError:
            registered = False
        if events and registered:
            self._selector.modify(obj, events, channel)
        elif events:
            self._selector.register(obj, events, channel)
        elif registered:
            self._selector.unregister(obj)

    def _accept(self, listening: socket.socket) -> None:
        try:
            sock, _ = listening.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            channel = Channel.connect(self._listening[listening], self._secret, CHUNK)
        except (LinkClosed, ValueError) as exc:
            log.warning("control tunnel: cannot reach the gate: %s", exc)
            sock.close()
            return
        plain = _Plain(sock)
        self._pairs[channel] = plain
        self._waiting[channel] = bytearray()
        self._selector.register(channel, channel.interest, channel)
        self._selector.register(plain.sock, plain.interest(0), channel)

    def _close(self, channel: Channel) -> None:
        plain = self._pairs.pop(channel, None)
        self._waiting.pop(channel, None)
        for obj in (channel, plain.sock if plain is not None else None):
            if obj is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(obj)
        channel.close()
        if plain is not None:
            plain.sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
