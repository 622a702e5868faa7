"""`pipeserve serve --pp-size 2` through the official `openai` client: completions and chat,
streamed and not, give the offline engine's greedy text (multi-byte characters split across
tokens included); usage, stop strings, seeds, logprobs, /v1/models and the API key; 64
concurrent streams each give what the request gives alone and leave no KV behind; two
"nodes" on localhost serve the same tokens as the one-command server.

One PP2 server serves the whole module. The offline references are computed before it
starts (the server must not sit idle for long: see test_server_idle.py)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_helpers import (
    Server,
    drained,
    error_message,
    free_port,
    running_server,
    wait_for,
    wait_gone,
)

from pipeserve import Engine

pytestmark = pytest.mark.timeout(240)

KEY = "sk-test-0123"
NAME = "tiny-served"
NEW = 24  # max_tokens of the reference prompts
ASCII_PROMPT = "The capital of France is"
# Byte-level BPE: these characters are several tokens each, in the prompt and (for some of
# these prompts) in the greedy output, where a character's bytes arrive in separate steps.
MULTIBYTE_PROMPTS = [
    "Hello 你好 🙂 été",
    "🙂🙂🙂 你好",
    "été 你好 世界 🙂 naïve façon",
    "Привет λ π ∑ 🚀",
    "über façon été naïve",
    "你好 世界 こんにちは",
]
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Was ist 你好 auf Deutsch? 🙂"},
]
GREEDY = {"temperature": 0, "max_new_tokens": NEW}


def split_characters(tokenizer: Any, ids: list[int]) -> set[str]:
    """Non-ASCII characters of the decoded text whose bytes span two or more tokens."""
    singles = [tokenizer.decode([t]) for t in ids]
    found = set()
    for i in range(len(ids)):
        for k in (2, 3, 4):
            for c in tokenizer.decode(ids[i : i + k]):
                if ord(c) > 127 and c != "\ufffd" and not any(c in s for s in singles[i : i + k]):
                    found.add(c)
    return found


def pick_stop(text: str) -> str:
    """A 2-character stop string whose first occurrence is well inside `text`."""
    for k in range(3, len(text) - 2):
        stop = text[k : k + 2]
        if "\ufffd" not in stop and text.index(stop) == k:
            return stop
    pytest.fail(f"no usable stop string in {text!r}")


@pytest.fixture(scope="module")
def refs(tiny_model: Path) -> dict[str, Any]:
    """Offline greedy outputs (in this process), made before the server starts."""
    out: dict[str, Any] = {}
    with Engine(str(tiny_model), dtype="float32") as engine:
        tok = engine.tokenizer
        gen = engine.generate
        for prompt in MULTIBYTE_PROMPTS:  # the first whose output splits a character
            o = gen(prompt, sampling_params=GREEDY)
            if split_characters(tok, o["output_ids"]) & set(o["text"]):
                out["utf8_prompt"] = prompt
                break
        else:
            pytest.fail("no candidate prompt has a multi-byte character split across tokens")
        for key, prompt in (
            ("ascii", ASCII_PROMPT),
            ("multibyte_in", MULTIBYTE_PROMPTS[2]),
            ("utf8_out", out["utf8_prompt"]),
        ):
            out[key] = gen(prompt, sampling_params=GREEDY, return_logprob=True)
            out[key]["prompt"] = prompt
            out[key]["prompt_len"] = len(tok.encode(prompt))
        chat_prompt = tok.apply_chat_template(CHAT)
        out["chat"] = gen(chat_prompt, sampling_params=GREEDY, return_logprob=True)
        out["chat"]["prompt_len"] = len(tok.encode(chat_prompt))
        out["split_chars"] = split_characters(tok, out["utf8_out"]["output_ids"])
        stop = pick_stop(out["ascii"]["text"])
        out["stop"] = gen(ASCII_PROMPT, sampling_params={**GREEDY, "stop": [stop]})
        out["stop"]["stop"] = stop
    return out


@pytest.fixture(scope="module")
def server(refs: dict[str, Any], tiny_model: Path, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("pp2-server") / "server.log"
    args = [
        "--pp-size",
        "2",
        "--chunked-prefill-size",
        "64",
        "--api-key",
        KEY,
        "--served-model-name",
        NAME,
    ]
    with running_server(tiny_model, args, log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def complete(client: openai.OpenAI, prompt: Any, stream: bool, **kw: Any) -> dict[str, Any]:
    """Text, finish reason and usage of one completion (stream deltas concatenated)."""
    if not stream:
        r = client.completions.create(model=NAME, prompt=prompt, **kw)
        return {
            "text": r.choices[0].text,
            "finish": r.choices[0].finish_reason,
            "usage": r.usage,
            "logprobs": r.choices[0].logprobs,
        }
    text, finish, usage = "", None, None
    chunks = client.completions.create(
        model=NAME, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
    )
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return {"text": text, "finish": finish, "usage": usage}


def chat(
    client: openai.OpenAI, messages: list[dict[str, str]], stream: bool, **kw: Any
) -> dict[str, Any]:
    if not stream:
        r = client.chat.completions.create(model=NAME, messages=messages, **kw)
        return {
            "text": r.choices[0].message.content,
            "finish": r.choices[0].finish_reason,
            "usage": r.usage,
            "role": r.choices[0].message.role,
            "logprobs": r.choices[0].logprobs,
        }
    text, finish, usage, roles = "", None, None, []
    chunks = client.chat.completions.create(
        model=NAME, messages=messages, stream=True, stream_options={"include_usage": True}, **kw
    )
    for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            text += delta.content or ""
            roles += [delta.role] if delta.role else []
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return {"text": text, "finish": finish, "usage": usage, "role": roles[0] if roles else None}


def check_usage(usage: Any, ref: dict[str, Any]) -> None:
    assert usage is not None
    assert usage.prompt_tokens == ref["prompt_len"]
    assert usage.completion_tokens == len(ref["output_ids"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# -- models, auth ---------------------------------------------------------------------------


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]


def test_api_key_is_required_except_for_health(server: Server) -> None:
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
        for r in (
            server.post("/v1/completions", body, headers=headers),
            server.get("/v1/models", headers=headers),
        ):
            assert r.status_code == 401, (headers, r.text)
            assert "API key" in error_message(r)
    assert server.get("/health").status_code == 200
    good = {"Authorization": f"Bearer {KEY}"}
    assert server.get("/v1/models", headers=good).status_code == 200
    r = server.post("/v1/completions", body, headers=good)
    assert r.status_code == 200, r.text
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="hi", max_tokens=2)


# -- greedy text == offline engine ------------------------------------------------------------


@pytest.mark.parametrize("case", ["ascii", "multibyte_in", "utf8_out"])
def test_completion_streamed_and_not_equal_offline(
    client: openai.OpenAI, refs: dict[str, Any], case: str
) -> None:
    ref = refs[case]
    for stream in (False, True):
        got = complete(client, ref["prompt"], stream, max_tokens=NEW, temperature=0)
        assert got["text"] == ref["text"], (stream, got["text"], ref["text"])
        assert got["finish"] == ref["meta_info"]["finish_reason"]
        check_usage(got["usage"], ref)


def test_a_long_prompt_s_progress_streams_when_asked(server: Server) -> None:
    """Through the engine process: a 200-token prompt in chunks of 64 reports each chunk but
    the last as a `prefill.progress` chunk before its first token; the text is unchanged."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": list(range(5, 205)), "max_tokens": 4, "temperature": 0}

    def events(extra: dict[str, Any]) -> list[dict[str, Any]]:
        r = server.post("/v1/completions", {**body, "stream": True, **extra}, headers=headers)
        assert r.status_code == 200, r.text
        parts = r.text.split("\n\n")
        return [json.loads(p[6:]) for p in parts if p.startswith("data: {")]

    got = events({"stream_options": {"include_progress": True}})
    progress = [e["prefilled_tokens"] for e in got if e["object"] == "prefill.progress"]
    assert progress == [64, 128, 192]
    assert all(e["prompt_tokens"] == 200 for e in got if e["object"] == "prefill.progress")
    assert got[len(progress)]["object"] == "text_completion"  # progress first, then tokens
    text = "".join(e["choices"][0]["text"] for e in got if e["object"] == "text_completion")
    plain = events({})
    assert not any(e["object"] == "prefill.progress" for e in plain)
    assert text == "".join(e["choices"][0]["text"] for e in plain)


