"""A stranger with TCP reach cannot starve pipeserve's HTTP servers (issue 41, row 1).

Real servers (the router; `pipeserve serve` with a tiny model) run with a lowered descriptor
limit while a flood of silent and half-sent connections is held against them. The flood
comes from 127.0.0.1 and the checks from 127.0.0.2 (all of 127/8 is loopback on Linux), so
the per-address cap shows; a second flood spread over many addresses reaches the total cap.
Against uvicorn's defaults every connection stays open for as long as the attacker holds it
and /health times out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import secrets
import select
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ports import free_port
from server_helpers import PIPESERVE, POOL_TOKENS
from tls_certs import make_certs

from pipeserve.server.connection_guard import DESCRIPTORS_KEPT, quiet_accept_errors

pytestmark = pytest.mark.timeout(180)

NOFILE = 256  # the servers' descriptor limit
HEAD_S, BODY_S = 1.5, 2.5
PER_PEER = 16
LIMIT_FLAGS = [
    "--http-head-timeout",
    str(HEAD_S),
    "--http-body-timeout",
    str(BODY_S),
    "--http-max-pending-per-peer",
    str(PER_PEER),
]
HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "
HALF_BODY = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"


def _low_descriptor_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@contextlib.contextmanager
def started(cmd: list[str], log: Path, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_low_descriptor_limit,
            start_new_session=True,
            env={**os.environ, "PIPESERVE_PD_AUTH_KEY": secrets.token_hex(32)},
        )
        try:
            deadline = time.monotonic() + 180
            while ready not in log.read_text(errors="replace"):
                assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(0.1)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def open_flood(port: int, n: int, sources: list[str]) -> list[socket.socket]:
    """`n` connections spread over `sources`: a third silent, a third with half a head, a
    third with a whole head and the first byte of a 1000-byte body."""
    socks = []
    for i in range(n):
        s = socket.socket()
        s.bind((sources[i % len(sources)], 0))
        try:
            s.connect(("127.0.0.1", port))
            if i % 3 == 1:
                s.sendall(HALF_HEAD)
            elif i % 3 == 2:
                s.sendall(HALF_BODY)
        except OSError:
            pass  # refused or reset at once: counted as not held below
        socks.append(s)
    return socks


def held(socks: list[socket.socket]) -> list[socket.socket]:
    """The connections the server still holds: no end of stream, no reset, nothing sent."""
    out = []
    for s in socks:
        readable, _, _ = select.select([s], [], [], 0)
        if not readable:
            out.append(s)
            continue
        with contextlib.suppress(OSError):
            s.recv(4096)  # b"" (closed), a 408, or a reset: not held
    return out


def answers(port: int, source: str, path: str) -> int:
    """The status /health (or `path`) answers a client from `source` with, within 5 s."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=5) as client:
        return client.get(f"http://127.0.0.1:{port}{path}").status_code


def settles(socks: list[socket.socket], bound: int) -> bool:
    """Whether the server comes to hold at most `bound` of `socks` within 5 s (connections
    still queued in the listen backlog look held until it accepts them)."""
    deadline = time.monotonic() + 5
    while len(held(socks)) > bound:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def check_flood(port: int, path: str) -> None:
    # one address: held at its pending cap, and the server answers everyone else
    flood = open_flood(port, 120, ["127.0.0.1"])
    assert settles(flood, PER_PEER), len(held(flood))
    assert answers(port, "127.0.0.2", path) in (200, 503)

    # many addresses: held at the total cap (descriptor limit less what is kept)
    sources = [f"127.0.0.{k}" for k in range(10, 40)]
    spread = open_flood(port, 30 * PER_PEER, sources)
    assert settles(flood + spread, NOFILE - DESCRIPTORS_KEPT), len(held(flood + spread))
    assert answers(port, "127.0.0.2", path) in (200, 503)

    # and nothing is held past the deadlines; the half-sent ones were told why
    time.sleep(BODY_S + 1.0)
    assert held(flood + spread) == []
    assert timed_out(port, HALF_HEAD)
    for s in [*flood, *spread]:
        s.close()


def timed_out(port: int, part: bytes, source: str = "127.0.0.1") -> bool:
    """Whether a connection (from `source`) that sends `part` of a request and then nothing is
    answered 408 and closed."""
    with socket.create_connection(("127.0.0.1", port), source_address=(source, 0)) as s:
        s.sendall(part)
        s.settimeout(BODY_S + HEAD_S + 3)
        answer = s.recv(4096)
        return answer.startswith(b"HTTP/1.1 408") and s.recv(4096) == b""


