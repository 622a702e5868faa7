"""The engine process behind the HTTP server: scheduler + backend (and through it the
worker processes), request intake and detokenization, so the HTTP event loop only moves
bytes. Talks to the HTTP process over ZMQ ipc:// sockets in a private directory.

Messages in:  ("add", rid, input_ids, sampling dict, return_logprob, top_logprobs),
              ("abort", rid), ("shutdown",)
Messages out: ("ready", info), ("deltas", [StreamDelta]), ("stats", dict),
              ("fatal", message)
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from pipeserve.scheduler.request import Req, SamplingParams
from pipeserve.server.streams import OutputStream, StreamDelta

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.5
IDLE_POLL_MS = 500


@dataclass(frozen=True)
class EngineProcessArgs:
    flags: dict[str, Any]
    in_url: str  # HTTP -> engine
    out_url: str  # engine -> HTTP


def engine_main(args: EngineProcessArgs) -> None:
    logging.basicConfig(level=logging.INFO, format="[pipeserve] %(message)s")
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(args.in_url)
    outbox.connect(args.out_url)
    try:
        from pipeserve.engine.engine import Engine

        engine = Engine(**args.flags)
    except BaseException as exc:  # start-up failure: tell the server, then exit
        outbox.send(pickle.dumps(("fatal", f"engine failed to start: {exc}")))
        time.sleep(0.2)
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

    def run(self) -> None:
        threading.Thread(target=self._watchdog, daemon=True).start()
        self._send(
            (
                "ready",
                {
                    "context_len": self.engine.context_len,
                    "vocab_size": self.engine.arch.vocab_size,
                    "model_path": str(self.engine.model_path),
                },
            )
        )
        try:
            while self.running:
                self.backend.check_health()
                self._intake(block=not self.backend.scheduler.has_work())
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
            self.engine.shutdown()

    def _intake(self, block: bool) -> None:
        timeout = IDLE_POLL_MS if block else 0
        while self.inbox.poll(timeout):
            self._handle(pickle.loads(self.inbox.recv()))
            timeout = 0

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, input_ids, params, return_logprob, top = msg
            self._add(rid, input_ids, params, return_logprob, top)
        elif kind == "abort":
            self.streams.pop(msg[1], None)
            self.backend.abort(msg[1])
        elif kind == "shutdown":
            self.running = False

    def _add(
        self, rid: str, input_ids: list[int], params: dict[str, Any], return_logprob: bool, top: int
    ) -> None:
        try:
            sp = SamplingParams.from_dict(params)
            req = Req(rid, input_ids, sp, return_logprob or top > 0, top_logprobs=top)
            self.engine.validate(req)
            self.backend.submit(req)
        except ValueError as exc:
            self._send(("deltas", [StreamDelta(rid, finish_reason="error", error=str(exc))]))
            return
        self.streams[rid] = OutputStream(rid, self.engine.tokenizer, sp.stop, len(input_ids))

    def _emit(self, updates: list[Any]) -> None:
        deltas = []
        for u in updates:
            stream = self.streams.get(u.rid)
            if stream is None:
                continue
            deltas.append(stream.apply(u))
            if u.finish_reason is not None:
                del self.streams[u.rid]
        if deltas:
            self._send(("deltas", deltas))

    def _maybe_stats(self) -> None:
        now = time.monotonic()
        if now - self.last_stats < STATS_EVERY_S:
            return
        self.last_stats = now
        self._send(("stats", self.backend.stats()))

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            self.outbox.send(pickle.dumps(msg))

    def _watchdog(self) -> None:
        """A step that overruns --watchdog-timeout cannot be interrupted from inside: report
        it, stop the workers and end this process (the server then fails its requests)."""
        parent = os.getppid()
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
            if os.getppid() != parent:  # the server is gone: leave no orphans
                self._die(71)

    def _die(self, code: int) -> None:
        kill = getattr(getattr(self.backend, "workers", None), "kill", None)
        if kill is not None:
            kill()
        time.sleep(0.2)
        os._exit(code)
