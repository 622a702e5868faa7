"""Floods of idle TCP connections for the tests of pipeserve's listeners: strangers who
connect and never speak, from chosen loopback addresses (all of 127/8 is loopback on
Linux), as fast as one thread can."""

from __future__ import annotations

import collections
import contextlib
import socket
import threading


def stranger(address: tuple[str, int], source: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(address)
    return sock


class Flood:
    """Connections opened as fast as one thread can from `sources` in turn, never speaking
    (the last `keep` of them stay open)."""

    def __init__(self, target: tuple[str, int], sources: list[str], keep: int = 200) -> None:
        self.target, self.sources, self.keep = target, sources, keep
        self.opened = 0
        self.held: collections.deque[socket.socket] = collections.deque()  # open, ours
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        held = self.held
        while not self.stop.is_set():
            with contextlib.suppress(OSError):
                held.append(stranger(self.target, self.sources[self.opened % len(self.sources)]))
                self.opened += 1
            while len(held) > self.keep:
                held.popleft().close()
        for sock in held:
            sock.close()

    def end(self) -> int:
        self.stop.set()
        self.thread.join(10)
        return self.opened
