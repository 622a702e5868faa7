"""A decode server's calls of its prefill servers (prefill/decode disaggregation), made by
its engine process: once a request has its pages and room (decode_side.py), the engine
calls the prefill server the request names (one it was started with:
`--disaggregation-prefill-url`) at `POST /pd/prefill` with the prompt, the sampling
parameters and where to send the KV (a `PrefillRequest` of messages.py, msgpack), with the
internal credential (auth.py); the answer is the first token, checked like client input (a
token in the vocabulary, finite logprobs, no more top logprobs than asked for). The peer's
error text is logged, never passed on.

The engine loop is not asynchronous: the calls run as tasks of an asyncio loop on a thread
of their own (`PrefillCalls`); the loop collects the finished ones each turn and cancels
the call of an aborted request (the prefill server then aborts the prompt, as for any
client that disconnects).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import httpx

from pipeserve.disaggregation.pd import auth
from pipeserve.distributed.messages import PD_PREFILL, PrefillRequest
from pipeserve.distributed.wire import WireError
from pipeserve.scheduler.request import SamplingParams
from pipeserve.server.connection_guard import client_tls

log = logging.getLogger(__name__)
_tls = functools.cache(client_tls)  # one TLS context per CA file, not one per call

PREFILL_PATH = "/pd/prefill"
PREFILL_CONTENT_TYPE = "application/vnd.msgpack"  # messages.PD_PREFILL's encoding
MAX_ANSWER_BYTES = 1 << 20  # a first token with its top logprobs is far smaller
PEER_TEXT_LOGGED = 300  # characters of a peer's error message kept in the log

First = tuple[int, float, list[tuple[int, float]]]  # the first token, its logprob, its top


class PrefillFailed(RuntimeError):
    """The prefill server failed the request (`invalid`: it rejected the request itself,
    which the client is told as a 400)."""

    def __init__(self, message: str, invalid: bool = False) -> None:
        super().__init__(message)
        self.invalid = invalid


@dataclass(frozen=True)
class PrefillCall:
    """One request's call: its prefill server and what it sends."""

    url: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    top_logprobs: int


@dataclass(frozen=True)
class PrefillClient:
    credential: auth.InternalCredential = dataclasses.field(repr=False)
    ca_certs: str | None  # --ssl-ca-certs: what a prefill server's certificate chains to
    timeout_s: float  # --disaggregation-prefill-timeout
    vocab: int
    urls: tuple[str, ...]  # the prefill servers it may call

    @classmethod
    def from_config(cls, config: Any, vocab: int) -> PrefillClient:
        d = config.disaggregation
        return cls(
            auth.InternalCredential(auth.pd_key(d.pd_auth_key)),
            config.server.ssl_ca_certs,
            d.disaggregation_prefill_timeout,
            vocab,
            tuple(u.rstrip("/") for u in d.disaggregation_prefill_url),
        )

    async def call(self, c: PrefillCall, destination: dict[str, Any]) -> First:
        """The prefill server's first token for the request, its KV sent to `destination`;
        PrefillFailed if anything goes wrong (the peer's words only in the log)."""
        if c.url not in self.urls:  # the HTTP process checked it too
            raise PrefillFailed("not a prefill server this decode server was started with")
        sampling = dataclasses.replace(c.sampling, max_new_tokens=1)
        body = PrefillRequest(c.input_ids, sampling, c.return_logprob, c.top_logprobs, destination)
        try:  # the ids as one int64 array: a long prompt's body is made in milliseconds
            content = PD_PREFILL.encode(body)
        except WireError as exc:
            raise PrefillFailed(f"the prefill request cannot be sent: {exc}") from None
        headers = {
            "content-type": PREFILL_CONTENT_TYPE,
            **self.credential.headers("POST", PREFILL_PATH, content),
        }
        tls = _tls(self.ca_certs)
        try:
            async with httpx.AsyncClient(
                timeout=self.timeout_s, trust_env=False, verify=tls
            ) as client:
                r = await client.post(c.url + PREFILL_PATH, content=content, headers=headers)
        except httpx.HTTPError as exc:
            log.warning("prefill server %s failed: %r", c.url, exc)
            raise PrefillFailed(f"the prefill server failed ({type(exc).__name__})") from None
        if r.status_code != 200:
            log.warning(
                "prefill server %s answered HTTP %d: %s",
                c.url,
                r.status_code,
                _error_message(r)[:PEER_TEXT_LOGGED],
            )
            if r.status_code == 400:  # the request itself: the client should know
                raise PrefillFailed("the prefill server rejected the request", invalid=True)
            raise PrefillFailed(f"the prefill server failed (HTTP {r.status_code})")
        try:
            return first_token(r, self.vocab, c.return_logprob, c.top_logprobs)
        except ValueError as exc:
            log.warning("prefill server %s answered a malformed first token: %s", c.url, exc)
            raise PrefillFailed(f"the prefill server's answer is malformed: {exc}") from None


class PrefillCalls:
    """The calls in flight, as tasks of an asyncio loop on a thread of its own."""

    def __init__(self, client: PrefillClient) -> None:
        self.client = client
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="pd-prefill-calls", daemon=True
        )
        self._thread.start()
        self.calls: dict[str, concurrent.futures.Future[First]] = {}

    def start(self, rid: str, call: PrefillCall, destination: dict[str, Any]) -> None:
        coro = self.client.call(call, destination)
        self.calls[rid] = asyncio.run_coroutine_threadsafe(coro, self.loop)

    def done(self) -> list[tuple[str, First | PrefillFailed]]:
        """The calls that have ended since last asked: each one's first token or failure."""
        out: list[tuple[str, First | PrefillFailed]] = []
        for rid, future in list(self.calls.items()):
            if not future.done():
                continue
            del self.calls[rid]
            try:
                out.append((rid, future.result()))
            except PrefillFailed as exc:
                out.append((rid, exc))
            except Exception as exc:  # a bug of ours: that request fails alone
                log.error("the prefill call of %s failed: %r", rid, exc)
                out.append((rid, PrefillFailed(f"the prefill call failed: {exc!r}")))
        return out

    def cancel(self, rid: str) -> None:
        future = self.calls.pop(rid, None)
        if future is not None:
            future.cancel()  # the task is cancelled: its connection closes

    def shutdown(self) -> None:
        for rid in list(self.calls):
            self.cancel(rid)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


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
