"""HTTP connections that a stranger cannot hold: deadlines for a request's head and body,
caps on the connections held in total and per peer address, and a quiet accept loop.

uvicorn arms no timer on a connection before its first request completes, and its
`limit_concurrency` answers 503 only to a parsed head: a flood of silent or half-sent
connections holds every file descriptor for as long as the attacker likes. The protocol
class here (passed as uvicorn's `Config(http=...)`, on top of its h11 implementation) keeps
what uvicorn does and adds:

- a *head deadline*: from the moment a connection owes a request head (at connect, or at
  the first byte of a later request on a kept-alive connection) it has `head_timeout_s` to
  finish it; a *body deadline*: from the end of the head, `body_timeout_s` to finish the
  body. On expiry the client gets 408 (when no response has started) and the connection
  closes. An idle kept-alive connection is uvicorn's to close (`timeout_keep_alive`).
- *pending* connections, those that owe a head or a body, are capped per peer address: a
  peer at `max_pending_per_peer` has its new connections closed at once, so one address
  cannot crowd out the others. Connections with a request in flight are not pending. The
  default cap (256) is above the listen backlog (128): asyncio makes every connection it
  accepts in one tick before any of them has sent a byte, so a lower cap would cut a
  legitimate burst from one address (a router under load opening a connection per
  request); with a cap of 256 a flood from one address holds 256 for the head deadline.
- at `max_connections` in total, the oldest pending connection (any peer) is dropped to
  make room; when none is pending the new connection is closed instead.

Refused, dropped and timed-out connections are counted and logged once per interval, and
so are failed accepts (asyncio logs a traceback for each, up to the listen backlog per
tick: a flood against a full descriptor table wrote tens of MB a second).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import ssl
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0  # counted events are reported at most this often
LISTEN_BACKLOG = 128  # uvicorn's 2048 lets one tick of a flood retry accept() 2048 times
DESCRIPTORS_KEPT = 64  # of the descriptor limit, left for everything but connections
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 28\r\n"
    b"connection: close\r\n\r\nrequest not received in time"
)


@dataclass(frozen=True)
class ConnectionLimits:
    head_timeout_s: float = 5.0
    body_timeout_s: float = 30.0
    max_connections: int = 2048
    max_pending_per_peer: int = 256  # above LISTEN_BACKLOG: one tick's burst is never cut

    @classmethod
    def of(cls, flags: Any) -> ConnectionLimits:
        """The limits its `http_*` attributes give (a ServerConfig, or the router's parsed
        arguments, which take the same flags)."""
        return cls(
            flags.http_head_timeout,
            flags.http_body_timeout,
            flags.http_max_connections,
            flags.http_max_pending_per_peer,
        )

    def check(self) -> None:
        """ValueError naming the flag when a limit is not positive."""
        for flag, value in (
            ("--http-head-timeout", self.head_timeout_s),
            ("--http-body-timeout", self.body_timeout_s),
            ("--http-max-connections", self.max_connections),
            ("--http-max-pending-per-peer", self.max_pending_per_peer),
        ):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")


def raise_descriptor_limit() -> int:
    """Raise the soft limit on open files to the hard one; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class _EventLog:
    """Counts of named events, logged as one line at most every LOG_INTERVAL_S."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()
        self.last = time.monotonic()

    def add(self, event: str) -> None:
        self.counts[event] += 1
        self.totals[event] += 1
        now = time.monotonic()
        if now - self.last >= LOG_INTERVAL_S:
            self.flush(now)

    def flush(self, now: float) -> None:
        if self.counts:
            parts = ", ".join(f"{n} {event}" for event, n in sorted(self.counts.items()))
            log.warning("HTTP connections in the last %.0f s: %s", now - self.last, parts)
        self.counts.clear()
        self.last = now


class _Guard:
    """What one server's connections share: the pending ones (oldest first), how many each
    peer holds, and the event counts."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.pending: OrderedDict[GuardedH11Protocol, None] = OrderedDict()
        self.per_peer: Counter[str] = Counter()
        self.events = _EventLog()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and caps of the module docstring."""

    guard: _Guard  # set on the subclass `guarded_protocol` makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peer = ""
        self.refused = False
        self.deadline: asyncio.TimerHandle | None = None
        self.deadline_kind = ""  # "head" or "body" while a deadline is armed

    # -- connection admission --

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        g = self.guard
        if g.per_peer[self.peer] >= g.limits.max_pending_per_peer:
            self._refuse(transport, "refused (peer at its pending cap)")
            return
        if len(self.connections) >= g.limits.max_connections:
            if not g.pending:
                self._refuse(transport, "refused (server at its connection cap)")
                return
            oldest = next(iter(g.pending))
            oldest._drop("dropped (oldest pending, server at its connection cap)")
        super().connection_made(transport)
        self._arm("head")

    def _refuse(self, transport: asyncio.Transport, event: str) -> None:
        self.refused = True
        self.guard.events.add(event)
        transport.abort()

    def _drop(self, event: str) -> None:
        self._disarm()
        self.guard.events.add(event)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            return
        self._disarm()
        super().connection_lost(exc)

    # -- deadlines --

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self.conn.trailing_data[0]:  # part of a next request's head is here
                if self.deadline_kind != "head":
                    self._arm("head")
            else:  # the bytes ended a request whose answer went out first: idle now
                self._disarm()
                if self.timeout_keep_alive_task is None and (
                    self.cycle is None or self.cycle.response_complete
                ):
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self.timeout_keep_alive_handler
                    )
        elif state is h11.SEND_BODY:
            if self.deadline_kind != "body":
                self._arm("body")
        else:  # the request is in; what remains is the app's
            self._disarm()

    def on_response_complete(self) -> None:
        # the next request on this connection owes nothing until its first byte: uvicorn's
        # keep-alive timer closes it if that byte never comes
        self._disarm()
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY:  # a pipelined request is already here
            self._arm("body")
        elif self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm("head")

    def _arm(self, kind: str) -> None:
        g = self.guard
        if self.deadline is not None:
            self.deadline.cancel()
        elif self.peer:
            g.pending[self] = None
            g.per_peer[self.peer] += 1
        timeout = g.limits.head_timeout_s if kind == "head" else g.limits.body_timeout_s
        self.deadline = self.loop.call_later(timeout, self._expired)
        self.deadline_kind = kind

    def _disarm(self) -> None:
        if self.deadline is None:
            return
        self.deadline.cancel()
        self.deadline, self.deadline_kind = None, ""
        g = self.guard
        g.pending.pop(self, None)
        g.per_peer[self.peer] -= 1
        if g.per_peer[self.peer] <= 0:
            del g.per_peer[self.peer]

    def _expired(self) -> None:
        kind = self.deadline_kind
        self._disarm()  # cancelling the handle that just fired is harmless
        if self.transport.is_closing():
            return
        self.guard.events.add(f"closed (request {kind} not received in time)")
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response begun
            self.transport.write(TIMEOUT_RESPONSE)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class for one server (its own pending set and counts)."""
    limits.check()
    return type("ServerH11Protocol", (GuardedH11Protocol,), {"guard": _Guard(limits)})


