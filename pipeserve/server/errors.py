"""OpenAI-style API errors: `ApiError` carries the status, body fields and Retry-After of
one error response."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pipeserve.server import protocol as P
from pipeserve.server.engine_client import EngineFailed

RETRY_UNAVAILABLE_S = 5  # Retry-After of a 503 from a server shutting down or failed


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.retry_after = param, code, retry_after

    def response(self) -> JSONResponse:
        return error_response(
            self.status,
            P.error_body(self.message, self.kind, self.param, self.code),
            self.retry_after,
        )


def error_response(status: int, body: dict[str, Any], retry_after: int | None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def unavailable(exc: EngineFailed | str) -> ApiError:
    return ApiError(
        503, f"engine unavailable: {exc}", "server_error", retry_after=RETRY_UNAVAILABLE_S
    )