def test_greedy_output_has_characters_split_across_tokens(
    client: openai.OpenAI, refs: dict[str, Any]
) -> None:
    """The streamed text of this prompt carries whole characters whose bytes came from
    different decode steps (the server must not emit half a character)."""
    ref = refs["utf8_out"]
    split = refs["split_chars"] & set(ref["text"])
    assert split, refs["split_chars"]
    pieces = []
    for chunk in client.completions.create(
        model=NAME, prompt=ref["prompt"], max_tokens=NEW, temperature=0, stream=True
    ):
        pieces.append(chunk.choices[0].text)
    assert "".join(pieces) == ref["text"]
    assert any(c in "".join(pieces) for c in split)
    for piece in pieces:  # each delta is valid text on its own
        assert piece.encode("utf-8").decode("utf-8") == piece


@pytest.mark.parametrize("stream", [False, True])
def test_chat_streamed_and_not_equal_offline_with_template(
    client: openai.OpenAI, refs: dict[str, Any], stream: bool
) -> None:
    ref = refs["chat"]
    got = chat(client, CHAT, stream, max_tokens=NEW, temperature=0)
    assert got["text"] == ref["text"]
    assert got["role"] == "assistant"
    assert got["finish"] == ref["meta_info"]["finish_reason"]
    check_usage(got["usage"], ref)


