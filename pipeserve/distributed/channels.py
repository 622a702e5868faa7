"""Control-plane channels between the scheduler and the worker processes (ZMQ).

- batches: scheduler PUSH -> each first-stage rank (PULL), one socket per rank: the same
  batch to every TP rank, its own batch to every attention rank under expert parallelism;
- status: every worker PUSH -> scheduler PULL: ready, results, heartbeats, errors;
- control: scheduler PUB -> every worker SUB: keepalives. A worker that hears none for
  ORPHAN_TIMEOUT_S exits, so no worker outlives its scheduler, on any node (before the first
  keepalive it waits FIRST_KEEPALIVE_TIMEOUT_S: node 0 may start well after the others).

Every message is one of `messages`' types, encoded by `wire` (msgpack, never pickle); one
that does not decode is dropped with a warning and has no other effect.

Who can connect: on one node the sockets are ipc:// files in a directory only this user can
enter (mode 0700), which the scheduler creates and removes. Across nodes they are tcp://
ports on node 0; with an auth key every socket speaks CURVE with keys derived from it, and
the scheduler's sockets admit only clients that hold the derived client key (ZAP). Without a
key anyone who reaches those ports can send or take messages (the launcher warns).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pipeserve.distributed import wire
from pipeserve.distributed.gate import Gate, Tunnel, gate_secret
from pipeserve.distributed.messages import (
    STAGE,
    STATUS,
    Heartbeat,
    StageCommand,
    Status,
    StatusBody,
    TimelinePiece,
)
from pipeserve.timeline import Event

log = logging.getLogger(__name__)

KEEPALIVE_S = 0.5
HEARTBEAT_S = 0.5
ORPHAN_TIMEOUT_S = 15.0
FIRST_KEEPALIVE_TIMEOUT_S = 600.0  # as long as the scheduler waits for workers to start
SEND_TIMEOUT_MS = 5000
# a connection to one of the scheduler's sockets that has not finished ZMQ's handshake (with a
# key: CURVE's, so a stranger never does) is closed after this long: ZMQ accepts every TCP
# connection and cannot cap how many, so this bounds how long a stranger holds one
HANDSHAKE_MS = 5000
DROP_WARN_EVERY_S = 10.0
KEEPALIVE = b"alive"
KEEPALIVE_MAX_BYTES = 4096  # ZMQ counts the handshake's frames against the limit too
MAX_IPC_PATH = 100  # sun_path holds 107 bytes on Linux


@dataclass(frozen=True)
class Endpoints:
    """Where workers find the scheduler's sockets (handed to spawned workers as is)."""

    batch: tuple[str, ...]  # one URL per first-stage rank
    status: str
    control: str
    directory: str | None = None  # single node: the scheduler's private directory
    auth_key: str | None = field(default=None, repr=False)  # across nodes: CURVE on

    @classmethod
    def ipc(cls, directory: str, width: int) -> Endpoints:
        def url(name: str) -> str:
            return f"ipc://{os.path.join(directory, name)}"

        batch = tuple(url(f"batch-{i}") for i in range(width))
        return cls(batch, url("status"), url("control"), directory)

    @classmethod
    def tcp(cls, host: str, base_port: int, width: int, auth_key: str | None = None) -> Endpoints:
        """Ports base_port .. + width - 1 take batches (one per first-stage rank), the next two
        status and control."""

        def url(port: int) -> str:
            return f"tcp://{host}:{port}"

        batch = tuple(url(base_port + i) for i in range(width))
        status, control = url(base_port + width), url(base_port + width + 1)
        return cls(batch, status, control, auth_key=auth_key)


