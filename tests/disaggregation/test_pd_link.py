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
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from floods import Flood, stranger

from pipeserve.disaggregation.pd import link
from pipeserve.disaggregation.pd.link import Channel, LinkClosed, Server

pytestmark = pytest.mark.timeout(60)

SECRET = link.derive("test-pd-key", "test link")


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


MAGIC = b"PSKVLNK2"


class RawPeer:
    """An initiator written from the protocol's description, over a blocking socket.
    `hello`: send this instead of a fresh hello (a replay); `confirm`: send this instead of
    the key confirmation."""

    def __init__(
        self,
        endpoint: str,
        secret: bytes = SECRET,
        hello: bytes | None = None,
        confirm: bytes | None = None,
    ):
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        mine = X25519PrivateKey.generate()
        ei = mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.hello = hello or MAGIC + ei + _hmac(secret, b"initiator hello" + MAGIC + ei)
        self.sock.sendall(self.hello)
        self.reply = self.read_all(64)  # b"" when the listener closed without a word
        self.authentic = False
        self.counter = 0
        if len(self.reply) < 64:
            return
        er, their_proof = self.reply[:32], self.reply[32:]
        shared = mine.exchange(X25519PublicKey.from_public_bytes(er))
        h = hashlib.sha256(self.hello + er).digest()
        okm = HKDF(hashes.SHA256(), 128, h, b"pipeserve kv link 2").derive(secret + shared)
        kr, ki, kir = okm[:32], okm[32:64], okm[64:96]
        self.authentic = hmac.compare_digest(their_proof, _hmac(kr, h))
        self.sock.sendall(_hmac(ki, h) if confirm is None else confirm)
        self.seal = AESGCM(kir)

    def read_all(self, n: int) -> bytes:
        """Up to `n` bytes: fewer only when the other end closes first."""
        data = b""
        while len(data) < n:
            try:
                got = self.sock.recv(n - len(data))
            except ConnectionResetError:
                return data
            if not got:
                return data
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
    """A stranger's hello is answered by nothing at all: no proof of the listener's to test
    guesses of the key against offline (the old protocol answered every hello with one)."""
    s = served()
    wrong = link.derive("another key", "test link")
    impostor = RawPeer(s.listener.endpoint, secret=wrong)
    assert impostor.reply == b""  # closed before a byte was sent back
    assert not impostor.authentic
    # the old protocol's hello, and a hello with a random proof: nothing either
    for hello in (b"PSKVLNK1" + os.urandom(64), MAGIC + os.urandom(64)):
        stranger = socket.create_connection(s.listener.sock.getsockname(), timeout=5)
        stranger.sendall(hello)
        assert closed(stranger)
        stranger.close()
    # link.py's own initiator is closed by a listener under another secret, and refuses a
    # listener that answers without proving the secret
    with pytest.raises(LinkClosed, match="closed the connection"):
        connected(s.listener.endpoint, secret=wrong)
    with socket.create_server(("127.0.0.1", 0)) as fake:

        def answer_anything() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.recv(72)
                conn.sendall(X25519PrivateKey.generate().public_key().public_bytes_raw())
                conn.sendall(os.urandom(32))
                conn.recv(1)

        threading.Thread(target=answer_anything, daemon=True).start()
        port = fake.getsockname()[1]
        with pytest.raises(LinkClosed, match="does not hold the link's key"):
            connected(f"tcp://127.0.0.1:{port}")
    # a recorded hello replayed: closed unanswered while the listener remembers it
    genuine = RawPeer(s.listener.endpoint)
    assert genuine.authentic
    replay = RawPeer(s.listener.endpoint, hello=genuine.hello)
    assert replay.reply == b""
    # a confirmation that is not the initiator's: closed
    wrong_confirm = RawPeer(s.listener.endpoint, confirm=os.urandom(32))
    assert wrong_confirm.authentic  # the listener proved itself, but takes nothing
    wrong_confirm.sock.sendall(wrong_confirm.message([b"forged"]))
    assert wrong_confirm.closed_by_peer()
    junk = socket.create_connection(s.listener.sock.getsockname(), timeout=5)
    junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(60))
    assert closed(junk)
    junk.close()
    genuine.close()
    time.sleep(0.2)
    assert s.got == []
    assert s.listener.refused["failed or left the handshake"] >= 6