def effective_limits(limits: ConnectionLimits) -> ConnectionLimits:
    """`limits` with the connection cap under this process's descriptor limit (raised to the
    hard limit first): a cap the process cannot reach is no cap."""
    soft = raise_descriptor_limit()
    room = max(16, soft - DESCRIPTORS_KEPT) if soft != resource.RLIM_INFINITY else None
    if room is not None and limits.max_connections > room:
        return dataclasses.replace(limits, max_connections=room)
    return limits


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs each failed accept (out of descriptors) with a traceback; count them and
    log once per interval instead. Every other loop error goes to the previous handler."""
    events = _EventLog()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "accept" in message and isinstance(context.get("exception"), OSError):
            events.add(f"failed accepts ({context['exception'].strerror})")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def uvicorn_options(
    limits: ConnectionLimits, certfile: str | None = None, keyfile: str | None = None
) -> dict[str, Any]:
    """The uvicorn.Config keywords every pipeserve server takes (HTTPS with a certificate)."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    tls = {"ssl_certfile": certfile, "ssl_keyfile": keyfile} if certfile else {}
    return {"http": guarded_protocol(effective_limits(limits)), "backlog": LISTEN_BACKLOG, **tls}


def client_tls(ca_certs: str | None) -> ssl.SSLContext | bool:
    """What httpx verifies an https:// server's certificate against: `ca_certs` (a PEM
    file) when given, else the system's CAs."""
    if ca_certs is None:
        return True
    try:
        return ssl.create_default_context(cafile=ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-ca-certs {ca_certs!r}: {exc}") from None


class GuardedServer(uvicorn.Server):
    """uvicorn's server with failed accepts counted, not logged one traceback each, and with
    HTTPS, a TLS handshake bounded by the head deadline (asyncio's default is 60 s, and a
    connection is counted by the caps only once its handshake is done)."""

    async def startup(self, sockets: Any = None) -> None:
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop)
        protocol = self.config.http
        if not (isinstance(protocol, type) and issubclass(protocol, GuardedH11Protocol)):
            await super().startup(sockets)
            return
        handshake_s = protocol.guard.limits.head_timeout_s
        create_server = loop.create_server

        async def bounded(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("ssl") is not None:
                kwargs.setdefault("ssl_handshake_timeout", handshake_s)
            return await create_server(*args, **kwargs)

        try:
            loop.create_server = bounded  # type: ignore[method-assign]
        except AttributeError:  # a loop (uvloop's) whose methods cannot be replaced
            log.info("TLS handshakes keep the event loop's own time limit")
            await super().startup(sockets)
            return
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server  # the loop's own method again
