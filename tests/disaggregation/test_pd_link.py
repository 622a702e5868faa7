"""The KV link (pipeserve/disaggregation/pd/link.py): messages arrive whole and in order
between holders of the secret; a peer without it, a tampered or replayed record, a part over
the limit and a record of a length not announced each end the connection with nothing
delivered; and the listener bounds what anyone holds: connections authenticating (the
oldest evicted), authenticated ones, a handshake's time and an idle peer's.

The peers here speak the protocol from its description (`RawPeer`: its own handshake, key
derivation and record framing over a plain socket), so they check link.py against the
protocol, not against itself."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pipeserve.disaggregation.pd import link
from pipeserve.disaggregation.pd.link import Channel, LinkClosed, Server

pytestmark = pytest.mark.timeout(60)

SECRET = link.derive("test-pd-key", "test link")


class RawPeer:
    """An initiator written from the protocol's description, over a blocking socket."""

    def __init__(self, endpoint: str, secret: bytes = SECRET, proof: bytes | None = None):
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        ni = os.urandom(32)
        self.sock.sendall(b"PSKVLNK1" + ni)
        reply = self.read(64)
        nr, their_proof = reply[:32], reply[32:]
        mac = lambda label: hmac.new(secret, label + ni + nr, hashlib.sha256).digest()  # noqa: E731
        self.authentic = hmac.compare_digest(their_proof, mac(b"responder"))
        self.proof = mac(b"initiator") if proof is None else proof
        self.sock.sendall(self.proof)
        self.seal = AESGCM(mac(b"i>r"))
        self.counter = 0

    def read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            got = self.sock.recv(n - len(data))
            if not got:
                raise ConnectionError("closed")
            data += got
        return data

    def record(self, plain: bytes) -> bytes:
        sealed = self.seal.encrypt(self.counter.to_bytes(12, "big"), plain, None)
        self.counter += 1
        return struct.pack(">I", len(sealed)) + sealed

    def message(self, parts: list[bytes]) -> bytes:
        head = struct.pack(">H", len(parts)) + b"".join(struct.pack(">Q", len(p)) for p in parts)
        return self.record(head) + b"".join(self.record(p) for p in parts)

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        return closed(self.sock, timeout)

    def close(self) -> None:
        self.sock.close()


def closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other end closes `sock` within `timeout` (sending nothing first)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


