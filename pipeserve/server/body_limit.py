"""The request-body limit: ASGI middleware that answers 413 to a body over
--max-request-bytes, whether its Content-Length says so or its chunks pass the limit."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeserve.server import protocol as P


class BodySizeLimit:
    """Pure ASGI middleware (streamed responses pass through untouched): a request body over
    `limit` bytes gets 413, at once when its Content-Length says so, else as soon as the
    chunks received pass the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif _content_length(scope) > self.limit:
            await _send_too_large(send, self.limit)
        else:
            await _LimitedBody(self.limit, receive, send).run(self.app, scope)


class _LimitedBody:
    """One request under BodySizeLimit. Past the limit the client gets 413 (unless a
    response already started), the app sees the client disconnect, and whatever the app
    answers then is dropped."""

    def __init__(self, limit: int, receive: Receive, send: Send) -> None:
        self.limit, self._receive, self._send = limit, receive, send
        self.received, self.rejected, self.started = 0, False, False

    async def run(self, app: ASGIApp, scope: Scope) -> None:
        await app(scope, self.receive, self.send)

    async def receive(self) -> Message:
        if self.rejected:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.rejected = True
                if not self.started:
                    await _send_too_large(self._send, self.limit)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.rejected:
            return
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


async def _send_too_large(send: Send, limit: int) -> None:
    message = f"the request body is larger than {limit} bytes (the server's --max-request-bytes)"
    body = json.dumps(P.error_body(message, code="request_too_large")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
