"""The HTTP process's handle on the engine process: start it, send it requests, route its
deltas to per-request queues, keep its latest stats, and notice when it fails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import shutil
import uuid
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from pipeserve.distributed import wire
from pipeserve.distributed.channels import private_directory
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
from pipeserve.scheduler.output import StreamDelta
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server.engine_process import EngineProcessArgs, engine_main

log = logging.getLogger(__name__)

SEND_NOW_TIMEOUT_S = 0.5


class EngineFailed(RuntimeError):
    pass


class EngineClient:
    def __init__(self, flags: dict[str, Any]) -> None:
        self.flags = flags
        self._dir = private_directory()  # 0700: only this user can connect
        self.ctx = zmq.asyncio.Context()
        self._to_engine = self.ctx.socket(zmq.PUSH)
        self._from_engine = self.ctx.socket(zmq.PULL)
        in_url, out_url = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._to_engine.bind(in_url)
        self._from_engine.bind(out_url)
        self.proc = mp.get_context("spawn").Process(
            target=engine_main,
            args=(EngineProcessArgs(flags, in_url, out_url),),
            name="pipeserve-engine",
            daemon=False,
        )
        self.queues: dict[str, asyncio.Queue[StreamDelta]] = {}
        self.stats: dict[str, Any] = {}
        self.info: EngineReady | None = None
        self.failure: str | None = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> bool:
        return self.failure is None and self.proc.is_alive() and self.info is not None

    async def start(self, timeout_s: float = 900.0) -> None:
        self.proc.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.info is None:
            if self.failure is not None:
                raise EngineFailed(self.failure)
            if not self.proc.is_alive():
                raise EngineFailed(f"engine process exited with code {self.proc.exitcode}")
            if loop.time() > deadline:
                raise EngineFailed("engine did not start in time")
            if await self._from_engine.poll(200):
                self._receive(await self._from_engine.recv())
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            if await self._from_engine.poll(500):
                self._receive(await self._from_engine.recv())
            elif not self.proc.is_alive() and self.failure is None:
                self._fail(f"engine process exited with code {self.proc.exitcode}")

    def _receive(self, data: bytes) -> None:
        try:
            msg = FROM_ENGINE.decode(data)
        except wire.WireError as exc:  # only the engine can connect; still, never trust bytes
            log.warning("dropped a malformed message from the engine: %s", exc)
            return
        self._dispatch(msg)

    def _dispatch(self, msg: FromEngine) -> None:
        match msg:
            case Deltas(deltas):
                for d in deltas:
                    q = self.queues.get(d.rid)
                    if q is not None:
                        q.put_nowait(d)
            case Stats(values):
                self.stats = values
            case EngineReady():
                self.info = msg
            case Fatal(message):
                self._fail(message)

    def _fail(self, message: str) -> None:
        """Every waiting request gets the error; the server turns unhealthy. The first
        cause stays (a watchdog's report, not the worker exits that follow from it)."""
        if self.failure is None:
            self.failure = message
        self.fail_all(self.failure)

    def fail_all(self, message: str) -> None:
        for rid, q in list(self.queues.items()):
            q.put_nowait(
                StreamDelta(rid, finish_reason="error", error=message, error_kind="engine")
            )

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        return_logprob: bool,
        top_logprobs: int,
        transfer: dict[str, Any] | None = None,
        prefill_url: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Deltas of one request until it finishes; aborts it if the caller stops listening.
        A prefill server's request may carry a KV `transfer` destination. On a decode
        server, `prefill_url` names the prefill server that computes the prompt (the engine
        reserves pages for it, calls it and decodes once the KV is in)."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        rid = uuid.uuid4().hex
        queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self.queues[rid] = queue
        finished = False
        try:
            try:
                args = (input_ids, sampling, return_logprob, top_logprobs, transfer, prefill_url)
                await self._send(AddRequest(rid, *args))
            except wire.WireError as exc:  # e.g. an integer beyond 64 bits
                finished = True
                yield StreamDelta(rid, finish_reason="error", error=f"invalid request: {exc}")
                return
            while True:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            self.queues.pop(rid, None)
            if not finished and self.failure is None:
                await self._send(Abort(rid))

    @property
    def num_active(self) -> int:
        return len(self.queues)

    async def _send_now(self, msg: ToEngine) -> None:
        """Send, giving up after SEND_NOW_TIMEOUT_S (an engine that is gone takes nothing)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._send(msg), SEND_NOW_TIMEOUT_S)

    async def _send(self, msg: ToEngine) -> None:
        await self._to_engine.send(TO_ENGINE.encode(msg))

    async def shutdown(self, timeout_s: float = 15.0) -> None:
        """Abort everything, stop the engine (and its workers), wait for it."""
        for rid in list(self.queues):
            await self._send_now(Abort(rid))
        if self.proc.is_alive():
            await self._send_now(StopEngine())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.proc.is_alive() and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self.proc.is_alive():
            self.proc.kill()
        if self._reader is not None:
            self._reader.cancel()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
