"""The HTTP legs of a disaggregated request. The router sends the client's request to a
decode server, naming a prefill server in the `X-Pipeserve-Prefill` header (with the
internal credential, auth.py); the decode server's engine reserves pages, then calls that
prefill server's `POST /pd/prefill` with the prompt, the sampling parameters and where to
send the KV (prefill_client.py); the prefill server computes the prompt (sending KV as it
goes) and answers with the first token. The client's stream comes from the decode server
alone. This module: the header's check on the decode server, the route on the prefill
server (its body a `PrefillRequest`, msgpack: the prompt's ids as one int64 array).

Neither side trusts the other's input more than a client's. A decode server calls only the
prefill servers it was started with (`--disaggregation-prefill-url`; the header names one
of them, at the fixed path), checks the answer (a token in the vocabulary, finite
logprobs, no more top logprobs than asked for) and does not pass the peer's error text on
to its client. A prefill server checks every field of `/pd/prefill` (400 for anything
malformed) and sends KV only to the hosts it was started with.

If the decode server's call goes away (its client left, or it died), the prefill server
aborts the prompt at once, as for any client that disconnects.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pipeserve.disaggregation.pd.prefill_client import PREFILL_PATH
from pipeserve.disaggregation.pd.router import PREFILL_HEADER
from pipeserve.distributed.messages import PD_PREFILL, PrefillRequest
from pipeserve.distributed.wire import WireError
from pipeserve.scheduler.output import StreamDelta
from pipeserve.scheduler.request import MAX_TOP_LOGPROBS, SamplingParams
from pipeserve.server.errors import ApiError, unavailable

if TYPE_CHECKING:
    from pipeserve.server.state import ServerState

__all__ = ["PREFILL_HEADER", "add_prefill_route", "prefill_target"]

log = logging.getLogger(__name__)


async def prefill_target(state: ServerState, request: Request) -> str | None:
    """The configured prefill server a request's `X-Pipeserve-Prefill` names (None: no
    header, the request is served here whole). ApiError unless this is a decode server,
    the request carries the internal credential and the name is one of its
    `--disaggregation-prefill-url`s: nothing is called for a refused request."""
    name = request.headers.get(PREFILL_HEADER)
    if name is None:
        return None
    d = state.config.disaggregation
    if d.disaggregation_mode != "decode":
        raise ApiError(400, f"{PREFILL_HEADER} is for decode servers (--disaggregation-mode)")
    credential = state.pd_credential
    body = await request.body()
    path = request.url.path
    problem = (
        "no PD key"
        if credential is None
        else credential.problem("POST", path, body, request.headers, name)
    )
    if problem is not None:
        log.warning("refused %s on %s: %s", PREFILL_HEADER, path, problem)
        raise ApiError(
            403,
            f"{PREFILL_HEADER} is accepted only with the disaggregation's internal credential, "
            "made for this call (the router sends it)",
            "permission_error",
            code="missing_internal_credential",
        )
    url = name.strip().rstrip("/")
    if url not in {u.rstrip("/") for u in d.disaggregation_prefill_url}:
        raise ApiError(
            400,
            f"{PREFILL_HEADER} names no prefill server this decode server was started with "
            "(--disaggregation-prefill-url)",
            code="unknown_prefill_server",
        )
    return url


def add_prefill_route(app: FastAPI, state: ServerState) -> None:
    """`POST /pd/prefill`, for holders of the internal credential only (not the client
    API key: a client cannot make this server send KV anywhere)."""
    from pipeserve.server.responses import until_done

    credential = state.pd_credential
    assert credential is not None, "a prefill server has its PD key"

    @app.post(PREFILL_PATH, include_in_schema=False)
    async def prefill(request: Request) -> Response:
        problem = credential.head_problem("POST", PREFILL_PATH, request.headers)
        if problem is None:  # only a key holder's body is read
            raw = await request.body()
            problem = credential.problem("POST", PREFILL_PATH, raw, request.headers)
        if problem is not None:
            log.warning("refused %s: %s", PREFILL_PATH, problem)
            raise ApiError(
                401,
                f"{PREFILL_PATH} is for decode servers: it needs the internal credential, made "
                "for this call",
                "authentication_error",
                code="missing_internal_credential",
            )
        try:
            body = PD_PREFILL.decode(raw)
        except WireError as exc:
            raise ApiError(400, f"the body is not a prefill request: {exc}") from None
        check_prefill_request(body, state.vocab_size)
        ticket = state.admission.admit(state.metrics)
        args = (body.input_ids, body.sampling, body.return_logprob, body.top_logprobs)
        run = _run_prefill(state, ticket, *args, body.transfer)
        return await until_done(request, run)


def check_prefill_request(body: PrefillRequest, vocab: int) -> None:
    """ApiError 400 unless the values of a /pd/prefill body (its types the wire checked)
    are in range: the engine checks the destination against its own layout."""
    if not body.input_ids:
        raise ApiError(400, "input_ids must be a non-empty list of integers", param="input_ids")
    if not 0 <= min(body.input_ids) <= max(body.input_ids) < vocab:  # C loops, not Python's
        raise ApiError(400, f"input_ids must be in [0, {vocab})", param="input_ids")
    if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
        )
    try:
        body.sampling.validate()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="sampling") from None


async def _run_prefill(
    state: ServerState,
    ticket: Any,
    ids: list[int],
    params: SamplingParams,
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
