"""The HTTP process's handle on the engine process: start it, send it requests, route its
deltas to per-request queues, keep its latest stats, and notice when it fails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
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
    Prefilled,
    Reserve,
    Reserved,
    Stats,
    StopEngine,
    ToEngine,
)
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server.engine_process import EngineProcessArgs, engine_main
from pipeserve.server.streams import StreamDelta

log = logging.getLogger(__name__)

SEND_NOW_TIMEOUT_S = 0.5


class EngineFailed(RuntimeError):
    pass


class PrefillFailed(RuntimeError):
    """The prefill server of a disaggregated request failed it (`invalid`: it rejected the
    request itself, a 400)."""

    def __init__(self, message: str, invalid: bool = False) -> None:
        super().__init__(message)
        self.invalid = invalid


# a decode server's call to a prefill server: the KV destination in, the first token out
# as (token, logprob, top logprobs)
Prefill = Callable[[dict[str, Any]], Awaitable[tuple[int, float, list[tuple[int, float]]]]]


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
        # decode server of a disaggregated pair: requests waiting for their pages and room
        self._reserved: dict[str, asyncio.Future[dict[str, Any]]] = {}

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
            case Reserved(rid, destination):
                waiter = self._reserved.get(rid)
                if waiter is not None and not waiter.done():
                    waiter.set_result(destination)
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
        prefill: Prefill | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Deltas of one request until it finishes; aborts it if the caller stops listening.
        A prefill server's request may carry a KV `transfer` destination. On a decode
        server, `prefill` runs the request's prompt on a prefill server (given where to send
        the KV; it returns the first token) once this engine has reserved pages for it."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        rid = uuid.uuid4().hex
        queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self.queues[rid] = queue
        finished = False
        try:
            try:
                if prefill is None:
                    args = (input_ids, sampling, return_logprob, top_logprobs, transfer)
                    await self._send(AddRequest(rid, *args))
                else:
                    reserve = Reserve(rid, input_ids, sampling, return_logprob, top_logprobs)
                    failed = await self._prefill_elsewhere(reserve, queue, prefill)
                    if failed is not None:  # the engine may still hold it: aborted below
                        yield failed
                        return
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

    async def _prefill_elsewhere(
        self, reserve: Reserve, queue: asyncio.Queue[StreamDelta], prefill: Prefill
    ) -> StreamDelta | None:
        """Reserve pages here, have the prefill server compute the prompt into them, hand
        its first token to this engine. An error delta if any of it fails (the request is
        then aborted here by the caller's cleanup: its pages and room go)."""
        rid = reserve.rid
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._reserved[rid] = waiter
        rejected = asyncio.ensure_future(queue.get())
        try:
            await self._send(reserve)
            pending: set[asyncio.Future[Any]] = {waiter, rejected}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if rejected.done():  # the engine refused it (an error delta)
                return rejected.result()
        finally:
            rejected.cancel()  # also when the caller went away meanwhile
            self._reserved.pop(rid, None)
        try:
            first = await prefill(waiter.result())
        except PrefillFailed as exc:
            kind = "invalid" if exc.invalid else "engine"
            return StreamDelta(rid, finish_reason="error", error=str(exc), error_kind=kind)
        await self._send(Prefilled(rid, *first))
        return None

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
