"""The engine process behind the HTTP server: scheduler + backend (and through it the
worker processes), request intake and detokenization, so the HTTP event loop only moves
bytes. Talks to the HTTP process over ZMQ ipc:// sockets in a private directory.

Messages (`distributed/messages.py`) in: AddRequest, Abort, StopEngine. Out: EngineReady,
Deltas, Stats, Fatal.

Prefill/decode disaggregation: a prefill server's AddRequest may carry a transfer
destination (the prompt's KV goes there as it is computed). A decode server's AddRequest
may name a prefill server: this process then reserves the request's pages and room, calls
that server, and decodes once the first token and the KV are in (pd/decode_side.py); the
HTTP process only forwards the request and its deltas.
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
from pipeserve.disaggregation.pd.prefill_client import PrefillCall, PrefillCalls, PrefillClient
from pipeserve.disaggregation.pd.transfer import ReceiverControl
from pipeserve.distributed import wire
from pipeserve.distributed.messages import (
    FROM_ENGINE,
    TO_ENGINE,
    Abort,
    AddRequest,
    Deltas,
    EngineReady,
    Fatal,
    FromEngine,
    Stats,
    StopEngine,
    ToEngine,
)
from pipeserve.lifetime import REFUSED_EXIT, exit_with_parent
from pipeserve.scheduler.output import OutputProcessor, StreamDelta
from pipeserve.scheduler.request import Req
from pipeserve.scheduler.scheduler import RequestUpdate

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
        outbox.send(FROM_ENGINE.encode(Fatal(f"engine failed to start: {exc}")))
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
        self.streams: dict[str, OutputProcessor] = {}  # the requests it answers
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
            room_ttl_s=d.prefill_wait_s,
        )
        scheduler = engine.backend.schedulers[0]
        calls = PrefillCalls(PrefillClient.from_config(engine.config, engine.arch.vocab_size))
        return DecodeTransfers(scheduler, control, engine.kv_layout(), *timeouts, calls)

    def run(self) -> None:
        threading.Thread(target=self._watchdog, daemon=True).start()
        self._send(
            EngineReady(
                # what one request can hold: the model's context, or the KV pool if smaller
                # (the HTTP layer's default max_tokens must fit it)
                min(self.engine.context_len, self.backend.schedulers[0].kv.capacity_tokens),
                self.engine.arch.vocab_size,
                str(self.engine.model_path),
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
            self._send(Fatal(f"engine failed: {exc}"))
            raise
        finally:
            if self.transfers is not None:
                self.transfers.shutdown()
            self.engine.shutdown()

    def _transfer_step(self, transfers: DecodeTransfers) -> None:
        transfers.reserve()  # pages and rooms, and the prefill calls started
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
                msg = TO_ENGINE.decode(self.inbox.recv())
            except wire.WireError as exc:
                log.warning("dropped a malformed message from the HTTP server: %s", exc)
            else:
                self._handle(msg)
            timeout = 0

    def _handle(self, msg: ToEngine) -> None:
        match msg:
            case AddRequest():
                self._add(msg)
            case Abort(rid):
                self.streams.pop(rid, None)
                if self.transfers is not None and rid in self.transfers:
                    self.transfers.abort(rid)
                else:
                    self.backend.abort(rid)
            case StopEngine():
                self.running = False

    def _add(self, msg: AddRequest) -> None:
        """Admit a request (one whose prompt a prefill server computes: queue it for pages
        its KV is sent to); anything wrong with it (or any failure while admitting it) is
        answered to that request alone. It was validated where it entered; the engine
        checks what only it knows (the model's limits, its layout against a KV
        destination, its prefill servers)."""
        rid, input_ids = msg.rid, msg.input_ids
        submitted = False
        try:
            top = msg.top_logprobs
            sp = msg.sampling
            req = Req(rid, input_ids, sp, msg.return_logprob or top > 0, top_logprobs=top)
            req.output = OutputProcessor.of(req, self.engine.tokenizer)
            self.engine.validate(req)
            if msg.transfer is not None:
                req.kv_dest = self._destination(msg.transfer)
            if msg.prefill_url is not None:
                if self.transfers is None:
                    raise ValueError("not a decode server (--disaggregation-mode decode)")
                call = PrefillCall(msg.prefill_url, input_ids, sp, msg.return_logprob, top)
                self.transfers.add(req, call)
            else:
                self.backend.submit(req)
            submitted = True
            self.streams[rid] = req.output
        except Exception as exc:
            if submitted and self.transfers is not None and rid in self.transfers:
                self.transfers.abort(rid)
            elif submitted:
                self.backend.abort(rid)
            invalid = isinstance(exc, ValueError) and not submitted
            self._send(Deltas([self._error_delta(rid, exc, invalid)]))

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
            self._send(Deltas(deltas))

    def _delta(self, u: RequestUpdate) -> StreamDelta | None:
        """The client's view of one update; a failure here fails (and aborts) that request."""
        stream = self.streams.get(u.rid)
        if stream is None:
            return None
        try:
            delta = stream.delta(u)
        except Exception as exc:
            del self.streams[u.rid]
            self.backend.abort(u.rid)
            return self._error_delta(u.rid, exc, invalid=False)
        if u.finish_reason is not None:
            del self.streams[u.rid]
        if u.error is not None:  # the engine failed it (or a prefill server refused it)
            delta.error, delta.error_kind = u.error, u.error_kind
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
        self._send(Stats(stats))

    def _send(self, msg: FromEngine) -> None:
        with self._lock:
            self.outbox.send(FROM_ENGINE.encode(msg))

    def _watchdog(self) -> None:
        """A step that overruns --watchdog-timeout cannot be interrupted from inside: report
        it, stop the workers and end this process (the server then fails its requests). The
        server's death ends this process through `exit_with_parent`."""
        while True:
            time.sleep(0.5)
            started = self.step_started
            if started is not None and time.monotonic() - started > self.watchdog_timeout:
                self._send(
                    Fatal(f"a step took longer than --watchdog-timeout {self.watchdog_timeout:g}s")
                )
                self._die(70)

    def _die(self, code: int) -> None:
        kill = getattr(getattr(self.backend, "workers", None), "kill", None)
        if kill is not None:
            kill()
        time.sleep(0.2)
        os._exit(code)