def test_the_router_is_not_starved_by_a_flood(tmp_path: Path) -> None:
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"  # no backend: /health answers 503, and at once
    cmd = [str(PIPESERVE), "router", "--prefill", dead, "--decode", dead, "--port", str(port)]
    log = tmp_path / "router.log"
    with started([*cmd, *LIMIT_FLAGS], log, "ready"):
        check_flood(port, "/health")
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]


def test_a_model_server_is_not_starved_by_a_flood(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        str(PIPESERVE),
        "serve",
        "--model",
        str(tiny_model),
        "--dtype",
        "float32",
        "--max-total-tokens",
        str(POOL_TOKENS),
        "--port",
        str(port),
    ]
    log = tmp_path / "server.log"
    with started([*cmd, *LIMIT_FLAGS], log, "ready"):
        # the guard is the router's (checked whole above): here, that serve runs behind it
        flood = open_flood(port, 60, ["127.0.0.1"])
        assert settles(flood, PER_PEER), len(held(flood))
        assert answers(port, "127.0.0.2", "/health") == 200
        # the app waits for the body: the body deadline (from an address not at its cap)
        assert timed_out(port, HALF_BODY, "127.0.0.3")
        for s in flood:
            s.close()
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]


def test_failed_accepts_are_counted_not_logged_each(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        quiet_accept_errors(loop)
        with caplog.at_level(logging.WARNING):
            for _ in range(2000):
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(24, "Too many open files"),
                    }
                )
            accept_records = len(caplog.records)
            loop.call_exception_handler({"message": "something else broke"})
    finally:
        loop.close()
    assert accept_records <= 1
    assert any("something else broke" in r.getMessage() for r in caplog.records)


def test_bad_limits_are_refused() -> None:
    out = subprocess.run(
        [str(PIPESERVE), "router", "--prefill", "http://a:1", "--decode", "http://b:2"]
        + ["--http-head-timeout", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PIPESERVE_PD_AUTH_KEY": secrets.token_hex(32)},
    )
    assert out.returncode != 0
    assert "--http-head-timeout must be positive" in out.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.fixture
def router(tmp_path: Path) -> Iterator[int]:
    """A router (no backend: /health answers 503, and at once) with the default caps, a
    1.5 s head deadline, HTTPS with a throwaway certificate; its port."""
    certs = make_certs(tmp_path)
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    cmd = [str(PIPESERVE), "router", "--prefill", dead, "--decode", dead, "--port", str(port)]
    cmd += ["--http-head-timeout", str(HEAD_S)]
    cmd += ["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)]
    with started(cmd, tmp_path / "router.log", "ready"):
        yield port


def tls_connection(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    return context.wrap_socket(socket.create_connection(("127.0.0.1", port)))


def test_a_burst_from_one_address_is_served_whole(router: int) -> None:
    """100 connections from one client opened at once, then each sends a request: all are
    answered (a cap below the listen backlog would reset some of them)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    socks = [tls_connection(router, context) for _ in range(100)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    for s in socks:
        s.settimeout(10)
        assert s.recv(64).startswith(b"HTTP/1.1 503"), "a connection of the burst was cut"
        s.close()


def test_a_tls_handshake_has_the_head_deadline(router: int) -> None:
    silent = socket.create_connection(("127.0.0.1", router))
    silent.settimeout(HEAD_S + 5)
    start = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        assert silent.recv(1) == b""  # closed, the handshake never begun
    assert time.monotonic() - start < HEAD_S + 4  # not asyncio's 60 s
    silent.close()


def response(s: socket.socket) -> bytes:
    """One whole HTTP response (head and a Content-Length body) read from `s`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += s.recv(4096)
    return head


def test_a_body_sent_after_the_answer_leaves_the_connection_kept_alive(router: int) -> None:
    """The router answers 503 before reading the body; the rest of the body that follows
    ends that request, and the connection is then idle (kept alive), not owing a head."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    s = tls_connection(router, context)
    s.settimeout(10)
    s.sendall(HALF_BODY)
    assert response(s).startswith(b"HTTP/1.1 503")
    s.sendall(b"x" * 999)  # the rest of the body
    time.sleep(HEAD_S + 0.5)  # past the head deadline: no 408 may come
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response(s).startswith(b"HTTP/1.1 503")
    s.close()
