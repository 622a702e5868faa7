"""The KV link of prefill/decode disaggregation: messages over TCP (or a Unix socket), each
connection mutually authenticated with a secret both ends derive from the PD key, every
record encrypted and authenticated, and a listener that bounds what strangers can hold.

Why not ZeroMQ's CURVE (what the link used before): a ZeroMQ listener accepts every TCP
connection it sees and gives no way to refuse or drop one, so a peer without the key could
still hold a file descriptor per connection for the handshake's time, as many as it opens.
Here the listener counts: at most `per_address` connections from one address may be
authenticating at once (more are closed at accept), and at most `pending` in all; a new one
past that evicts the oldest that has not yet sent a valid hello (one that has holds the key:
it is never evicted by strangers, and when all of them have, the new connection is closed
instead). A sender's hello follows its connect at once, so a flood of idle strangers, from
one address or many, cannot lock out a sender whose handshake takes round trips. Each
connection has HANDSHAKE_S to prove itself, at most `peers`
authenticated connections are kept (a further one is closed), and an authenticated one
silent for `idle_s` is closed (a sender that keeps its connection pings every PING_S).

The protocol, both ends holding a 32-byte `secret` S (a Noise NNpsk0-like handshake: the
initiator proves first, ephemeral X25519 keys give forward secrecy):
1. the connecting end (initiator) sends MAGIC, its fresh X25519 public key Ei and
   Pi = HMAC-SHA256(S, "initiator hello" MAGIC Ei). The listening end (responder) checks Pi
   before it sends a byte: a stranger is closed having learnt nothing it could test guesses
   of S against. A hello repeating an Ei among the listener's last REPLAY_WINDOW is closed
   too (a replayed hello could not finish anyway: it lacks Ei's private half).
2. the responder sends its fresh X25519 public key Er and Pr = HMAC(Kr, H), where
   H = SHA-256(MAGIC Ei Pi Er), D = X25519(er, Ei) = X25519(ei, Er), and
   HKDF-SHA256(S D, salt H, info "pipeserve kv link 2") gives 128 bytes: Kr, Ki, Kir, Kri.
3. the initiator checks Pr (the responder holds S and er) and sends Ci = HMAC(Ki, H); the
   responder checks Ci (the initiator holds S and ei, so the hello was not replayed).
Records then go initiator to responder under the AES-256-GCM key Kir, the other way under
Kri, a record counter as the GCM nonce: a record that was altered, replayed, reordered or
left out fails to decrypt, and the connection is closed. The ephemeral keys are dropped once
the keys are made, so a recording cannot be decrypted with S learnt later; someone who
recorded a hello can still test guesses of S against Pi offline, which is why S derives from
a key of at least 128 random bits (auth.py refuses shorter ones). A record is its
ciphertext's length (4 bytes) then the ciphertext; a message is a head record (how many
parts, and each part's size) followed by a record per part. A head announcing a part over
the listener's `max_part`, or a record whose length is not the one announced, closes the
connection before any of its body is read. A message of no parts is a ping.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import os
import selectors
import socket
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

MAGIC = b"PSKVLNK2"
PUBLIC, MAC, TAG = 32, 32, 16
HELLO = len(MAGIC) + PUBLIC + MAC
KDF_INFO = b"pipeserve kv link 2"
REPLAY_WINDOW = 4096  # hellos a listener remembers, to close one that repeats
MAX_PARTS = 8
HEAD = struct.Struct(">H")  # number of parts; then one SIZE per part
SIZE = struct.Struct(">Q")
LENGTH = struct.Struct(">I")  # a record's ciphertext length
MAX_HEAD = HEAD.size + MAX_PARTS * SIZE.size + TAG
HANDSHAKE_S = 5.0  # a connection that has not authenticated by then is closed
PING_S = 20.0  # an initiator with nothing to send pings this often
READ_BUDGET = 8 << 20  # bytes read from one connection before the others get a turn
SOCKET_BUFFER = 4 << 20
BACKLOG = 128  # connections the kernel holds for accept (not descriptors of ours)


class LinkClosed(Exception):
    """The connection is over: the peer closed it, it failed, or it broke the protocol.
    `messages`: those it completed before that, in the same read."""

    messages: list[list[bytearray]] = []


def derive(key: str, label: str) -> bytes:
    """A link's 32-byte secret from the PD key, under the link's own label."""
    return hmac.new(key.encode(), f"pipeserve {label}".encode(), hashlib.sha256).digest()


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _public(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class Handshake:
    """What both ends compute from the handshake: H and the four keys (module docstring)."""

    def __init__(
        self, secret: bytes, private: X25519PrivateKey, peer: bytes, hello: bytes, er: bytes
    ):
        """`private`: this end's ephemeral key; `peer`: the other end's public key."""
        try:
            shared = private.exchange(X25519PublicKey.from_public_bytes(peer))
        except ValueError as exc:  # a low-order point: no shared secret
            raise LinkClosed("a malformed handshake key") from exc
        self.h = hashlib.sha256(hello + er).digest()
        okm = HKDF(hashes.SHA256(), 4 * MAC, self.h, KDF_INFO).derive(secret + shared)
        self.kr, self.ki, self.kir, self.kri = (okm[i : i + MAC] for i in range(0, 4 * MAC, MAC))


class Recent:
    """The last REPLAY_WINDOW handshake keys a listener was sent."""

    def __init__(self) -> None:
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def first_time(self, key: bytes) -> bool:
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > REPLAY_WINDOW:
            self._seen.popitem(last=False)
        return True


def _address(endpoint: str) -> tuple[int, Any]:
    """(family, address) of `tcp://HOST:PORT` or `ipc://PATH`; ValueError otherwise."""
    if endpoint.startswith("ipc://"):
        return socket.AF_UNIX, endpoint.removeprefix("ipc://")
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp:// or ipc:// endpoint: {endpoint!r}")
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not (port == "*" or port.isdigit()):
        raise ValueError(f"not a tcp://HOST:PORT endpoint: {endpoint!r}")
    family, _, _, _, addr = socket.getaddrinfo(host, 0 if port == "*" else int(port))[0]
    return family, addr


class Channel:
    """One end of a connection: non-blocking, driven by its owner's selector loop through
    `readable()` (complete messages) and `flush()` (queued bytes out)."""

    def __init__(
        self,
        sock: socket.socket,
        secret: bytes,
        initiator: bool,
        max_part: int,
        recent: Recent | None = None,
    ):
        """`recent`: a responder's listener's memory of hellos (None: replays not looked
        for)."""
        sock.setblocking(False)
        self.sock, self.secret, self.initiator, self.max_part = sock, secret, initiator, max_part
        self.ready = False
        self.opened_at = self.heard_at = self.sent_at = time.monotonic()
        self._out: collections.deque[memoryview] = collections.deque()
        self.pending = 0  # bytes queued, not yet taken by the socket
        self._recent = recent
        # a responder makes its key once the hello proved the secret (strangers cost nothing)
        self._ephemeral = X25519PrivateKey.generate() if initiator else None
        self._hello = b""
        self._handshake: Handshake | None = None
        self._seal: AESGCM | None = None
        self._open: AESGCM | None = None
        self._sent_records = self._read_records = 0
        self._sizes: list[int] = []  # the sizes of the message's parts still to come
        self._parts: list[bytearray] = []
        self._state = "hello-reply" if initiator else "hello"
        self._want(PUBLIC + MAC if initiator else HELLO)
        if self._ephemeral is not None:  # the initiator
            ei = _public(self._ephemeral)
            self._hello = MAGIC + ei + _mac(secret, b"initiator hello" + MAGIC + ei)
            self._queue(self._hello)

    @classmethod
    def connect(cls, endpoint: str, secret: bytes, max_part: int) -> Channel:
        """The initiating end, its connect under way (ValueError for an endpoint that is
        not tcp:// or ipc://, LinkClosed if the connect fails at once)."""
        family, addr = _address(endpoint)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _tune(sock)
            sock.setblocking(False)
            code = sock.connect_ex(addr)
        except OSError as exc:
            sock.close()
            raise LinkClosed(f"cannot connect: {exc}") from exc
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            raise LinkClosed(f"cannot connect: {os.strerror(code)}")
        channel = cls(sock, secret, True, max_part)
        channel.connecting = code != 0
        return channel

    connecting = False
    paused = False  # its owner reads nothing from it for now (the reader behind is full)
    address = ""  # a responder's peer address (its listener counts per address)

    @property
    def proven(self) -> bool:
        """A responder's peer sent a valid hello (it holds the secret; not yet confirmed)."""
        return self._state != "hello"

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def interest(self) -> int:
        """The selector events to wait for: reading unless its owner paused it, writing
        while bytes are queued (or the connect is under way)."""
        writing = self.pending or self.connecting
        reading = 0 if self.paused else selectors.EVENT_READ
        return reading | (selectors.EVENT_WRITE if writing else 0)

    def close(self) -> None:
        self.sock.close()

    # -- writing ------------------------------------------------------------------------

    def send(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Queue a message (no parts: a ping); `flush()` sends it."""
        assert self.ready and self._seal is not None and len(parts) <= MAX_PARTS
        head = HEAD.pack(len(parts)) + b"".join(SIZE.pack(len(p)) for p in parts)
        for data in (head, *parts):
            nonce = self._sent_records.to_bytes(12, "big")
            self._sent_records += 1
            sealed = self._seal.encrypt(nonce, data, None)
            self._queue(LENGTH.pack(len(sealed)))
            self._queue(sealed)
        self.sent_at = time.monotonic()

    def _queue(self, data: bytes) -> None:
        if data:
            self._out.append(memoryview(data))
            self.pending += len(data)

    def flush(self) -> int:
        """Send what the socket takes now; returns the bytes sent (LinkClosed on failure)."""
        if self.connecting:
            code = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise LinkClosed(f"cannot connect: {os.strerror(code)}")
            try:
                self.sock.getpeername()
            except OSError:
                return 0  # still connecting
            self.connecting = False
        sent = 0
        while self._out:
            try:
                n = self.sock.sendmsg(list(self._out)[:64])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise LinkClosed(f"send failed: {exc}") from exc
            sent += n
            self.pending -= n
            while n:
                head = self._out[0]
                if n >= len(head):
                    n -= len(head)
                    self._out.popleft()
                else:
                    self._out[0] = head[n:]
                    n = 0
        return sent

    # -- reading ------------------------------------------------------------------------

    def _want(self, n: int) -> None:
        self._buf = bytearray(n)
        self._got = 0

    def readable(self) -> list[list[bytearray]]:
        """Read what has arrived: the messages it completes (LinkClosed on EOF, an error or
        a breach of the protocol, carrying the messages completed before it)."""
        messages: list[list[bytearray]] = []
        try:
            self._read_into(messages)
        except LinkClosed as exc:
            exc.messages = messages
            raise
        return messages

    def _read_into(self, messages: list[list[bytearray]]) -> None:
        budget = READ_BUDGET
        while budget > 0:
            try:
                n = self.sock.recv_into(memoryview(self._buf)[self._got :])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise LinkClosed(f"receive failed: {exc}") from exc
            if n == 0:
                raise LinkClosed("the peer closed the connection")
            self._got += n
            budget -= n
            self.heard_at = time.monotonic()
            if self._got == len(self._buf):
                message = self._on_record(self._buf)
                if message is not None:
                    messages.append(message)

    def _on_record(self, data: bytearray) -> list[bytearray] | None:
        state = self._state
        if state == "hello":  # responder: MAGIC Ei Pi
            hello = bytes(data)
            ei = hello[len(MAGIC) : len(MAGIC) + PUBLIC]
            if hello[: len(MAGIC)] != MAGIC:
                raise LinkClosed("not the KV link protocol")
            want = _mac(self.secret, b"initiator hello" + MAGIC + ei)
            if not hmac.compare_digest(hello[len(MAGIC) + PUBLIC :], want):
                raise LinkClosed("the peer does not hold the link's key")
            if self._recent is not None and not self._recent.first_time(ei):
                raise LinkClosed("a replayed hello")
            mine = X25519PrivateKey.generate()
            er = _public(mine)
            self._handshake = Handshake(self.secret, mine, ei, hello, er)
            self._ephemeral = None
            self._queue(er + _mac(self._handshake.kr, self._handshake.h))
            self._state = "proof"
            self._want(MAC)
        elif state == "hello-reply":  # initiator: Er Pr
            er, proof = bytes(data[:PUBLIC]), bytes(data[PUBLIC:])
            assert self._ephemeral is not None
            hs = Handshake(self.secret, self._ephemeral, er, self._hello, er)
            self._ephemeral = None
            if not hmac.compare_digest(proof, _mac(hs.kr, hs.h)):
                raise LinkClosed("the listener does not hold the link's key")
            self._queue(_mac(hs.ki, hs.h))
            self._keys(hs)
        elif state == "proof":  # responder: Ci
            made = self._handshake
            assert made is not None
            if not hmac.compare_digest(bytes(data), _mac(made.ki, made.h)):
                raise LinkClosed("the peer does not hold the link's key")
            self._keys(made)
        elif state == "length":
            (length,) = LENGTH.unpack(data)
            if self._sizes:
                ok = length == self._sizes[0] + TAG
            else:
                ok = HEAD.size + TAG <= length <= MAX_HEAD
            if not ok:
                raise LinkClosed("a record of a length not announced")
            self._state = "record"
            self._want(length)
        else:  # a record
            plain = self._decrypt(data)
            self._state = "length"
            self._want(LENGTH.size)
            if self._sizes:
                self._sizes.pop(0)
                self._parts.append(plain)
                if not self._sizes:
                    parts, self._parts = self._parts, []
                    return parts
                return None
            return self._on_head(plain)
        return None

    def _on_head(self, plain: bytearray) -> list[bytearray] | None:
        (count,) = HEAD.unpack_from(plain)
        if count > MAX_PARTS or len(plain) != HEAD.size + count * SIZE.size:
            raise LinkClosed("a malformed message head")
        sizes = [SIZE.unpack_from(plain, HEAD.size + i * SIZE.size)[0] for i in range(count)]
        if any(s > self.max_part for s in sizes):
            raise LinkClosed("a message part over the size limit")
        self._sizes = sizes
        return None  # no parts: a ping

    def _decrypt(self, data: bytearray) -> bytearray:
        assert self._open is not None
        nonce = self._read_records.to_bytes(12, "big")
        self._read_records += 1
        plain = bytearray(len(data) - TAG)
        try:
            self._open.decrypt_into(nonce, data, None, plain)
        except InvalidTag as exc:
            raise LinkClosed("a record failed authentication") from exc
        return plain

    def _keys(self, hs: Handshake) -> None:
        i2r, r2i = AESGCM(hs.kir), AESGCM(hs.kri)
        self._seal, self._open = (i2r, r2i) if self.initiator else (r2i, i2r)
        self._handshake = None
        self.ready = True
        self._state = "length"
        self._want(LENGTH.size)


def _tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


@dataclass(eq=False)
class Listener:
    """A listening socket and the connections it accepted."""

    sock: socket.socket
    endpoint: str
    secret: bytes
    max_part: int
    peers: int  # authenticated connections kept at most
    pending: int  # connections authenticating at once, at most
    idle_s: float | None  # an authenticated connection silent this long is closed
    authenticating: dict[Channel, None] = field(default_factory=dict)  # oldest first
    authenticated: set[Channel] = field(default_factory=set)
    per_address: int = 8  # connections one address may have authenticating at once
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    recent: Recent = field(default_factory=Recent)  # hellos seen lately (replays are closed)
    pending_from: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class Watch:
    """A socket the Server's owner serves in the same poll (`Server.watch`)."""

    on_events: Callable[[int], None]


class Server:
    """Listeners and their connections, served by one thread's `poll()`."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._owner: dict[Channel, Listener] = {}

    def listen(
        self,
        address: str,
        secret: bytes,
        max_part: int,
        peers: int,
        pending: int,
        idle_s: float | None = None,
        per_address: int = 8,
    ) -> Listener:
        """Listen at `tcp://HOST:PORT` (`*`: any free port) or `ipc://PATH`. At most
        `pending` connections authenticate at once (module docstring: who is evicted) and at
        most `per_address` from one address (more are closed at accept; a Unix socket's
        peers are one address)."""
        family, addr = _address(address)
        sock = socket.socket(family, socket.SOCK_STREAM)
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        if family == socket.AF_UNIX:
            endpoint = f"ipc://{addr}"
        else:
            host, port = sock.getsockname()[:2]
            endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        if family == socket.AF_UNIX:
            per_address = pending
        listener = Listener(
            sock, endpoint, secret, max_part, peers, pending, idle_s, per_address=per_address
        )
        self._selector.register(sock, selectors.EVENT_READ, listener)
        return listener

    def poll(self, timeout_s: float) -> list[tuple[Listener, Channel, list[bytearray]]]:
        """Serve the sockets for up to `timeout_s`: messages that arrived, with the listener
        and connection they came on."""
        got: list[tuple[Listener, Channel, list[bytearray]]] = []
        for key, events in self._selector.select(timeout_s):
            if isinstance(key.data, Watch):  # a socket of the owner's, served alongside
                key.data.on_events(events)
                continue
            if not isinstance(key.fileobj, Channel):
                self._accept(key.data)
                continue
            channel = key.fileobj
            listener = key.data
            try:
                if events & selectors.EVENT_WRITE:
                    channel.flush()
                if events & selectors.EVENT_READ:
                    for message in channel.readable():
                        got.append((listener, channel, message))
                    if channel.ready and channel in listener.authenticating:
                        self._admit(listener, channel)
                    if channel.pending:  # the handshake's answer, at once
                        channel.flush()
                self._interest(channel)
            except LinkClosed as exc:
                got += [(listener, channel, m) for m in exc.messages]
                if channel in listener.authenticating:
                    listener.refused["failed or left the handshake"] += 1
                self.drop(channel)
        self._sweep(time.monotonic())
        return got

    def watch(self, sock: socket.socket, events: int, on_events: Callable[[int], None]) -> None:
        """Serve another socket in the same `poll()`: `on_events(events)` when it is ready
        (`events` again to change what to wait for, `unwatch` before closing it)."""
        watch = Watch(on_events)
        if self._watched(sock):
            self._selector.modify(sock, events, watch)
        else:
            self._selector.register(sock, events, watch)

    def _watched(self, sock: socket.socket | Channel) -> bool:
        try:
            self._selector.get_key(sock)
        except KeyError:
            return False
        return True

    def unwatch(self, sock: socket.socket) -> None:
        if self._watched(sock):
            self._selector.unregister(sock)

    def send(self, channel: Channel, parts: Sequence[bytes | bytearray | memoryview]) -> bool:
        """Queue a message to a connection (False if it is gone)."""
        if channel not in self._owner:
            return False
        try:
            channel.send(parts)
            channel.flush()
            self._interest(channel)
        except LinkClosed:
            self.drop(channel)
            return False
        return True

    def connections(self, listener: Listener) -> int:
        return len(listener.authenticating) + len(listener.authenticated)

    def _accept(self, listener: Listener) -> None:
        for _ in range(64):  # a burst is taken in a few turns, never all at once
            try:
                sock, addr = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors or a reset before accept: not fatal
                listener.refused["accept failed"] += 1
                return
            if len(listener.authenticated) >= listener.peers:
                listener.refused["over the peer limit"] += 1
                sock.close()
                continue
            address = addr[0] if isinstance(addr, tuple) else "local"
            if listener.pending_from[address] >= listener.per_address:
                listener.refused["over the per-address pending limit"] += 1
                sock.close()
                continue
            if len(listener.authenticating) >= listener.pending and not self._evict(listener):
                listener.refused["over the pending limit"] += 1  # all are key holders'
                sock.close()
                continue
            try:
                _tune(sock)
                channel = Channel(sock, listener.secret, False, listener.max_part, listener.recent)
            except OSError:  # reset between accept and now
                sock.close()
                continue
            channel.address = address
            listener.pending_from[address] += 1
            listener.authenticating[channel] = None
            self._owner[channel] = listener
            self._selector.register(channel, selectors.EVENT_READ, listener)

    def _evict(self, listener: Listener) -> bool:
        """Make room among the connections authenticating: drop the oldest that has not
        sent a valid hello, after reading what it sent (a hello may be waiting in its socket,
        not read yet). False when every one of them has."""
        for channel in list(listener.authenticating):
            if channel.proven:
                continue
            try:
                channel.readable()  # a responder's hello: no messages yet
                if channel.pending:
                    channel.flush()
                self._interest(channel)
            except LinkClosed:
                listener.refused["failed or left the handshake"] += 1
                self.drop(channel)
                return True
            if not channel.proven:
                listener.refused["evicted while authenticating"] += 1
                self.drop(channel)
                return True
        return False

    def _admit(self, listener: Listener, channel: Channel) -> None:
        self._unpend(listener, channel)
        if len(listener.authenticated) >= listener.peers:
            listener.refused["over the peer limit"] += 1
            self.drop(channel)
        else:
            listener.authenticated.add(channel)

    def pause(self, channel: Channel, paused: bool) -> None:
        """Stop (or resume) reading a connection: its peer's sends then wait on TCP."""
        if channel.paused != paused:
            channel.paused = paused
            self._interest(channel)

    def _interest(self, channel: Channel) -> None:
        if channel not in self._owner:
            return
        events = channel.interest
        registered = self._watched(channel)
        if events and registered:
            if self._selector.get_key(channel).events != events:
                self._selector.modify(channel, events, self._owner[channel])
        elif events:
            self._selector.register(channel, events, self._owner[channel])
        elif registered:  # paused with nothing to send: nothing to wait for
            self._selector.unregister(channel)

    def _sweep(self, now: float) -> None:
        for listener in {*self._owner.values()}:
            for channel in list(listener.authenticating):
                if now - channel.opened_at > HANDSHAKE_S:
                    listener.refused["no handshake in time"] += 1
                    self.drop(channel)
            if listener.idle_s is not None:
                for channel in [
                    c for c in listener.authenticated if now - c.heard_at > listener.idle_s
                ]:
                    listener.refused["idle"] += 1
                    self.drop(channel)

    @staticmethod
    def _unpend(listener: Listener, channel: Channel) -> None:
        if listener.authenticating.pop(channel, 0) is None:  # it was there
            listener.pending_from[channel.address] -= 1
            if listener.pending_from[channel.address] <= 0:
                del listener.pending_from[channel.address]

    def drop(self, channel: Channel) -> None:
        listener = self._owner.pop(channel, None)
        if listener is None:
            return
        self._unpend(listener, channel)
        listener.authenticated.discard(channel)
        if self._watched(channel):
            self._selector.unregister(channel)
        channel.close()

    def close(self) -> None:
        for channel in list(self._owner):
            self.drop(channel)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            if isinstance(key.data, Listener):
                key.data.sock.close()
        self._selector.close()


def drive(channels: Iterable[Channel], timeout_s: float) -> list[tuple[Channel, list[bytearray]]]:
    """For initiators: flush what is queued and read what arrives within `timeout_s`. A
    channel that fails raises LinkClosed with the channel as its second argument."""
    selector = selectors.DefaultSelector()
    try:
        for channel in channels:
            selector.register(channel, channel.interest)
        got = []
        for key, events in selector.select(timeout_s):
            channel = key.fileobj  # type: ignore[assignment]
            try:
                if events & selectors.EVENT_WRITE:
                    channel.flush()
                if events & selectors.EVENT_READ:
                    got += [(channel, m) for m in channel.readable()]
                if channel.ready and channel.pending:
                    channel.flush()
            except LinkClosed as exc:
                raise LinkClosed(str(exc), channel) from exc
        return got
    finally:
        selector.close()