class Served:
    """A Server with one listener, polled by a thread; what arrives is kept."""

    def __init__(self, **limits) -> None:
        self.server = Server()
        args = {"max_part": 1 << 20, "peers": 8, "pending": 8, "idle_s": None} | limits
        self.listener = self.server.listen("tcp://127.0.0.1:*", SECRET, **args)
        self.got: list[list[bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            for _listener, _channel, message in self.server.poll(0.02):
                with self.lock:
                    self.got.append([bytes(p) for p in message])
        self.server.close()

    def connections(self) -> int:
        return len(self.listener.authenticating) + len(self.listener.authenticated)

    def wait(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate():
                    return True
            time.sleep(0.01)
        return False


@pytest.fixture
def served(request) -> Iterator:
    made: list[Served] = []

    def make(**limits) -> Served:
        made.append(Served(**limits))
        return made[-1]

    yield make
    for s in made:
        s.stop.set()
        s.thread.join(5)


def connected(endpoint: str, secret: bytes = SECRET) -> Channel:
    channel = Channel.connect(endpoint, secret, max_part=0)
    deadline = time.monotonic() + 5
    while not channel.ready:
        assert time.monotonic() < deadline, "no handshake"
        link.drive([channel], 0.05)
    return channel


def send(channel: Channel, parts: list[bytes]) -> None:
    channel.send(parts)
    while channel.pending:
        link.drive([channel], 0.05)


def test_messages_arrive_whole_and_in_order(served) -> None:
    s = served(max_part=3 << 20)
    channel = connected(s.listener.endpoint)
    big = os.urandom(3 << 20)
    messages = [[b"a"], [b"", b"x" * 100, b""], [big, b"tail"], [b"z"] * link.MAX_PARTS]
    for m in messages:
        send(channel, m)
    send(channel, [])  # a ping: keeps the connection, delivers nothing
    assert s.wait(lambda: len(s.got) >= 4)
    time.sleep(0.1)
    assert s.got == messages
    channel.close()


def test_the_raw_protocol_is_understood(served) -> None:
    """A peer written from the description gets its messages through (the oracle for the
    refusals below: they differ from this in one thing each)."""
    s = served()
    peer = RawPeer(s.listener.endpoint)
    assert peer.authentic
    peer.sock.sendall(peer.message([b"header", b"payload"]))
    assert s.wait(lambda: s.got == [[b"header", b"payload"]])
    peer.close()


def test_a_peer_without_the_secret_gets_nothing_in(served) -> None:
    s = served()
    wrong = link.derive("another key", "test link")
    impostor = RawPeer(s.listener.endpoint, secret=wrong)
    assert not impostor.authentic  # it cannot tell the listener is genuine either
    impostor.sock.sendall(impostor.message([b"forged"]))
    assert impostor.closed_by_peer()
    # link.py's own initiator refuses a listener that does not prove the secret
    with pytest.raises(LinkClosed, match="does not hold the link's key"):
        connected(s.listener.endpoint, secret=wrong)
    # a stranger that replays a genuine peer's proof (from another connection) fails too
    genuine = RawPeer(s.listener.endpoint)
    replay = RawPeer(s.listener.endpoint, proof=genuine.proof)
    replay.sock.sendall(replay.message([b"forged"]))
    assert replay.closed_by_peer()
    junk = socket.create_connection(s.listener.sock.getsockname(), timeout=5)
    junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(40))
    assert closed(junk)
    junk.close()
    genuine.close()
    time.sleep(0.2)
    assert s.got == []
    assert s.listener.refused["failed or left the handshake"] >= 3


def test_a_tampered_replayed_or_unannounced_record_ends_the_connection(served) -> None:
    s = served()
    cases = []
    tampered = RawPeer(s.listener.endpoint)
    data = bytearray(tampered.message([b"payload"]))
    data[-1] ^= 1
    cases.append((tampered, bytes(data)))
    replayed = RawPeer(s.listener.endpoint)
    first = replayed.message([b"one"])
    cases.append((replayed, first + first))  # the second copy's counter is stale
    unannounced = RawPeer(s.listener.endpoint)
    head = unannounced.record(struct.pack(">HQ", 1, 5))
    cases.append((unannounced, head + unannounced.record(b"not five bytes")))
    too_many = RawPeer(s.listener.endpoint)
    parts = struct.pack(">H", link.MAX_PARTS + 1) + struct.pack(">Q", 1) * (link.MAX_PARTS + 1)
    cases.append((too_many, too_many.record(parts)))
    for peer, data in cases:
        peer.sock.sendall(data)
        assert peer.closed_by_peer()
        peer.close()
    time.sleep(0.1)
    assert s.got == [[b"one"]]  # the replayed connection's genuine first message only


def test_a_part_over_the_limit_is_refused_at_its_head(served) -> None:
    """A head announcing 4 GiB: the connection closes before any of the body is read; the
    listener would otherwise take every byte."""
    s = served(max_part=1 << 20)
    peer = RawPeer(s.listener.endpoint)
    peer.sock.sendall(peer.record(struct.pack(">HQ", 1, 4 << 30)))
    sent, chunk = 0, bytes(1 << 20)
    with contextlib.suppress(OSError):
        while sent < 256 << 20:
            peer.sock.sendall(chunk)
            sent += len(chunk)
    peer.close()
    assert sent < 256 << 20, "the listener kept reading a 4 GiB part"


def test_strangers_cannot_hold_more_than_the_pending_limit(served) -> None:
    """300 connections that never speak: the listener keeps at most `pending` of them (the
    oldest evicted), so their descriptors are bounded, and a genuine peer arriving among
    them still authenticates and delivers."""
    s = served(pending=16, peers=4)
    address = s.listener.sock.getsockname()
    strangers = []
    try:
        for i in range(300):
            strangers.append(socket.create_connection(address, timeout=5))
            if i == 150:
                channel = connected(s.listener.endpoint)
                send(channel, [b"still served"])
        assert s.wait(lambda: s.got == [[b"still served"]])
        assert s.wait(lambda: s.listener.refused["evicted while authenticating"] >= 280)
        assert s.connections() <= 16 + 1
        assert len(s.listener.authenticated) == 1
    finally:
        for sock in strangers:
            sock.close()


def test_authenticated_peers_are_capped(served) -> None:
    s = served(peers=2)
    first, second = connected(s.listener.endpoint), connected(s.listener.endpoint)
    assert s.wait(lambda: len(s.listener.authenticated) == 2)
    third = socket.create_connection(s.listener.sock.getsockname(), timeout=5)
    third.sendall(b"PSKVLNK1" + os.urandom(32))
    assert closed(third)  # at accept: no handshake is even answered
    third.close()
    assert s.listener.refused["over the peer limit"] == 1
    send(first, [b"1"])
    send(second, [b"2"])
    assert s.wait(lambda: sorted(s.got) == [[b"1"], [b"2"]])


def test_a_silent_stranger_and_an_idle_peer_are_closed(served, monkeypatch) -> None:
    monkeypatch.setattr(link, "HANDSHAKE_S", 0.3)
    s = served(idle_s=0.6)
    stranger = socket.create_connection(s.listener.sock.getsockname(), timeout=5)
    idle = RawPeer(s.listener.endpoint)
    pinging = connected(s.listener.endpoint)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:
        send(pinging, [])
        time.sleep(0.1)
    assert closed(stranger, timeout=0.1)
    assert idle.closed_by_peer(timeout=0.1)
    assert s.listener.refused["no handshake in time"] == 1 and s.listener.refused["idle"] == 1
    send(pinging, [b"alive"])
    assert s.wait(lambda: s.got == [[b"alive"]])
    stranger.close()
