"""The engine process behind the HTTP server: scheduler + backend (and through it the
worker processes), request intake and detokenization, so the HTTP event loop only moves
bytes. Talks to the HTTP process over ZMQ ipc:// sockets in a private directory.

Messages in:  ("add", rid, input_ids, sampling dict, return_logprob, top_logprobs,
              transfer), ("abort", rid), ("shutdown",); prefill/decode disaggregation:
              ("pd_reserve", rid, input_ids, sampling dict, return_logprob, top_logprobs)
              and ("pd_prefilled", rid, token, logprob, top) on a decode server
Messages out: ("ready", info), ("deltas", [StreamDelta]), ("stats", dict),
              ("fatal", message), ("reserved", [rid, destination]) on a decode server

A prefill server's "add" may carry a transfer destination (the prompt's KV goes there as
it is computed). A decode server's "pd_reserve" gets pages and a room (answered by
"reserved", or by an error delta); "pd_prefilled" brings the first token the prefill server
sampled; the request's deltas follow once its KV has arrived.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from pipeserve import envs
from pipeserve.config import SettingsError
from pipeserve.disaggregation.pd.decode_side import DecodeTransfers
from pipeserve.disaggregation.pd.kv_remap import KVDestination, plan
from pipeserve.disaggregation.pd.transfer import ReceiverControl
from pipeserve.distributed import wire
from pipeserve.lifetime import REFUSED_EXIT, exit_with_parent
from pipeserve.scheduler.request import MAX_TOP_LOGPROBS, Req, SamplingParams
from pipeserve.scheduler.scheduler import RequestUpdate
from pipeserve.server.streams import OutputStream, StreamDelta

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.5
IDLE_POLL_MS = 500
TRANSFER_POLL_MS = 5


@dataclass(frozen=True)
class EngineProcessArgs:
    flags: dict[str, Any]
    in_url: str  # HTTP -> engine
    out_url: str  # engine -> HTTP


def engine_main(args: EngineProcessArgs) -> None:
    exit_with_parent()
    logging.basicConfig(level=logging.INFO, format="[pipeserve] %(message)s")
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(args.in_url)
    outbox.connect(args.out_url)
    try:
        from pipeserve.engine.engine import Engine

        engine = Engine(**args.flags)
    except BaseException as exc:  # start-up failure: tell the server, then exit
        outbox.send(wire.encode_from_engine(("fatal", f"engine failed to start: {exc}")))
        time.sleep(0.2)
        if isinstance(exc, SettingsError) and not envs.show_tracebacks():  # the server says it
            raise SystemExit(REFUSED_EXIT) from None
        raise
    EngineLoop(engine, inbox, outbox, args.flags.get("watchdog_timeout") or 300.0).run()


class EngineLoop:
    def __init__(
        self, engine: Any, inbox: zmq.Socket, outbox: zmq.Socket, watchdog_timeout: float
    ) -> None:
        self.engine, self.backend = engine, engine.backend
        self.inbox, self.outbox = inbox, outbox
        self.streams: dict[str, OutputStream] = {}
        self.watchdog_timeout = watchdog_timeout
        self.step_started: float | None = None
        self.stage_busy: list[float] = []
        self.last_stats = 0.0
        self.running = True
        self._lock = threading.Lock()
        self.transfers = self._decode_transfers(engine)

    @staticmethod
    def _decode_transfers(engine: Any) -> DecodeTransfers | None:
        d = engine.config.disaggregation
        if d.disaggregation_mode != "decode":
            return None
        timeouts = (d.disaggregation_prefill_timeout, d.disaggregation_transfer_timeout)
        control = ReceiverControl(
            engine.backend.kv_endpoints(),
            engine.backend.kv_controls(),
            # a safety net: every way out of a request closes its room; one left open by a
            # fault still expires, a transfer timeout after the request's own deadline
            room_ttl_s=sum(timeouts) + d.disaggregation_transfer_timeout,
        )
        scheduler = engine.backend.schedulers[0]
        return DecodeTransfers(scheduler, control, engine.kv_layout(), *timeouts)

    def run(self) -> None:
        threading.Thread(target=self._watchdog, daemon=True).start()
        self._send(
            (
                "ready",
                {
                    # what one request can hold: the model's context, or the KV pool if
                    # smaller (the HTTP layer's default max_tokens must fit it)
                    "context_len": min(
                        self.engine.context_len, self.backend.schedulers[0].kv.capacity_tokens
                    ),
                    "vocab_size": self.engine.arch.vocab_size,
                    "model_path": str(self.engine.model_path),
                },
            )
        )
        try:
            while self.running:
                self.backend.check_health()
                self._intake(block=not self.backend.scheduler.has_work())
                if self.transfers is not None:
                    self._transfer_step(self.transfers)
                if self.backend.scheduler.has_work():
                    self.step_started = time.monotonic()
                    updates = self.backend.step()
                    self.step_started = None
                    self._emit(updates)
                    if not self.backend.scheduler.has_work():
                        self.last_stats = 0.0  # idle now: report the drained state at once
                self._maybe_stats()
        except BaseException as exc:
            log.error("engine failed:\n%s%s", traceback.format_exc(), getattr(exc, "details", ""))
            self._send(("fatal", f"engine failed: {exc}"))
            raise
        finally:
            if self.transfers is not None:
                self.transfers.shutdown()
            self.engine.shutdown()

    def _transfer_step(self, transfers: DecodeTransfers) -> None:
        for rid, dest in transfers.reserve():
            self._send(("reserved", [rid, dest]))
        self._emit(transfers.step())

    def _intake(self, block: bool) -> None:
        if not block:
            timeout = 0
        elif self.transfers is not None and self.transfers.active:
            timeout = TRANSFER_POLL_MS  # KV arriving: look for its done notices often
        else:
            timeout = IDLE_POLL_MS
        while self.inbox.poll(timeout):
            try:
                msg = wire.decode_to_engine(self.inbox.recv())
            except wire.WireError as exc:
                log.warning("dropped a malformed message from the HTTP server: %s", exc)
            else:
                self._handle(msg)
            timeout = 0

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(*msg[1:7])
        elif kind == "pd_reserve":
            rid, input_ids, params, return_logprob, top = msg[1:6]
            self._add(rid, input_ids, params, return_logprob, top, reserve=True)
        elif kind == "pd_prefilled":
            if self.transfers is not None:
                self.transfers.prefilled(*msg[1:])
        elif kind == "abort":
            self.streams.pop(msg[1], None)
            if self.transfers is not None and msg[1] in self.transfers:
                self.transfers.abort(msg[1])
            else:
                self.backend.abort(msg[1])
        elif kind == "shutdown":
            self.running = False

    def _add(
        self,
        rid: str,
        input_ids: list[int],
        params: dict[str, Any],
        return_logprob: bool,
        top: int,
        transfer: dict[str, Any] | None = None,
        reserve: bool = False,
    ) -> None:
        """Admit a request (on a decode server, `reserve`: queue it for pages its KV is sent
        to); anything wrong with it (or any failure while admitting it) is answered to that
        request alone."""
        submitted = False
        try:
            req = request_from_message(rid, input_ids, params, return_logprob, top)
            self.engine.validate(req)
            if transfer is not None:
                req.kv_dest = self._destination(transfer)
            if reserve:
                if self.transfers is None:
                    raise ValueError("not a decode server (--disaggregation-mode decode)")
                self.transfers.add(req)
            else:
                self.backend.submit(req)
            submitted = True
            stream = OutputStream(rid, self.engine.tokenizer, req.sampling.stop, len(input_ids))
            self.streams[rid] = stream
        except Exception as exc:
            if submitted and self.transfers is not None and rid in self.transfers:
                self.transfers.abort(rid)
            elif submitted:
                self.backend.abort(rid)
            invalid = isinstance(exc, ValueError) and not submitted
            self._send(("deltas", [self._error_delta(rid, exc, invalid)]))

    def _destination(self, transfer: dict[str, Any]) -> KVDestination:
        """Where a prefill server sends a request's KV; ValueError unless this server is a
        prefill server whose layers and heads map onto the decode side's."""
        d = self.engine.config.disaggregation
        if d.disaggregation_mode != "prefill":
            raise ValueError("not a prefill server (--disaggregation-mode prefill)")
        arch = self.engine.arch
        dest = KVDestination.from_json(
            transfer,
            hosts=d.disaggregation_decode_host,
            max_stages=arch.num_layers,
            max_tp=arch.num_heads,
        )
        plan(self.engine.kv_layout(), dest.layout)  # raises on a model mismatch
        return dest

    def _emit(self, updates: list[RequestUpdate]) -> None:
        deltas = [d for u in updates if (d := self._delta(u)) is not None]
        if deltas:
            self._send(("deltas", deltas))

    def _delta(self, u: RequestUpdate) -> StreamDelta | None:
        """The client's view of one update; a failure here fails (and aborts) that request."""
        stream = self.streams.get(u.rid)
        if stream is None:
            return None
        try:
            delta = stream.apply(u)
        except Exception as exc:
            del self.streams[u.rid]
            self.backend.abort(u.rid)
            return self._error_delta(u.rid, exc, invalid=False)
        if u.finish_reason is not None:
            del self.streams[u.rid]
        if u.error is not None:  # the scheduler failed this request
            delta.error, delta.error_kind = u.error, "engine"
        return delta

    @staticmethod
    def _error_delta(rid: str, exc: Exception, invalid: bool) -> StreamDelta:
        if invalid:
            return StreamDelta(rid, finish_reason="error", error=str(exc))
        log.error("request %s failed:\n%s", rid, traceback.format_exc())
        message = f"internal error while handling the request: {exc!r}"
        return StreamDelta(rid, finish_reason="error", error=message, error_kind="engine")

    def _maybe_stats(self) -> None:
        now = time.monotonic()
        if now - self.last_stats < STATS_EVERY_S:
            return
        self.last_stats = now
        stats = self.backend.stats()
        if self.transfers is not None:
            stats |= self.transfers.stats()
        self._send(("stats", stats))

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            self.outbox.send(wire.encode_from_engine(msg))

    def _watchdog(self) -> None:
        """A step that overruns --watchdog-timeout cannot be interrupted from inside: report
        it, stop the workers and end this process (the server then fails its requests). The
        server's death ends this process through `exit_with_parent`."""
        while True:
            time.sleep(0.5)
            started = self.step_started
            if started is not None and time.monotonic() - started > self.watchdog_timeout:
                self._send(
                    (
                        "fatal",
                        f"a step took longer than --watchdog-timeout {self.watchdog_timeout:g}s",
                    )
                )
                self._die(70)

    def _die(self, code: int) -> None:
        kill = getattr(getattr(self.backend, "workers", None), "kill", None)
        if kill is not None:
            kill()
        time.sleep(0.2)
        os._exit(code)


def request_from_message(
    rid: Any, input_ids: Any, params: Any, return_logprob: Any, top: Any
) -> Req:
    """The Req of an "add" message; ValueError names the first field that is wrong (the
    HTTP layer checks these too: this is the engine's own line of defence)."""
    if not isinstance(rid, str):
        raise ValueError(f"the request id must be a string, got {type(rid).__name__}")
    if not isinstance(input_ids, list) or not all(type(t) is int for t in input_ids):
        raise ValueError("input_ids must be a list of integers")
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be true or false, got {return_logprob!r}")
    if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
    sp = SamplingParams.from_dict(params)
    return Req(rid, input_ids, sp, return_logprob or top > 0, top_logprobs=top)
