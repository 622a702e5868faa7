"""The HTTP legs of a disaggregated request. The router sends the client's request to a
decode server, naming a prefill server in the `X-Pipeserve-Prefill` header (with the
internal credential, auth.py); the decode server reserves pages, then calls that prefill
server's `POST /pd/prefill` with the prompt, the sampling parameters and where to send the
KV; the prefill server computes the prompt (sending KV as it goes) and answers with the
first token. The client's stream comes from the decode server alone.

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

import contextlib
import dataclasses
import json
import logging
import math
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pipeserve.disaggregation.pd.router import PREFILL_HEADER
from pipeserve.scheduler.request import MAX_TOP_LOGPROBS, SamplingParams
from pipeserve.server.connection_guard import client_tls
from pipeserve.server.engine_client import Prefill, PrefillFailed
from pipeserve.server.errors import ApiError, unavailable
from pipeserve.server.streams import StreamDelta

if TYPE_CHECKING:
    from pipeserve.server.state import ServerState

__all__ = ["PREFILL_HEADER", "add_prefill_route", "prefill_call", "prefill_target"]

log = logging.getLogger(__name__)

PREFILL_PATH = "/pd/prefill"
MAX_ANSWER_BYTES = 1 << 20  # a first token with its top logprobs is far smaller
PEER_TEXT_LOGGED = 300  # characters of a peer's error message kept in the log


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


def prefill_call(
    state: ServerState,
    url: str,
    input_ids: list[int],
    params: SamplingParams,
    return_logprob: bool,
    top_logprobs: int,
) -> Prefill:
    """The decode server's call of one request's prefill (see `EngineClient.generate`): to a
    configured prefill server `url`, with the internal credential."""
    credential = state.pd_credential
    assert credential is not None, "a decode server has its PD key"
    tls = client_tls(state.config.server.ssl_ca_certs)
    timeout_s = state.config.disaggregation.disaggregation_prefill_timeout
    vocab = state.vocab_size

    async def call(destination: dict[str, Any]) -> tuple[int, float, list[tuple[int, float]]]:
        body = {
            "input_ids": input_ids,
            "sampling": {**dataclasses.asdict(params), "max_new_tokens": 1},
            "return_logprob": return_logprob,
            "top_logprobs": top_logprobs,
            "transfer": destination,
        }
        content = json.dumps(body).encode()
        headers = {
            "content-type": "application/json",
            **credential.headers("POST", PREFILL_PATH, content),
        }
        try:
            async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, verify=tls) as client:
                r = await client.post(url + PREFILL_PATH, content=content, headers=headers)
        except httpx.HTTPError as exc:
            log.warning("prefill server %s failed: %r", url, exc)
            raise PrefillFailed(f"the prefill server failed ({type(exc).__name__})") from None
        if r.status_code != 200:
            log.warning(
                "prefill server %s answered HTTP %d: %s",
                url,
                r.status_code,
                _error_message(r)[:PEER_TEXT_LOGGED],
            )
            if r.status_code == 400:  # the request itself: the client should know
                raise PrefillFailed("the prefill server rejected the request", invalid=True)
            raise PrefillFailed(f"the prefill server failed (HTTP {r.status_code})")
        try:
            return first_token(r, vocab, return_logprob, top_logprobs)
        except ValueError as exc:
            log.warning("prefill server %s answered a malformed first token: %s", url, exc)
            raise PrefillFailed(f"the prefill server's answer is malformed: {exc}") from None

    return call


def first_token(
    r: httpx.Response, vocab: int, return_logprob: bool, top_logprobs: int
) -> tuple[int, float, list[tuple[int, float]]]:
    """The (token, logprob, top) of a prefill server's answer, checked like client input:
    ValueError says what is wrong (in our words: the peer's text is not repeated)."""
    if len(r.content) > MAX_ANSWER_BYTES:
        raise ValueError("the answer is too large")
    try:
        out = r.json()
        token, logprob, top = out["token"], out["logprob"], out["top"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("not a JSON object with token, logprob and top") from None
    if type(token) is not int or not 0 <= token < vocab:
        raise ValueError(f"the token is not an id in [0, {vocab})")
    if logprob is None:
        value = math.nan  # not asked for
    elif _finite(logprob):
        value = float(logprob)
    else:
        raise ValueError("the logprob is not a finite number")
    if return_logprob and logprob is None:
        raise ValueError("the logprob asked for is missing")
    if not isinstance(top, list) or len(top) > top_logprobs:
        raise ValueError(f"top is not a list of at most {top_logprobs} pairs")
    pairs = []
    for pair in top:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError("top is not a list of [token, logprob] pairs")
        t, v = pair
        if type(t) is not int or not 0 <= t < vocab or not _finite(v):
            raise ValueError("a top pair is not [an id in the vocabulary, a finite logprob]")
        pairs.append((t, float(v)))
    return token, value, pairs


def _finite(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _error_message(r: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return str(r.json()["error"]["message"])
    return f"HTTP {r.status_code}"


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
            body = json.loads(raw)
        except ValueError:
            raise ApiError(400, "the body must be JSON") from None
        ids, params, logprob, top, transfer = prefill_request(body, state.vocab_size)
        ticket = state.admission.admit(state.metrics)
        run = _run_prefill(state, ticket, ids, params, logprob, top, transfer)
        return await until_done(request, run)


def prefill_request(
    body: Any, vocab: int
) -> tuple[list[int], SamplingParams, bool, int, dict[str, Any]]:
    """The fields of a /pd/prefill body, their types and ranges checked (ApiError 400):
    the engine checks the destination against its own layout."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    fields = ("input_ids", "sampling", "return_logprob", "top_logprobs", "transfer")
    missing = [f for f in fields if f not in body]
    if missing:
        raise ApiError(400, f"missing field(s): {', '.join(missing)}")
    ids, sampling, logprob, top, transfer = (body[f] for f in fields)
    if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
        raise ApiError(400, "input_ids must be a non-empty list of integers", param="input_ids")
    if not all(0 <= t < vocab for t in ids):
        raise ApiError(400, f"input_ids must be in [0, {vocab})", param="input_ids")
    if not isinstance(sampling, dict):
        raise ApiError(400, "sampling must be an object", param="sampling")
    if not isinstance(logprob, bool):
        raise ApiError(400, "return_logprob must be true or false", param="return_logprob")
    if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
        )
    if not isinstance(transfer, dict):
        raise ApiError(400, "transfer must be an object", param="transfer")
    try:
        params = SamplingParams.from_dict(sampling)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="sampling") from None
    return ids, params, logprob, top, transfer


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
