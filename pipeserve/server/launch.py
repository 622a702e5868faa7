"""Run the HTTP server: engine process first, then uvicorn; a line with `ready` once
requests are accepted; SIGTERM/SIGINT stop accepting, abort what is in flight and exit."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import uvicorn

from pipeserve.config import EngineConfig
from pipeserve.device import with_compute_dtype
from pipeserve.lifetime import REFUSED_EXIT
from pipeserve.models.resolve import resolve_model_path
from pipeserve.server.app import create_app
from pipeserve.server.connection_guard import ConnectionLimits, GuardedServer, uvicorn_options
from pipeserve.server.state import ServerState

GRACEFUL_SHUTDOWN_S = 3


class _Server(GuardedServer):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            c = self.state.config.server
            print(
                f"pipeserve ready: serving {self.state.model_name!r} on "
                f"{'https' if c.ssl_certfile else 'http'}://{c.host}:{c.port}",
                flush=True,
            )

    def handle_exit(self, sig: int, frame: Any) -> None:
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self.state.client.fail_all, "the server is shutting down")
        super().handle_exit(sig, frame)


class _EngineStartReport:
    """The app as uvicorn runs it: when the engine fails to start, the server says so in one
    line (`serve`) instead of uvicorn logging the whole traceback Starlette hands it."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state
        self.engine_failed = False  # the start failed because the engine did

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def relay(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed" and self.state.client.failure:
                self.engine_failed = True
                message = {**message, "message": ""}
            await send(message)

        return await self.app(scope, receive, relay)


def serve(flags: dict[str, Any]) -> int:
    config = with_compute_dtype(EngineConfig.from_flags(**flags))
    model_path = resolve_model_path(config.model.model_path, config.model.dtype)
    flags = {**flags, "model_path": str(model_path), "dtype": config.model.dtype}
    state = ServerState.for_model(config, flags, model_path)
    app = create_app(state)
    c = config.server
    report = _EngineStartReport(app, state)
    server = _Server(
        uvicorn.Config(
            report,
            host=c.host,
            port=c.port,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            **uvicorn_options(
                ConnectionLimits.of(c),
                c.ssl_certfile,
                c.ssl_keyfile,
            ),
        ),
        state,
    )
    state.on_failure = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    except SystemExit:  # uvicorn's exit when the app did not start (or the port is taken)
        failure = state.client.failure
        if not report.engine_failed or failure is None:
            raise
        print(f"pipeserve: error: {failure.splitlines()[0]}", file=sys.stderr)
        state.client.proc.join(timeout=5)
        return REFUSED_EXIT if state.client.proc.exitcode == REFUSED_EXIT else 1
    if state.client.failure is not None:
        print(f"pipeserve stopped: {state.client.failure.splitlines()[0]}", file=sys.stderr)
        return 1
    return 0
