"""The control plane's gate and tunnels (pipeserve/distributed/gate.py) carry bytes exactly
both ways, bytes sent right after connecting included, and a stalled reader stalls its
sender instead of growing a buffer inside the gate or the tunnel."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from ports import free_port

from pipeserve.disaggregation.pd import link
from pipeserve.distributed.channels import private_directory
from pipeserve.distributed.gate import BACKLOG, Gate, Tunnel, gate_secret

pytestmark = pytest.mark.timeout(60)

SECRET = gate_secret("4f1a9c0e7b3d25e8a6c1f09b7d4e2a53")


class Target:
    """A Unix socket standing for a scheduler socket: echoes, or (stalled) reads nothing."""

    def __init__(self, echo: bool) -> None:
        self.path = os.path.join(tempfile.mkdtemp(), "target")
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen()
        self.echo = echo
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.echo:
                threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
        except OSError:
            pass


@pytest.fixture
def spliced(request) -> Iterator:
    made: list = []

    def make(echo: bool) -> socket.socket:
        target = Target(echo)
        public = f"tcp://127.0.0.1:{free_port()}"
        gate = Gate(SECRET, {public: target.path})
        tunnel = Tunnel(SECRET, [public], private_directory())
        made.extend([tunnel, gate, target.sock])
        client = socket.socket(socket.AF_UNIX)
        client.connect(tunnel.local[public].removeprefix("ipc://"))
        client.settimeout(20)
        made.append(client)
        return client

    yield make
    for obj in made:
        obj.close()


def test_bytes_cross_exactly_both_ways(spliced) -> None:
    client = spliced(echo=True)
    payload = os.urandom(8 << 20)  # sent at once: the first bytes race the handshake
    threading.Thread(target=client.sendall, args=(payload,), daemon=True).start()
    got = bytearray()
    while len(got) < len(payload):
        got += client.recv(1 << 20)
    assert bytes(got) == payload


def kernel_buffers() -> int:
    """What the kernel may hold along the way: the link's TCP connection (the sender's send
    buffer and the receiver's receive buffer, as link.py asks for them and this kernel
    grants them) and both ends' Unix sockets."""
    tcp = socket.socket()
    link._tune(tcp)
    unix = socket.socket(socket.AF_UNIX)
    total = tcp.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    total += tcp.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    total += 2 * unix.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    total += 2 * unix.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    tcp.close()
    unix.close()
    return total


def test_a_stalled_reader_stalls_its_sender(spliced) -> None:
    """The target reads nothing: the client can write only what the kernel's buffers and
    the splice's backlogs hold, then its send blocks (ZeroMQ's own limits apply again)."""
    client = spliced(echo=False)
    client.setblocking(False)
    sent, chunk = 0, bytes(1 << 16)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            sent += client.send(chunk)
        except BlockingIOError:
            time.sleep(0.05)  # the splice may still move a little: look again
    # the splice's backlogs, every buffer on the way and 4 MiB to spare; without the
    # backpressure this machine took 37 MB in those 5 s, and more the longer it ran
    bound = 4 * BACKLOG + kernel_buffers() + (4 << 20)
    assert sent < bound, (sent, bound)
    assert sent > 0
