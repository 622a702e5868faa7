"""Waiting for a non-streamed answer while watching its client (shared by the OpenAI routes
and the disaggregation routes)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

DISCONNECT_POLL_S = 0.25
CLIENT_GONE = 499  # status of a request whose client disconnected (never seen by it)


async def until_done(request: Request, work: Any) -> Response:
    """Await a non-streamed response; abort it if the client disconnects meanwhile (then
    nobody reads the answer: an empty 499, as proxies log a client that went away)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=CLIENT_GONE)
    return JSONResponse(task.result())
