"""Control-plane channels between the scheduler and the worker processes (ZMQ over TCP, so
the same code spans nodes).

- batches: scheduler PUSH -> each first-stage TP rank (PULL), one socket per rank;
- status: every worker PUSH -> scheduler PULL: ready, results, heartbeats, errors;
- control: scheduler PUB -> every worker SUB: keepalives. A worker that hears none for
  ORPHAN_TIMEOUT_S exits, so no worker outlives its scheduler, on any node (before the first
  keepalive it waits FIRST_KEEPALIVE_TIMEOUT_S: node 0 may start well after the others).

Payloads are pickled plain data exchanged among the engine's own processes only.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

KEEPALIVE_S = 0.5
HEARTBEAT_S = 0.5
ORPHAN_TIMEOUT_S = 15.0
FIRST_KEEPALIVE_TIMEOUT_S = 600.0  # as long as the scheduler waits for workers to start
SEND_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class Endpoints:
    host: str
    batch_ports: tuple[int, ...]  # one per first-stage TP rank
    status_port: int
    control_port: int

    def url(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"


class SchedulerChannels:
    """The scheduler's end: binds every socket."""

    def __init__(self, host: str, tp_size: int, base_port: int | None = None) -> None:
        self.ctx = zmq.Context()
        self._batch = [self.ctx.socket(zmq.PUSH) for _ in range(tp_size)]
        self._status = self.ctx.socket(zmq.PULL)
        self._control = self.ctx.socket(zmq.PUB)
        sockets = [*self._batch, self._status, self._control]
        ports = [
            self._bind(s, host, None if base_port is None else base_port + i)
            for i, s in enumerate(sockets)
        ]
        for s in self._batch:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.endpoints = Endpoints(host, tuple(ports[:tp_size]), ports[tp_size], ports[tp_size + 1])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._keepalive = threading.Thread(target=self._keepalive_loop, daemon=True)
        self._keepalive.start()

    @staticmethod
    def _bind(sock: zmq.Socket, host: str, port: int | None) -> int:
        if port is None:
            return sock.bind_to_random_port(f"tcp://{host}")
        sock.bind(f"tcp://{host}:{port}")
        return port

    def send_batch(self, obj: Any, block: bool = True) -> bool:
        """False if a first-stage rank did not take it (within SEND_TIMEOUT_MS if blocking)."""
        data = pickle.dumps(obj)
        try:
            for s in self._batch:
                s.send(data, copy=False, flags=0 if block else zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def poll(self, timeout_ms: int) -> Any | None:
        if self._status.poll(timeout_ms):
            return pickle.loads(self._status.recv())
        return None

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(KEEPALIVE_S):
            with self._lock:
                self._control.send(b"alive")

    def close(self) -> None:
        self._stop.set()
        self._keepalive.join(timeout=2)
        self.ctx.destroy(linger=0)


class WorkerChannels:
    """A worker's end: status out (thread-safe), batches in (first stage), and the orphan
    watchdog on the keepalives."""

    def __init__(self, rank: int, endpoints: Endpoints, batch_port: int | None) -> None:
        self.rank = rank
        self.ctx = zmq.Context()
        self._status = self.ctx.socket(zmq.PUSH)
        self._status.connect(endpoints.url(endpoints.status_port))
        self._lock = threading.Lock()
        self._batch = None
        if batch_port is not None:
            self._batch = self.ctx.socket(zmq.PULL)
            self._batch.connect(endpoints.url(batch_port))
        self._control_url = endpoints.url(endpoints.control_port)
        threading.Thread(target=self._watchdog, daemon=True).start()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def send_status(self, kind: str, payload: Any = None) -> None:
        data = pickle.dumps((kind, self.rank, payload))
        with self._lock:
            self._status.send(data)

    def recv_batch(self) -> Any:
        assert self._batch is not None
        return pickle.loads(self._batch.recv())

    def _heartbeat(self) -> None:
        while True:
            self.send_status("heartbeat")
            time.sleep(HEARTBEAT_S)

    def _watchdog(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._control_url)
        last, timeout = time.monotonic(), FIRST_KEEPALIVE_TIMEOUT_S
        while True:
            if sub.poll(int(KEEPALIVE_S * 1000)):
                sub.recv()
                last, timeout = time.monotonic(), ORPHAN_TIMEOUT_S
            elif time.monotonic() - last > timeout:
                os._exit(3)  # the scheduler is gone: do not linger as an orphan