def test_a_replayed_hello_that_is_answered_cannot_finish(served) -> None:
    """Past the listener's memory a replayed hello gets an answer, but without the private
    half of its key the replayer cannot confirm, nor read or write a record."""
    s = served()
    genuine = RawPeer(s.listener.endpoint)
    other = served()  # same secret, a listener that never saw the hello
    replay = RawPeer(other.listener.endpoint, hello=genuine.hello)
    assert len(replay.reply) == 64  # answered: the hello's proof is genuine
    # without Ei's private half the replayer computes other keys: its confirmation (sent by
    # RawPeer) fails, and the listener closes the connection before any record
    replay.sock.sendall(replay.message([b"forged"]))
    assert replay.closed_by_peer()
    assert other.listener.refused["failed or left the handshake"] == 1
    genuine.close()
    time.sleep(0.1)
    assert other.got == []


def test_the_handshake_keys_are_fresh_per_connection(served) -> None:
    """The record keys come from ephemeral keys (forward secrecy): two connections under the
    same secret get different listener keys and both work."""
    s = served()
    a, b = RawPeer(s.listener.endpoint), RawPeer(s.listener.endpoint)
    assert a.authentic and b.authentic
    assert a.reply[:32] != b.reply[:32]  # the listener's ephemeral keys differ
    a.sock.sendall(a.message([b"a"]))
    b.sock.sendall(b.message([b"b"]))
    assert s.wait(lambda: sorted(s.got) == [[b"a"], [b"b"]])
    a.close()
    b.close()


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


def test_strangers_cannot_hold_more_than_the_pending_limits(served) -> None:
    """Connections that never speak: one address keeps at most `per_address` of them (the
    rest are closed at accept), many addresses at most `pending` (the oldest evicted), so
    their descriptors are bounded, and a genuine peer arriving among them still
    authenticates and delivers."""
    s = served(pending=16, peers=4)
    address = s.listener.sock.getsockname()
    strangers = []
    try:
        strangers += [stranger(address, "127.0.0.2") for _ in range(60)]
        assert s.wait(lambda: s.listener.refused["over the per-address pending limit"] >= 52)
        assert s.connections() <= 8
        for i in range(240):  # 3 each from 80 addresses
            strangers.append(stranger(address, f"127.0.1.{i // 3}"))
            if i == 120:
                channel = connected(s.listener.endpoint)
                send(channel, [b"still served"])
        assert s.wait(lambda: s.got == [[b"still served"]])
        assert s.wait(lambda: s.listener.refused["evicted while authenticating"] >= 200)
        assert s.connections() <= 16 + 1
        assert len(s.listener.authenticated) == 1
    finally:
        for sock in strangers:
            sock.close()


class DelayedPath:
    """A relay that holds every chunk `delay_s` each way, connecting to `target` from
    `source`: a sender far away, as the listener sees it (its connect arrives with its first
    bytes, as a real sender's final ACK and hello travel together)."""

    def __init__(self, target: tuple[str, int], source: str, delay_s: float) -> None:
        self.target, self.source, self.delay_s = target, source, delay_s
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._open, args=(near,), daemon=True).start()

    def _open(self, near: socket.socket) -> None:
        with contextlib.suppress(OSError):
            first = near.recv(65536)
            time.sleep(self.delay_s)
            far = socket.socket()
            far.bind((self.source, 0))
            far.connect(self.target)
            far.sendall(first)
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                time.sleep(self.delay_s)
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()


def test_a_far_sender_connects_during_a_flood(served) -> None:
    """A sender 25 ms away (a relay that delays each way), from an address that never
    authenticated, authenticates and delivers while a stranger floods the listener at the
    rate one thread manages, from one address and then from a hundred. Before the per-address
    cap and the rule that only connections without a valid hello are evicted, each flood
    connection evicted the oldest handshake, so one taking a round trip never finished."""
    s = served(pending=16, peers=8)
    address = s.listener.sock.getsockname()
    paths = []
    try:
        for n, sources in enumerate((["127.0.0.2"], [f"127.0.2.{i}" for i in range(100)])):
            path = DelayedPath(address, f"127.0.0.{3 + n}", 0.025)  # a new sender each time
            paths.append(path)
            flood = Flood(address, sources)
            deadline = time.monotonic() + 10
            while flood.opened < 100:  # at full rate before the sender starts
                assert time.monotonic() < deadline, flood.opened
                time.sleep(0.01)
            channel = connected(path.endpoint)
            send(channel, [sources[0].encode()])
            assert s.wait(lambda sources=sources: [sources[0].encode()] in s.got)
            flood.end()
            channel.close()
        assert s.listener.refused["over the per-address pending limit"] > 0
        assert s.listener.refused["evicted while authenticating"] > 0
    finally:
        for path in paths:
            path.close()


def test_authenticated_peers_are_capped(served) -> None:
    s = served(peers=2)
    first, second = connected(s.listener.endpoint), connected(s.listener.endpoint)
    assert s.wait(lambda: len(s.listener.authenticated) == 2)
    third = socket.create_connection(s.listener.sock.getsockname(), timeout=5)
    third.sendall(MAGIC + os.urandom(64))
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