# -- stop, seed, logprobs ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_before_it(
    client: openai.OpenAI, refs: dict[str, Any], stream: bool
) -> None:
    ref, full = refs["stop"], refs["ascii"]["text"]
    stop = ref["stop"]
    got = complete(client, ASCII_PROMPT, stream, max_tokens=NEW, temperature=0, stop=[stop])
    assert got["text"] == full[: full.index(stop)] == ref["text"]
    assert got["finish"] == "stop"
    assert got["usage"].completion_tokens == len(ref["output_ids"]) < NEW


def test_seed_reproduces_sampled_text(client: openai.OpenAI) -> None:
    kw = {"max_tokens": 16, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    first = complete(client, ASCII_PROMPT, False, seed=1234, **kw)["text"]
    assert complete(client, ASCII_PROMPT, False, seed=1234, **kw)["text"] == first
    assert complete(client, ASCII_PROMPT, True, seed=1234, **kw)["text"] == first
    others = {complete(client, ASCII_PROMPT, False, seed=s, **kw)["text"] for s in (1, 2)}
    assert first not in others  # 16 tokens from a 512-token vocabulary at temperature 1
    m = chat(client, CHAT, False, seed=7, **kw)["text"]
    assert chat(client, CHAT, True, seed=7, **kw)["text"] == m


def test_completion_logprobs(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    ref = refs["ascii"]
    lp = complete(client, ASCII_PROMPT, False, max_tokens=NEW, temperature=0, logprobs=2)[
        "logprobs"
    ]
    n = len(ref["output_ids"])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs == pytest.approx(ref["output_logprobs"], abs=1e-4)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 2
        if len(top) == 2:  # greedy: the chosen token is the most likely one
            assert max(top.values()) == pytest.approx(value, abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_streamed_completion_text_offsets_match_non_streamed(client: openai.OpenAI) -> None:
    kw = {"model": NAME, "prompt": ASCII_PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**kw).choices[0].logprobs.text_offset
    streamed = []
    for chunk in client.completions.create(stream=True, **kw):
        streamed += chunk.choices[0].logprobs.text_offset
    assert len(whole) > 1
    assert streamed == whole


def test_chat_logprobs(client: openai.OpenAI, refs: dict[str, Any]) -> None:
    ref = refs["chat"]
    lp = chat(client, CHAT, False, max_tokens=NEW, temperature=0, logprobs=True, top_logprobs=2)[
        "logprobs"
    ]
    content = lp.content
    assert len(content) == len(ref["output_ids"])
    assert [c.logprob for c in content] == pytest.approx(ref["output_logprobs"], abs=1e-4)
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert isinstance(c.bytes, list)


def test_completion_top_logprobs_keep_every_alternative(
    client: openai.OpenAI, refs: dict[str, Any]
) -> None:
    """20 alternatives from a 512-token byte-level vocabulary: several are lone bytes of
    multi-byte characters at every position."""
    prompt = refs["utf8_out"]["prompt"]
    lp = complete(client, prompt, False, max_tokens=8, temperature=0, logprobs=20)["logprobs"]
    assert lp.top_logprobs and [len(top) for top in lp.top_logprobs] == [20] * len(lp.top_logprobs)


def test_chat_logprob_bytes_are_the_tokens_bytes(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "🙂🙂🙂 你好"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
    )
    content = r.choices[0].logprobs.content
    for c in content:  # distinct tokens of a byte-level BPE have distinct bytes
        alternatives = [tuple(t.bytes) for t in c.top_logprobs]
        assert len(set(alternatives)) == len(alternatives), c.top_logprobs
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content


# -- load -------------------------------------------------------------------------------------


def load_requests(n: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    lengths = [1, 3, 17, 40, 63, 64, 65, 100, 150, 257, 300]
    reqs = []
    for i in range(n):
        if i % 4 == 3:
            prompt: Any = " ".join(
                rng.choice(["ka", "ri", "你好", "été", "the", "🙂"])
                for _ in range(rng.randint(1, 60))
            )
        else:
            prompt = [rng.randrange(500) for _ in range(lengths[i % len(lengths)])]
        reqs.append({"prompt": prompt, "max_tokens": rng.randint(1, 32)})
    return reqs


async def stream_all(server: Server, reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    client = openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=180
    )

    async def one(r: dict[str, Any]) -> dict[str, Any]:
        text, finish, usage = "", None, None
        stream = await client.completions.create(
            model=NAME, temperature=0, stream=True, stream_options={"include_usage": True}, **r
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return {"text": text, "finish": finish, "tokens": usage.completion_tokens}

    try:
        return await asyncio.gather(*(one(r) for r in reqs))
    finally:
        await client.close()


def test_64_concurrent_streams_equal_alone_and_free_all_kv(
    client: openai.OpenAI, server: Server
) -> None:
    reqs = load_requests(64)
    alone = []
    for r in reqs:
        c = client.completions.create(model=NAME, temperature=0, **r)
        alone.append(
            {
                "text": c.choices[0].text,
                "finish": c.choices[0].finish_reason,
                "tokens": c.usage.completion_tokens,
            }
        )
    together = asyncio.run(stream_all(server, reqs))
    assert len(together) == 64
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b == a, (i, reqs[i], a, b)
    m = wait_for(lambda: drained(server), timeout_s=10)
    assert m, server.metrics()
    assert m["pipeserve_kv_pages_total"] > 0
    assert m["pipeserve_generation_tokens_total"] >= 2 * sum(a["tokens"] for a in alone)
    assert server.get("/health").status_code == 200


# -- two nodes --------------------------------------------------------------------------------


def test_two_nodes_on_localhost_serve_the_same_tokens(
    client: openai.OpenAI, tiny_model: Path, tmp_path: Path
) -> None:
    """Node 0 schedules and serves, node 1 only runs its stage; node 1 exits on its own once
    node 0 is gone. (Last in this module: the one-command server idles meanwhile.)"""
    rng = random.Random(1)
    prompts = [ASCII_PROMPT, MULTIBYTE_PROMPTS[0], [rng.randrange(500) for _ in range(200)]]
    expected = [complete(client, p, False, max_tokens=NEW, temperature=0) for p in prompts]
    dist = f"127.0.0.1:{free_port(span=5)}"
    common = ["--pp-size", "2", "--nnodes", "2", "--dist-init-addr", dist]
    node1 = Server(tiny_model, [*common, "--node-rank", "1"], tmp_path / "node1.log")
    node0 = Server(tiny_model, [*common, "--node-rank", "0"], tmp_path / "node0.log")
    try:
        node0.wait_for_line("ready")
        node1.wait_for_line("workers [1] started", timeout_s=10)
        c0 = openai.OpenAI(
            base_url=node0.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        model = c0.models.list().data[0].id
        for p, want in zip(prompts, expected, strict=True):
            r = c0.completions.create(model=model, prompt=p, max_tokens=NEW, temperature=0)
            assert r.choices[0].text == want["text"]
            assert r.usage.completion_tokens == want["usage"].completion_tokens
        node1_tree = node1.tree()
        assert len(node1_tree) >= 2, node1_tree  # the node process and its worker
        node0.stop()
        assert node1.proc.wait(timeout=30) is not None
        assert not wait_gone(node1_tree, 10)
    finally:
        node0.stop()
        node1.stop()