@dataclass(frozen=True)
class CurveKeys:
    """Curve25519 key pairs (Z85) of the scheduler (server) and of every worker (client)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def derive(cls, auth_key: str, purpose: str = "control plane") -> CurveKeys:
        """The same pairs on every node that holds `auth_key`; another `purpose` (a link of
        its own, e.g. disaggregation's KV link) gets pairs unrelated to these."""
        server, client = _secret(auth_key, purpose, "server"), _secret(auth_key, purpose, "client")
        return cls(zmq.curve_public(server), server, zmq.curve_public(client), client)


def _secret(auth_key: str, purpose: str, role: str) -> bytes:
    label = f"pipeserve {purpose} {role}".encode()
    return z85.encode(hmac.new(auth_key.encode(), label, hashlib.sha256).digest())


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE server (before it binds)."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE client of the scheduler (before it connects)."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


class ClientKey:
    """ZAP credentials: only the one client key gets in."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


def private_directory() -> str:
    """A fresh directory only this user can enter (mkdtemp makes it 0700), short enough to
    hold ipc socket paths."""
    path = tempfile.mkdtemp(prefix="pipeserve-")
    if len(path) > MAX_IPC_PATH - 16:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="pipeserve-", dir="/tmp")
    return path


class DropLog:
    """Warns about messages that do not decode, at most once per DROP_WARN_EVERY_S."""

    def __init__(self, where: str) -> None:
        self.where, self.count, self.last = where, 0, -math.inf

    def dropped(self, exc: wire.WireError) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= DROP_WARN_EVERY_S:
            log.warning(
                "%s: dropped %d message(s) that do not decode (last: %s)",
                self.where,
                self.count,
                exc,
            )
            self.count, self.last = 0, now


class SchedulerChannels:
    """The scheduler's end: binds every socket, ipc:// in a private directory when
    `base_port` is None (one node), else tcp:// on `host` from `base_port` on."""

    def __init__(
        self, host: str, width: int, base_port: int | None = None, auth_key: str | None = None
    ) -> None:
        self.ctx = zmq.Context()
        self._directory: str | None = None
        self._keys: CurveKeys | None = None
        if base_port is None:
            self._directory = private_directory()
            self.endpoints = Endpoints.ipc(self._directory, width)
        else:
            self.endpoints = Endpoints.tcp(host, base_port, width, auth_key)
            self._keys = CurveKeys.derive(auth_key) if auth_key else None
        self._auth: ThreadAuthenticator | None = None
        self._gate: Gate | None = None
        try:
            self._start_authenticator()
            self._init_sockets()
        except BaseException:  # a port in use, say: give back what was made
            self._release()
            raise
        self._dropped = DropLog("scheduler status channel")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._keepalive = threading.Thread(target=self._keepalive_loop, daemon=True)
        self._keepalive.start()

    def _start_authenticator(self) -> None:
        """Kept in self._auth before it starts, so a failure after its start stops it."""
        if self._keys is None:
            return
        self._auth = ThreadAuthenticator(self.ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", ClientKey(self._keys.client_public))

    def _init_sockets(self) -> None:
        """With a key across nodes the sockets bind to loopback and the public ports are the
        gate's (gate.py); else they bind where the endpoints say."""
        e = self.endpoints
        gated = e.auth_key is not None and e.directory is None
        if gated:  # the sockets themselves: Unix sockets only this user reaches
            self._directory = private_directory()
        routes: dict[str, str] = {}

        def bind(kind: int, url: str, max_bytes: int = -1) -> zmq.Socket:
            inside = f"{self._directory}/gate-{len(routes)}" if gated else ""
            sock = self._bind(kind, f"ipc://{inside}" if gated else url, max_bytes)
            routes[url] = inside
            return sock

        self._batch = [bind(zmq.PUSH, url) for url in e.batch]
        self._status = bind(zmq.PULL, e.status, wire.STATUS_MAX_BYTES)
        self._control = bind(zmq.PUB, e.control)
        for s in self._batch:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        if gated:
            assert e.auth_key is not None
            self._gate = Gate(gate_secret(e.auth_key), routes)

    def _bind(self, kind: int, url: str, max_bytes: int = -1) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        if self._keys is not None:
            secure_server(sock, self._keys)
        sock.bind(url)
        return sock

    def send_batch(self, command: StageCommand, block: bool = True) -> bool:
        """Send one command to every first-stage rank. False if one did not take it (within
        SEND_TIMEOUT_MS if blocking)."""
        return self.send_each([command] * len(self._batch), block)

    def send_each(self, commands: list[StageCommand], block: bool = True) -> bool:
        """Send commands[i] to first-stage rank i."""
        encoded: dict[int, bytes] = {}  # one encoding per distinct object
        try:
            for s, obj in zip(self._batch, commands, strict=True):
                if id(obj) not in encoded:
                    encoded[id(obj)] = STAGE.encode(obj)
                data = encoded[id(obj)]
                s.send(data, copy=False, flags=0 if block else zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def poll(self, timeout_ms: int) -> Status | None:
        """The next status message, waiting up to `timeout_ms`; messages that do not decode
        are dropped on the way."""
        deadline = time.monotonic() + timeout_ms / 1000
        while self._status.poll(max(0, round((deadline - time.monotonic()) * 1000))):
            try:
                return STATUS.decode(self._status.recv())
            except wire.WireError as exc:
                self._dropped.dropped(exc)
        return None

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(KEEPALIVE_S):
            with self._lock:
                self._control.send(KEEPALIVE)

    def close(self) -> None:
        self._stop.set()
        self._keepalive.join(timeout=2)
        self._release()

    def _release(self) -> None:
        """Close every socket at once (linger 0) and remove the private directory. A context
        left to the garbage collector instead closes its sockets with their own linger, and
        its term() can then block that later, unrelated moment for good."""
        if self._auth is not None:
            self._auth.stop()
        if self._gate is not None:
            self._gate.close()
        self.ctx.destroy(linger=0)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


class WorkerChannels:
    """A worker's end: status out (thread-safe), batches in (first stage), and the orphan
    watchdog on the keepalives."""

    def __init__(
        self,
        rank: int,
        endpoints: Endpoints,
        batch_url: str | None,
        heartbeat_s: float = HEARTBEAT_S,
        orphan_timeout_s: float = ORPHAN_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.heartbeat_s, self.orphan_timeout_s = heartbeat_s, orphan_timeout_s
        self.ctx = zmq.Context()
        self._keys = CurveKeys.derive(endpoints.auth_key) if endpoints.auth_key else None
        self._tunnel: Tunnel | None = None
        if endpoints.auth_key is not None and endpoints.directory is None:  # through the gate
            urls = [endpoints.status, endpoints.control, *([batch_url] if batch_url else [])]
            self._tunnel = Tunnel(gate_secret(endpoints.auth_key), urls, private_directory())
        self._status = self._connect(zmq.PUSH, endpoints.status)
        self._lock = threading.Lock()
        self._batch = None
        if batch_url is not None:
            self._batch = self._connect(zmq.PULL, batch_url, wire.BATCH_MAX_BYTES)
        self._dropped = DropLog(f"worker {rank} batch channel")
        self._control_url = endpoints.control
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=self._watchdog, daemon=True),
            threading.Thread(target=self._heartbeat, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def close(self, linger_ms: int = 0) -> None:
        """Stop the heartbeat and the watchdog. `linger_ms`: how long what was sent may still
        take to leave (a worker that exits right after its last message: a forked process
        ends with os._exit, which would drop it)."""
        self._closed.set()
        for t in self._threads:
            t.join(timeout=5)
        self.ctx.destroy(linger=linger_ms)
        if self._tunnel is not None:
            self._tunnel.close()

    def _connect(self, kind: int, url: str, max_bytes: int = -1) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        if self._keys is not None:
            secure_client(sock, self._keys)
        sock.connect(self._tunnel.local[url] if self._tunnel is not None else url)
        return sock

    def send_status(self, body: StatusBody) -> None:
        data = STATUS.encode(Status(self.rank, body))
        with self._lock:
            self._status.send(data)

    def send_timeline(self, events: list[Event]) -> None:
        """The recorded events, in pieces of wire.TIMELINE_PIECE (the last one says so), so
        that no status message outgrows the channel's cap."""
        step = wire.TIMELINE_PIECE
        starts = range(0, max(len(events), 1), step)
        for start in starts:
            self.send_status(TimelinePiece(events[start : start + step], start == starts[-1]))

    def recv_batch(self) -> StageCommand:
        """The next message from the scheduler that decodes (others are dropped)."""
        assert self._batch is not None
        while True:
            try:
                return STAGE.decode(self._batch.recv())
            except wire.WireError as exc:
                self._dropped.dropped(exc)

    def _heartbeat(self) -> None:
        while not self._closed.is_set():
            self.send_status(Heartbeat())
            self._closed.wait(self.heartbeat_s)

    def _watchdog(self) -> None:
        sub = self._connect(zmq.SUB, self._control_url, KEEPALIVE_MAX_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        last, timeout = time.monotonic(), FIRST_KEEPALIVE_TIMEOUT_S
        while not self._closed.is_set():
            if sub.poll(int(KEEPALIVE_S * 1000)):
                sub.recv()
                last, timeout = time.monotonic(), self.orphan_timeout_s
            elif time.monotonic() - last > timeout:
                os._exit(3)  # the scheduler is gone: do not linger as an orphan
        sub.close(linger=0)
