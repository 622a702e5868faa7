"""Request screening in-process (fake engine): strings UTF-8 cannot encode, bounds on stop
strings and prompt sizes, and unsupported fields are answered with 400 naming the field,
before any tokenization or engine work; harmless OpenAI fields and no-op values pass, also
through the official `openai` client."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from fake_engine import NAME, error_of, make_state, serving

from pipeserve.server import protocol as P
from pipeserve.server.state import ServerState

pytestmark = pytest.mark.timeout(60)

COMPLETION = {"model": NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
S = "\\ud800"  # a lone surrogate, as JSON text


def post(state: ServerState, path: str, body: Any = None, content: str | None = None) -> Any:
    async def go() -> httpx.Response:
        async with serving(state) as http:
            if content is not None:
                headers = {"content-type": "application/json"}
                return await http.post(path, content=content.encode(), headers=headers)
            return await http.post(path, json=body)

    return asyncio.run(go())


def untouched(state: ServerState) -> bool:
    """Nothing was tokenized and nothing reached the engine."""
    return not state.tokenizer.encoded and not state.client.requests  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", f'{{"model": "{NAME}", "prompt": "a{S}b"}}', "prompt"),
        (
            "/v1/completions",
            f'{{"model": "{NAME}", "prompt": "hi", "stop": ["x", "{S}"]}}',
            "stop.1",
        ),
        ("/v1/completions", f'{{"model": "{NAME}", "prompt": "hi", "stop": "{S}"}}', "stop"),
        ("/v1/completions", f'{{"model": "x{S}", "prompt": "hi"}}', "model"),
        ("/v1/completions", f'{{"model": "{NAME}", "prompt": "hi", "user": "{S}"}}', "user"),
        (
            "/v1/completions",
            f'{{"model": "{NAME}", "prompt": "hi", "metadata": {{"{S}": "v"}}}}',
            "metadata",  # the field holding the bad key
        ),
        (
            "/v1/chat/completions",
            f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "{S}"}}]}}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": '
            f'[{{"type": "text", "text": "ok"}}, {{"type": "text", "text": "\\udfff"}}]}}]}}',
            "messages.0.content.1.text",
        ),
        (
            "/v1/chat/completions",
            f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "hi"}}], '
            f'"response_format": {{"type": "{S}"}}}}',
            "response_format.type",
        ),
    ],
)
def test_lone_surrogate_anywhere_is_400_naming_the_field(path: str, raw: str, param: str) -> None:
    state = make_state()
    r = post(state, path, content=raw)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    error = error_of(r)
    assert error["param"] == param, error
    assert "surrogate" in error["message"], error
    assert untouched(state)


def test_too_many_stop_strings_is_400() -> None:
    state = make_state()
    r = post(state, "/v1/completions", {**COMPLETION, "stop": ["x"] * (P.MAX_STOP_STRINGS + 1)})
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["param"] == "stop" and str(P.MAX_STOP_STRINGS) in error["message"], error
    assert untouched(state)


def test_too_long_stop_string_is_400() -> None:
    state = make_state()
    for stop in ("x" * (P.MAX_STOP_CHARS + 1), ["a", "x" * (P.MAX_STOP_CHARS + 1)]):
        r = post(state, "/v1/chat/completions", {**CHAT, "stop": stop})
        assert r.status_code == 400, r.text
        error = error_of(r)
        assert error["param"] == "stop" and str(P.MAX_STOP_CHARS) in error["message"], error
    assert untouched(state)


def test_stop_strings_at_the_bounds_are_accepted() -> None:
    stops = ["x" * P.MAX_STOP_CHARS] * P.MAX_STOP_STRINGS
    r = post(make_state(), "/v1/completions", {**COMPLETION, "stop": stops})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": "x" * (16 * 4096 + 1)}, "prompt"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x" * 40000}] * 2},
            "messages",
        ),
    ],
)
def test_prompt_with_more_characters_than_the_context_holds_is_400_untokenized(
    path: str, body: dict[str, Any], param: str
) -> None:
    state = make_state()  # the fake engine's context: 4096 tokens
    r = post(state, path, body)
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert untouched(state)


def test_token_id_prompt_longer_than_the_context_is_400_before_the_engine() -> None:
    state = make_state()
    r = post(state, "/v1/completions", {**COMPLETION, "prompt": [5] * 4096})
    assert r.status_code == 400, r.text
    assert error_of(r)["code"] == "context_length_exceeded"
    assert untouched(state)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("logit_bias", {"50": 5}, "not supported"),
        ("presence_penalty", 0.5, "not supported"),
        ("frequency_penalty", -1, "not supported"),
        ("best_of", 2, "not supported"),
        ("suffix", "tail", "not supported"),
        ("store", True, "not supported"),
        ("response_format", {"type": "json_object"}, "not supported"),
        ("tools", [{"type": "function", "function": {"name": "f"}}], "not supported"),
        ("tool_choice", "auto", "not supported"),
        ("functions_v9", 1, "unsupported field 'functions_v9'"),
        ("logprob", 1, "unsupported field 'logprob'"),
    ],
)
def test_unsupported_field_is_400_naming_it(field: str, value: Any, words: str) -> None:
    state = make_state()
    r = post(state, "/v1/chat/completions", {**CHAT, field: value})
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["param"] == field and words in error["message"], error
    assert untouched(state)


def test_unsupported_message_field_is_400_naming_it() -> None:
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for message, param in (
        ({"role": "assistant", "content": "x", "tool_calls": calls}, "messages.0.tool_calls"),
        ({"role": "user", "content": "x", "audio": {"id": "a"}}, "messages.0.audio"),
    ):
        r = post(make_state(), "/v1/chat/completions", {**CHAT, "messages": [message]})
        assert r.status_code == 400, r.text
        assert error_of(r)["param"] == param


def test_unknown_text_part_field_is_400() -> None:
    part = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
    body = {**CHAT, "messages": [{"role": "user", "content": [part]}]}
    r = post(make_state(), "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert "cache_control" in error_of(r)["message"]


HARMLESS = {
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "parallel_tool_calls": True,
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "response_format": {"type": "text"},
    "tools": [],
    "tool_choice": "none",
}


def test_harmless_fields_and_no_op_values_are_accepted() -> None:
    r = post(make_state(), "/v1/chat/completions", {**CHAT, **HARMLESS})
    assert r.status_code == 200, r.text
    completion = {**COMPLETION, "best_of": 1, "suffix": None, "logit_bias": None, "user": "u"}
    assert post(make_state(), "/v1/completions", completion).status_code == 200
    message = {"role": "user", "content": "hi", "name": "bob", "tool_calls": None}
    r = post(make_state(), "/v1/chat/completions", {**CHAT, "messages": [message]})
    assert r.status_code == 200, r.text


def test_official_client_requests_pass() -> None:
    async def go() -> None:
        async with serving(make_state()) as http:
            client = openai.AsyncOpenAI(
                base_url="http://pipeserve/v1", api_key="x", http_client=http, max_retries=0
            )
            chat = await client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                temperature=0,
                top_p=1,
                stop=["\n"],
                seed=1,
                n=1,
                user="u",
                presence_penalty=0,
                frequency_penalty=0,
                logprobs=True,
                top_logprobs=2,
            )
            assert chat.choices[0].message.content == "aaa"
            stream = await client.completions.create(
                model=NAME,
                prompt="hi",
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "top_k": 5},
            )
            assert "".join([c.choices[0].text async for c in stream if c.choices]) == "aaa"

    asyncio.run(go())
