"""The attacks on prefill/decode disaggregation, as regression tests against live servers:
one prefill server, one decode server and the router (all with a client API key and the
same PD key), plus a fake prefill server the decode server is configured to call.

- Only the PD key's internal credential opens `/pd/prefill` and makes a decode server
  follow `X-Pipeserve-Prefill`; the client API key opens neither.
- A decode server calls only its configured prefill servers: a header naming anything else
  connects nowhere, and the error does not echo the name.
- A prefill server's bad answer (out-of-vocabulary token, NaN logprob, extra top pairs, an
  error with text of its own) fails that one request, echoes nothing of the peer's text and
  leaks no pages.
- Malformed `/pd/prefill` bodies get 400, never 500 or a hang, and leak no admission.
- No API docs on any of the three.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from server_helpers import Router, Server, drained, error_message, wait_for

from pipeserve.disaggregation.pd import auth
from pipeserve.disaggregation.pd.auth import INTERNAL_HEADER, InternalCredential
from pipeserve.disaggregation.pd.prefill_client import PREFILL_CONTENT_TYPE
from pipeserve.disaggregation.pd.router import PREFILL_HEADER
from pipeserve.distributed.messages import PD_PREFILL, PrefillRequest
from pipeserve.scheduler.request import SamplingParams

pytestmark = pytest.mark.timeout(300)

PD_KEY = "9c41e07a2b5d83f6e1a4c2b9d07f5e38"
CLIENT_KEY = "client-key"
CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}
SIGNER = InternalCredential(PD_KEY)  # what the router and a decode server hold
HTTP_TIMEOUT_S = 30.0  # a hang fails fast
SETTLE_S = 30.0
SECRET = "SECRET-PEER-TEXT"
FLAGS = [
    "--chunked-prefill-size",
    "32",
    "--served-model-name",
    "m",
    "--api-key",
    CLIENT_KEY,
    "--disaggregation-transfer-timeout",
    "60",
    "--watchdog-timeout",
    "60",
]
PROMPT = [(7 * j) % 500 + 1 for j in range(70)]  # three chunks of 32


class ServerThread:
    """An ASGI app under uvicorn in a daemon thread, on a socket bound before start (its
    URL is known before the decode server that is configured with it starts)."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        assert wait_for(lambda: self.server.started, 10), "the fake server did not start"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class FakePrefill:
    """A prefill server that answers `/pd/prefill` with `answer` (status, raw body) and
    records the headers it was called with."""

    def __init__(self) -> None:
        self.answer: tuple[int, bytes] = (200, b"{}")
        self.calls: list[tuple[dict[str, str], bytes]] = []  # headers and body
        self.app = FastAPI()
        self.app.post("/pd/prefill")(self.prefill)

    async def prefill(self, request: Request) -> Response:
        self.calls.append((dict(request.headers), await request.body()))
        status, content = self.answer
        return Response(content, status_code=status, media_type="application/json")


