"""The HTTP legs of a disaggregated request. The router sends the client's request to a
decode server, naming a prefill server in the `X-Pipeserve-Prefill` header; the decode
server reserves pages, then calls that prefill server's `POST /pd/prefill` with the prompt,
the sampling parameters and where to send the KV; the prefill server computes the prompt
(sending KV as it goes) and answers with the first token. The client's stream comes from
the decode server alone.

If the decode server's call goes away (its client left, or it died), the prefill server
aborts the prompt at once, as for any client that disconnects.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pipeserve.disaggregation.pd.router import PREFILL_HEADER
from pipeserve.server.engine_client import Prefill, PrefillFailed
from pipeserve.server.errors import ApiError, unavailable
from pipeserve.server.streams import StreamDelta

if TYPE_CHECKING:
    from pipeserve.server.state import ServerState

__all__ = ["PREFILL_HEADER", "add_prefill_route", "prefill_call"]

PREFILL_PATH = "/pd/prefill"


def prefill_call(
    url: str,
    input_ids: list[int],
    params: dict[str, Any],
    return_logprob: bool,
    top_logprobs: int,
    timeout_s: float,
) -> Prefill:
    """The decode server's call of one request's prefill (see `EngineClient.generate`)."""

    async def call(destination: dict[str, Any]) -> tuple[int, float, list[tuple[int, float]]]:
        body = {
            "input_ids": input_ids,
            "sampling": {**params, "max_new_tokens": 1},
            "return_logprob": return_logprob,
            "top_logprobs": top_logprobs,
            "transfer": destination,
        }
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                r = await client.post(url.rstrip("/") + PREFILL_PATH, json=body)
        except httpx.HTTPError as exc:
            raise PrefillFailed(f"prefill server {url} failed: {exc!r}") from None
        if r.status_code != 200:
            message = _error_message(r)
            raise PrefillFailed(f"prefill server {url}: {message}", invalid=r.status_code == 400)
        out = r.json()
        value = float("nan") if out["logprob"] is None else float(out["logprob"])
        return int(out["token"]), value, [(int(t), float(v)) for t, v in out["top"]]

    return call


def _error_message(r: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(r.json()["error"]["message"])
    return f"HTTP {r.status_code}"


def add_prefill_route(app: FastAPI, state: ServerState, authorize: Any) -> None:
    from fastapi import Depends

    from pipeserve.server.responses import until_done

    @app.post(PREFILL_PATH, dependencies=[Depends(authorize)], include_in_schema=False)
    async def prefill(request: Request) -> Response:
        body = await request.json()
        ids, params, logprob, top, transfer = _prefill_request(body)
        ticket = state.admission.admit(state.metrics)
        run = _run_prefill(state, ticket, ids, params, logprob, top, transfer)
        return await until_done(request, run)


def _prefill_request(body: Any) -> tuple[list[int], dict[str, Any], bool, int, dict[str, Any]]:
    """The fields of a /pd/prefill body (the engine checks their values)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    fields = ("input_ids", "sampling", "return_logprob", "top_logprobs", "transfer")
    missing = [f for f in fields if f not in body]
    if missing:
        raise ApiError(400, f"missing field(s): {', '.join(missing)}")
    return tuple(body[f] for f in fields)


async def _run_prefill(
    state: ServerState,
    ticket: Any,
    ids: list[int],
    params: dict[str, Any],
    logprob: bool,
    top: int,
    transfer: dict[str, Any],
) -> dict[str, Any]:
    reason = "abort"
    try:
        final: StreamDelta | None = None
        tokens, logprobs, tops = [], [], []
        async for d in state.client.generate(ids, params, logprob, top, transfer=transfer):
            if d.error is not None:
                reason = "error"
                if d.error_kind == "invalid":
                    raise ApiError(400, str(d.error))
                raise unavailable(str(d.error))
            tokens += d.token_ids
            logprobs += d.logprobs
            tops += d.top_logprobs or [[] for _ in d.token_ids]
            final = d
        assert final is not None and tokens, "a prefill ends with its first token"
        reason = final.finish_reason or reason
        value = logprobs[0] if math.isfinite(logprobs[0]) else None  # nan: not asked for
        return {"token": tokens[0], "logprob": value, "top": [list(p) for p in tops[0]]}
    finally:
        ticket.end(reason)
