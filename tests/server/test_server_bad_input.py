"""Bad requests get the right status and an OpenAI-style error body that says what is wrong,
never reach (or hurt) the engine, and the server keeps serving; schemathesis fuzzes the two
generation endpoints from the server's own OpenAPI schema and no answer may be a 5xx.

The module's server runs with --context-length 64: context errors are easy to provoke and a
fuzzed request without max_tokens generates at most a few dozen tokens; and with
--max-request-bytes 65536."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from server_helpers import Server, error_message, running_server, wait_for

pytestmark = pytest.mark.timeout(240)

CONTEXT = 64
MAX_BYTES = 65536
NAME = "tiny"
VOCAB = 512
OK = {"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("bad-input-server") / "server.log"
    args = ["--context-length", str(CONTEXT), "--served-model-name", NAME]
    args += ["--max-request-bytes", str(MAX_BYTES)]
    args += ["--enable-api-docs"]  # the fuzzing reads the schema
    with running_server(tiny_model, args, log) as srv:
        yield srv


def expect_error(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    message = error_message(r)
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    return message


def still_serves(server: Server) -> None:
    r = server.post("/v1/completions", OK)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert server.get("/health").status_code == 200


def test_malformed_json_is_400(server: Server) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = server.post(
            path,
            content=b'{"model": "tiny", "prompt": "hi",',
            headers={"content-type": "application/json"},
        )
        expect_error(r, 400, "JSON")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"model": NAME}, "prompt"),
        ("/v1/completions", {"prompt": "hi"}, "model"),
        ("/v1/chat/completions", {"model": NAME}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"content": "hi"}]}, "role"),
    ],
)
def test_missing_required_field_is_400_naming_it(
    server: Server, path: str, body: dict, field: str
) -> None:
    message = expect_error(server.post(path, body), 400, field)
    assert "required" in message.lower()


def test_unknown_model_is_404(server: Server) -> None:
    r = server.post("/v1/completions", {**OK, "model": "gpt-17"})
    expect_error(r, 404, "gpt-17", "not found")
    assert r.json()["error"]["code"] == "model_not_found"
    r = server.post(
        "/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}
    )
    expect_error(r, 404, "gpt-17")


def test_prompt_longer_than_context_is_400(server: Server) -> None:
    for prompt in (" ".join(["kari"] * 100), list(range(1, CONTEXT + 1)), list(range(200))):
        r = server.post("/v1/completions", {**OK, "prompt": prompt, "max_tokens": 1})
        expect_error(r, 400, "context length", str(CONTEXT))
    chat = {"model": NAME, "messages": [{"role": "user", "content": "ka " * 100}]}
    expect_error(server.post("/v1/chat/completions", chat), 400, "context length")


def test_too_long_completion_prompt_error_names_prompt(server: Server) -> None:
    r = server.post("/v1/completions", {**OK, "prompt": list(range(CONTEXT)), "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"


def test_max_tokens_past_context_is_400(server: Server) -> None:
    ids = list(range(10))
    for key in ("max_tokens", "max_completion_tokens"):
        r = server.post("/v1/completions", {"model": NAME, "prompt": ids, key: CONTEXT - 9})
        expect_error(r, 400, "context length", str(CONTEXT - 9))
    r = server.post("/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": CONTEXT - 10})
    assert r.status_code == 200, r.text  # exactly fills the context


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 2),
        ("n", 2),
        ("max_tokens", -1),
        ("top_k", -2),
        ("min_p", 1.5),
        ("logprobs", 21),
        ("echo", True),
    ],
)
def test_out_of_range_sampling_value_is_400_naming_it(
    server: Server, field: str, value: Any
) -> None:
    r = server.post("/v1/completions", {**OK, field: value})
    expect_error(r, 400, field)
    assert r.json()["error"]["param"] == field


def test_chat_bad_values_are_400(server: Server) -> None:
    base = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    expect_error(server.post("/v1/chat/completions", {**base, "messages": []}), 400, "messages")
    expect_error(server.post("/v1/chat/completions", {**base, "n": 2}), 400, "n")
    expect_error(
        server.post("/v1/chat/completions", {**base, "top_logprobs": 30}), 400, "top_logprobs"
    )
    bad_role = {**base, "messages": [{"role": "wizard", "content": "hi"}]}
    expect_error(server.post("/v1/chat/completions", bad_role), 400, "role")


def test_token_ids_outside_vocabulary_are_400(server: Server) -> None:
    for ids, words in (
        ([1, 2, VOCAB], ("token id 512", "vocabulary")),
        ([VOCAB + 1000], ("token id 1512",)),
        ([3, -1], ("token id -1",)),
    ):
        r = server.post("/v1/completions", {**OK, "prompt": ids})
        expect_error(r, 400, *words)
    r = server.post("/v1/completions", {**OK, "prompt": [3, -1], "stream": True})
    expect_error(r, 400, "token id -1")


def test_streamed_token_id_outside_vocabulary_is_400(server: Server) -> None:
    r = server.post("/v1/completions", {**OK, "prompt": [1, 2, VOCAB], "stream": True})
    expect_error(r, 400, "token id 512")


def test_empty_prompt_is_400(server: Server) -> None:
    for prompt in ("", []):
        expect_error(server.post("/v1/completions", {**OK, "prompt": prompt}), 400, "prompt")


def test_wrong_content_type_is_a_4xx_error_body(server: Server) -> None:
    data = json.dumps(OK).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        r = server.post("/v1/completions", content=data, headers={"content-type": ctype})
        assert r.status_code in (400, 415), r.text
        error_message(r)
    r = server.post(
        "/v1/completions",
        content=b"model=tiny&prompt=hi",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code in (400, 415), r.text


def test_wrong_content_type_message_names_the_content_type(server: Server) -> None:
    r = server.post(
        "/v1/completions", content=json.dumps(OK).encode(), headers={"content-type": "text/plain"}
    )
    assert "application/json" in error_message(r).lower()


def test_malformed_json_error_has_no_bogus_param(server: Server) -> None:
    r = server.post(
        "/v1/completions",
        content=b'{"model": "tiny", "prompt": "hi",',
        headers={"content-type": "application/json"},
    )
    assert r.json()["error"]["param"] in (None, "body")


def test_chat_content_part_with_non_string_text_is_400(server: Server) -> None:
    body = {
        "model": NAME,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    }
    expect_error(server.post("/v1/chat/completions", body), 400, "text")


def test_lone_surrogates_are_400_on_a_connection_that_keeps_serving(server: Server) -> None:
    """They used to crash the engine (in a stop string) or end in a text/plain 500 and a
    reset connection (in a prompt)."""
    headers = {"content-type": "application/json"}
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}'
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for path, raw, param in (
            ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800"}', "prompt"),
            ("/v1/completions", '{"model": "tiny", "prompt": "a", "stop": ["\\udc00"]}', "stop.0"),
            ("/v1/chat/completions", chat, "messages.0.content"),
        ):
            r = http.post(path, content=raw.encode(), headers=headers)
            expect_error(r, 400, "surrogate")
            assert r.json()["error"]["param"] == param
        r = http.post("/v1/completions", json=OK)
        assert r.status_code == 200, r.text
    still_serves(server)


def test_declared_body_over_max_request_bytes_is_413_unread(server: Server) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: pipeserve\r\n"
        f"Content-Type: application/json\r\nContent-Length: {MAX_BYTES + 1}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head.encode())  # no body: the answer must come from the header alone
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), reply
    assert "--max-request-bytes" in json.loads(body)["error"]["message"]
    still_serves(server)


def test_server_keeps_serving_after_bad_input(server: Server) -> None:
    still_serves(server)
    r = server.post(
        "/v1/chat/completions",
        {
            "model": NAME,
            "max_tokens": 3,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}],
                }
            ],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


# -- fuzzing ------------------------------------------------------------------------------------


def _number(value: Any, kind: type) -> Any:
    """What pydantic (lax mode) would make of a fuzzed value, or None."""
    if isinstance(value, bool):
        return None
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        return None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_server_error(
    server: Server, path: str, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operation = schema[path]["POST"]
    failures: list[str] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=50,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Any) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = NAME  # otherwise nearly every case stops at the 404
        r = case.call(base_url=server.base_url, timeout=120)
        if r.status_code >= 500:
            failures.append(f"{r.status_code} for {case.body!r}: {r.text[:300]}")
        elif r.status_code >= 400:
            assert "error" in r.json(), r.text

    fuzz()
    assert not failures, "\n".join(failures)
    assert wait_for(lambda: server.get("/health").status_code == 200, 5)
    still_serves(server)


# -- inputs that take the whole server down -----------------------------------------------------


@pytest.fixture
def fresh_server(tiny_model: Path, tmp_path: Path) -> Iterator[Server]:
    with running_server(tiny_model, ["--served-model-name", NAME], tmp_path / "server.log") as srv:
        yield srv


def test_huge_seed_is_rejected_not_fatal(fresh_server: Server) -> None:
    r = fresh_server.post("/v1/completions", {**OK, "temperature": 1.0, "seed": 2**64})
    assert r.status_code < 500, r.text
    still_serves(fresh_server)


def test_tiny_positive_temperature_is_not_fatal(fresh_server: Server) -> None:
    r = fresh_server.post("/v1/completions", {**OK, "temperature": 1e-46})
    assert r.status_code < 500, r.text
    still_serves(fresh_server)