@dataclass
class Cluster:
    prefill: Server
    decode: Server
    router: Router
    fake: FakePrefill
    fake_url: str
    model: Path


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One set of servers for the whole module: each start-up costs seconds."""
    model = model_dir("tiny-llama")
    tmp = tmp_path_factory.mktemp("pd_security")
    fake = FakePrefill()
    made: list[Any] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPESERVE_PD_AUTH_KEY", PD_KEY)  # inherited by every process started here
        try:
            fake_server = ServerThread(fake.app).start()
            made.append(fake_server)
            prefill = Server(model, [*FLAGS, "--disaggregation-mode", "prefill"], tmp / "p.log")
            made.append(prefill)
            urls = ["--disaggregation-prefill-url", prefill.base_url]
            urls += ["--disaggregation-prefill-url", fake_server.url]
            decode = Server(
                model, [*FLAGS, "--disaggregation-mode", "decode", *urls], tmp / "d.log"
            )
            made.append(decode)
            prefill.wait_for_line("ready")
            decode.wait_for_line("ready")
            router = Router(
                [prefill.base_url], [decode.base_url], tmp / "router.log", ["--api-key", CLIENT_KEY]
            )
            made.append(router)
            yield Cluster(prefill, decode, router, fake, fake_server.url, model)
        finally:
            for m in reversed(made):
                m.stop()


def body(max_tokens: int = 5) -> dict[str, Any]:
    return {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
    }


def tokens_of(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def complete(
    base_url: str, headers: dict[str, str] | None = None, prefill: str | None = None
) -> httpx.Response:
    """A completion request; `prefill`: as the router sends it, naming that prefill server
    with an internal credential made for the call."""
    content = json.dumps(body()).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    if prefill is not None:
        headers |= {PREFILL_HEADER: prefill}
        headers |= SIGNER.headers("POST", "/v1/completions", content, prefill)
    url = base_url + "/v1/completions"
    return httpx.post(url, content=content, headers=headers, timeout=HTTP_TIMEOUT_S * 4)


def internal(content: bytes) -> dict[str, str]:
    """A decode server's credential for one call of /pd/prefill with `content`."""
    return SIGNER.headers("POST", "/pd/prefill", content)


def post_prefill(server: Server, content: bytes, headers: dict[str, str]) -> httpx.Response:
    headers = {"Content-Type": PREFILL_CONTENT_TYPE, **headers}
    url = server.base_url + "/pd/prefill"
    return httpx.post(url, content=content, headers=headers, timeout=HTTP_TIMEOUT_S)


def transfer(model: Path, **over: Any) -> dict[str, Any]:
    """The destination a real decode server (one rank, this model) would send."""
    cfg = json.loads((model / "config.json").read_text())
    return {
        "room": "0" * 32,
        "endpoints": ["tcp://127.0.0.1:5"],
        "stage_layers": [[0, cfg["num_hidden_layers"]]],
        "tp_size": 1,
        "num_kv_heads": cfg["num_key_value_heads"],
        "latent": False,
        **over,
    }


def prefill_body(model: Path, **over: Any) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "sampling": SamplingParams(max_new_tokens=1, temperature=0.0),
        "return_logprob": True,
        "top_logprobs": 0,
        "transfer": transfer(model),
        **over,
    }


def encoded(fields: dict[str, Any]) -> bytes:
    """A /pd/prefill body as a decode server sends it."""
    return PD_PREFILL.encode(PrefillRequest(**fields))


def logs(*servers: Server | Router) -> str:
    return "\n".join(f"--- {s.log.name}\n{s.output()[-3000:]}" for s in servers)


def test_the_api_key_serves_end_to_end(cluster: Cluster) -> None:
    c = cluster
    served = tokens_of(complete(c.router.base_url, CLIENT))
    assert served == tokens_of(complete(c.decode.base_url, CLIENT))  # co-located, same tokens
    for url in (c.router.base_url, c.decode.base_url, c.prefill.base_url):
        assert complete(url).status_code == 401, url
    # a body that is well formed but sends KV to a host not allowed: 400 shows the
    # credential let it through, and nothing is computed or sent
    outside = transfer(c.model, endpoints=["tcp://10.9.9.9:5"])
    content = encoded(prefill_body(c.model, transfer=outside))
    r = post_prefill(c.prefill, content, CLIENT)
    assert r.status_code == 401, r.text
    r = post_prefill(c.prefill, content, internal(content))
    assert r.status_code == 400, (r.text, logs(c.prefill))


def test_an_internal_credential_opens_one_call_once(cluster: Cluster) -> None:
    """The credential is made per call: replayed, moved to another body, stale, or the old
    fixed token, it opens nothing (401), and the body is never read further."""
    c = cluster
    outside = transfer(c.model, endpoints=["tcp://10.9.9.9:5"])
    content = encoded(prefill_body(c.model, transfer=outside))
    seen = internal(content)
    assert post_prefill(c.prefill, content, seen).status_code == 400  # let in, then refused
    assert post_prefill(c.prefill, content, seen).status_code == 401  # a replay
    other = encoded(prefill_body(c.model))
    assert post_prefill(c.prefill, other, internal(content)).status_code == 401
    stamp = internal(content)[INTERNAL_HEADER].split(".")[0]
    stale = str(int(stamp) - int(2 * auth.WINDOW_S * 1e6))
    old = InternalCredential(PD_KEY)
    with pytest.MonkeyPatch.context() as mp:  # made with a clock two windows behind
        mp.setattr(auth.time, "time", lambda: int(stale) / 1e6)
        late = old.headers("POST", "/pd/prefill", content)
    assert post_prefill(c.prefill, content, late).status_code == 401
    fixed = hmac.new(PD_KEY.encode(), b"pipeserve disaggregation internal http", "sha256")
    assert post_prefill(c.prefill, content, {INTERNAL_HEADER: fixed.hexdigest()}).status_code == 401
    # digits that are not ASCII ("²³¹" passes str.isdigit, not int): 401, never a 500
    odd = {INTERNAL_HEADER: "\u00b2\u00b3\u00b9." + seen[INTERNAL_HEADER].split(".", 1)[1]}
    r = httpx.post(
        c.prefill.base_url + "/pd/prefill",
        content=content,
        headers={k: v.encode("latin-1") for k, v in {**odd, "Content-Type": "x"}.items()},
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 401, r.text
    # the decode server: a replayed router call is refused too
    headers = {**CLIENT, "Content-Type": "application/json", PREFILL_HEADER: c.fake_url}
    raw = json.dumps(body()).encode()
    headers |= SIGNER.headers("POST", "/v1/completions", raw, c.fake_url)
    c.fake.answer = (500, b"{}")
    url = c.decode.base_url + "/v1/completions"
    first = httpx.post(url, content=raw, headers=headers, timeout=HTTP_TIMEOUT_S)
    assert first.status_code != 403, first.text  # let in (the fake then fails it)
    again = httpx.post(url, content=raw, headers=headers, timeout=HTTP_TIMEOUT_S)
    assert again.status_code == 403, again.text


@contextlib.contextmanager
def listener() -> Iterator[socket.socket]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def test_a_header_naming_an_unconfigured_url_calls_nothing(cluster: Cluster) -> None:
    c = cluster
    calls = len(c.fake.calls)
    with listener() as lst:
        port = lst.getsockname()[1]
        aimed = [
            f"http://127.0.0.1:{port}/some/path#",
            f"http://127.0.0.1:{port}",
            f"{c.fake_url}@127.0.0.1:{port}",
            f"{c.fake_url}/../../127.0.0.1:{port}",
        ]
        for name in aimed:
            r = complete(c.decode.base_url, CLIENT, prefill=name)
            assert r.status_code == 400, (name, r.text)
            assert "--disaggregation-prefill-url" in error_message(r)
            assert str(port) not in r.text
        # a configured URL, but without the internal credential
        r = complete(c.decode.base_url, {**CLIENT, PREFILL_HEADER: c.fake_url})
        assert r.status_code == 403, r.text
        # the client's own copies of the headers are dropped by the router
        forged = {**CLIENT, PREFILL_HEADER: f"http://127.0.0.1:{port}", INTERNAL_HEADER: "x"}
        assert tokens_of(complete(c.router.base_url, forged))
        pending, _, _ = select.select([lst], [], [], 0.5)
        assert not pending, "a refused request connected to the address it named"
    assert len(c.fake.calls) == calls, "a request without the credential was followed"


BAD_ANSWERS = [  # (status, body) of a prefill server, and what the client should read
    (200, json.dumps({"token": 100000, "logprob": -0.5, "top": []}).encode(), "malformed"),
    (200, b'{"token": 1, "logprob": NaN, "top": []}', "malformed"),
    (200, json.dumps({"token": 1, "logprob": -0.5, "top": [[1, -0.1]]}).encode(), "malformed"),
    (200, b"[1, 2", "malformed"),
    (500, json.dumps({"error": {"message": SECRET}}).encode(), "prefill server"),
    (400, json.dumps({"error": {"message": SECRET}}).encode(), "prefill server"),
]


def test_a_prefill_server_answering_out_of_range_fails_that_request_only(
    cluster: Cluster,
) -> None:
    c = cluster
    for status, content, said in BAD_ANSWERS:
        calls = len(c.fake.calls)
        c.fake.answer = (status, content)
        r = complete(c.decode.base_url, CLIENT, prefill=c.fake_url)
        assert r.status_code in (400, 503), (content, r.text, logs(c.decode))
        message = error_message(r)
        assert said in message, message
        assert SECRET not in r.text and "100000" not in r.text and "NaN" not in r.text
        assert len(c.fake.calls) == calls + 1, "the decode server never called the fake"
        called_with, sent = c.fake.calls[-1]
        assert InternalCredential(PD_KEY).problem("POST", "/pd/prefill", sent, called_with) is None
    assert tokens_of(complete(c.decode.base_url, CLIENT))
    assert wait_for(lambda: drained(c.decode), SETTLE_S), (c.decode.metrics(), logs(c.decode))
    assert c.decode.get("/health").status_code == 200


def malformed_bodies(model: Path) -> dict[str, bytes]:
    plain = prefill_body(model)
    fields = msgpack.unpackb(encoded(plain))
    typed: dict[str, Any] = {
        "not msgpack": b"{not msgpack",
        "JSON (the old body)": json.dumps({**plain, "sampling": {}}).encode(),
        "missing fields": msgpack.packb(fields[:2]),
        "return_logprob a string": msgpack.packb([*fields[:2], "yes", *fields[3:]]),
        "input_ids as a list of floats": msgpack.packb([[1.5, 2.5], *fields[1:]]),
    }
    cases: dict[str, Any] = {
        "NaN temperature": {**plain, "sampling": SamplingParams(temperature=math.nan)},
        "no input_ids": {**plain, "input_ids": []},
        "a token beyond the vocabulary": {**plain, "input_ids": [1, 10**9]},
        "negative top_logprobs": {**plain, "top_logprobs": -1},
        "a non-tcp endpoint": {**plain, "transfer": transfer(model, endpoints=["foo://bar"])},
        "16000 ranks": {
            **plain,
            "transfer": transfer(model, tp_size=16000, endpoints=["tcp://127.0.0.1:5"] * 16000),
        },
        "a host not allowed": {
            **plain,
            "transfer": transfer(model, endpoints=["tcp://10.9.9.9:5"]),
        },
        "a room not hex": {**plain, "transfer": transfer(model, room="../" * 11 + "ab")},
    }
    return {**typed, **{k: encoded(v) for k, v in cases.items()}}


def test_malformed_pd_prefill_bodies_get_400(cluster: Cluster) -> None:
    c = cluster
    for name, content in malformed_bodies(c.model).items():
        started = time.monotonic()
        r = post_prefill(c.prefill, content, internal(content))
        assert r.status_code == 400, (name, r.text, logs(c.prefill))
        assert error_message(r), name
        assert time.monotonic() - started < HTTP_TIMEOUT_S, name
    assert tokens_of(complete(c.prefill.base_url, CLIENT))
    assert wait_for(lambda: drained(c.prefill), SETTLE_S), (c.prefill.metrics(), logs(c.prefill))


def test_api_docs_are_off(cluster: Cluster) -> None:
    c = cluster
    for base in (c.decode.base_url, c.prefill.base_url, c.router.base_url):
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = httpx.get(base + path, timeout=HTTP_TIMEOUT_S)
            assert r.status_code == 404, (base, path, r.status_code)
        assert httpx.get(base + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200, base
    health = httpx.get(c.router.base_url + "/health", timeout=HTTP_TIMEOUT_S)
    assert "http://" not in health.text, health.text
